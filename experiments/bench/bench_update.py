r"""Benchmark: one optimizer update of every method against AdamW plus gradient pmean.

Every method updates the same params tree from the same per-worker gradients,
on simulated CPU devices (or real accelerators when present), inside one
jitted ``shard_map`` step with params and state donated, as in training. The
methods are timed in interleaved rounds, so a slow spell of a shared machine
hits all of them, and each ratio is the median over rounds of the ratio of
calls made moments apart.

The rows: ``dj.demo`` at its defaults and at Psyche's top-k 8 with 1-bit
values; every method ``compare`` runs by default (``adamw``, ``muon``,
``demo``, ``demo-k8-1bit``, ``demo-k2-1bit``, the recommended
``demo-k1-c8-1bit-rand-fb1-orth``, ``diloco``, ``sparseloco``), built by the
method registry as ``compare`` builds them (their recipes for ``small``,
clipping included), and the recommended message with the sign step. DiLoCo
and SparseLoCo step locally between exchanges: their row is a local step, a
second row times the same method synchronizing at every step, and a third is
the per-step cost over a round of H steps, ``((H - 1) local + 1
synchronizing) / H``.

Beside the totals it times DeMo's parts on the same data, each as its own
jitted step: ``transform`` (the momentum update with the chunked DCT of the
gradient), ``top-k`` (selection and error feedback), ``aggregate`` (encode,
all-gather, decode and mean over contributors) and ``decode`` (the inverse DCT
of the aggregate). It also prints the wire bytes for the defaults, for
Psyche's top-k 8 with 1-bit values and for one drawn position of each 8x8
chunk.

  python -m experiments.bench_update                  # 13.4M-param stacked tree
  python -m experiments.bench_update --methods=demo-k1-c8-1bit-rand-fb1-orth --noparts
  python -m experiments.bench_update --preset=small   # a model preset's params
  python -m experiments.bench_update --preset=medium --scan_layers   # its layers stacked
"""

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import distro_jax as dj
from distro_jax import codec, cpu_kernels, dct, wire

SYNTHETIC = "stacked"


def transformer_params(d_model: int, layers: int, vocab: int, dtype: Any) -> dict:
  """Shapes of a Llama-style decoder with its layers stacked, laid out as the model's own.

  The paths are those of ``experiments.run.model`` with ``scan_layers``
  (``blocks/attn/wq``, ``embedding``, ``lm_head``...), so a method built by
  the registry treats each tensor as it treats the model's (``orth``
  orthogonalizes each layer's hidden matrices, the embedding and the head
  step at unit RMS).
  """
  ff = 4 * d_model * 2 // 3 // 64 * 64 or 64
  square = (layers, d_model, d_model)
  norm = {"scale": (layers, 1, d_model)}
  shapes = {
    "embedding": (vocab, d_model),
    "blocks": {
      "attn": {"wq": square, "wk": square, "wv": square, "wo": square},
      "attn_norm": norm,
      "mlp": {
        "w_gate": (layers, d_model, ff),
        "w_up": (layers, d_model, ff),
        "w_down": (layers, ff, d_model),
      },
      "mlp_norm": norm,
    },
    "final_norm": {"scale": (d_model,)},
    "lm_head": (d_model, vocab),
  }
  rng = np.random.default_rng(0)
  return jax.tree.map(
    lambda s: jnp.asarray(rng.normal(size=s) * 0.02, dtype),
    shapes,
    is_leaf=lambda x: isinstance(x, tuple),
  )


def preset_params(name: str, dtype: Any, scan_layers: bool = False) -> Any:
  """Random params with the tree and shapes of the model preset ``name``.

  With ``scan_layers``, the tree of the model with its layers stacked
  (:class:`experiments.run.model.ModelConfig`): the same message, far fewer
  tensors, so a far shorter compile.
  """
  from experiments.run.model import abstract_params
  from experiments.run.presets import get_preset

  rng = np.random.default_rng(0)
  abstract = abstract_params(get_preset(name, scan_layers=scan_layers))
  return jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.02, dtype), abstract)


# One drawn position of every 8x8 chunk, one sign bit each (docs/results.md).
DRAWN = dict(compression_topk=1, compression_chunk=8, quantize_1bit=True, random_positions=True)
BASELINE = "AdamW + grad pmean"
DEFAULTS_NAME = "dj.demo (defaults)"
K8_NAME = "dj.demo (top-k 8, 1-bit)"
# The message recommended past 1,000x as compare runs it (each layer's hidden
# matrices orthogonalized), and the same message with the sign step, which
# shows what the orthogonalization costs.
ORTH_NAME = "demo-k1-c8-1bit-rand-fb1-orth"
DRAWN_NAME = "demo-k1-c8-1bit-rand-fb1"
# What a row of a method with local steps names: its synchronizing step.
SYNC_STEP = "{} (synchronizing step)"


def compare_update(name: str) -> tuple[optax.GradientTransformation, int]:
  """``name`` (a method as ``compare`` takes it) built as ``compare`` builds it, and its H.

  The registry's build with its recipe for the ``small`` preset (clipping
  included), on the data axis ``"data"``, for a tree with its layers
  stacked; H is the steps between its exchanges (1 for DeMo).
  """
  from experiments.run import checks
  from experiments.run import methods as registry
  from experiments.run.config import ConfigError, TrainConfig

  method, fields = registry.parse(name)
  try:
    cfg = checks.resolve(TrainConfig(**fields, preset="small", scan_layers=True))
  except ConfigError:
    # A method whose check refuses a stack of layers (SparseLoCo's median clip
    # would take the stack as one tensor) runs on the tree with a tensor per layer.
    cfg = checks.resolve(TrainConfig(**fields, preset="small", scan_layers=False))
  return method.build(cfg, registry.Axes(replica="data", fsdp=None)), method.exchange_every(cfg)


def _compare_names() -> tuple[str, ...]:
  from experiments.run.methods import DEFAULT_COMPARISON

  return (*DEFAULT_COMPARISON, DRAWN_NAME)


def methods(learning_rate: float = 1e-3) -> dict[str, optax.GradientTransformation]:
  """The updates compared, the all-reduce baseline first.

  DeMo's defaults and Psyche's top-k 8 with 1-bit values as ``dj.demo`` builds
  them; then every method ``compare`` runs by default, as it builds them
  (:func:`compare_update`), and the recommended drawn message with the sign.
  A method with local steps (DiLoCo, SparseLoCo) has a second row: the same
  method synchronizing at every step, whose time is that of its 1-in-H
  synchronizing step (:func:`local_steps`).
  """
  rows = {
    BASELINE: optax.chain(dj.pmean_gradients("data"), optax.adamw(learning_rate)),
    DEFAULTS_NAME: dj.demo(learning_rate),
    K8_NAME: dj.demo(learning_rate, compression_topk=8, quantize_1bit=True),
  }
  for name in _compare_names():
    rows[name], every = compare_update(name)
    if every > 1:
      rows[SYNC_STEP.format(name)], _ = compare_update(f"{name}-h1")
  return rows


def _registry_rows(names: Sequence[str], every: dict[str, Any]) -> dict[str, Any]:
  """Rows for methods beyond :func:`methods`' that ``compare`` takes, built as it builds them."""
  from experiments.run.config import ConfigError

  rows = {}
  for name in names:
    try:
      rows[name], _ = compare_update(name)
    except ConfigError as e:
      raise ValueError(
        f"Unknown method {name!r} ({e}); choose from {sorted(every)} or name a method "
        "as compare takes it."
      ) from None
  return rows


def local_steps() -> dict[str, int]:
  """H of each method in :func:`methods` that takes local steps between exchanges."""
  every = {name: compare_update(name)[1] for name in _compare_names()}
  return {name: h for name, h in every.items() if h > 1}


def _worker_grads(params: Any, mesh: jax.sharding.Mesh, seed: int = 1) -> Any:
  """A different gradient per worker: global arrays ``(W, *shape)`` split over "data"."""
  rng = np.random.default_rng(seed)
  workers = mesh.shape["data"]
  return jax.tree.map(
    lambda x: jax.device_put(
      jnp.asarray(rng.normal(size=(workers, *x.shape)), x.dtype), NamedSharding(mesh, P("data"))
    ),
    params,
  )


def first_call(label: str, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
  """Calls ``fn(*args)`` once and waits; prints and returns its seconds with the result.

  A jitted function's first call compiles it. The line is printed as soon as
  the call ends, since on an accelerator compiling DeMo's per-tensor
  pipeline may take minutes, and a run cut short should say how far it got.
  """
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  seconds = time.perf_counter() - t0
  print(f"  compiled {label:<40}{seconds:>8.1f} s (first call)", flush=True)
  return out, seconds


def build_update(tx: optax.GradientTransformation, params: Any, mesh: jax.sharding.Mesh):
  """A jitted update with params and state donated, and its first carry (compiled, warm)."""
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
  return step, (jax.tree.map(jnp.copy, params), state)


def demo_parts(
  params: Any, grads: Any, mesh: jax.sharding.Mesh, *, topk: int, quantize_1bit: bool
) -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
  """DeMo's update cut into its parts, each a jitted step with its inputs ready.

  The parts call the library's own pieces on the data the full update would
  hand them, so their times show where the full update's time goes (the full
  update also fuses across the seams, so the parts need not add up to it).
  Where the fused CPU kernels serve a tensor (:mod:`distro_jax.cpu_kernels`),
  its parts are theirs: ``transform`` then holds the top-k as well, ``top-k``
  only the error feedback, and ``decode`` the mean as well as the inverse DCT.
  """
  leaves = jax.tree.leaves(params)
  plans = wire.plan_tree(leaves, 64)
  layout = wire.wire_layout(
    leaves, compression_topk=topk, compression_chunk=64, quantize_1bit=quantize_1bit
  )
  ks = [t.k for t in layout.tensors]
  g_leaves = jax.tree.leaves(grads)
  data = P("data")

  def per_worker(fn):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=data, out_specs=data))

  def transform(args):
    gs, ms = args
    out = []
    for g, m, plan, k in zip(gs, ms, plans, ks):
      g, m = dct.to_blocks(g[0], plan), dct.to_blocks(m[0], plan)
      if cpu_kernels.serves(plan, g, m, k=k):
        out.append(tuple(x[None] for x in cpu_kernels.compress(g, m, 0.999, 1e-3, k)))
      else:
        out.append(((0.999 * m + 1e-3 * dct.forward_blocks(g, plan))[None],))
    return out

  def top_k(ms):
    rest = [i for i, m in enumerate(ms) if len(m) == 1]
    found = dict(
      zip(rest, codec.select_topk_many([ms[i][0][0] for i in rest], [ks[i] for i in rest]))
    )
    out = []
    for i, m in enumerate(ms):
      idx, val = found[i] if i in found else (m[1][0], m[2][0])
      out.append((codec.zero_selected_blocks(m[0][0], idx)[None], idx[None], val[None]))
    return out

  def aggregate(selections):
    message = codec.encode_message(
      [i[0] for _, i, _ in selections], [v[0] for _, _, v in selections], layout
    )
    gathered = jax.lax.all_gather(message, "data", to="invarying")
    tensors, valid_W = codec.decode_message(gathered, layout)
    native = [cpu_kernels.serves(p, m[0]) for p, (m, _, _) in zip(plans, selections)]
    rest = [i for i in range(len(plans)) if not native[i]]
    means = dict(
      zip(
        rest,
        codec.aggregate_blocks(
          [tensors[i] for i in rest], [plans[i].block_shape for i in rest], valid_W
        ),
      )
    )
    out = []
    for i in range(len(plans)):
      # The kernels' tensors go on as what arrived; decode takes the mean.
      parts = (means[i][0],) if i in means else (*tensors[i], valid_W)
      out.append(tuple(jax.lax.pcast(x, "data", to="varying")[None] for x in parts))
    return out

  def decode(dense):
    out = []
    for d, p in zip(dense, plans):
      if len(d) == 1:
        out.append(dct.from_blocks(dct.inverse_blocks(d[0][0], p), p)[None])
      else:
        idx, val, valid_W = (x[0] for x in d)
        out.append(dct.from_blocks(cpu_kernels.decode(idx, val, valid_W, p.block_shape), p)[None])
    return out

  momenta = [jnp.zeros_like(g) for g in g_leaves]
  fns = {
    "transform": per_worker(transform),
    "top-k": per_worker(top_k),
    "aggregate": per_worker(aggregate),
    "decode": per_worker(decode),
  }
  m_blocks = fns["transform"]((g_leaves, momenta))
  selections = fns["top-k"](m_blocks)
  dense = fns["aggregate"](selections)
  return {
    "transform": (fns["transform"], ((g_leaves, momenta),)),
    "top-k": (fns["top-k"], (m_blocks,)),
    "aggregate": (fns["aggregate"], (selections,)),
    "decode": (fns["decode"], (dense,)),
  }


def run(
  *,
  workers: int,
  preset: str,
  d_model: int,
  layers: int,
  vocab: int,
  repeats: int,
  dtype: str,
  scan_layers: bool = False,
  only: Sequence[str] | None = None,
  parts: bool = True,
) -> dict[str, Any]:
  """Times every method and DeMo's parts; prints the table and returns the medians.

  Args:
    workers: simulated devices on the data axis.
    preset: a model preset, or :data:`SYNTHETIC`.
    d_model: the synthetic tree's width.
    layers: the synthetic tree's blocks.
    vocab: the synthetic tree's embedding rows.
    repeats: interleaved rounds.
    dtype: the params' dtype.
    scan_layers: with ``preset``, its layers stacked.
    only: the rows of :func:`methods` to time (AdamW always is); all by default.
    parts: also time DeMo's parts.

  Returns:
    ``{"ms": {name: median ms}, "ratio": {name: median ratio to AdamW},
    "first_call_s": {update: seconds of its first call, the compile included},
    "numel": int}``. A method with local steps also has the row
    ``"NAME (per step, H=...)"``: ``((H - 1) local + 1 synchronizing) / H``
    in each round.
  """
  devices = jax.devices()[:workers]
  if len(devices) < workers:
    raise ValueError(f"--workers={workers} but only {len(devices)} devices are visible.")
  mesh = jax.make_mesh((workers,), ("data",), devices=devices)
  jdtype = jnp.dtype(dtype)
  if preset == SYNTHETIC:
    if scan_layers:
      raise ValueError(
        f"--scan_layers stacks a model preset's layers, and the '{SYNTHETIC}' tree has its "
        "layers stacked already; pass --preset=NAME with it, or drop --scan_layers."
      )
    params = transformer_params(d_model, layers, vocab, jdtype)
  else:
    params = preset_params(preset, jdtype, scan_layers)
  numel = sum(x.size for x in jax.tree.leaves(params))
  params = jax.device_put(params, NamedSharding(mesh, P()))
  grads = _worker_grads(params, mesh)

  every = methods()
  if only is not None:
    every.update(_registry_rows(sorted(set(only) - set(every)), every))
    every = {n: tx for n, tx in every.items() if n == BASELINE or n in only}
  timed: dict[str, tuple[Callable[..., Any], Any, bool]] = {}
  first_s: dict[str, float] = {}
  for name, tx in every.items():
    step, carry = build_update(tx, params, mesh)
    carry, first_s[name] = first_call(name, step, *carry, grads)
    timed[name] = (step, carry, True)
  for label, kw in [("defaults", (32, False)), ("top-k 8, 1-bit", (8, True))] if parts else []:
    cut = demo_parts(params, grads, mesh, topk=kw[0], quantize_1bit=kw[1])
    for part, (fn, args) in cut.items():
      jax.block_until_ready(fn(*args))
      timed[f"  {part} ({label})"] = (fn, args, False)

  times: dict[str, list[float]] = {name: [] for name in timed}
  for _ in range(repeats):
    for name, (fn, carry, is_step) in timed.items():
      t0 = time.perf_counter()
      out = jax.block_until_ready(fn(*carry, grads) if is_step else fn(*carry))
      times[name].append(time.perf_counter() - t0)
      if is_step:
        timed[name] = (fn, out, True)
  for name, h in local_steps().items():
    sync = SYNC_STEP.format(name)
    if name in times and sync in times:
      # One round of H steps: H - 1 local steps and one that synchronizes.
      times[f"{name} (per step, H={h})"] = [
        ((h - 1) * t + ts) / h for t, ts in zip(times[name], times[sync])
      ]

  base = times[BASELINE]
  ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
  ratio = {name: statistics.median(t / b for t, b in zip(ts, base)) for name, ts in times.items()}
  if preset == SYNTHETIC:
    label = f"{SYNTHETIC} (d_model {d_model}, {layers} layers)"
  else:
    label = f"{preset}, layers stacked" if scan_layers else preset
  print(
    f"devices: {workers} x {devices[0].platform}, params: {numel / 1e6:.2f}M ({jdtype.name}), "
    f"tree: {label}, {len(jax.tree.leaves(params))} tensors"
  )
  kernels = (
    "on" if cpu_kernels.available() else f"off ({cpu_kernels.SWITCH}=0, no compiler, or no CPU)"
  )
  print(f"DeMo's fused CPU kernels (distro_jax.cpu_kernels): {kernels}")
  print(
    f"{'update':<48}{'median ms':>12}{'x AdamW':>10}{'first call s':>14}"
    f"   (medians of {repeats} rounds; an update's first call compiles it)"
  )
  for name in times:
    first = f"{first_s[name]:>14.1f}" if name in first_s else ""
    print(f"{name:<48}{ms[name]:>12.1f}{ratio[name]:>10.2f}{first}")

  print(f"\n{'wire (per worker per step)':<34}{'payload B':>12}{'vs bf16 grad':>14}{'vs ring':>10}")
  for name, kw in [
    ("defaults: top-k 32, chunk 64", {}),
    ("top-k 8, 1-bit", {"compression_topk": 8, "quantize_1bit": True}),
    ("1 drawn of 8x8, 1-bit", DRAWN),
  ]:
    b = dj.wire_bytes(params, num_workers=workers, **kw)
    print(f"{name:<34}{b.payload:>12,}{b.ratio_vs_bf16:>13.0f}x{b.ratio_vs_ring:>9.0f}x")
  print(
    f"(bf16 gradient: {2 * numel:,} B; ring all-reduce moves 2(W-1)/W of the "
    f"{jdtype.name} gradient per worker: {b.ring_allreduce:,.0f} B)"
  )
  return {"ms": ms, "ratio": ratio, "first_call_s": first_s, "numel": numel}


def main() -> None:
  """Defines the flags (only when run as a command, so the module imports anywhere) and runs."""
  workers = flags.DEFINE_integer("workers", 8, "Data-parallel workers (simulated CPU devices).")
  preset = flags.DEFINE_string(
    "preset",
    SYNTHETIC,
    f"A model preset of experiments/run/presets.py, or '{SYNTHETIC}' for a Llama-style tree "
    "with stacked layers shaped by --d_model, --layers and --vocab.",
  )
  d_model = flags.DEFINE_integer("d_model", 384, f"Model width of the '{SYNTHETIC}' tree.")
  layers = flags.DEFINE_integer("layers", 4, f"Transformer blocks of the '{SYNTHETIC}' tree.")
  vocab = flags.DEFINE_integer("vocab", 8192, f"Embedding rows of the '{SYNTHETIC}' tree.")
  repeats = flags.DEFINE_integer("repeats", 11, "Timed rounds (one call of each update).")
  dtype = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter dtype.")
  scan_layers = flags.DEFINE_bool(
    "scan_layers", False, "With --preset: the model's tree with its layers stacked (ModelConfig)."
  )
  only = flags.DEFINE_list(
    "methods",
    None,
    "Rows to time (AdamW + grad pmean always is), e.g. 'dj.demo (defaults)', "
    f"{ORTH_NAME} or any other method compare takes; all of its rows by default.",
  )
  parts = flags.DEFINE_bool("parts", True, "Also time DeMo's parts (transform, top-k, ...).")

  def _main(argv: list[str]) -> None:
    del argv
    # Simulated CPU devices; set before the first device query, no effect on GPUs.
    jax.config.update("jax_num_cpu_devices", workers.value)
    try:
      run(
        workers=workers.value,
        preset=preset.value,
        d_model=d_model.value,
        layers=layers.value,
        vocab=vocab.value,
        repeats=repeats.value,
        dtype=dtype.value,
        scan_layers=scan_layers.value,
        only=only.value,
        parts=parts.value,
      )
    except ValueError as e:
      raise app.UsageError(str(e)) from e

  app.run(_main)


if __name__ == "__main__":
  main()
