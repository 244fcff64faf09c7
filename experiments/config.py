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
import math
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from absl import flags

from distro_jax.elastic import LEAVING
from distro_jax.unit_rms import NORMALIZE

# Flags defined through define_flags belong to the command that calls it, so --help lists them.
flags.disclaim_key_flags()

__all__ = [
  "ELASTIC_FIELDS",
  "RESUMED_FIELDS",
  "RUNTIME_FIELDS",
  "ConfigError",
  "TrainConfig",
  "checked_chunk",
  "checked_preset",
  "config_from_flags",
  "define_flags",
  "fingerprint",
  "model_config",
  "parse_field",
  "positive_ints",
  "resolve",
  "runtime_settings",
  "validate",
]


class ConfigError(ValueError):
  """A setting that cannot work; the message names the flag and the fix."""


def _field(default: Any, help: str, **extra: Any) -> Any:  # noqa: A002 - absl's word
  return dataclasses.field(default=default, metadata={"help": help, **extra})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything one training run needs; ``None`` means the method's recipe (preset, steps).

  Each field is a flag of ``python -m experiments.train`` with the same name;
  its help text is the field's ``metadata["help"]``.
  """

  optimizer: str = _field(
    "demo", "Optimizer family, a name in experiments/methods.py (demo, adamw, ...).", enum=True
  )
  preset: str = _field("tiny", "Model preset (experiments/presets.py).")
  scan_layers: bool = _field(
    False,
    "Hold each kind of block weight as one (n_layers, ...) array and run the blocks "
    "with nnx.scan: the same model and DeMo message, far shorter compiles (a GPU "
    "compiles one block, not n_layers; docs/performance.md). Params then have no "
    "per-layer paths, and SparseLoCo's median clip would treat a stack as one tensor, "
    "so it is refused.",
  )
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
  random_positions: bool = _field(
    False,
    "Send the values at --compression_topk positions per chunk drawn from a seed every "
    "worker shares, instead of the largest and their indices (no index bits).",
  )
  frequency_bias: float = _field(
    0.0,
    "With --random_positions, draw DCT coefficient (i, j) of a chunk with probability "
    "proportional to ((1 + i)(1 + j))^-bias; 0 draws uniformly.",
  )
  normalize: str = _field(
    "sign",
    "How DeMo turns its decoded aggregate into a step: 'sign' (DeMo's, every entry moves "
    "by the learning rate), 'rms' (each tensor scaled to unit RMS) or 'orth' (each hidden "
    "matrix orthogonalized as Muon does, then at unit RMS; the rest at unit RMS).",
  )
  compression_groups: str = _field(
    "",
    "DeMo: message sizes per group of params, 'REGEX=CHUNK:TOPK;...': the params whose "
    "path the first REGEX matches get that chunk and top-k, in a message of their own; "
    "the rest keep --compression_chunk and --compression_topk, e.g. "
    "\"'attn'=8:2;'mlp'=16:1\". Empty: one group.",
  )
  diloco_sync_every: int = _field(50, "DiLoCo: inner steps between synchronizations (H).")
  diloco_outer_lr: float = _field(0.7, "DiLoCo: outer Nesterov learning rate.")
  diloco_outer_momentum: float = _field(0.9, "DiLoCo: outer Nesterov momentum.")
  sparseloco_sync_every: int = _field(
    30, "SparseLoCo: inner steps between synchronizations (H; the paper's 30)."
  )
  sparseloco_topk: int = _field(64, "SparseLoCo: entries kept per chunk (the paper's 64 of 64x64).")
  sparseloco_chunk: int = _field(
    64, "SparseLoCo: chunk length target per axis of the last two (the paper's 64)."
  )
  sparseloco_value_bits: int = _field(
    2, "SparseLoCo: bits per value sent, 1 or 2 (the paper's 2), or 0 for float values."
  )
  sparseloco_error_decay: float = _field(0.95, "SparseLoCo: error-feedback decay (0.95).")
  sparseloco_outer_lr: float = _field(1.0, "SparseLoCo: outer learning rate (1.0).")
  sparseloco_clip: bool = _field(
    True, "SparseLoCo: clip each worker's contribution to the median norm."
  )
  sparseloco_dct: bool = _field(
    False, "SparseLoCo: select in the chunked DCT domain, as DeMo does (the paper: no DCT)."
  )
  delayed_apply: bool = _field(
    False,
    "Apply the previous step's aggregate, so the exchange can overlap the next "
    "forward and backward pass (overlapped DisTrO). Its loss trails the plain "
    "exchange's less at --compression_topk=8 than at 32 (docs/overlapped.md).",
  )
  synchronous_params: str = _field(
    "",
    "With --delayed_apply, a regular expression searched in each param's path "
    "(e.g. \"['blocks'][0]['attn']['wq'].value\"): the params it matches are "
    "exchanged in the step that computes them, the rest one step late (a partial "
    "overlap; the method option 'partial' picks attention, embedding and head). "
    "Empty: every param overlapped.",
  )
  overlap_exchange: str = _field(
    "auto",
    "With --delayed_apply, how the all-gather of the message in flight overlaps the "
    "gradient: 'thread' runs it as a program of its own on a thread of its own (XLA's "
    "CPU runtime blocks the thread that reaches a collective, so a fused step waits for "
    "it), 'fused' leaves it inside the step for the compiler to schedule, 'auto' is "
    "'thread' for CPU processes exchanging over a network and 'fused' otherwise "
    "(docs/overlapped.md).",
  )
  lookahead: bool = _field(
    True,
    "With --delayed_apply, take each gradient where the params will be once the "
    "update in flight lands, as the worker guesses it (Psyche's lookahead); "
    "--nolookahead is the bare delayed exchange.",
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
  eval_every: int | None = _field(
    None,
    "Validate every N steps; 0: only after the last step (default 100; on --resume, "
    "the checkpointed run's).",
    fallback=100,
  )
  eval_batches: int | None = _field(
    None,
    "Validation batches per evaluation (default 4; on --resume, the checkpointed run's).",
    fallback=4,
  )
  checkpoint_every: int | None = _field(
    None,
    "Checkpoint every N steps and after the last; 0: never (default 0; on --resume, "
    "the checkpointed run's).",
    fallback=0,
  )
  keep_checkpoints: int | None = _field(
    None,
    "Keep only the newest N checkpoints, deleting older ones as new ones are saved; 0 "
    "keeps every one (default 0; on --resume, the checkpointed run's).",
    fallback=0,
  )
  log_every: int | None = _field(
    None,
    "Progress line every N steps off a terminal (default 10; on --resume, the checkpointed run's).",
    fallback=10,
  )
  progress: bool = _field(True, "Show the progress line.")
  check_replicas: bool | None = _field(
    None,
    "Every log_every steps, verify all workers hold identical params; stop if not "
    "(default off; on --resume, the checkpointed run's).",
    fallback=False,
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
  time_optimizer: bool | None = _field(
    None,
    "After training, time full steps against gradient-only steps and report the "
    "optimizer's share of a step (default off; on --resume, the checkpointed run's).",
    fallback=False,
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
    "keep_checkpoints",
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


# The runtime fields a resume takes from the checkpoint unless they are given
# again: they say how the run is conducted (how often it saves, logs and
# evaluates), so a run that crashed continues as it was started. Their field
# default is ``None`` ("not given"); ``metadata["fallback"]`` is the value a
# fresh run takes.
RESUMED_FIELDS = (
  "eval_every",
  "eval_batches",
  "checkpoint_every",
  "keep_checkpoints",
  "log_every",
  "check_replicas",
  "time_optimizer",
)


def runtime_settings(cfg: TrainConfig) -> dict[str, Any]:
  """The :data:`RESUMED_FIELDS` of a resolved config, as a checkpoint records them."""
  return {name: getattr(cfg, name) for name in RESUMED_FIELDS}


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


_KIND_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


def parse_field(name: str, text: str) -> Any:
  """A field's value from text, typed as the field is (the sweep's grid values).

  ``none`` gives ``None`` for a field whose default is ``None``; bools take
  true/false, 1/0 or yes/no.

  Raises:
    ConfigError: ``text`` is not of the field's type.
  """
  kind = _flag_kind(TrainConfig, name)
  text = text.strip()
  default = {f.name: f.default for f in dataclasses.fields(TrainConfig)}[name]
  if text.lower() == "none" and default is None:
    return None
  try:
    if kind is bool:
      return _WORDS[text.lower()]
    return kind(text)
  except (KeyError, ValueError):
    raise ConfigError(f"{name}={text!r} is not {_KIND_WORDS[kind]}.") from None


def model_config(cfg: TrainConfig) -> Any:
  """The :class:`experiments.model.ModelConfig` a run builds: its preset, laid out as asked."""
  return checked_preset(cfg.preset, scan_layers=cfg.scan_layers)


def checked_preset(name: str, *, scan_layers: bool = False) -> Any:
  """The model config of preset ``name``; an unknown name is a ConfigError naming ``--preset``."""
  from experiments import presets

  try:
    return presets.get_preset(name, scan_layers=scan_layers)
  except ValueError as e:
    raise ConfigError(str(e).replace("unknown preset", "unknown --preset", 1)) from None


def positive_ints(flag: str, values: Sequence[str], example: str, *, wants: str) -> tuple[int, ...]:
  """A list flag's values as integers of 1 or more.

  Args:
    flag: the flag's name, without dashes.
    values: its values, as absl's ``DEFINE_list`` gives them.
    example: a valid value for the messages, e.g. ``"1,2,4,8"``.
    wants: what the second message says the flag needs, e.g. ``"positive sizes"``.

  Raises:
    ConfigError: a value that is no integer, or none of 1 or more.
  """
  given, fix = f"--{flag}={','.join(values)}", f"e.g. --{flag}={example}."
  try:
    ints = tuple(int(v) for v in values)
  except ValueError:
    raise ConfigError(f"{given} must be comma-separated integers; {fix}") from None
  if not ints or min(ints) < 1:
    raise ConfigError(f"{given} needs {wants}; {fix}")
  return ints


def checked_chunk(chunk: int) -> int:
  """``--compression_chunk``, refused below 1."""
  if chunk < 1:
    raise ConfigError(f"--compression_chunk={chunk} must be 1 or more; the reference uses 64.")
  return chunk


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


# Each integer's least value, and what that value (or the way out) means to the user.
_INT_FLOORS: dict[str, tuple[int, str]] = {
  "steps": (1, "use --steps=1 or more"),
  "workers": (1, "use --workers=1 or more"),
  "replicas": (1, "use --replicas=1 or more, or leave it unset"),
  "fsdp": (1, "use --fsdp=1 for one device per site"),
  "batch_size": (1, "use --batch_size=1 or more"),
  "seq_len": (1, "use --seq_len=1 or more"),
  "compression_topk": (1, "use --compression_topk=1 or more (the reference sends 32)"),
  "compression_chunk": (1, "use --compression_chunk=1 or more (the reference uses 64)"),
  "diloco_sync_every": (1, "use --diloco_sync_every=1 or more (DiLoCo's paper uses 500)"),
  "sparseloco_sync_every": (1, "use --sparseloco_sync_every=1 or more (the paper uses 30)"),
  "sparseloco_topk": (1, "use --sparseloco_topk=1 or more (the paper sends 64 of 4096)"),
  "sparseloco_chunk": (1, "use --sparseloco_chunk=1 or more (the paper uses 64)"),
  "sparseloco_value_bits": (0, "use 2 (the paper's), 1, or 0 for float values"),
  "warmup_steps": (0, "use --warmup_steps=0 for no warmup"),
  "seed": (0, "use a seed in [0, 2**32)"),
  "eval_every": (0, "use --eval_every=0 to validate only after the last step"),
  "eval_batches": (1, "use --eval_batches=1 or more"),
  "checkpoint_every": (0, "use --checkpoint_every=0 to never checkpoint"),
  "keep_checkpoints": (0, "use --keep_checkpoints=0 to keep every checkpoint"),
  "log_every": (1, "use --log_every=1 or more"),
  "stop_at_step": (0, "use --stop_at_step=0 to run all --steps"),
  "inject_nan_step": (0, "use --inject_nan_step=0 for no fault drill"),
  "inject_nan_worker": (0, "use a worker index from 0"),
  "cold_start_steps": (0, "use --cold_start_steps=0 for joiners that count at once"),
}

# Each float's allowed interval (low, low inclusive, high exclusive) and the fix.
_FLOAT_RANGES: dict[str, tuple[float, bool, float, str]] = {
  "learning_rate": (0.0, False, math.inf, "use a positive rate such as 3e-3, or leave it unset"),
  "compression_decay": (0.0, True, 1.0, "0 is stateless; the reference uses 0.999"),
  "clip_norm": (0.0, True, math.inf, "use --clip_norm=0 to turn clipping off, or e.g. 1.0"),
  "weight_decay": (0.0, True, math.inf, "use --weight_decay=0 for none, or e.g. 0.1"),
  "diloco_outer_lr": (0.0, False, math.inf, "DiLoCo's paper uses 0.7"),
  "diloco_outer_momentum": (0.0, True, 1.0, "DiLoCo's paper uses 0.9; 0 is plain averaging"),
  "sparseloco_error_decay": (0.0, True, 1.0, "the paper uses 0.95; 0 keeps no error"),
  "sparseloco_outer_lr": (0.0, False, math.inf, "the paper uses 1.0"),
  "frequency_bias": (0.0, True, math.inf, "0 draws uniformly; e.g. 1.0 prefers low frequencies"),
}


def _check_types(cfg: TrainConfig) -> None:
  """Each field holds its annotated type (Colab, the sweep's grid and tests build configs)."""
  for f in dataclasses.fields(cfg):
    value, kind = getattr(cfg, f.name), _flag_kind(TrainConfig, f.name)
    if value is None and f.default is None:
      continue
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
      ok = True
    if not ok:
      raise ConfigError(f"--{f.name} must be {_KIND_WORDS[kind]}, got {value!r}.")


def _check_numbers(cfg: TrainConfig) -> None:
  """The sign and range of every number, and that every float is finite."""
  for name, (floor, fix) in _INT_FLOORS.items():
    value = getattr(cfg, name)
    if value is not None and value < floor:
      raise ConfigError(f"--{name}={value} must be {floor} or more; {fix}.")
  if cfg.seed >= 2**32:
    raise ConfigError(f"--seed={cfg.seed} must be below 2**32; use a seed in [0, 2**32).")
  for name, (low, closed, high, fix) in _FLOAT_RANGES.items():
    value = getattr(cfg, name)
    if value is None:
      continue
    inside = (low <= value if closed else low < value) and value < high
    if not (math.isfinite(value) and inside):
      lower = f"[{low:g}" if closed else f"({low:g}"
      upper = "inf)" if high == math.inf else f"{high:g})"
      raise ConfigError(f"--{name}={value} must be a finite number in {lower}, {upper}; {fix}.")
  if not cfg.out_dir:
    raise ConfigError("--out_dir is empty; name a directory for the run's outputs.")


def _check_mesh(cfg: TrainConfig) -> None:
  """Devices, sites and the batch split over them."""
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


def _check_combinations(cfg: TrainConfig, max_seq_len: int) -> None:
  """Settings that are fine alone and wrong together (``cfg`` has the recipe filled in)."""
  if cfg.seq_len > max_seq_len:
    raise ConfigError(
      f"--seq_len={cfg.seq_len} is longer than preset {cfg.preset!r} supports "
      f"({max_seq_len}); use --seq_len<={max_seq_len}."
    )
  if cfg.stop_at_step > cfg.steps:
    raise ConfigError(
      f"--stop_at_step={cfg.stop_at_step} is beyond --steps={cfg.steps}; use "
      f"--stop_at_step<={cfg.steps}, or 0 to run all --steps."
    )
  if cfg.inject_nan_step > cfg.steps or cfg.inject_nan_worker >= cfg.sites:
    raise ConfigError(
      f"--inject_nan_step={cfg.inject_nan_step} --inject_nan_worker={cfg.inject_nan_worker} "
      f"names no step of --steps={cfg.steps} or no worker of {cfg.sites}; use a step in "
      f"[1, {cfg.steps}] and a worker in [0, {cfg.sites})."
    )
  if cfg.learning_rate * cfg.weight_decay >= 1:
    raise ConfigError(
      f"--weight_decay={cfg.weight_decay:g} with a learning rate of {cfg.learning_rate:g} "
      f"scales params by 1 - lr x wd = {1 - cfg.learning_rate * cfg.weight_decay:g} each "
      f"step, to zero or past it; use --weight_decay<{1 / cfg.learning_rate:g}."
    )


def _supporting(attribute: str) -> str:
  from experiments import methods

  return " or ".join(n for n in methods.names() if getattr(methods.get(n), attribute))


def _check_synchronous(cfg: TrainConfig) -> None:
  """``--synchronous_params`` needs the delay, and must be a pattern that picks some params."""
  from experiments import model

  if not cfg.delayed_apply:
    raise ConfigError(
      f"--synchronous_params={cfg.synchronous_params!r} picks the params a --delayed_apply "
      "run still exchanges in the same step; without --delayed_apply every param is. Add "
      "--delayed_apply, or drop --synchronous_params."
    )
  try:
    pattern = re.compile(cfg.synchronous_params)
  except re.error as e:
    raise ConfigError(
      f"--synchronous_params={cfg.synchronous_params!r} is not a regular expression ({e})."
    ) from None
  paths = model.param_paths(model_config(cfg))
  if not any(pattern.search(p) for p in paths):
    raise ConfigError(
      f"--synchronous_params={cfg.synchronous_params!r} matches no param of preset "
      f"{cfg.preset!r}, so the run would overlap every param; its paths look like "
      f"{paths[0]!r}, e.g. --synchronous_params=\"'attn'\"."
    )


OVERLAP_EXCHANGE = ("auto", "thread", "fused")


def _check_overlap_exchange(cfg: TrainConfig) -> None:
  if cfg.overlap_exchange not in OVERLAP_EXCHANGE:
    raise ConfigError(f"--overlap_exchange={cfg.overlap_exchange!r}; use auto, thread or fused.")
  if cfg.overlap_exchange == "thread" and not cfg.delayed_apply:
    raise ConfigError(
      "--overlap_exchange=thread runs the all-gather of the message in flight beside the "
      "gradient; only --delayed_apply has one. Add --delayed_apply, or drop the flag."
    )
  if cfg.overlap_exchange == "thread" and cfg.fsdp > 1:
    raise ConfigError(
      f"--overlap_exchange=thread with --fsdp={cfg.fsdp} would run the site's own "
      "collectives beside the exchange's, which is not supported; use "
      "--overlap_exchange=fused (or auto) with --fsdp."
    )


def _check_method(cfg: TrainConfig, method: Any) -> None:
  """What the chosen method cannot do with these settings, then its own check."""
  if cfg.delayed_apply and not method.supports_delayed_apply:
    raise ConfigError(
      "--delayed_apply applies the previous step's DisTrO aggregate; it needs "
      f"--optimizer={_supporting('supports_delayed_apply')}, not {method.name}."
    )
  if cfg.synchronous_params:
    _check_synchronous(cfg)
  if cfg.fsdp > 1 and not method.supports_fsdp:
    raise ConfigError(
      f"--optimizer={method.name} runs with one device per site only; drop --fsdp "
      "(or use --fsdp=1)."
    )
  _check_overlap_exchange(cfg)
  if cfg.normalize not in NORMALIZE:
    raise ConfigError(
      f"--normalize={cfg.normalize!r}; use --normalize=sign, --normalize=rms or --normalize=orth."
    )
  if cfg.normalize != "sign" and not method.supports_normalize:
    raise ConfigError(
      f"--normalize={cfg.normalize} shapes DeMo's step from its aggregate; it needs "
      f"--optimizer={_supporting('supports_normalize')}, not {method.name}. Drop --normalize."
    )
  if cfg.compression_groups and not method.supports_compression_groups:
    raise ConfigError(
      "--compression_groups gives groups of params DeMo messages of their own sizes; it "
      f"needs --optimizer={_supporting('supports_compression_groups')}, not {method.name}. "
      "Drop --compression_groups."
    )
  if cfg.leaving not in LEAVING:
    raise ConfigError(f"--leaving={cfg.leaving!r}; use --leaving=drop or --leaving=fold.")
  if cfg.cold_start_steps and not method.supports_cold_start:
    raise ConfigError(
      f"--cold_start_steps marks a joining worker's DisTrO message invalid; --optimizer="
      f"{method.name} sends none. Drop --cold_start_steps."
    )
  if cfg.skip_nonfinite and not method.supports_skip_nonfinite:
    raise ConfigError(
      "--skip_nonfinite skips a step whose all-reduced update is not finite; it needs "
      f"--optimizer={_supporting('supports_skip_nonfinite')}, not {method.name}, which "
      "would ignore it. Drop --skip_nonfinite."
    )
  if cfg.skip_nonfinite and cfg.fsdp > 1:
    raise ConfigError(
      "--skip_nonfinite is not supported with --fsdp > 1 (its skip counter would "
      "differ between a site's shards); drop it or use --fsdp=1."
    )
  method.check(cfg)


def validate(cfg: TrainConfig) -> None:
  """Refuses settings that cannot work, before anything is built or compiled.

  Every field's type; every number's sign, range and finiteness; the preset
  and the optimizer; how the devices and the batch split; combinations
  (a stop step beyond the run, a warmup as long as the run, ...); and the
  method's own check (:attr:`experiments.methods.Method.check`), e.g. a
  top-k above the largest chunk. What only the data or the filesystem can
  tell is checked by the trainer, still before compilation.

  Raises:
    ConfigError: naming the flag and the fix.
  """
  from experiments import methods

  _check_types(cfg)
  method = methods.get(cfg.optimizer)
  model_cfg = checked_preset(cfg.preset)
  _check_numbers(cfg)
  _check_mesh(cfg)
  if cfg.warmup_steps is not None and cfg.warmup_steps >= cfg.steps:
    raise ConfigError(
      f"--warmup_steps={cfg.warmup_steps} is not shorter than --steps={cfg.steps}, so the "
      f"run would end still warming up; use --warmup_steps<{cfg.steps} (e.g. "
      f"{cfg.steps // 10}), or leave it unset for the recipe's, shortened to fit."
    )
  full = _fill(cfg, method, {})
  _check_combinations(full, model_cfg.max_seq_len)
  _check_method(full, method)


def _fill(cfg: TrainConfig, method: Any, saved: Mapping[str, Any]) -> TrainConfig:
  """``cfg`` with the recipe, the runtime fields and the mesh made explicit."""
  rec = method.recipe_for(cfg.preset, cfg.steps)
  fill = {
    f: getattr(rec, f)
    for f in ("learning_rate", "compression_decay", "warmup_steps", "clip_norm", "weight_decay")
    if getattr(cfg, f) is None
  }
  fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
  for name in RESUMED_FIELDS:
    if getattr(cfg, name) is None:
      fill[name] = saved.get(name, fields[name].metadata["fallback"])
  return dataclasses.replace(cfg, **fill, replicas=cfg.sites, workers=cfg.devices)


def resolve(cfg: TrainConfig, saved: Mapping[str, Any] | None = None) -> TrainConfig:
  """Checks ``cfg`` and fills what it leaves to defaults.

  Every ``None`` hyperparameter takes the method's recipe for the preset and
  the run's length; every ``None`` of :data:`RESUMED_FIELDS` takes its value
  in ``saved`` (what the checkpoint a run resumes from recorded), else its
  fallback; and the mesh is made explicit: ``replicas`` sites of ``fsdp``
  devices, ``workers = replicas * fsdp`` in all.

  Args:
    cfg: the config as given.
    saved: :func:`runtime_settings` of the run being resumed, if any.

  Raises:
    ConfigError: for settings that cannot work (see :func:`validate`).
  """
  from experiments import methods

  validate(cfg)
  return _fill(cfg, methods.get(cfg.optimizer), saved or {})
