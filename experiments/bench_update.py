r"""Benchmark: one DeMo update against one AdamW update plus gradient pmean.

Both run on the same transformer-shaped params tree, on simulated CPU devices
(or real accelerators when present), timed in the same process, and reported as
medians and their ratio. It also prints the wire bytes for the defaults and
for Psyche's top-k 8 with 1-bit values.

  python -m experiments.bench_update --workers=8 --d_model=384 --layers=4
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import distro_jax as dj

_WORKERS = flags.DEFINE_integer("workers", 8, "Data-parallel workers (simulated CPU devices).")
_D_MODEL = flags.DEFINE_integer("d_model", 384, "Model width of the params tree.")
_LAYERS = flags.DEFINE_integer("layers", 4, "Transformer blocks in the params tree.")
_VOCAB = flags.DEFINE_integer("vocab", 8192, "Embedding rows.")
_REPEATS = flags.DEFINE_integer("repeats", 11, "Timed rounds (one call of each update).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter dtype.")


def transformer_params(d_model: int, layers: int, vocab: int, dtype) -> dict:
  """Shapes of a Llama-style decoder: stacked attention and SwiGLU weights."""
  ff = 4 * d_model * 2 // 3 // 64 * 64 or 64
  shapes = {
    "embed": (vocab, d_model),
    "wq": (layers, d_model, d_model),
    "wk": (layers, d_model, d_model),
    "wv": (layers, d_model, d_model),
    "wo": (layers, d_model, d_model),
    "w_gate": (layers, d_model, ff),
    "w_up": (layers, d_model, ff),
    "w_down": (layers, ff, d_model),
    "norm_attn": (layers, d_model),
    "norm_mlp": (layers, d_model),
    "norm_out": (d_model,),
    "unembed": (d_model, vocab),
  }
  rng = np.random.default_rng(0)
  return {k: jnp.asarray(rng.normal(size=s) * 0.02, dtype) for k, s in shapes.items()}


def main(argv):
  del argv
  workers = _WORKERS.value
  # Simulated CPU devices; set before the first device query, no effect on GPUs.
  jax.config.update("jax_num_cpu_devices", workers)
  devices = jax.devices()[:workers]
  if len(devices) < workers:
    raise app.UsageError(f"--workers={workers} but only {len(devices)} devices are visible.")
  mesh = jax.make_mesh((workers,), ("data",), devices=devices)
  dtype = jnp.dtype(_DTYPE.value)
  params = transformer_params(_D_MODEL.value, _LAYERS.value, _VOCAB.value, dtype)
  numel = sum(x.size for x in params.values())
  params = jax.device_put(params, NamedSharding(mesh, P()))
  rng = np.random.default_rng(1)
  grads = {
    k: jax.device_put(
      jnp.asarray(rng.normal(size=(workers, *x.shape)), dtype), NamedSharding(mesh, P("data"))
    )
    for k, x in params.items()
  }

  def build(tx):
    """A jitted update with params and state donated, as in a real train step."""
    specs = dj.worker_state_specs(tx, params, mesh)
    state = dj.init_worker_state(tx, params, mesh)

    def local(p, s, g):
      g = jax.tree.map(lambda x: x[0], g)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    step = jax.jit(
      jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)),
      donate_argnums=(0, 1),
    )
    carry = step(jax.tree.map(jnp.copy, params), state, grads)  # compile and warm up
    jax.block_until_ready(carry)
    return step, carry

  methods = {
    "AdamW + grad pmean": optax.chain(dj.pmean_gradients("data"), optax.adamw(1e-3)),
    "dj.demo (defaults)": dj.demo(1e-3),
    "dj.demo (top-k 8, 1-bit)": dj.demo(1e-3, compression_topk=8, quantize_1bit=True),
  }
  built = {name: build(tx) for name, tx in methods.items()}
  times = {name: [] for name in methods}
  # Rounds interleave the methods, so a slow spell of a shared machine hits
  # all of them; each round's ratio compares calls made moments apart.
  for _ in range(_REPEATS.value):
    for name, (step, carry) in built.items():
      t0 = time.perf_counter()
      carry = step(*carry, grads)
      jax.block_until_ready(carry)
      times[name].append(time.perf_counter() - t0)
      built[name] = (step, carry)

  base = times["AdamW + grad pmean"]
  print(f"devices: {workers} x {devices[0].platform}, params: {numel / 1e6:.2f}M ({dtype.name})")
  print(f"{'update':<34}{'median ms':>12}{'x AdamW':>10}   (median of {_REPEATS.value} rounds)")
  for name, ts in times.items():
    ratio = statistics.median(t / b for t, b in zip(ts, base))
    print(f"{name:<34}{statistics.median(ts) * 1e3:>12.1f}{ratio:>10.2f}")

  print(f"\n{'wire (per worker per step)':<34}{'payload B':>12}{'vs bf16 grad':>14}{'vs ring':>10}")
  for name, kw in [
    ("defaults: top-k 32, chunk 64", {}),
    ("top-k 8, 1-bit", {"compression_topk": 8, "quantize_1bit": True}),
  ]:
    b = dj.wire_bytes(params, num_workers=workers, **kw)
    print(f"{name:<34}{b.payload:>12,}{b.ratio_vs_bf16:>13.0f}x{b.ratio_vs_ring:>9.0f}x")
  print(
    f"(bf16 gradient: {2 * numel:,} B; ring all-reduce moves 2(W-1)/W of the "
    f"{dtype.name} gradient per worker: {b.ring_allreduce:,.0f} B)"
  )


if __name__ == "__main__":
  app.run(main)
