"""Language-model training with DisTrO or AdamW all-reduce: the importable core.

``experiments.train`` is the command-line entry point; Colab and tests call
:func:`run` with a :class:`TrainConfig` directly.

The train step is a pure module-level function, :func:`train_step`, of one
worker's view (params, its optimizer state, its batch shard). It is wrapped
once in ``jax.shard_map`` over the ``"data"`` axis and ``jax.jit`` with the
params and optimizer state donated.

With ``fsdp > 1`` (or ``replicas`` set) the mesh is 2-D, ``("replica",
"fsdp")``: a replica is a site of ``fsdp`` devices that shard the params, the
gradient and the optimizer state (FSDP, planned by ``dj.plan_fsdp``), and the
optimizer exchanges only over ``"replica"``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import distro_jax as dj
from experiments import data as data_lib
from experiments import model as model_lib
from experiments import presets, recipes, reporting
from experiments.checkpointing import Checkpointer, CheckpointError

__all__ = ["ConfigError", "TrainConfig", "build_optimizer", "run", "train_step"]

OPTIMIZERS = ("demo", "distro_adamw", "adamw", "diloco")


class ReplicaDivergenceError(RuntimeError):
  """Workers no longer hold bit-identical params (``--check_replicas``)."""


class ConfigError(ValueError):
  """A flag value that cannot work; the message names the flag and the fix."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything one run needs. ``None`` means the recipe's default for the preset.

  Attributes mirror the flags of ``experiments.train``.
  """

  optimizer: str = "demo"
  preset: str = "tiny"
  data_path: str | None = None
  steps: int = 1000
  workers: int = 8
  replicas: int | None = None
  fsdp: int = 1
  batch_size: int = 32
  seq_len: int = 128
  learning_rate: float | None = None
  compression_topk: int = 32
  compression_chunk: int = 64
  compression_decay: float | None = None
  quantize_1bit: bool = False
  use_dct: bool = True
  diloco_sync_every: int = 50
  diloco_outer_lr: float = 0.7
  diloco_outer_momentum: float = 0.9
  delayed_apply: bool = False
  warmup_steps: int | None = None
  clip_norm: float | None = None
  weight_decay: float | None = None
  seed: int = 0
  out_dir: str = "runs/latest"
  resume: bool = False
  eval_every: int = 100
  eval_batches: int = 4
  checkpoint_every: int = 0
  log_every: int = 10
  progress: bool = True
  check_replicas: bool = False
  stop_at_step: int = 0
  skip_nonfinite: bool = False
  inject_nan_step: int = 0
  inject_nan_worker: int = 0
  time_optimizer: bool = False

  @property
  def two_d(self) -> bool:
    """Whether the run uses the 2-D ``("replica", "fsdp")`` mesh."""
    return self.replicas is not None or self.fsdp > 1

  def resolved(self) -> TrainConfig:
    """Fills every ``None`` from the recipe for (preset, optimizer).

    On the 2-D mesh ``workers`` becomes the device count, ``replicas * fsdp``;
    ``replicas`` unset means ``workers // fsdp``.
    """
    rec = recipes.recipe(self.preset, self.optimizer)
    fill = {
      f: getattr(rec, f)
      for f in ("learning_rate", "compression_decay", "warmup_steps", "clip_norm", "weight_decay")
      if getattr(self, f) is None
    }
    if self.replicas is not None:
      fill["workers"] = self.replicas * self.fsdp
    elif self.fsdp > 1:
      fill["replicas"] = self.workers // self.fsdp
    return dataclasses.replace(self, **fill)


def validate(cfg: TrainConfig) -> None:
  """Raises :class:`ConfigError` for flag values that cannot work."""
  if cfg.optimizer not in OPTIMIZERS:
    raise ConfigError(
      f"unknown optimizer {cfg.optimizer!r}; use --optimizer= one of {', '.join(OPTIMIZERS)}."
    )
  try:
    presets.get_preset(cfg.preset)
  except ValueError as e:
    raise ConfigError(str(e).replace("unknown preset", "unknown --preset", 1)) from None
  for name in (
    "steps",
    "workers",
    "batch_size",
    "seq_len",
    "compression_topk",
    "compression_chunk",
    "diloco_sync_every",
  ):
    if getattr(cfg, name) <= 0:
      raise ConfigError(f"--{name} must be positive, got {getattr(cfg, name)}.")
  if cfg.fsdp < 1 or (cfg.replicas is not None and cfg.replicas < 1):
    raise ConfigError(
      f"--fsdp and --replicas must be positive, got --fsdp={cfg.fsdp} --replicas={cfg.replicas}."
    )
  if cfg.replicas is None and cfg.workers % cfg.fsdp:
    raise ConfigError(
      f"--workers={cfg.workers} does not divide by --fsdp={cfg.fsdp}; set --replicas "
      f"(devices = replicas x fsdp), e.g. --replicas={max(cfg.workers // cfg.fsdp, 1)}."
    )
  devices = cfg.replicas * cfg.fsdp if cfg.replicas is not None else cfg.workers
  flag = "--replicas x --fsdp" if cfg.replicas is not None else "--workers"
  if cfg.batch_size % devices:
    lo = cfg.batch_size // devices * devices or devices
    raise ConfigError(
      f"--batch_size={cfg.batch_size} does not divide by {flag}={devices} devices; "
      f"use --batch_size={lo} or {lo + devices}."
    )
  if cfg.delayed_apply and cfg.optimizer == "adamw":
    raise ConfigError(
      "--delayed_apply applies the previous step's DisTrO aggregate; it needs "
      "--optimizer=demo or distro_adamw, not adamw."
    )
  if cfg.two_d and (cfg.optimizer == "diloco" or cfg.time_optimizer):
    raise ConfigError(
      "--optimizer=diloco and --time_optimizer run on the 1-D data mesh only; drop "
      "--fsdp/--replicas (or use --fsdp=1 without --replicas)."
    )
  if cfg.delayed_apply and cfg.optimizer == "diloco":
    raise ConfigError("--delayed_apply needs --optimizer=demo or distro_adamw, not diloco.")
  if cfg.skip_nonfinite and cfg.two_d:
    raise ConfigError(
      "--skip_nonfinite is not supported on the 2-D mesh (its skip counter would "
      "differ between a site's shards); drop it or use --fsdp=1 without --replicas."
    )
  if cfg.compression_decay is not None and not 0 <= cfg.compression_decay < 1:
    raise ConfigError(f"--compression_decay must be in [0, 1), got {cfg.compression_decay}.")


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
  """The reference's schedule: linear warmup from 0, then cosine down to 0.1x.

  The optimizer steps with it and the metrics log it, so both see one schedule.
  """
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=cfg.learning_rate,
    warmup_steps=min(cfg.warmup_steps, max(cfg.steps - 1, 0)),
    decay_steps=max(cfg.steps, cfg.warmup_steps + 1),
    end_value=0.1 * cfg.learning_rate,
  )


def build_optimizer(
  cfg: TrainConfig, axis_name: str | None = "data", fsdp_axis: str | None = None
) -> optax.GradientTransformation:
  """The optimizer for ``cfg`` (resolved), fed each worker's local gradients.

  The schedule is the reference's: linear warmup, then cosine down to 0.1x.
  DisTrO clips each worker's own gradient; AdamW clips the all-reduced one,
  as data-parallel AdamW does. With ``fsdp_axis`` the gradients are shards,
  and the clipping norm is that of the whole gradient.
  """
  lr = lr_schedule(cfg)
  if not cfg.clip_norm:
    clip = optax.identity()
  elif fsdp_axis is not None:
    clip = dj.clip_by_sharded_global_norm(cfg.clip_norm, fsdp_axis)
  else:
    clip = optax.clip_by_global_norm(cfg.clip_norm)
  compression = {
    "compression_decay": cfg.compression_decay,
    "compression_topk": cfg.compression_topk,
    "compression_chunk": cfg.compression_chunk,
    "quantize_1bit": cfg.quantize_1bit,
    "use_dct": cfg.use_dct,
    "axis_name": axis_name,
    "delayed_apply": cfg.delayed_apply,
  }
  if cfg.optimizer == "demo":
    return optax.chain(clip, dj.demo(lr, weight_decay=cfg.weight_decay, **compression))
  if cfg.optimizer == "distro_adamw":
    return optax.chain(clip, dj.distro_adamw(lr, weight_decay=cfg.weight_decay, **compression))
  if cfg.optimizer == "diloco":
    # Each worker clips and steps its own gradient between synchronizations.
    return dj.diloco(
      optax.chain(clip, optax.adamw(lr, weight_decay=cfg.weight_decay)),
      sync_every=cfg.diloco_sync_every,
      outer_learning_rate=cfg.diloco_outer_lr,
      outer_momentum=cfg.diloco_outer_momentum,
      axis_name=axis_name,
    )
  adamw = optax.chain(clip, optax.adamw(lr, weight_decay=cfg.weight_decay))
  if cfg.skip_nonfinite:
    # What optax users reach for: skip a step whose gradient is not finite. It
    # wraps the part after the all-reduce, so every worker makes the same call.
    adamw = optax.apply_if_finite(adamw, max_consecutive_errors=1000)
  return optax.chain(dj.pmean_gradients(axis_name), adamw)


def bytes_sent_per_step(cfg: TrainConfig, params: Any) -> dict[str, float]:
  """Bytes per worker per step for ``params``, and the baselines.

  ``payload_bytes`` is what one worker puts into the collective (the HLO
  operand): the DisTrO message, AdamW's gradient, or DiLoCo's fp32
  pseudo-gradient amortized over its H steps. ``bytes_sent`` is what a ring
  moves per worker where the collective is an all-reduce (``2 (W-1)/W`` times
  the operand), and the message itself for DisTrO.

  On the 2-D mesh pass one device's shards: each device sends its own message
  over ``"replica"``, and the all-reduce it replaces runs over the replicas.
  """
  wb = dj.wire_bytes(
    params,
    compression_topk=cfg.compression_topk,
    compression_chunk=cfg.compression_chunk,
    quantize_1bit=cfg.quantize_1bit,
    num_workers=cfg.replicas or cfg.workers,
  )
  peers = cfg.replicas or cfg.workers
  ring_factor = 2 * (peers - 1) / peers
  if cfg.optimizer == "adamw":
    payload, sent = wb.grad, wb.ring_allreduce
  elif cfg.optimizer == "diloco":
    payload = wb.grad_fp32 / cfg.diloco_sync_every
    sent = payload * ring_factor
  else:
    payload = sent = wb.payload
  return {
    "bytes_sent": sent,
    "payload_bytes": payload,
    "grad_bytes_bf16": wb.grad_bf16,
    "ring_allreduce_bytes": wb.ring_allreduce,
  }


def _loss(params, graphdef, inputs_BxL, targets_BxL):
  logits_BxLxV = nnx.merge(graphdef, params)(inputs_BxL)
  return model_lib.next_token_loss(logits_BxLxV, targets_BxL)


def _inject_fault(grads, step, fault, axis_name):
  """NaN in one worker's gradient at one step, to exercise the failure path."""
  fault_step, fault_worker = fault
  hit = (step == fault_step) & (jax.lax.axis_index(axis_name) == fault_worker)
  return jax.tree.map(lambda g: jnp.where(hit, jnp.nan, g), grads)


def train_step(
  params,
  opt_state,
  step,
  inputs_BxL,
  targets_BxL,
  *,
  graphdef,
  tx,
  fault=None,
  param_specs=None,
):
  """One worker's step: its own loss and gradient, then the optimizer's exchange.

  Args:
    params: the params, identical on every worker (on the 2-D mesh, this
      device's shards of them).
    opt_state: this worker's optimizer state.
    step: the 1-based step number, an int32 scalar.
    inputs_BxL: this worker's input tokens.
    targets_BxL: this worker's next tokens.
    graphdef: the model's static structure.
    tx: the optimizer.
    fault: ``(step, worker)`` whose gradient becomes NaN, or None.
    param_specs: on the 2-D mesh, the params' fsdp ``PartitionSpec`` tree;
      the gradient is then the site's, reduce-scattered over ``"fsdp"``.

  Returns:
    ``(params, opt_state, metrics)``. ``metrics["loss"]`` averages the finite
    worker losses; ``metrics["excluded"]`` counts messages a DisTrO optimizer
    left out this step (0 for AdamW).
  """
  replica_axis, axes = ("data", ("data",)) if param_specs is None else ("replica", MESH_2D)
  if param_specs is None:
    # DiLoCo workers take their gradient at their own inner params.
    at = dj.inner_params(opt_state, params)
    loss, grads = dj.local_value_and_grad(_loss)(at, graphdef, inputs_BxL, targets_BxL)
  else:
    grad_fn = dj.fsdp_value_and_grad(_loss, param_specs)
    loss, grads = grad_fn(params, graphdef, inputs_BxL, targets_BxL)
  if fault is not None:
    grads = _inject_fault(grads, step, fault, replica_axis)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  mean_loss = _mean_finite_loss(loss, axes)
  # AdamW has no DemoState: every worker counts as contributing.
  workers = jax.lax.axis_size(replica_axis)
  contributors = optax.tree_utils.tree_get(opt_state, "contributors", jnp.int32(workers))
  return params, opt_state, {"loss": mean_loss, "excluded": workers - contributors}


def _mean_finite_loss(loss, axes=("data",)):
  finite = jnp.isfinite(loss)
  num_finite = jax.lax.psum(finite.astype(jnp.float32), axes)
  total = jax.lax.psum(jnp.where(finite, loss, 0.0), axes)
  return jnp.where(num_finite > 0, total / jnp.maximum(num_finite, 1.0), jnp.nan)


def metrics_collective_bytes(mesh: jax.sharding.Mesh, axes: tuple[str, ...] = ("data",)) -> int:
  """Collective bytes of the train step's loss averaging, apart from the optimizer's exchange.

  Subtracting them from the step's HLO total leaves what the optimizer sends.
  ``axes`` are the mesh axes the loss is averaged over (both on the 2-D mesh).
  """
  spec = P(axes[0]) if len(axes) == 1 else P(axes)
  fn = jax.jit(
    jax.shard_map(
      functools.partial(_mean_finite_loss, axes=axes), mesh=mesh, in_specs=spec, out_specs=P()
    )
  )
  loss = jax.ShapeDtypeStruct((mesh.size,), jnp.float32, sharding=NamedSharding(mesh, spec))
  return dj.collective_bytes(fn, loss).total


def eval_step(params, inputs_BxL, targets_BxL, *, graphdef, param_specs=None):
  if param_specs is None:
    return jax.lax.pmean(_loss(params, graphdef, inputs_BxL, targets_BxL), "data")
  full = dj.gather_params(params, param_specs)
  return jax.lax.pmean(_loss(full, graphdef, inputs_BxL, targets_BxL), MESH_2D)


def gradient_step(params, opt_state, inputs_BxL, targets_BxL, *, graphdef):
  """The train step without the optimizer: loss and gradient, no collective.

  Returns this worker's squared gradient norm, shape ``(1,)``, so that the
  gradient is computed in full. Timing it against :func:`train_step` gives the
  optimizer's share of the step (exchange and update together).
  """
  at = dj.inner_params(opt_state, params)
  _, grads = dj.local_value_and_grad(_loss)(at, graphdef, inputs_BxL, targets_BxL)
  return optax.tree_utils.tree_sum(jax.tree.map(lambda g: jnp.sum(jnp.square(g)), grads))[None]


def time_step_parts(
  full_step: Any,
  gradient_only: Any,
  params: Any,
  opt_state: Any,
  *,
  first_step: int,
  block: int,
  rounds: int,
) -> dict[str, float]:
  """Seconds per full step and per gradient-only step, timed in alternation.

  Each round times ``block`` consecutive steps, then ``block`` gradient-only
  calls; the medians over rounds of the per-call means are reported. A block
  should span whatever an optimizer does only now and then (DiLoCo's
  synchronization), so that its cost is amortized as in training.

  Args:
    full_step: ``(params, opt_state, step) -> (params, opt_state)``, donating.
    gradient_only: ``(params, opt_state) -> array``.
    params: params to start from.
    opt_state: optimizer state to start from.
    first_step: the step number before the first timed step.
    block: calls per timed block.
    rounds: blocks of each kind.

  Returns:
    ``step_seconds``, ``gradient_seconds`` and ``optimizer_time_fraction``
    (``1 - gradient_seconds / step_seconds``, floored at 0).
  """
  jax.block_until_ready(gradient_only(params, opt_state))  # compile outside the timing
  step_s, grad_s = [], []
  step = first_step
  for _ in range(rounds):
    t0 = time.perf_counter()
    # Waiting on every call keeps one step in flight, as in training; queuing
    # dozens of collective steps can outlast XLA's rendezvous timeout on a busy host.
    for _ in range(block):
      step += 1
      params, opt_state = jax.block_until_ready(full_step(params, opt_state, step))
    step_s.append((time.perf_counter() - t0) / block)
    t0 = time.perf_counter()
    for _ in range(block):
      jax.block_until_ready(gradient_only(params, opt_state))
    grad_s.append((time.perf_counter() - t0) / block)
  step_med, grad_med = float(np.median(step_s)), float(np.median(grad_s))
  return {
    "step_seconds": step_med,
    "gradient_seconds": grad_med,
    "optimizer_time_fraction": max(step_med - grad_med, 0.0) / step_med,
  }


def _replica_mismatches(params, param_specs=None):
  """How many param entries differ, bit for bit, between any two workers."""

  def count(x, spec):
    # A shard is compared across replicas; a param kept whole, across all devices.
    axes = ("data",) if param_specs is None else ("replica",) if spec != P() else MESH_2D
    bits = jax.lax.bitcast_convert_type(
      x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    )
    n = jnp.sum(jax.lax.pmax(bits, axes) != jax.lax.pmin(bits, axes), dtype=jnp.int32)
    # Each device of a site counted its own shard.
    return jax.lax.psum(n, "fsdp") if axes == ("replica",) else n

  specs = jax.tree.map(lambda _: P(), params) if param_specs is None else param_specs
  return sum(
    count(x, s) for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=_is_spec))
  )


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


MESH_2D = ("replica", "fsdp")


def make_mesh(workers: int, fsdp: int | None = None) -> jax.sharding.Mesh:
  """A mesh of ``workers`` devices, the same number from each process.

  Args:
    workers: devices in total.
    fsdp: ``None`` for the 1-D ``"data"`` mesh; else the 2-D ``("replica",
      "fsdp")`` mesh of ``workers // fsdp`` sites of ``fsdp`` devices, each
      site's devices consecutive (so within one process where they fit).

  Returns:
    The mesh.
  """
  nproc = jax.process_count()
  if workers % nproc:
    raise ConfigError(f"--workers={workers} does not divide by the {nproc} processes.")
  per_process = workers // nproc
  devices = []
  for p in range(nproc):
    local = [d for d in jax.devices() if d.process_index == p]
    if len(local) < per_process:
      raise ConfigError(
        f"--workers={workers} needs {per_process} devices in each of {nproc} process(es), "
        f"but process {p} has {len(local)}. On CPU the driver simulates them; when calling "
        "trainer.run directly, set XLA_FLAGS=--xla_force_host_platform_device_count="
        f"{per_process} before importing jax."
      )
    devices += local[:per_process]
  if fsdp is not None:
    return jax.make_mesh((workers // fsdp, fsdp), MESH_2D, devices=devices)
  return jax.make_mesh((workers,), ("data",), devices=devices)


def _fingerprint(cfg: TrainConfig) -> dict[str, Any]:
  keys = (
    "optimizer",
    "preset",
    "workers",
    "batch_size",
    "seq_len",
    "learning_rate",
    "compression_topk",
    "compression_chunk",
    "compression_decay",
    "quantize_1bit",
    "use_dct",
    "diloco_sync_every",
    "diloco_outer_lr",
    "diloco_outer_momentum",
    "replicas",
    "fsdp",
    "delayed_apply",
    "warmup_steps",
    "clip_norm",
    "weight_decay",
    "seed",
    "steps",
  )
  return {k: getattr(cfg, k) for k in keys}


def params_digest(params: Any) -> str:
  """SHA-256 of this process's copy of every param, in tree order."""
  h = hashlib.sha256()
  for x in jax.tree.leaves(params):
    # A sharded param is whole only as the full array.
    h.update(np.asarray(x if x.is_fully_addressable else x.addressable_shards[0].data).tobytes())
  return h.hexdigest()


def run(cfg: TrainConfig) -> dict[str, Any]:
  """Trains one model; returns the summary (also written to ``OUT_DIR/summary.json``).

  Raises:
    ConfigError, data_lib.DataError, CheckpointError: bad flags, data or
      checkpoints, before anything is written.
  """
  validate(cfg)
  cfg = cfg.resolved()
  model_cfg = presets.get_preset(cfg.preset)
  if cfg.seq_len > model_cfg.max_seq_len:
    raise ConfigError(
      f"--seq_len={cfg.seq_len} is longer than preset {cfg.preset!r} supports "
      f"({model_cfg.max_seq_len}); use --seq_len<={model_cfg.max_seq_len}."
    )
  tokens = data_lib.load_tokens(cfg.data_path, model_cfg.vocab_size)
  train_tokens, val_tokens = data_lib.split_tokens(tokens)
  mesh = make_mesh(cfg.workers, cfg.fsdp if cfg.two_d else None)
  replica_axis = "replica" if cfg.two_d else "data"
  is_main = jax.process_index() == 0
  ckpt_dir = os.path.join(cfg.out_dir, "checkpoints")
  # Orbax names finished checkpoints by their step; a save that died leaves
  # only a temporary directory, which does not count.
  saved = os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir))
  if not cfg.resume and saved:
    raise CheckpointError(
      f"{ckpt_dir} already holds checkpoints; pass --resume to continue that run, "
      "or choose a new --out_dir (a fresh run never overwrites them)."
    )
  if cfg.resume and not os.path.isdir(ckpt_dir):
    raise CheckpointError(
      f"--resume: checkpoint directory {ckpt_dir} does not exist. Check --out_dir, "
      "or start without --resume."
    )
  train_iter = data_lib.make_train_iterator(
    train_tokens,
    seq_len=cfg.seq_len,
    global_batch_size=cfg.batch_size,
    num_workers=cfg.workers,
    process_index=jax.process_index(),
    process_count=jax.process_count(),
    seed=cfg.seed,
  )
  eval_batches = data_lib.make_eval_batches(
    val_tokens, seq_len=cfg.seq_len, batch_size=cfg.batch_size, max_batches=cfg.eval_batches
  )

  replicated = NamedSharding(mesh, P())
  rows = P(MESH_2D) if cfg.two_d else P("data")
  batch_sharding = NamedSharding(mesh, rows)
  graphdef, abstract = nnx.split(
    nnx.eval_shape(lambda: model_lib.Llama(model_cfg, rngs=nnx.Rngs(cfg.seed))), nnx.Param
  )
  fsdp_plan = param_specs = None
  if cfg.two_d:
    fsdp_plan = dj.plan_fsdp(abstract, cfg.fsdp, compression_chunk=cfg.compression_chunk)
    param_specs = fsdp_plan.specs
  # shard_map's specs for the params: a tree of them on the 2-D mesh.
  param_in = P() if param_specs is None else param_specs
  param_shardings = (
    replicated
    if param_specs is None
    else jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs, is_leaf=_is_spec)
  )

  @functools.partial(jax.jit, out_shardings=param_shardings)
  def init_params():
    return nnx.split(model_lib.Llama(model_cfg, rngs=nnx.Rngs(cfg.seed)), nnx.Param)[1]

  tx = build_optimizer(cfg, replica_axis, "fsdp" if cfg.two_d else None)
  fault = (cfg.inject_nan_step, cfg.inject_nan_worker) if cfg.inject_nan_step else None
  state_specs = dj.worker_state_specs(tx, abstract, mesh, replica_axis, param_specs=param_specs)
  step_fn = jax.jit(
    jax.shard_map(
      functools.partial(train_step, graphdef=graphdef, tx=tx, fault=fault, param_specs=param_specs),
      mesh=mesh,
      in_specs=(param_in, state_specs, P(), rows, rows),
      out_specs=(param_in, state_specs, P()),
    ),
    donate_argnums=(0, 1),
  )
  eval_fn = jax.jit(
    jax.shard_map(
      functools.partial(eval_step, graphdef=graphdef, param_specs=param_specs),
      mesh=mesh,
      in_specs=(param_in, rows, rows),
      out_specs=P(),
    )
  )
  mismatch_fn = jax.jit(
    jax.shard_map(
      functools.partial(_replica_mismatches, param_specs=param_specs),
      mesh=mesh,
      in_specs=(param_in,),
      out_specs=P(),
    )
  )
  # The optimizer-free step for --time_optimizer (1-D mesh only).
  grad_fn = jax.jit(
    jax.shard_map(
      functools.partial(gradient_step, graphdef=graphdef),
      mesh=mesh,
      in_specs=(P(), state_specs, P("data"), P("data")),
      out_specs=P("data"),
    )
  )

  checkpointer = (
    Checkpointer(ckpt_dir, save_every=cfg.checkpoint_every, fingerprint=_fingerprint(cfg))
    if (cfg.checkpoint_every or cfg.resume)
    else None
  )

  start_step = 0
  if cfg.resume:
    abstract_state = {
      "params": jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
        abstract,
        param_shardings
        if param_specs is not None
        else jax.tree.map(lambda _: replicated, abstract),
      ),
      "opt_state": dj.abstract_worker_state(
        tx, abstract, mesh, replica_axis, param_specs=param_specs
      ),
    }
    start_step, restored = checkpointer.restore_latest(abstract_state, train_iter)
    params, opt_state = restored["params"], restored["opt_state"]
  else:
    params = init_params()
    opt_state = dj.init_worker_state(tx, params, mesh, replica_axis, param_specs=param_specs)

  def to_global(batch):
    return [
      jax.make_array_from_process_local_data(batch_sharding, np.asarray(batch[k]))
      for k in ("inputs", "targets")
    ]

  sample_inputs = jax.ShapeDtypeStruct(
    (cfg.batch_size, cfg.seq_len), jnp.int32, sharding=batch_sharding
  )
  step_arg = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
  compiled = step_fn.lower(params, opt_state, step_arg, sample_inputs, sample_inputs).compile()
  hlo = compiled.as_text()
  measured = dj.parse_collective_bytes(hlo)
  by_axes = {
    "+".join(k) or "none": v.total for k, v in dj.collective_bytes_by_axes(hlo, mesh).items()
  }
  # What crosses the data-parallel axis: the slow links between sites.
  crossing = sum(v for k, v in by_axes.items() if replica_axis in k.split("+"))
  sent = bytes_sent_per_step(
    cfg,
    abstract if param_specs is None else dj.local_shapes(abstract, param_specs, {"fsdp": cfg.fsdp}),
  )
  # DiLoCo's all-reduce sits in a branch taken once every H steps.
  per_step = cfg.diloco_sync_every if cfg.optimizer == "diloco" else 1
  metric_axes = MESH_2D if cfg.two_d else ("data",)
  measured_exchange = (crossing - metrics_collective_bytes(mesh, metric_axes)) / per_step
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract))

  writer = reporting.MetricsWriter(
    cfg.out_dir, enabled=is_main, truncate_after=start_step if cfg.resume else None
  )
  progress = reporting.Progress(cfg.steps, enabled=is_main and cfg.progress, every=cfg.log_every)
  layout = (
    f"{cfg.replicas} replicas x {cfg.fsdp} fsdp devices" if cfg.two_d else f"{cfg.workers} workers"
  )
  progress.message(
    f"{cfg.optimizer}{' (delayed apply)' if cfg.delayed_apply else ''} | preset {cfg.preset} "
    f"({num_params / 1e6:.2f}M params) | "
    f"{layout} x {cfg.batch_size // cfg.workers} seqs x {cfg.seq_len} tokens | "
    f"lr {cfg.learning_rate:g} | sends {reporting.human_bytes(sent['bytes_sent'])}/step/"
    f"{'device' if cfg.two_d else 'worker'} (HLO: {reporting.human_bytes(crossing)} into "
    f"collectives over {replica_axis!r}, {reporting.human_bytes(measured.total)} in all)"
  )
  if fsdp_plan is not None and fsdp_plan.whole:
    progress.message(
      f"{len(fsdp_plan.whole)} params stay whole on every device of a site (each device "
      f"sends their chunks too):\n{fsdp_plan.describe_whole()}"
    )

  timer = reporting.StepTimer()
  tokens_per_step = cfg.batch_size * cfg.seq_len
  pending = None  # (step, metrics arrays, seconds), read one step late
  tx_lr = lr_schedule(cfg)

  def flush(entry, val_loss=None):
    step, metrics, seconds = entry
    record = {
      "step": step,
      "loss": float(metrics["loss"]),  # blocks until the step is done, so the next line
      "wall_time": time.time(),  # is when it finished: netlab times steps across processes
      "bytes_sent": sent["bytes_sent"],
      "lr": float(tx_lr(step - 1)),
      "tokens_per_s": tokens_per_step / max(seconds, 1e-9),
    }
    if cfg.optimizer != "adamw":
      record["excluded_contributions"] = int(metrics["excluded"])
    if val_loss is not None:
      record["val_loss"] = val_loss
    if not math.isfinite(record["loss"]):
      raise FloatingPointError(
        f"the loss became {record['loss']} on every worker at step {step}; no checkpoint "
        "was written after it. Lower --learning_rate or --clip_norm"
        + (", or pass --skip_nonfinite" if cfg.optimizer == "adamw" else "")
        + "."
      )
    writer.write(record)
    progress.update(step, record["loss"], record["tokens_per_s"], sent["bytes_sent"])

  def evaluate(p):
    # Eval batches are global; each process feeds its own rows of them.
    rows = cfg.batch_size // jax.process_count()
    lo = jax.process_index() * rows
    local = [{k: v[lo : lo + rows] for k, v in b.items()} for b in eval_batches]
    losses = [float(eval_fn(p, *to_global(b))) for b in local]
    return float(np.mean(losses)) if losses else None

  try:
    last_step = cfg.stop_at_step or cfg.steps
    for step in range(start_step + 1, last_step + 1):
      inputs, targets = to_global(next(train_iter))
      step_arr = jax.device_put(np.int32(step), replicated)
      params, opt_state, metrics = compiled(params, opt_state, step_arr, inputs, targets)
      seconds = timer.lap()
      if pending is not None:
        flush(pending)
      pending = (step, metrics, seconds)
      if cfg.check_replicas and (step % cfg.log_every == 0 or step == cfg.steps):
        mismatches = int(mismatch_fn(params))
        if mismatches:
          raise ReplicaDivergenceError(
            f"replicas diverged at step {step}: {mismatches} param entries differ between "
            "workers. This is a bug; please report it with the flags of this run."
          )
      val_loss = None
      if eval_batches and (step % cfg.eval_every == 0 or step == cfg.steps):
        val_loss = evaluate(params)
      if val_loss is not None:
        flush(pending, val_loss)
        pending = None
      if checkpointer and checkpointer.should_save(step, last_step):
        if pending is not None:
          flush(pending)
          pending = None
        checkpointer.save(step, {"params": params, "opt_state": opt_state}, train_iter)
    if pending is not None:
      flush(pending)
  finally:
    writer.close()
    if checkpointer:
      checkpointer.close()

  records = writer.records
  last = records[-1] if records else {}
  tail = [r["loss"] for r in records[-10:]]
  val = [r["val_loss"] for r in records if "val_loss" in r]
  steps_done = records[-1]["step"] if records else start_step
  summary = {
    "optimizer": cfg.optimizer,
    "preset": cfg.preset,
    "num_params": num_params,
    "steps": steps_done,
    "workers": cfg.workers,
    "final_train_loss": last.get("loss"),
    "final_train_loss_avg10": float(np.mean(tail)) if tail else None,
    "final_val_loss": val[-1] if val else None,
    "bytes_sent_per_step": sent["bytes_sent"],
    "payload_bytes_per_step": sent["payload_bytes"],
    "measured_collective_bytes_per_step": measured.total,
    "measured_by_kind": {k: v for k, v in measured.by_kind.items() if v},
    "measured_exchange_bytes_per_step": measured_exchange,
    "measured_by_axes": by_axes,
    "measured_crossing_replicas_per_step": crossing,
    "params_kept_whole": [path for path, _ in fsdp_plan.whole] if fsdp_plan else [],
    "total_bytes_sent_per_worker": sent["bytes_sent"] * steps_done,
    "ratio_vs_ring_allreduce": sent["ring_allreduce_bytes"] / sent["payload_bytes"],
    "ratio_vs_bf16_grad": sent["grad_bytes_bf16"] / sent["payload_bytes"],
    "params_digest": params_digest(params),
    "config": dataclasses.asdict(cfg),
  }
  if cfg.time_optimizer and steps_done > start_step:
    # After the digest: timing keeps stepping the (donated) params.
    def full_step(p, s, step):
      return compiled(p, s, jax.device_put(np.int32(step), replicated), inputs, targets)[:2]

    summary.update(
      time_step_parts(
        full_step,
        lambda p, s: grad_fn(p, s, inputs, targets),
        params,
        opt_state,
        first_step=steps_done,
        block=cfg.diloco_sync_every if cfg.optimizer == "diloco" else 4,
        rounds=3 if cfg.optimizer == "diloco" else 5,
      )
    )
  # Every process records its own copy's digest, so replicas can be compared across hosts.
  os.makedirs(cfg.out_dir, exist_ok=True)
  with open(os.path.join(cfg.out_dir, f"params_digest.process{jax.process_index()}"), "w") as f:
    f.write(summary["params_digest"] + "\n")
  if is_main:
    with open(os.path.join(cfg.out_dir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
    if records:
      reporting.plot_losses(
        records, os.path.join(cfg.out_dir, "loss.png"), f"{cfg.optimizer} on {cfg.preset}"
      )
    progress.message(
      f"done: train loss {summary['final_train_loss']:.4f}"
      + (f", val loss {summary['final_val_loss']:.4f}" if val else "")
      + f" | {reporting.human_bytes(summary['total_bytes_sent_per_worker'])} sent per worker"
      f" | {summary['ratio_vs_ring_allreduce']:.0f}x less than a ring all-reduce,"
      f" {summary['ratio_vs_bf16_grad']:.0f}x less than a bf16 gradient"
      f" | outputs in {cfg.out_dir}"
    )
  return summary
