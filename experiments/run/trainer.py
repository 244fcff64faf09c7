"""Language-model training with any method of the registry: the importable core.

``experiments.train`` is the command-line entry point; Colab and tests call
:func:`run` with a :class:`~experiments.run.config.TrainConfig` directly.

:func:`run` is the loop. What it runs is built once by :func:`build`: the
pure steps of ``experiments.run.steps``, each wrapped in ``jax.shard_map`` over
the ``("replica", "fsdp")`` mesh and jitted, the train step with its params
and optimizer state donated. A plain data-parallel run is that mesh with one
device per site.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import distro_jax as dj
from experiments.run import (
  checks,
  config,
  elastic,
  interruption,
  measure,
  methods,
  peers,
  preemption,
  presets,
  reporting,
  rundir,
  steps,
)
from experiments.run import data as data_lib
from experiments.run import model as model_lib
from experiments.run.checkpointing import Checkpointer, CheckpointError, ResumePoint
from experiments.run.cli import ReplicaDivergenceError
from experiments.run.config import ConfigError, TrainConfig
from experiments.run.launch import FSDP, REPLICA, make_mesh
from experiments.run.records import StepRecord, Summary, logged_loss
from experiments.run.threaded_step import ThreadedStep

__all__ = [
  "CheckpointError",
  "ConfigError",
  "Program",
  "ReplicaDivergenceError",
  "TrainConfig",
  "build",
  "run",
  "step_number",
]


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


@dataclasses.dataclass(frozen=True)
class Program:
  """What a run executes, built once from its (resolved) config.

  Attributes:
    cfg: the resolved config.
    method: the registry entry of ``cfg.optimizer``.
    mesh: the ``("replica", "fsdp")`` mesh.
    graphdef: the model's static structure.
    abstract: the params' global shapes and dtypes.
    fsdp_plan: how the params are sharded within a site.
    tx: the optimizer each device runs.
    state_specs: ``PartitionSpec`` tree of the per-worker optimizer state.
    train_step: ``(params, opt_state, step, inputs, targets)``, jitted, donating.
    threaded_step: the same step as three programs, its all-gather on a thread
      of its own (:mod:`experiments.run.threaded_step`), when the run overlaps its
      exchange that way (``--overlap_exchange``); ``None`` otherwise.
    eval_step: ``(params, inputs, targets) -> loss``.
    gradient_step: ``(params, opt_state, inputs, targets)``, no optimizer.
    mismatches: ``params -> entries that differ between replicas``.
    rows: how a global batch's rows are split over the mesh.
  """

  cfg: TrainConfig
  method: methods.Method
  mesh: jax.sharding.Mesh
  graphdef: Any
  abstract: Any
  fsdp_plan: dj.FsdpPlan
  tx: optax.GradientTransformation
  state_specs: Any
  train_step: Any
  threaded_step: ThreadedStep | None
  eval_step: Any
  gradient_step: Any
  mismatches: Any
  rows: P

  def sharding(self, spec: Any = None) -> Any:
    """``NamedSharding``\\ (s) on this mesh for a spec or a tree of specs (default: replicated)."""
    spec = P() if spec is None else spec
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s), spec, is_leaf=_is_spec)

  def placed(self, tree: Any, specs: Any) -> Any:
    """``jax.ShapeDtypeStruct``\\ s of ``tree`` placed as ``specs`` say."""
    return jax.tree.map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, self.sharding(specs)
    )

  def init_params(self) -> Any:
    spec_leaves, spec_def = jax.tree.flatten(self.fsdp_plan.specs, is_leaf=_is_spec)
    make = _params_init(
      config.model_config(self.cfg), self.cfg.seed, self.mesh, tuple(spec_leaves), spec_def
    )
    return make()

  def init_opt_state(self, params: Any) -> Any:
    return dj.init_worker_state(
      self.tx, params, self.mesh, REPLICA, param_specs=self.fsdp_plan.specs
    )

  def abstract_state(self) -> dict[str, Any]:
    """The checkpoint's restore target: params and optimizer state, placed."""
    opt_state = dj.abstract_worker_state(
      self.tx, self.abstract, self.mesh, REPLICA, param_specs=self.fsdp_plan.specs
    )
    return {"params": self.placed(self.abstract, self.fsdp_plan.specs), "opt_state": opt_state}


@functools.lru_cache(maxsize=8)
def _params_init(
  model_cfg: model_lib.ModelConfig,
  seed: int,
  mesh: jax.sharding.Mesh,
  spec_leaves: tuple[P, ...],
  spec_def: Any,
) -> Any:
  """The jitted function that makes a model's params, placed as the specs say.

  Kept, so that the runs of one model and seed in a process (the methods of a
  comparison) trace and compile it once.
  """
  specs = jax.tree.unflatten(spec_def, spec_leaves)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)
  make = lambda: nnx.split(model_lib.Llama(model_cfg, rngs=nnx.Rngs(seed)), nnx.Param)[1]
  return jax.jit(make, out_shardings=shardings)


def build(cfg: TrainConfig, *, cold_until: tuple[int, ...] | None = None) -> Program:
  """The mesh, model, optimizer and jitted steps for ``cfg`` (resolved).

  ``cold_until`` (an elastic resume's joiners in their cold start) is what
  :func:`experiments.run.steps.train_step` takes.

  The last few programs built in this process are kept. A run whose settings
  differ only in where and how it reports, saves, resumes and stops (a resume
  in the same notebook, a test's straight run beside its interrupted one)
  gets the kept program, whose steps are already traced and compiled.
  """
  settings = dataclasses.replace(cfg, **_RUNTIME_DEFAULTS)
  # The fused kernels' switches are read when the steps are traced.
  kernels = (
    dj.cpu_kernels.switched_off(),
    dj.pallas_kernels.available(),
    dj.pallas_kernels.interpreting(),
  )
  key = (settings, cold_until, kernels, jax.process_count())
  try:
    hash(key)
  except TypeError:  # a setting that cannot be hashed: nothing to key it on
    return dataclasses.replace(_build(settings, cold_until), cfg=cfg)
  return dataclasses.replace(_kept_build(*key), cfg=cfg)


# What only steers a run (where and how it reports, saves, resumes and
# stops), and the data it reads: none of it enters what build() makes, so
# build() keys its programs on the settings with these at their defaults. An
# elastic resume's leaving workers and cold start enter as cold_until.
_RUNTIME_DEFAULTS = {
  f.name: f.default
  for f in dataclasses.fields(TrainConfig)
  if f.name in config.RUNTIME_FIELDS | {"data_path"}
}


@functools.lru_cache(maxsize=4)
def _kept_build(
  settings: TrainConfig, cold_until: tuple[int, ...] | None, kernels: Any, processes: int
) -> Program:
  """:func:`_build`, kept for the last four keys (``kernels`` and ``processes`` are key only)."""
  del kernels, processes
  return _build(settings, cold_until)


def _build(cfg: TrainConfig, cold_until: tuple[int, ...] | None) -> Program:
  """:func:`build`, computed."""
  method = methods.get(cfg.optimizer)
  model_cfg = config.model_config(cfg)
  mesh = make_mesh(cfg.workers, cfg.fsdp)
  graphdef, abstract = nnx.split(
    nnx.eval_shape(lambda: model_lib.Llama(model_cfg, rngs=nnx.Rngs(cfg.seed))), nnx.Param
  )
  plan = dj.plan_fsdp(abstract, cfg.fsdp, compression_chunk=cfg.compression_chunk, axis_name=FSDP)
  specs = plan.specs
  tx = method.build(cfg, methods.Axes(REPLICA, FSDP if cfg.fsdp > 1 else None))
  state_specs = dj.worker_state_specs(tx, abstract, mesh, REPLICA, param_specs=specs)
  fault = (cfg.inject_nan_step, cfg.inject_nan_worker) if cfg.inject_nan_step else None
  rows = steps.rows_spec(cfg.fsdp)
  common = {"graphdef": graphdef, "param_specs": specs}
  point = method.gradient_point(cfg)
  # Each device's loss, unreduced (the host averages it, records.logged_loss).
  metric_specs = {"loss": rows, "excluded": P()}
  threaded = None
  # An all-to-all exchange's result is typed by worker (exchange.all_gather_messages).
  typed = cfg.collective == "all_gather"
  if _overlap_on_thread(cfg):
    worker_rows = jax.tree.map(lambda _: rows, specs, is_leaf=_is_spec)
    compressed_specs = steps.compressed_part(state_specs)
    (message_spec,) = [p for _, p in compressed_specs]
    threaded = ThreadedStep(
      exchange=steps.shard_step(
        steps.exchange_step,
        mesh,
        (message_spec,),
        P(),
        check_vma=typed,
        collective=cfg.collective,
      ),
      gradient=steps.shard_step(
        steps.gradient_and_message,
        mesh,
        (specs, state_specs, P(), rows, rows),
        (rows, worker_rows, compressed_specs, message_spec),
        point=point,
        tx=tx,
        fault=fault,
        cold_until=cold_until,
        **common,
      ),
      apply=steps.shard_step(
        steps.apply_step,
        mesh,
        (specs, state_specs, P(), rows, worker_rows, P()),
        (specs, state_specs, metric_specs),
        donate=(0, 1),
        tx=tx,
        fault=fault,
        cold_until=cold_until,
      ),
    )
  return Program(
    cfg=cfg,
    method=method,
    mesh=mesh,
    graphdef=graphdef,
    abstract=abstract,
    fsdp_plan=plan,
    tx=tx,
    state_specs=state_specs,
    train_step=steps.shard_step(
      steps.train_step,
      mesh,
      (specs, state_specs, P(), rows, rows),
      (specs, state_specs, metric_specs),
      donate=(0, 1),
      check_vma=typed,
      tx=tx,
      point=point,
      fault=fault,
      cold_until=cold_until,
      **common,
    ),
    threaded_step=threaded,
    eval_step=steps.shard_step(steps.eval_step, mesh, (specs, rows, rows), P(), **common),
    gradient_step=steps.shard_step(
      steps.gradient_step, mesh, (specs, state_specs, rows, rows), rows, point=point, **common
    ),
    mismatches=steps.shard_step(steps.replica_mismatches, mesh, (specs,), P(), param_specs=specs),
    rows=rows,
  )


def _overlap_on_thread(cfg: TrainConfig) -> bool:
  """Whether the delayed exchange's all-gather runs as a program on a thread of its own."""
  if not cfg.delayed_apply or cfg.fsdp > 1 or cfg.overlap_exchange == "fused":
    return False
  if cfg.overlap_exchange == "thread":
    return True
  # In one process the collectives are copies in memory, with no transfer to
  # hide; the fused step there also keeps the docs' single-process figures.
  return jax.default_backend() == "cpu" and jax.process_count() > 1


def _checkpoint_dir(cfg: TrainConfig) -> str:
  """The checkpoint directory; a resume of a run that never saved stops here, before any write."""
  ckpt_dir = os.path.join(cfg.out_dir, "checkpoints")
  if cfg.resume and not os.path.isdir(ckpt_dir):
    raise CheckpointError(
      f"--resume: checkpoint directory {ckpt_dir} does not exist. Check --out_dir, "
      "or start without --resume."
    )
  return ckpt_dir


def _open_checkpoints(
  given: TrainConfig, data_identity: Any
) -> tuple[TrainConfig, Checkpointer, ResumePoint | None]:
  """The resolved config, and the checkpoints it saves to or resumes from.

  A resume reads the newest intact checkpoint's metadata first: it must be of
  this run (the fingerprint), and the settings that steered the run come from
  it unless given again. Only small files are read; nothing is compiled yet.
  """
  ckpt_dir = os.path.join(given.out_dir, "checkpoints")
  fixed = checks.resolve(given)
  fingerprint = {**config.fingerprint(fixed), "data_identity": data_identity}
  procs = {"main": jax.process_index() == 0, "multiprocess": jax.process_count() > 1}
  point = None
  if given.resume:
    checkpointer = Checkpointer(ckpt_dir, fingerprint=fingerprint, **procs)
    point = checkpointer.find_resume_point()
  elif os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir)):
    # Orbax names finished checkpoints by their step; a save that died leaves
    # only a temporary directory, which does not count.
    raise CheckpointError(
      f"{ckpt_dir} already holds checkpoints; pass --resume to continue that run, "
      "or choose a new --out_dir (a fresh run never overwrites them)."
    )
  cfg = checks.resolve(given, saved=point.meta.get("runtime") if point else None)
  if point is not None:
    _check_resume_span(cfg, point.step)
  else:
    # Also at --checkpoint_every=0: a preemption notice saves where the run is.
    checkpointer = Checkpointer(ckpt_dir, fingerprint=fingerprint, **procs)
  checkpointer.configure(
    save_every=cfg.checkpoint_every,
    keep=cfg.keep_checkpoints,
    runtime=config.runtime_settings(cfg),
  )
  return cfg, checkpointer, point


def _check_space(out_dir: str, program: Program) -> None:
  """A disk too full for one checkpoint is found now, not after compiling and training.

  Orbax writes arrays uncompressed, so a checkpoint takes about the bytes of
  the params and every worker's optimizer state. Process 0 looks; every
  process of a multi-process run stops on its verdict.
  """
  problem = None
  if jax.process_index() == 0:
    need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(program.abstract_state()))
    stat = os.statvfs(out_dir)
    if (free := stat.f_bavail * stat.f_frsize) < need:
      problem = rundir.OutDirError(
        f"--out_dir={out_dir} has {reporting.human_bytes(free)} free, less than one "
        f"checkpoint of this run takes (about {reporting.human_bytes(need)}); free space, "
        "choose another --out_dir, or run without --checkpoint_every."
      )
  if jax.process_count() > 1 and not rundir.agree(problem is None):
    problem = problem or rundir.OutDirError(
      f"process 0 found no room for a checkpoint in --out_dir={out_dir} (its error says how much)."
    )
  if problem is not None:
    raise problem


def _check_resume_span(cfg: TrainConfig, step: int) -> None:
  """A resume that would train nothing is refused rather than reported done."""
  if step >= cfg.steps:
    raise CheckpointError(
      f"--resume: the run in {cfg.out_dir} already finished (its checkpoint is at step "
      f"{step} of --steps={cfg.steps}); nothing is left to train. For a longer run, start "
      "one with more --steps in a new --out_dir."
    )
  if cfg.stop_at_step and cfg.stop_at_step <= step:
    raise ConfigError(
      f"--stop_at_step={cfg.stop_at_step} is not past the checkpoint's step {step}, so the "
      f"resumed run would train nothing; use --stop_at_step in ({step}, {cfg.steps}], or 0."
    )


class _Batches:
  """The run's data: the training iterator, the validation batches, and their placement."""

  def __init__(self, cfg: TrainConfig, program: Program, splits: data_lib.Splits):
    self.train_windows = data_lib.window_count(splits.train, cfg.seq_len)
    self.train = data_lib.make_train_iterator(
      splits.train,
      seq_len=cfg.seq_len,
      global_batch_size=cfg.batch_size,
      num_workers=cfg.workers,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
      seed=cfg.seed,
    )
    self.eval = data_lib.make_eval_batches(
      splits.val,
      seq_len=cfg.seq_len,
      batch_size=cfg.batch_size,
      max_batches=cfg.eval_batches,
      spread=splits.by_document,
    )
    self.sharding = program.sharding(program.rows)
    self.abstract = jax.ShapeDtypeStruct(
      (cfg.batch_size, cfg.seq_len), jnp.int32, sharding=self.sharding
    )
    self.rows = cfg.batch_size // jax.process_count()

  def place(self, batch: dict[str, np.ndarray]) -> list[jax.Array]:
    """This process's rows of a global batch, as global arrays."""
    return [
      jax.make_array_from_process_local_data(self.sharding, np.asarray(batch[k]))
      for k in ("inputs", "targets")
    ]

  def next_train(self) -> list[jax.Array]:
    return self.place(next(self.train))

  def evaluate(self, eval_step: Any, params: Any) -> float | None:
    # Eval batches are global; each process feeds its own rows of them.
    lo = jax.process_index() * self.rows
    local = [{k: v[lo : lo + self.rows] for k, v in b.items()} for b in self.eval]
    losses = [float(eval_step(params, *self.place(b))) for b in local]
    return float(np.mean(losses)) if losses else None


@dataclasses.dataclass(frozen=True)
class _Read:
  """A step as this process read it, before its record is written.

  Attributes:
    step: the 1-based step.
    losses: the losses of this process's devices, in the order of ``_Log.positions``.
    wall_time: ``time.time()`` once this process's step had finished.
    seconds: the step's time, dispatch to dispatch.
    excluded: messages the optimizer left out (replicated, so read locally).
    val_loss: validation loss after this step, where one was taken.
  """

  step: int
  losses: np.ndarray
  wall_time: float
  seconds: float
  excluded: int
  val_loss: float | None


class _Log:
  """The progress line and ``metrics.jsonl``, fed one step late (process 0 writes).

  The train step returns every device's loss unreduced; the logged loss is
  their mean (:func:`~experiments.run.records.logged_loss`), taken here. In
  one process every device's loss is at hand and each step is written as it
  is read. In a multi-process run a process holds only its own devices'
  losses: each reads its own one step late, and the processes gather what
  they read in one ``process_allgather`` every ``--log_every`` steps and
  before an evaluation, a checkpoint or the end (:meth:`flush`), off the
  steps' path, so ``metrics.jsonl`` gets those lines in bursts.
  """

  def __init__(
    self, cfg: TrainConfig, method: methods.Method, payload: methods.Payload, start: int
  ):
    self.cfg, self.method, self.sent = cfg, method, payload.sent
    main = jax.process_index() == 0
    self.writer = reporting.MetricsWriter(
      cfg.out_dir, enabled=main, truncate_after=start if cfg.resume else None
    )
    self.progress = reporting.Progress(
      cfg.steps, enabled=main and cfg.progress, every=cfg.log_every
    )
    self.timer = reporting.StepTimer()
    self.schedule = methods.lr_schedule(cfg)
    self.pending: tuple[int, Any, float] | None = None
    self.unwritten: list[_Read] = []
    self.positions: np.ndarray | None = None  # where this process's losses sit among all
    self.write_every = 1 if jax.process_count() == 1 else max(1, cfg.log_every or 1)

  def gathers_next(self) -> bool:
    """Whether the next :meth:`stepped` gathers across processes."""
    if self.pending is None or jax.process_count() == 1:
      return False
    return self.pending[0] % self.write_every == 0

  def stepped(self, step: int, metrics: Any) -> None:
    """Records the step just dispatched and reads (and, when due, writes) the one before it."""
    seconds = self.timer.lap()
    self._read()
    if self.unwritten and self.unwritten[-1].step % self.write_every == 0:
      self._write()
    self.pending = (step, metrics, seconds)

  def flush(self, val_loss: float | None = None) -> None:
    """Writes every step not yet written, the one in flight (with ``val_loss``) included.

    In a multi-process run every process must call it at the same step.
    """
    self._read(val_loss)
    self._write()

  def _read(self, val_loss: float | None = None) -> None:
    if self.pending is None:
      return
    step, metrics, seconds = self.pending
    self.pending = None
    shards = metrics["loss"].addressable_shards
    if self.positions is None:
      order = np.arange(metrics["loss"].size)
      self.positions = np.concatenate([order[s.index] for s in shards])
    # Blocks until this process's step is done, so the next field is when it
    # finished: netlab times steps across processes.
    losses = np.concatenate([np.asarray(s.data, np.float32) for s in shards])
    self.unwritten.append(
      _Read(step, losses, time.time(), seconds, int(metrics["excluded"]), val_loss)
    )

  def _write(self) -> None:
    if not self.unwritten:
      return
    reads, self.unwritten = self.unwritten, []
    losses = np.stack([r.losses for r in reads])
    if jax.process_count() > 1:
      # The one exchange of the log: every process's losses of these steps.
      every = multihost_utils.process_allgather({"at": self.positions, "losses": losses})
      at, got = every["at"].reshape(-1), every["losses"]  # (P, L), (P, steps, L)
      losses = np.empty((len(reads), at.size), np.float32)
      losses[:, at] = np.moveaxis(got, 0, 1).reshape(len(reads), -1)
    else:
      losses = losses[:, np.argsort(self.positions)]
    for read, step_losses in zip(reads, losses):
      self._record(read, logged_loss(step_losses))

  def _record(self, read: _Read, loss: float) -> None:
    step = read.step
    record = StepRecord(
      step=step,
      loss=loss,
      wall_time=read.wall_time,
      bytes_sent=self.sent,
      lr=float(self.schedule(step - 1)),
      tokens_per_s=self.cfg.batch_size * self.cfg.seq_len / max(read.seconds, 1e-9),
      excluded_contributions=read.excluded if self.method.excludes_nonfinite else None,
      val_loss=read.val_loss,
    )
    if not math.isfinite(record.loss):
      raise FloatingPointError(
        f"the loss became {record.loss} on every worker at step {step}; no checkpoint "
        f"was written after it. {_nonfinite_advice(self.method)}"
      )
    self.writer.write(record)
    self.progress.update(step, record.loss, record.tokens_per_s, self.sent)

  def close(self) -> None:
    self.writer.close()


def _describe(program: Program, payload: methods.Payload, hlo: measure.HloBytes) -> str:
  cfg = program.cfg
  layout = (
    f"{cfg.replicas} sites x {cfg.fsdp} fsdp devices" if cfg.fsdp > 1 else f"{cfg.workers} workers"
  )
  per = "device" if cfg.fsdp > 1 else "worker"
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(program.abstract))
  return (
    f"{cfg.optimizer}{' (delayed apply)' if cfg.delayed_apply else ''} | preset {cfg.preset} "
    f"({num_params / 1e6:.2f}M params) | "
    f"{layout} x {cfg.batch_size // cfg.workers} seqs x {cfg.seq_len} tokens | "
    f"lr {cfg.learning_rate:g} | sends {reporting.human_bytes(payload.sent)}/step/{per} "
    f"(HLO: {reporting.human_bytes(hlo.crossing)} into collectives over {REPLICA!r}, "
    f"{reporting.human_bytes(hlo.total)} in all)"
  )


def _start(
  program: Program,
  batches: _Batches,
  checkpointer: Checkpointer,
  point: ResumePoint | None,
):
  """``(start_step, params, opt_state, resize)``: restored from the checkpoint, or fresh.

  A checkpoint saved on another worker count is restored and resized
  (``experiments.run.elastic``); ``resize`` says what changed (None: a fresh run).
  """
  if point is not None:
    restore = elastic.Restore(program, checkpointer.directory)
    restored = checkpointer.restore(point, restore.target(point.step), batches.train)
    params = restored["params"]
    return point.step, params, restore.finish(params, restored["opt_state"]), restore.resize
  params = program.init_params()
  return 0, params, program.init_opt_state(params), None


def run(cfg: TrainConfig) -> Summary:
  """Trains one model; returns the summary (also written to ``OUT_DIR/summary.json``).

  Everything that can be checked before compiling is: the settings
  (``checks.validate``), the output directory (claimed for this run alone,
  ``experiments.run.rundir``), the data file, and on ``--resume`` the checkpoint.

  Raises:
    ConfigError, data_lib.DataError, CheckpointError, rundir.OutDirError: bad
      flags, data, checkpoints or output directory, before anything compiles;
      OutDirError also for a disk that fills up or turns read-only later.
  """
  checks.validate(cfg)
  _checkpoint_dir(cfg)
  if cfg.data_path is not None:
    data_lib.check_file(cfg.data_path)  # its ids are scanned once the directory is ours
  main = jax.process_index() == 0
  # SIGTERM from here on is a preemption notice (experiments.run.preemption).
  with (
    rundir.claim(cfg.out_dir, main=main, multiprocess=jax.process_count() > 1),
    preemption.Notice() as notice,
  ):
    try:
      return _run_claimed(cfg, notice)
    except OSError as e:
      if err := rundir.filesystem_error(e, e.filename or f"to --out_dir={cfg.out_dir}"):
        raise err from None
      raise


def _run_claimed(cfg: TrainConfig, notice: preemption.Notice) -> Summary:
  """:func:`run` once the output directory is this run's, with SIGTERM heard by ``notice``."""
  argv = interruption.train_argv(cfg)
  splits = data_lib.load_splits(cfg.data_path, presets.get_preset(cfg.preset).vocab_size)
  cfg, checkpointer, point = _open_checkpoints(cfg, data_lib.identity(cfg.data_path))
  program = build(cfg)
  if checkpointer.save_every:
    _check_space(cfg.out_dir, program)
  batches = _Batches(cfg, program, splits)
  start_step, params, opt_state, resize = _start(program, batches, checkpointer, point)
  if resize and (cold := resize.cold_until(cfg.cold_start_steps)):
    program = build(cfg, cold_until=cold)
  step_arg = jax.ShapeDtypeStruct((), jnp.int32, sharding=program.sharding())
  if program.threaded_step is not None:
    compiled = program.threaded_step.compile(
      params, opt_state, step_arg, batches.abstract, batches.abstract
    )
    hlo_texts = compiled.hlo_texts()
  else:
    compiled = program.train_step.lower(
      params, opt_state, step_arg, batches.abstract, batches.abstract
    ).compile()
    hlo_texts = [compiled.as_text()]
  hlo = measure.hlo_bytes(hlo_texts, program.mesh, program.method.exchange_every(cfg))
  local = dj.local_shapes(program.abstract, program.fsdp_plan.specs, {FSDP: cfg.fsdp})
  payload = program.method.payload(cfg, local)
  log = _Log(cfg, program.method, payload, start_step)
  log.progress.message(_describe(program, payload, hlo))
  _say_how_much_it_reads(cfg, batches, log)
  if resize and resize.changed:
    log.writer.write_event(resize.event(cfg))
    log.progress.message(resize.describe(cfg))
  if program.fsdp_plan.whole:
    log.progress.message(
      f"{len(program.fsdp_plan.whole)} params stay whole on every device of a site (each "
      f"device sends their chunks too):\n{program.fsdp_plan.describe_whole()}"
    )
  last_step = cfg.stop_at_step or cfg.steps
  _check_start_agreed(start_step)
  peers.watch_run(cfg, argv, checkpointer.directory)
  try:
    for step in range(start_step + 1, last_step + 1):
      step_arr = step_number(step, program.sharding())
      params, opt_state, metrics = compiled(params, opt_state, step_arr, *batches.next_train())
      preempted = notice.reached(step - start_step)
      check = cfg.check_replicas and (step % cfg.log_every == 0 or step == cfg.steps)
      # --eval_every=0: only after the last step.
      due = (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps
      saving = checkpointer.should_save(step, last_step) or preempted
      if hasattr(compiled, "settle") and (
        check or due or saving or step == last_step or log.gathers_next()
      ):
        compiled.settle()  # the exchange in flight, before another crosses processes
      log.stepped(step, metrics)
      if check:
        _check_replicas(program, params, step)
      if batches.eval and due:
        log.flush(batches.evaluate(program.eval_step, params))
      if saving:
        log.flush()
        # The loss was taken before this step's update, so it cannot vouch
        # for the params about to be saved.
        if not bool(_all_finite(params)):
          raise FloatingPointError(
            f"the params are not finite after step {step}'s update (its loss, taken before "
            f"the update, was finite); checkpoint {step} was not written, so the last one on "
            f"disk is good. {_nonfinite_advice(program.method)}"
          )
        checkpointer.save(step, {"params": params, "opt_state": opt_state}, batches.train)
      if preempted:
        raise preemption.stop(cfg, step, argv)
    log.flush()
  except Exception as e:
    peers.collective_failed(e)  # a peer that went away ends the process here, in one line
    raise
  finally:
    log.close()
    checkpointer.close()
  summary = _summarize(program, log.writer.records, start_step, params, payload, hlo)
  read = data_lib.Reading.of(summary.steps, cfg.batch_size, batches.train_windows)
  summary = dataclasses.replace(summary, **dataclasses.asdict(read))
  if cfg.time_optimizer and summary.steps > start_step:
    summary = dataclasses.replace(
      summary, **_time(program, compiled, params, opt_state, batches, summary.steps)
    )
  _write_outputs(cfg, summary, log)
  return summary


def step_number(step: int, replicated: NamedSharding) -> jax.Array:
  """The step number as a replicated int32 on the mesh, placed by each process on its own devices.

  ``jax.device_put`` of a host value onto devices of several processes
  first checks that every process passed the same value: an all-gather in a
  program of its own, waited for before the step is dispatched, one more
  chain of round trips per step on a far link (docs/netlab.md, "Round trips
  per step"). Each process here places the number on its own devices alone.
  They agree without the check: every process counts from the same start
  (checked once, :func:`_check_start_agreed`) through the same loop.
  """
  value = np.int32(step)
  return jax.make_array_from_single_device_arrays(
    (), replicated, [jax.device_put(value, d) for d in replicated.addressable_devices]
  )


def _check_start_agreed(start_step: int) -> None:
  """Every process starts its loop at the same step: the one check :func:`step_number` relies on."""
  if jax.process_count() > 1:
    multihost_utils.assert_equal(
      np.int32(start_step),
      fail_message="the processes start at different steps (their resume points differ)",
    )


def _say_how_much_it_reads(cfg: TrainConfig, batches: _Batches, log: _Log) -> None:
  """The share of its training split the run will read; a warning where it rereads some."""
  steps = cfg.stop_at_step or cfg.steps
  reading = data_lib.Reading.of(steps, cfg.batch_size, batches.train_windows)
  if reading.rereads_data and jax.process_index() == 0:
    logging.warning(reading.describe(steps))  # also without --progress
  else:
    log.progress.message(reading.describe(steps))


def _nonfinite_advice(method: Any) -> str:
  """What to change when a run's loss or params stop being finite."""
  skip = ", or pass --skip_nonfinite" if method.supports_skip_nonfinite else ""
  return f"Lower --learning_rate or --clip_norm{skip}."


@jax.jit
def _all_finite(params: Any) -> jax.Array:
  """Whether every entry of every param is finite, one replicated bool."""
  return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)]))


def _check_replicas(program: Program, params: Any, step: int) -> None:
  if mismatches := int(program.mismatches(params)):
    raise ReplicaDivergenceError(
      f"replicas diverged at step {step}: {mismatches} param entries differ between "
      "workers. This is a bug; please report it with the flags of this run."
    )


def _time(
  program: Program, compiled: Any, params: Any, opt_state: Any, batches: _Batches, step: int
):
  """The optimizer's share of a step (``--time_optimizer``), after the digest was taken."""
  inputs, targets = batches.next_train()
  replicated = program.sharding()

  def full_step(p, s, i):
    out = compiled(p, s, step_number(i, replicated), inputs, targets)[:2]
    if hasattr(compiled, "settle"):
      compiled.settle()  # the gradient-only step timed next may cross processes too
    return out

  every = program.method.exchange_every(program.cfg)
  return measure.time_step_parts(
    full_step,
    lambda p, s: program.gradient_step(p, s, inputs, targets),
    params,
    opt_state,
    first_step=step,
    block=every if every > 1 else 4,
    rounds=3 if every > 1 else 5,
  )


def _summarize(
  program: Program,
  records: list[StepRecord],
  start_step: int,
  params: Any,
  payload: methods.Payload,
  hlo: measure.HloBytes,
) -> Summary:
  cfg = program.cfg
  tail = [r.loss for r in records[-10:]]
  val = [r.val_loss for r in records if r.val_loss is not None]
  steps_done = records[-1].step if records else start_step
  wb = dj.wire_bytes(
    dj.local_shapes(program.abstract, program.fsdp_plan.specs, {FSDP: cfg.fsdp}),
    num_workers=cfg.replicas,
  )
  return Summary(
    optimizer=cfg.optimizer,
    preset=cfg.preset,
    num_params=sum(int(np.prod(x.shape)) for x in jax.tree.leaves(program.abstract)),
    steps=steps_done,
    workers=cfg.workers,
    final_train_loss=records[-1].loss if records else None,
    final_train_loss_avg10=float(np.mean(tail)) if tail else None,
    final_val_loss=val[-1] if val else None,
    bytes_sent_per_step=payload.sent,
    payload_bytes_per_step=payload.per_step,
    measured_collective_bytes_per_step=hlo.total,
    measured_by_kind=hlo.by_kind,
    measured_exchange_bytes_per_step=hlo.exchange,
    measured_by_axes=hlo.by_axes,
    measured_crossing_replicas_per_step=hlo.crossing,
    params_kept_whole=[path for path, _ in program.fsdp_plan.whole],
    total_bytes_sent_per_worker=program.method.sent_over(cfg, payload, steps_done),
    ratio_vs_ring_allreduce=wb.ring_allreduce / payload.per_step,
    ratio_vs_bf16_grad=wb.grad_bf16 / payload.per_step,
    params_digest=measure.params_digest(params),
    config=dataclasses.asdict(cfg),
  )


def _write_outputs(cfg: TrainConfig, summary: Summary, log: _Log) -> None:
  """The digest file of every process; process 0's summary, plot and closing line."""
  os.makedirs(cfg.out_dir, exist_ok=True)
  # Every process records its own copy's digest, so replicas can be compared across hosts.
  with open(os.path.join(cfg.out_dir, f"params_digest.process{jax.process_index()}"), "w") as f:
    f.write(summary.params_digest + "\n")
  if jax.process_index() != 0:
    return
  summary.save(os.path.join(cfg.out_dir, "summary.json"))
  if log.writer.records:
    reporting.plot_losses(
      log.writer.records, os.path.join(cfg.out_dir, "loss.png"), f"{cfg.optimizer} on {cfg.preset}"
    )
  val = summary.final_val_loss
  # A lone worker's ring all-reduce sends nothing: no ratio to give.
  against = [
    f"{_times(ratio)} {baseline}"
    for ratio, baseline in (
      (summary.ratio_vs_ring_allreduce, "a ring all-reduce"),
      (summary.ratio_vs_bf16_grad, "a bf16 gradient"),
    )
    if ratio > 0
  ]
  compared = f" | {', '.join(against)}" if against else ""
  log.progress.message(
    f"done: train loss {summary.final_train_loss:.4f}"
    + (f", val loss {val:.4f}" if val is not None else "")
    + f" | {reporting.human_bytes(summary.total_bytes_sent_per_worker)} sent per worker"
    + compared
    + f" | outputs in {cfg.out_dir}"
  )


def _times(ratio: float) -> str:
  """``"857x less than"``, or for a message larger than the baseline ``"2.5x more than"``."""
  if ratio >= 1:
    return f"{ratio:,.0f}x less than" if ratio >= 10 else f"{ratio:.2f}x less than"
  return f"{1 / ratio:.2f}x more than"
