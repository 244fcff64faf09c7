"""One run's settings: every field with its help text and its flag.

:class:`TrainConfig` is the single place a setting lives. The commands build
their absl flags from its fields (:func:`experiments.run.cli.define_flags`),
Colab and the tests construct it directly, :mod:`experiments.run.checks`
refuses what cannot work and fills in the method's recipe, and a checkpoint
records its fingerprint: every field except the :data:`RUNTIME_FIELDS`, which
steer a run without changing what it computes.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Sequence
from typing import Any

__all__ = [
  "ELASTIC_FIELDS",
  "RESUMED_FIELDS",
  "RUNTIME_FIELDS",
  "ConfigError",
  "TrainConfig",
  "checked_chunk",
  "checked_preset",
  "fingerprint",
  "flag_kind",
  "model_config",
  "parse_field",
  "positive_ints",
  "runtime_settings",
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
    "demo", "Optimizer family, a name in experiments/run/methods.py (demo, adamw, ...).", enum=True
  )
  preset: str = _field("tiny", "Model preset (experiments/run/presets.py).")
  scan_layers: bool = _field(
    False,
    "Hold each kind of block weight as one (n_layers, ...) array and run the blocks "
    "with nnx.scan: the same model and DeMo message, far shorter compiles (a GPU "
    "compiles one block, not n_layers; docs/performance.md). Params then have no "
    "per-layer paths, and SparseLoCo's median clip would treat a stack as one tensor, "
    "so it is refused.",
  )
  data_path: str | None = _field(
    None,
    "Text file (bytes), .npy or uint16 .bin tokens, or a corpus directory "
    "(python -m experiments.fetch_corpus) with its split by document; default: embedded corpus.",
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
  aggregate_momentum: float = _field(
    0.0,
    "DeMo: a Nesterov momentum of this decay on the decoded aggregate, before --normalize "
    "(Muon's momentum, the same on every worker); 0 keeps none.",
  )
  step_momentum: float = _field(
    0.0,
    "DeMo: a Nesterov momentum of this decay on the step --normalize made (Muon's "
    "momentum after the orthogonalization, not before it: each step averaged with the "
    "ones before it, the same on every worker); 0 keeps none.",
  )
  estimate_step: float = _field(
    0.0,
    "DeMo: above 0, each worker sends its unit-RMS momentum's difference from an estimate "
    "of the workers' mean momentum that every worker keeps alike, the estimate moves by this "
    "step times the decoded mean, and the step follows the estimate (EF21); "
    "--compression_decay is then each worker's momentum decay. 0 is DeMo's exchange.",
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
  sparseloco_random_positions: bool = _field(
    False,
    "SparseLoCo: send DeMo's drawn message (values at --sparseloco_topk positions per chunk "
    "drawn from a seed every worker shares, no indices) instead of the top-k; needs "
    "--sparseloco_value_bits=1 (or 0).",
  )
  sparseloco_frequency_bias: float = _field(
    0.0,
    "SparseLoCo: with --sparseloco_random_positions, the draw's preference for a chunk's low "
    "frequencies, as --frequency_bias; 0 draws uniformly.",
  )
  sparseloco_normalize: str = _field(
    "",
    "SparseLoCo: how the mean of the messages becomes the outer step: '' (the mean, the "
    "paper's), 'rms' (each tensor at unit RMS) or 'orth' (each hidden matrix orthogonalized "
    "as Muon does, then at unit RMS; the rest at unit RMS). With 'rms' or 'orth' the step "
    "per entry is --sparseloco_outer_lr x H x the learning-rate schedule.",
  )
  sparseloco_inner: str = _field(
    "adamw",
    "SparseLoCo: the inner optimizer, 'adamw', 'muon' (optax's Muon on the hidden "
    "matrices, AdamW on the rest, as --optimizer=muon; MuLoCo's inner optimizer) or 'sgd' "
    "(plain SGD at the schedule's rate).",
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
  error_feedback: bool = _field(
    True,
    "DeMo: remove what each message sent from the worker's momentum (error feedback); "
    "--noerror_feedback keeps it, so the momentum is Muon's and the message samples it.",
  )
  sent_keep: float = _field(
    0.0,
    "DeMo: the share in [0, 1) of each sent coefficient the error feedback leaves in the "
    "momentum: 0 removes it all (DeMo's), e.g. 0.5 keeps half, so what was sent decays as "
    "a momentum (Dion's error feedback). The plain exchange only.",
  )
  collective: str = _field(
    "all_gather",
    "DeMo: how the messages travel: 'all_gather' (gloo's ring on CPU, W-1 dependent hops) "
    "or 'all_to_all' (each message straight to every peer, one hop, for far links; the "
    "step's shard_map then runs with check_vma=False; not with --fsdp>1) (docs/netlab.md).",
  )
  lookahead_normalize: str = _field(
    "",
    "With --lookahead, how the guess of the update in flight is normalized: empty, as the "
    "step is (--normalize); 'rms', each tensor at unit RMS, which skips the "
    "orthogonalization's Newton-Schulz iterations (docs/overlapped.md).",
  )
  warmup_steps: int | None = _field(
    None, "Linear warmup steps before the cosine (default: recipe)."
  )
  clip_norm: float | None = _field(
    None, "Gradient clipping by global norm; 0 disables (default: recipe)."
  )
  weight_decay: float | None = _field(None, "Decoupled weight decay (default: recipe).")
  adam_b1: float | None = _field(
    None,
    "Adam's first-moment decay wherever AdamW steps: the adamw baseline, Muon's Adam part "
    "(embedding, head, norms), and the local steps of DiLoCo and SparseLoCo (default: recipe).",
  )
  adam_b2: float | None = _field(
    None, "Adam's second-moment decay, wherever AdamW steps as --adam_b1 (default: recipe)."
  )
  adam_eps: float | None = _field(
    None, "Adam's epsilon, wherever AdamW steps as --adam_b1; Muon's too (default: recipe)."
  )
  muon_adam_learning_rate: float = _field(
    0.0,
    "Muon: the peak rate of its AdamW part (embedding, head, norms), on the same schedule; "
    "0 takes --learning_rate.",
  )
  muon_beta: float = _field(
    0.95,
    "Muon: the momentum decay of the hidden matrices (optax's Nesterov form); 0 steps with "
    "the orthogonalized gradient itself.",
  )
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


def flag_kind(cls: type, name: str) -> type:
  """The Python type behind a field's annotation, ``int`` for ``int | None``."""
  hint = typing.get_type_hints(cls)[name]
  if isinstance(hint, types.UnionType):
    (hint,) = [a for a in hint.__args__ if a is not type(None)]
  return hint


KIND_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


def parse_field(name: str, text: str) -> Any:
  """A field's value from text, typed as the field is (the sweep's grid values).

  ``none`` gives ``None`` for a field whose default is ``None``; bools take
  true/false, 1/0 or yes/no.

  Raises:
    ConfigError: ``text`` is not of the field's type.
  """
  kind = flag_kind(TrainConfig, name)
  text = text.strip()
  default = {f.name: f.default for f in dataclasses.fields(TrainConfig)}[name]
  if text.lower() == "none" and default is None:
    return None
  try:
    if kind is bool:
      return _WORDS[text.lower()]
    return kind(text)
  except (KeyError, ValueError):
    raise ConfigError(f"{name}={text!r} is not {KIND_WORDS[kind]}.") from None


def model_config(cfg: TrainConfig) -> Any:
  """The :class:`experiments.run.model.ModelConfig` a run builds: its preset, laid out as asked."""
  return checked_preset(cfg.preset, scan_layers=cfg.scan_layers)


def checked_preset(name: str, *, scan_layers: bool = False) -> Any:
  """The model config of preset ``name``; an unknown name is a ConfigError naming ``--preset``."""
  from experiments.run import presets

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
