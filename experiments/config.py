"""One run's settings: every field with its help text, its flag, and its checks.

:class:`TrainConfig` is the single place a setting lives. The commands build
their absl flags from its fields (:func:`define_flags`, called inside each
command's ``main``, so importing a command defines nothing), Colab and the
tests construct it directly, and a checkpoint records its fingerprint: every
field except the :data:`RUNTIME_FIELDS`, which steer a run without changing
what it computes.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from typing import Any

from absl import flags

# Flags defined through define_flags belong to the command that calls it, so --help lists them.
flags.disclaim_key_flags()

__all__ = [
  "ELASTIC_FIELDS",
  "RUNTIME_FIELDS",
  "ConfigError",
  "TrainConfig",
  "config_from_flags",
  "define_flags",
  "fingerprint",
  "resolve",
  "validate",
]


class ConfigError(ValueError):
  """A setting that cannot work; the message names the flag and the fix."""


def _field(default: Any, help: str, **extra: Any) -> Any:  # noqa: A002 - absl's word
  return dataclasses.field(default=default, metadata={"help": help, **extra})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything one training run needs; ``None`` means the method's recipe for the preset.

  Each field is a flag of ``python -m experiments.train`` with the same name;
  its help text is the field's ``metadata["help"]``.
  """

  optimizer: str = _field(
    "demo", "Optimizer family, a name in experiments/methods.py (demo, adamw, ...).", enum=True
  )
  preset: str = _field("tiny", "Model preset (experiments/presets.py).")
  data_path: str | None = _field(
    None, "Text file (bytes), .npy or uint16 .bin tokens; default: embedded corpus."
  )
  steps: int = _field(1000, "Training steps.")
  workers: int = _field(8, "Data-parallel workers in total (simulated CPU devices on CPU).")
  replicas: int | None = _field(
    None,
    "Sites on the (replica, fsdp) mesh; devices = replicas x fsdp, and it overrides "
    "--workers (default: workers // fsdp).",
  )
  fsdp: int = _field(
    1,
    "Devices per site that shard params, gradient and optimizer state (FSDP); the "
    "optimizer exchanges only between sites.",
  )
  batch_size: int = _field(32, "Global sequences per step.")
  seq_len: int = _field(128, "Tokens per sequence.")
  learning_rate: float | None = _field(
    None, "Peak learning rate (default: the recipe for preset and optimizer)."
  )
  compression_topk: int = _field(32, "DCT coefficients sent per chunk.")
  compression_chunk: int = _field(64, "Chunk length target per axis.")
  compression_decay: float | None = _field(
    None, "Momentum decay in [0, 1); 0 is stateless (default: recipe)."
  )
  quantize_1bit: bool = _field(False, "Send 1-bit values.")
  use_dct: bool = _field(True, "DCT before top-k; --nouse_dct is the no-transform ablation.")
  diloco_sync_every: int = _field(50, "DiLoCo: inner steps between synchronizations (H).")
  diloco_outer_lr: float = _field(0.7, "DiLoCo: outer Nesterov learning rate.")
  diloco_outer_momentum: float = _field(0.9, "DiLoCo: outer Nesterov momentum.")
  delayed_apply: bool = _field(
    False,
    "Apply the previous step's aggregate, so the exchange can overlap the next "
    "forward and backward pass (overlapped DisTrO).",
  )
  warmup_steps: int | None = _field(
    None, "Linear warmup steps before the cosine (default: recipe)."
  )
  clip_norm: float | None = _field(
    None, "Gradient clipping by global norm; 0 disables (default: recipe)."
  )
  weight_decay: float | None = _field(None, "Decoupled weight decay (default: recipe).")
  seed: int = _field(0, "Seed for init and data order.")
  out_dir: str = _field("runs/latest", "Where metrics, plots and checkpoints go.")
  resume: bool = _field(False, "Continue from the latest checkpoint.")
  eval_every: int = _field(100, "Validate every N steps.")
  eval_batches: int = _field(4, "Validation batches per evaluation.")
  checkpoint_every: int = _field(0, "Checkpoint every N steps (0: never).")
  log_every: int = _field(10, "Progress line every N steps off a terminal.")
  progress: bool = _field(True, "Show the progress line.")
  check_replicas: bool = _field(
    False, "Every log_every steps, verify all workers hold identical params; stop if not."
  )
  stop_at_step: int = _field(0, "Stop after this step as if interrupted (0: run all --steps).")
  skip_nonfinite: bool = _field(
    False,
    "AdamW: skip steps whose update is not finite (optax.apply_if_finite). DisTrO "
    "optimizers always leave out a worker whose message is not finite.",
  )
  inject_nan_step: int = _field(
    0, "Fault drill: make one worker's gradient NaN at this step (0: never)."
  )
  inject_nan_worker: int = _field(0, "Fault drill: which worker --inject_nan_step hits.")
  time_optimizer: bool = _field(
    False,
    "After training, time full steps against gradient-only steps and report the "
    "optimizer's share of a step.",
  )
  leaving: str = _field(
    "drop",
    "Elastic resume on fewer workers: 'drop' discards the unsent momentum (error "
    "feedback) of the workers that leave; 'fold' folds it into those that stay, keeping "
    "the mean over all workers.",
  )
  cold_start_steps: int = _field(
    0,
    "Elastic resume on more workers: each joining worker's DisTrO message is marked "
    "invalid for its first N steps, while its momentum builds up (0: it counts at once).",
  )

  @property
  def devices(self) -> int:
    """Devices in the mesh: ``replicas * fsdp`` (``workers`` once resolved)."""
    return self.replicas * self.fsdp if self.replicas is not None else self.workers

  @property
  def sites(self) -> int:
    """Data-parallel peers that exchange messages: one per site of ``fsdp`` devices."""
    return self.replicas if self.replicas is not None else self.workers // self.fsdp


# Fields that steer a run without changing what it computes; a resume may change them.
RUNTIME_FIELDS = frozenset(
  {
    "out_dir",
    "resume",
    "eval_every",
    "eval_batches",
    "checkpoint_every",
    "log_every",
    "progress",
    "check_replicas",
    "stop_at_step",
    "time_optimizer",
    "leaving",
    "cold_start_steps",
  }
)

# The worker count: a resume may change it (an elastic resume), and the trainer
# resizes the per-worker optimizer state. The process count is no field at all.
ELASTIC_FIELDS = frozenset({"workers", "replicas"})


def fingerprint(cfg: TrainConfig) -> dict[str, Any]:
  """What a checkpoint must match to be resumed: every field but the runtime and elastic ones.

  :data:`RUNTIME_FIELDS` steer a run without changing what it computes;
  :data:`ELASTIC_FIELDS` (the worker count) may change on resume, which the
  trainer reads off the checkpoint's state itself. ``fsdp`` stays in: a site's
  devices shard the state, and their number cannot change.

  The data path is made absolute, so a resume from another directory that
  names the same file matches, and one that names another file does not.
  """
  out = {
    f.name: getattr(cfg, f.name)
    for f in dataclasses.fields(cfg)
    if f.name not in RUNTIME_FIELDS | ELASTIC_FIELDS
  }
  if out["data_path"] is not None:
    out["data_path"] = os.path.abspath(out["data_path"])
  return out


def _flag_kind(cls: type, name: str) -> type:
  """The Python type behind a field's annotation, ``int`` for ``int | None``."""
  hint = typing.get_type_hints(cls)[name]
  if isinstance(hint, types.UnionType):
    (hint,) = [a for a in hint.__args__ if a is not type(None)]
  return hint


_DEFINE = {
  bool: flags.DEFINE_bool,
  int: flags.DEFINE_integer,
  float: flags.DEFINE_float,
  str: flags.DEFINE_string,
}


def define_flags(
  cls: type = TrainConfig,
  defaults: Mapping[str, Any] | None = None,
  *,
  flag_values: flags.FlagValues = flags.FLAGS,
) -> dict[str, flags.FlagHolder]:
  """Defines one absl flag per field of a config dataclass; call it from a command's ``main``.

  Args:
    cls: :class:`TrainConfig`, or another dataclass whose fields carry
      ``metadata["help"]`` (``experiments.launch.LaunchConfig``).
    defaults: a command's own defaults for some fields (``compare`` trains
      ``small`` for 300 steps, for example).
    flag_values: where to define them (absl's global ``FLAGS`` by default).

  Returns:
    The flag holders by field name, for :func:`config_from_flags`.
  """
  from experiments import methods

  defaults = dict(defaults or {})
  unknown = set(defaults) - {f.name for f in dataclasses.fields(cls)}
  if unknown:
    raise ValueError(f"define_flags: {cls.__name__} has no field {sorted(unknown)}.")
  holders = {}
  for f in dataclasses.fields(cls):
    default = defaults.get(f.name, f.default)
    help_text = f.metadata["help"]
    if f.metadata.get("enum"):
      holders[f.name] = flags.DEFINE_enum(
        f.name, default, methods.names(), help_text, flag_values=flag_values
      )
    else:
      define = _DEFINE[_flag_kind(cls, f.name)]
      holders[f.name] = define(f.name, default, help_text, flag_values=flag_values)
  return holders


def config_from_flags(
  holders: Mapping[str, flags.FlagHolder], cls: type = TrainConfig, **overrides: Any
) -> Any:
  """The config (a :class:`TrainConfig` by default) that parsed flags describe.

  Args:
    holders: what :func:`define_flags` returned, after absl parsed the flags.
    cls: the config dataclass the holders were defined from.
    **overrides: fields to set on top of the flags.

  Returns:
    An instance of ``cls``.
  """
  return cls(**{**{k: v.value for k, v in holders.items()}, **overrides})


_POSITIVE = (
  "steps",
  "workers",
  "batch_size",
  "seq_len",
  "compression_topk",
  "compression_chunk",
  "diloco_sync_every",
)


def validate(cfg: TrainConfig) -> None:
  """Refuses settings that cannot work, before anything is built.

  Raises:
    ConfigError: naming the flag and the fix.
  """
  from experiments import methods, presets

  method = methods.get(cfg.optimizer)
  try:
    presets.get_preset(cfg.preset)
  except ValueError as e:
    raise ConfigError(str(e).replace("unknown preset", "unknown --preset", 1)) from None
  for name in _POSITIVE:
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
  flag = "--replicas x --fsdp" if cfg.replicas is not None else "--workers"
  if cfg.batch_size % cfg.devices:
    lo = cfg.batch_size // cfg.devices * cfg.devices or cfg.devices
    raise ConfigError(
      f"--batch_size={cfg.batch_size} does not divide by {flag}={cfg.devices} devices; "
      f"use --batch_size={lo} or {lo + cfg.devices}."
    )
  _check_method(cfg, method)
  if cfg.compression_decay is not None and not 0 <= cfg.compression_decay < 1:
    raise ConfigError(f"--compression_decay must be in [0, 1), got {cfg.compression_decay}.")


def _supporting(attribute: str) -> str:
  from experiments import methods

  return " or ".join(n for n in methods.names() if getattr(methods.get(n), attribute))


def _check_method(cfg: TrainConfig, method: Any) -> None:
  """What the chosen method cannot do with these settings."""
  if cfg.delayed_apply and not method.supports_delayed_apply:
    raise ConfigError(
      "--delayed_apply applies the previous step's DisTrO aggregate; it needs "
      f"--optimizer={_supporting('supports_delayed_apply')}, not {method.name}."
    )
  if cfg.fsdp > 1 and not method.supports_fsdp:
    raise ConfigError(
      f"--optimizer={method.name} runs with one device per site only; drop --fsdp "
      "(or use --fsdp=1)."
    )
  if cfg.skip_nonfinite and cfg.fsdp > 1:
    raise ConfigError(
      "--skip_nonfinite is not supported with --fsdp > 1 (its skip counter would "
      "differ between a site's shards); drop it or use --fsdp=1."
    )


def resolve(cfg: TrainConfig) -> TrainConfig:
  """Checks ``cfg`` and fills what it leaves to defaults.

  Every ``None`` hyperparameter takes the method's recipe for the preset,
  and the mesh is made explicit: ``replicas`` sites of ``fsdp`` devices,
  ``workers = replicas * fsdp`` in all.

  Raises:
    ConfigError: for settings that cannot work (see :func:`validate`).
  """
  from experiments import methods

  validate(cfg)
  rec = methods.get(cfg.optimizer).recipe_for(cfg.preset)
  fill = {
    f: getattr(rec, f)
    for f in ("learning_rate", "compression_decay", "warmup_steps", "clip_norm", "weight_decay")
    if getattr(cfg, f) is None
  }
  return dataclasses.replace(cfg, **fill, replicas=cfg.sites, workers=cfg.devices)
