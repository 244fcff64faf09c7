r"""Train a Llama-style LM with DisTrO (DeMo), AdamW all-reduce or DiLoCo, from absl flags.

With no flags: the ``tiny`` preset, DeMo, 8 simulated CPU workers, the
embedded corpus.

  python -m experiments.train
  python -m experiments.train --optimizer=adamw --preset=small --data_path=book.txt
  # 2 sites of 4 devices: FSDP within a site, only DeMo's message between sites
  python -m experiments.train --replicas=2 --fsdp=4
  # two processes of a multi-host run (here both on one machine, gloo on CPU):
  python -m experiments.train --num_processes=2 --process_id=0 \
      --coordinator_address=127.0.0.1:12355 --workers=4 &
  python -m experiments.train --num_processes=2 --process_id=1 \
      --coordinator_address=127.0.0.1:12355 --workers=4
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from absl import app, flags, logging

if TYPE_CHECKING:
  from experiments.trainer import TrainConfig

_D = {}  # flag name -> FlagHolder


def _define():
  from experiments.trainer import OPTIMIZERS, TrainConfig

  d = TrainConfig()
  _D["optimizer"] = flags.DEFINE_enum("optimizer", d.optimizer, OPTIMIZERS, "Optimizer.")
  _D["preset"] = flags.DEFINE_string("preset", d.preset, "Model preset (experiments/presets.py).")
  _D["data_path"] = flags.DEFINE_string(
    "data_path", None, "Text file (bytes), .npy or uint16 .bin tokens; default: embedded corpus."
  )
  _D["steps"] = flags.DEFINE_integer("steps", d.steps, "Training steps.")
  _D["workers"] = flags.DEFINE_integer(
    "workers", d.workers, "Data-parallel workers in total (simulated CPU devices on CPU)."
  )
  _D["replicas"] = flags.DEFINE_integer(
    "replicas",
    None,
    "Sites on the 2-D (replica, fsdp) mesh; devices = replicas x fsdp, and it overrides "
    "--workers (default: workers // fsdp when --fsdp > 1, else the 1-D data mesh).",
  )
  _D["fsdp"] = flags.DEFINE_integer(
    "fsdp",
    d.fsdp,
    "Devices per site that shard params, gradient and optimizer state (FSDP); the "
    "optimizer exchanges only between sites.",
  )
  _D["batch_size"] = flags.DEFINE_integer("batch_size", d.batch_size, "Global sequences per step.")
  _D["seq_len"] = flags.DEFINE_integer("seq_len", d.seq_len, "Tokens per sequence.")
  _D["learning_rate"] = flags.DEFINE_float(
    "learning_rate", None, "Peak learning rate (default: the recipe for preset and optimizer)."
  )
  _D["compression_topk"] = flags.DEFINE_integer(
    "compression_topk", d.compression_topk, "DCT coefficients sent per chunk."
  )
  _D["compression_chunk"] = flags.DEFINE_integer(
    "compression_chunk", d.compression_chunk, "Chunk length target per axis."
  )
  _D["compression_decay"] = flags.DEFINE_float(
    "compression_decay", None, "Momentum decay in [0, 1); 0 is stateless (default: recipe)."
  )
  _D["quantize_1bit"] = flags.DEFINE_bool("quantize_1bit", d.quantize_1bit, "Send 1-bit values.")
  _D["use_dct"] = flags.DEFINE_bool(
    "use_dct", d.use_dct, "DCT before top-k; --nouse_dct is the no-transform ablation."
  )
  _D["diloco_sync_every"] = flags.DEFINE_integer(
    "diloco_sync_every", d.diloco_sync_every, "DiLoCo: inner steps between synchronizations (H)."
  )
  _D["diloco_outer_lr"] = flags.DEFINE_float(
    "diloco_outer_lr", d.diloco_outer_lr, "DiLoCo: outer Nesterov learning rate."
  )
  _D["diloco_outer_momentum"] = flags.DEFINE_float(
    "diloco_outer_momentum", d.diloco_outer_momentum, "DiLoCo: outer Nesterov momentum."
  )
  _D["delayed_apply"] = flags.DEFINE_bool(
    "delayed_apply",
    d.delayed_apply,
    "Apply the previous step's aggregate, so the exchange can overlap the next "
    "forward and backward pass (overlapped DisTrO).",
  )
  _D["warmup_steps"] = flags.DEFINE_integer(
    "warmup_steps", None, "Linear warmup steps before the cosine (default: recipe)."
  )
  _D["clip_norm"] = flags.DEFINE_float(
    "clip_norm", None, "Gradient clipping by global norm; 0 disables (default: recipe)."
  )
  _D["weight_decay"] = flags.DEFINE_float(
    "weight_decay", None, "Decoupled weight decay (default: recipe)."
  )
  _D["seed"] = flags.DEFINE_integer("seed", d.seed, "Seed for init and data order.")
  _D["out_dir"] = flags.DEFINE_string(
    "out_dir", d.out_dir, "Where metrics, plots and checkpoints go."
  )
  _D["resume"] = flags.DEFINE_bool("resume", False, "Continue from the latest checkpoint.")
  _D["eval_every"] = flags.DEFINE_integer("eval_every", d.eval_every, "Validate every N steps.")
  _D["eval_batches"] = flags.DEFINE_integer(
    "eval_batches", d.eval_batches, "Validation batches per evaluation."
  )
  _D["checkpoint_every"] = flags.DEFINE_integer(
    "checkpoint_every", d.checkpoint_every, "Checkpoint every N steps (0: never)."
  )
  _D["log_every"] = flags.DEFINE_integer(
    "log_every", d.log_every, "Progress line every N steps off a terminal."
  )
  _D["progress"] = flags.DEFINE_bool("progress", d.progress, "Show the progress line.")
  _D["stop_at_step"] = flags.DEFINE_integer(
    "stop_at_step", 0, "Stop after this step as if interrupted (0: run all --steps)."
  )
  _D["skip_nonfinite"] = flags.DEFINE_bool(
    "skip_nonfinite",
    d.skip_nonfinite,
    "AdamW: skip steps whose update is not finite (optax.apply_if_finite). DisTrO "
    "optimizers always leave out a worker whose message is not finite.",
  )
  _D["inject_nan_step"] = flags.DEFINE_integer(
    "inject_nan_step", 0, "Fault drill: make one worker's gradient NaN at this step (0: never)."
  )
  _D["inject_nan_worker"] = flags.DEFINE_integer(
    "inject_nan_worker", 0, "Fault drill: which worker --inject_nan_step hits."
  )
  _D["check_replicas"] = flags.DEFINE_bool(
    "check_replicas",
    d.check_replicas,
    "Every log_every steps, verify all workers hold identical params; stop if not.",
  )


_define()
_COORDINATOR = flags.DEFINE_string(
  "coordinator_address", None, "host:port of process 0, for multi-process runs."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "Processes in a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "This process's index.")


def setup_devices() -> None:
  """Simulated CPU devices and, when asked, the multi-process runtime, from the flags.

  Must run before anything touches a JAX backend.
  """
  import jax

  nproc = _NUM_PROCESSES.value
  replicas = _D["replicas"].value
  workers = replicas * _D["fsdp"].value if replicas else _D["workers"].value
  if workers % nproc:
    raise ValueError(f"{workers} devices do not divide by --num_processes={nproc}.")
  jax.config.update("jax_num_cpu_devices", workers // nproc)
  if nproc > 1:
    if not _COORDINATOR.value:
      raise ValueError("--num_processes>1 needs --coordinator_address=host:port of process 0.")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      coordinator_address=_COORDINATOR.value,
      num_processes=nproc,
      process_id=_PROCESS_ID.value,
    )


def config_from_flags(**overrides: Any) -> TrainConfig:
  """The :class:`~experiments.trainer.TrainConfig` the flags describe, with ``overrides``."""
  from experiments.trainer import TrainConfig

  return TrainConfig(**{**{k: v.value for k, v in _D.items()}, **overrides})


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  from experiments import trainer
  from experiments.checkpointing import CheckpointError
  from experiments.data import DataError

  try:
    setup_devices()
    cfg = config_from_flags()
    trainer.run(cfg)
  except (
    trainer.ConfigError,
    trainer.ReplicaDivergenceError,
    DataError,
    CheckpointError,
    ValueError,
    FloatingPointError,
  ) as e:
    logging.debug("failed", exc_info=True)
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  app.run(main)
