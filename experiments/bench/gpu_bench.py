r"""Accelerator check: DeMo's update and its share of a train step, against AdamW.

Two measurements per model preset, each as ratios to AdamW with an all-reduce
of the gradient (the data-parallel baseline), timed in interleaved rounds on
every visible device:

1. **Update.** One optimizer update on the preset's params tree, from a
   different gradient per worker: DeMo at the defaults and at Psyche's top-k 8
   with 1-bit values (``--methods=all`` adds the drawn-position messages and
   the rest of ``compare``'s methods), against ``pmean`` + AdamW
   (``experiments.bench_update``'s step).
2. **Train step.** A full step of the Llama model (forward, backward, exchange,
   update) against the same step without the optimizer; the optimizer's share
   is ``1 - gradient time / step time``.

Each DeMo update and train step runs twice (``--paths``): as JAX takes it
on the device, with the Pallas kernels on a GPU (``distro_jax.pallas_kernels``),
and on XLA's path alone, as ``"NAME (XLA path)"``, so one run shows what the
kernels buy. The check a GPU session runs, in one command (about ten
programs to compile per preset):

  python -m experiments.gpu_bench --presets=base,largest --methods=defaults,k8-1bit,drawn-orth

The default ``--presets=base,medium,largest`` runs ``base``, ``medium`` and
then the largest of ``report-1.2b``, ``1b`` and ``base`` that fits in memory,
printing each preset's figures as it ends. The models hold their layers
stacked and scanned (``--noscan_layers`` keeps them separate): DeMo's update
is one pipeline per tensor, so its compile grows with the number of tensors,
and a short device lease may run out on it. Scanned, every program compiled
in 15 s or less on an H200, and the three presets took 3.3 minutes in all;
with separate layers, the first run there printed no figure in 225 s at
``base``. Each program's first call (its compile) is printed as it happens
(``docs/performance.md``).

  python -m experiments.gpu_bench
  python -m experiments.gpu_bench --presets=tiny --batch_size=2 --seq_len=16  # CPU smoke
"""

import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import distro_jax as dj
from distro_jax import cpu_kernels, pallas_kernels
from experiments.bench import bench_update
from experiments.run import model as model_lib
from experiments.run.presets import get_preset

LARGEST = ("report-1.2b", "1b", "base")
BASELINE = bench_update.BASELINE
# --methods names DeMo's updates by these keys (the full names hold commas).
METHOD_KEYS = {
  "defaults": bench_update.DEFAULTS_NAME,
  "k8-1bit": bench_update.K8_NAME,
  "drawn": bench_update.DRAWN_NAME,
  "drawn-orth": bench_update.ORTH_NAME,
  # The rest of compare's default methods, by their own names.
  **{
    name: name
    for name in (
      "adamw",
      "muon",
      "demo",
      "demo-k8-1bit",
      "demo-k2-1bit",
      "demo-k1-c16-1bit-rand-fb1-orth",
      "diloco",
      "sparseloco",
    )
  },
  "diloco-sync": bench_update.SYNC_STEP.format("diloco"),
  "sparseloco-sync": bench_update.SYNC_STEP.format("sparseloco"),
}
# DeMo's update unrolls one pipeline per tensor (50,000 lines of optimized HLO
# at base on the CPU, AdamW's 3,600), and an H200 gave no figure in 225 s at
# base with all five methods. Three keep a run shorter; --methods=all adds the
# drawn-position ones, which compile for twice as long.
DEFAULT_KEYS = ("defaults", "k8-1bit")
DEFAULT_METHODS = (BASELINE, *(METHOD_KEYS[k] for k in DEFAULT_KEYS))
# Each DeMo update as JAX takes it here (the Pallas kernels on a GPU) and on
# XLA's path alone.
PATHS = ("kernels", "xla")
XLA_PATH = "{} (XLA path)"
# The train step compiles the whole model per method; two keep the run short.
TRAIN_METHODS = (BASELINE, bench_update.DEFAULTS_NAME)


def _random_params(config: model_lib.ModelConfig, seed: int = 0) -> tuple[Any, Any]:
  """The model's graphdef and random params, drawn on the device (no host copy)."""
  graphdef, abstract = nnx.split(
    nnx.eval_shape(lambda: model_lib.Llama(config, rngs=nnx.Rngs(seed))), nnx.Param
  )
  leaves, treedef = jax.tree.flatten(abstract)

  @jax.jit
  def draw(key):
    keys = jax.random.split(key, len(leaves))
    return [0.02 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]

  return graphdef, treedef.unflatten(draw(jax.random.key(seed)))


def _worker_grads(params: Any, mesh: jax.sharding.Mesh, seed: int = 1) -> Any:
  """A different gradient per worker, ``(W, *shape)`` split over "data", drawn on the devices."""
  workers = mesh.shape["data"]
  leaves, treedef = jax.tree.flatten(params)
  out = NamedSharding(mesh, P("data"))

  def draw(key):
    keys = jax.random.split(key, len(leaves))
    return [jax.random.normal(k, (workers, *x.shape), x.dtype) for k, x in zip(keys, leaves)]

  return treedef.unflatten(jax.jit(draw, out_shardings=out)(jax.random.key(seed)))


def _interleaved(calls: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
  """Seconds of each call, one call of each per round, every call waited for."""
  times: dict[str, list[float]] = {name: [] for name in calls}
  for _ in range(rounds):
    for name, call in calls.items():
      t0 = time.perf_counter()
      jax.block_until_ready(call())
      times[name].append(time.perf_counter() - t0)
  return times


def _median_ratio(times: list[float], base: list[float]) -> float:
  return statistics.median(t / b for t, b in zip(times, base))


def _chosen(methods: Sequence[str] | None) -> dict[str, optax.GradientTransformation]:
  """``bench_update``'s methods named in ``methods`` (all of them for ``None``), baseline first."""
  every = bench_update.methods()
  if methods is None:
    return every
  unknown = sorted(set(methods) - set(every))
  if unknown:
    raise ValueError(f"Unknown methods {unknown}; choose from {sorted(every)}.")
  return {name: tx for name, tx in every.items() if name == BASELINE or name in methods}


@contextlib.contextmanager
def _xla_path() -> Iterator[None]:
  """Traces DeMo's update on XLA's path: no Pallas kernel, no CPU kernel."""
  with pallas_kernels.disabled(), cpu_kernels.disabled():
    yield


def time_updates(
  params: Any,
  mesh: jax.sharding.Mesh,
  rounds: int,
  methods: Sequence[str] | None = None,
  paths: Sequence[str] = PATHS,
) -> dict[str, Any]:
  """Median ms of one update per method and its ratio to AdamW + all-reduce.

  With ``"kernels"`` in ``paths`` each DeMo update is timed as JAX takes it
  here (the Pallas kernels on a GPU, the fused CPU kernels on a CPU); with
  ``"xla"``, also on XLA's path alone, as ``"NAME (XLA path)"``.
  """
  grads = _worker_grads(params, mesh)
  steps: dict[str, list[Any]] = {}
  for name, tx in _chosen(methods).items():
    variants = {name: contextlib.nullcontext}
    if name != BASELINE:
      variants = {
        **({name: contextlib.nullcontext} if "kernels" in paths else {}),
        **({XLA_PATH.format(name): _xla_path} if "xla" in paths else {}),
      }
    for label, path in variants.items():
      # The kernels are chosen as the update is traced, at its first call.
      with path():
        step, carry = bench_update.build_update(tx, params, mesh)
        steps[label] = [step, bench_update.first_call(f"update {label}", step, *carry, grads)[0]]

  def call(name: str) -> Callable[[], Any]:
    def run():
      step, carry = steps[name]
      steps[name][1] = step(*carry, grads)
      return steps[name][1]

    return run

  times = _interleaved({name: call(name) for name in steps}, rounds)
  return {
    name: {
      "ms": statistics.median(ts) * 1e3,
      "x_adamw": _median_ratio(ts, times[BASELINE]),
    }
    for name, ts in times.items()
  }


def _train_steps(graphdef: Any, tx: optax.GradientTransformation, params: Any, mesh: Any):
  """A donating train step and the same step without the optimizer, with their state."""
  specs = dj.worker_state_specs(tx, params, mesh)
  state = dj.init_worker_state(tx, params, mesh)

  def loss_fn(p, tokens_BxL):
    logits = nnx.merge(graphdef, p)(tokens_BxL[:, :-1])
    return model_lib.next_token_loss(logits, tokens_BxL[:, 1:])

  def full(p, s, tokens_BxL):
    loss, grads = dj.local_value_and_grad(loss_fn)(dj.inner_params(s, p), tokens_BxL)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, loss[None]

  def gradient_only(p, s, tokens_BxL):
    _, grads = dj.local_value_and_grad(loss_fn)(dj.inner_params(s, p), tokens_BxL)
    return optax.tree_utils.tree_sum(jax.tree.map(lambda g: jnp.sum(jnp.square(g)), grads))[None]

  data = P("data")
  full_step = jax.jit(
    jax.shard_map(full, mesh=mesh, in_specs=(P(), specs, data), out_specs=(P(), specs, data)),
    donate_argnums=(0, 1),
  )
  grad_step = jax.jit(
    jax.shard_map(gradient_only, mesh=mesh, in_specs=(P(), specs, data), out_specs=data)
  )
  return full_step, grad_step, state


def time_train_steps(
  graphdef: Any,
  params: Any,
  mesh: jax.sharding.Mesh,
  *,
  batch_size: int,
  seq_len: int,
  vocab_size: int,
  rounds: int,
  paths: Sequence[str] = PATHS,
) -> dict[str, Any]:
  """Per method: step and gradient-only ms, the optimizer's share, and ratios to AdamW's.

  With ``"xla"`` in ``paths``, DeMo's step on XLA's path too (see :func:`time_updates`).
  """
  workers = mesh.shape["data"]
  tokens = jax.device_put(
    jnp.asarray(
      np.random.default_rng(2).integers(0, vocab_size, (workers * batch_size, seq_len + 1)),
      jnp.int32,
    ),
    NamedSharding(mesh, P("data")),
  )
  runs: dict[str, list[Any]] = {}
  for name, tx in bench_update.methods().items():
    if name not in TRAIN_METHODS:
      continue
    variants = {name: contextlib.nullcontext}
    if name != BASELINE and "xla" in paths:
      variants[XLA_PATH.format(name)] = _xla_path
    for label, path in variants.items():
      with path():
        full_step, grad_step, state = _train_steps(graphdef, tx, params, mesh)
        first = bench_update.first_call
        start = jax.tree.map(jnp.copy, params)
        out, _ = first(f"train step {label}", full_step, start, state, tokens)
        carry = out[:2]
        first(f"gradient step {label}", grad_step, *carry, tokens)
      runs[label] = [full_step, grad_step, carry]

  def step_call(name: str) -> Callable[[], Any]:
    def run():
      full_step, _, carry = runs[name]
      out = full_step(*carry, tokens)
      runs[name][2] = out[:2]
      return out

    return run

  def grad_call(name: str) -> Callable[[], Any]:
    return lambda: runs[name][1](*runs[name][2], tokens)

  calls = {}
  for name in runs:
    calls[f"{name} | step"] = step_call(name)
    calls[f"{name} | gradient"] = grad_call(name)
  times = _interleaved(calls, rounds)
  out = {}
  for name in runs:
    step_s = statistics.median(times[f"{name} | step"])
    grad_s = statistics.median(times[f"{name} | gradient"])
    out[name] = {
      "step_ms": step_s * 1e3,
      "gradient_ms": grad_s * 1e3,
      "optimizer_ms": max(step_s - grad_s, 0.0) * 1e3,
      "optimizer_share": max(step_s - grad_s, 0.0) / step_s,
    }
  base = out[BASELINE]
  for row in out.values():
    row["share_x_adamw"] = row["optimizer_share"] / max(base["optimizer_share"], 1e-9)
    row["optimizer_x_adamw"] = row["optimizer_ms"] / max(base["optimizer_ms"], 1e-9)
  return out


def _too_big(error: Exception) -> bool:
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def run(
  presets: Sequence[str],
  *,
  workers: int | None = None,
  rounds: int = 5,
  train_rounds: int = 3,
  batch_size: int = 8,
  seq_len: int = 512,
  methods: Sequence[str] | None = DEFAULT_METHODS,
  scan_layers: bool = True,
  paths: Sequence[str] = PATHS,
) -> dict[str, Any]:
  """Measures every preset (``largest``: the biggest of :data:`LARGEST` that fits).

  Args:
    presets: preset names, or ``largest``.
    workers: devices on the data axis; all visible ones by default.
    rounds: interleaved rounds of the update timing.
    train_rounds: interleaved rounds of the train-step timing.
    batch_size: sequences per worker per train step.
    seq_len: tokens per sequence.
    methods: the update methods timed (names in ``bench_update.methods()``;
      AdamW is always in), or ``None`` for all of them.
    scan_layers: build the models with their layers stacked and scanned
      (:class:`experiments.run.model.ModelConfig`), so DeMo's update is one
      pipeline per kind of weight and compiles in seconds; the message is
      that of the separate layers.
    paths: time DeMo's updates with the kernels JAX takes here
      (``"kernels"``: Pallas's on a GPU), on XLA's path (``"xla"``), or both.

  Returns:
    ``{preset: {"params": int, "update": {...}, "train_step": {...}}}``, as printed.
  """
  devices = jax.devices()[: workers or len(jax.devices())]
  mesh = jax.make_mesh((len(devices),), ("data",), devices=devices)
  print(f"devices: {len(devices)} x {devices[0].device_kind} ({devices[0].platform})", flush=True)
  results = {}
  for preset in presets:
    candidates = LARGEST if preset == "largest" else (preset,)
    for name in candidates:
      config = get_preset(name, scan_layers=scan_layers)
      try:
        graphdef, params = _random_params(config)
        params = jax.device_put(params, NamedSharding(mesh, P()))
        numel = sum(x.size for x in jax.tree.leaves(params))
        layers = ", layers stacked and scanned" if scan_layers else ""
        print(f"\n== {name}: {numel / 1e6:,.1f}M params{layers}", flush=True)
        update = time_updates(params, mesh, rounds, methods, paths)
        for method, row in update.items():
          print(f"  update {method:<40} {row['ms']:>9.2f} ms  {row['x_adamw']:>6.2f}x AdamW")
        train = time_train_steps(
          graphdef,
          params,
          mesh,
          batch_size=batch_size,
          seq_len=min(seq_len, config.max_seq_len),
          vocab_size=config.vocab_size,
          rounds=train_rounds,
          paths=paths,
        )
        for method, row in train.items():
          print(
            f"  train  {method:<40} step {row['step_ms']:>9.2f} ms, optimizer "
            f"{row['optimizer_ms']:>8.2f} ms = {row['optimizer_share']:>6.1%} of the step "
            f"({row['share_x_adamw']:.2f}x AdamW's share)"
          )
        results[name] = {"params": numel, "update": update, "train_step": train}
        break
      except Exception as e:  # an accelerator's out-of-memory error: try the next size
        if preset != "largest" or not _too_big(e):
          raise
        print(f"  {name} does not fit: {str(e).splitlines()[0][:120]}", flush=True)
      finally:
        jax.clear_caches()
  return results


def main() -> None:
  """Defines the flags only when run as a command, so the module imports anywhere."""
  presets = flags.DEFINE_list("presets", ["base", "medium", "largest"], "Presets, or 'largest'.")
  workers = flags.DEFINE_integer("workers", None, "Devices on the data axis (default: all).")
  rounds = flags.DEFINE_integer("rounds", 5, "Interleaved rounds of the update timing.")
  train_rounds = flags.DEFINE_integer("train_rounds", 3, "Interleaved train-step rounds.")
  batch_size = flags.DEFINE_integer("batch_size", 8, "Sequences per worker per train step.")
  seq_len = flags.DEFINE_integer("seq_len", 512, "Tokens per sequence.")
  out = flags.DEFINE_string("out", None, "Also write the results here as JSON.")
  scan_layers = flags.DEFINE_bool(
    "scan_layers",
    True,
    "Stack and scan the layers: far shorter compiles, the same message (ModelConfig); "
    "--noscan_layers keeps them separate.",
  )
  paths = flags.DEFINE_list(
    "paths",
    list(PATHS),
    "DeMo's updates with the kernels JAX takes here (Pallas's on a GPU), on XLA's path, or both.",
  )
  methods = flags.DEFINE_list(
    "methods",
    list(DEFAULT_KEYS),
    f"DeMo updates to time (AdamW always is): some of {', '.join(METHOD_KEYS)}, or 'all'.",
  )

  def _main(argv: list[str]) -> None:
    del argv
    unknown = sorted(set(methods.value) - set(METHOD_KEYS) - {"all"})
    if unknown:  # before any compile
      raise app.UsageError(f"--methods: unknown {unknown}; choose from {list(METHOD_KEYS)}.")
    chosen = None if "all" in methods.value else [METHOD_KEYS[m] for m in methods.value]
    if not paths.value or set(paths.value) - set(PATHS):
      raise app.UsageError(f"--paths: some of {list(PATHS)}; got {paths.value}.")
    results = run(
      presets.value,
      workers=workers.value,
      rounds=rounds.value,
      train_rounds=train_rounds.value,
      batch_size=batch_size.value,
      seq_len=seq_len.value,
      methods=chosen,
      scan_layers=scan_layers.value,
      paths=paths.value,
    )
    if out.value:
      with open(out.value, "w") as f:
        json.dump(results, f, indent=2)
    sys.stdout.flush()

  app.run(_main)


if __name__ == "__main__":
  main()
