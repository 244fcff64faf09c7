"""Whether a run's settings can work, and the settings filled in from its method's recipe.

:func:`validate` refuses a :class:`~experiments.run.config.TrainConfig` that
cannot work, before anything is built or compiled, with a
:class:`~experiments.run.config.ConfigError` that names the flag and the fix;
:func:`resolve` then fills every setting left to defaults from the method's
recipe. The method registry's own checks (:attr:`Method.check
<experiments.run.methods.Method.check>`) run from here, so the registry
depends on the config and this module on both.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from distro_jax.elastic import LEAVING
from distro_jax.exchange import COLLECTIVES
from distro_jax.unit_rms import NORMALIZE
from experiments.run import methods, model
from experiments.run.config import (
  KIND_WORDS,
  RESUMED_FIELDS,
  ConfigError,
  TrainConfig,
  checked_preset,
  flag_kind,
  model_config,
)

__all__ = ["OVERLAP_EXCHANGE", "resolve", "validate"]


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
  "sparseloco_frequency_bias": (
    0.0,
    True,
    math.inf,
    "0 draws uniformly; e.g. 1.0 prefers low frequencies",
  ),
}


def _check_types(cfg: TrainConfig) -> None:
  """Each field holds its annotated type (Colab, the sweep's grid and tests build configs)."""
  for f in dataclasses.fields(cfg):
    value, kind = getattr(cfg, f.name), flag_kind(TrainConfig, f.name)
    if value is None and f.default is None:
      continue
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
      ok = True
    if not ok:
      raise ConfigError(f"--{f.name} must be {KIND_WORDS[kind]}, got {value!r}.")


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

  return " or ".join(n for n in methods.names() if getattr(methods.get(n), attribute))


def _check_synchronous(cfg: TrainConfig) -> None:
  """``--synchronous_params`` needs the delay, and must be a pattern that picks some params."""

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


def _check_collective(cfg: TrainConfig, method: Any) -> None:
  if cfg.collective not in COLLECTIVES:
    raise ConfigError(f"--collective={cfg.collective!r}; use all_gather or all_to_all.")
  if cfg.collective == "all_gather":
    return
  if not method.supports_delayed_apply:
    raise ConfigError(
      "--collective=all_to_all sends DeMo's message to every peer directly; it needs "
      f"--optimizer={_supporting('supports_delayed_apply')}, not {method.name}."
    )
  if cfg.fsdp > 1:
    raise ConfigError(
      f"--collective=all_to_all runs the step without shard_map's types, which say how a "
      f"worker is split over its site's devices; with --fsdp={cfg.fsdp} use all_gather."
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
  _check_collective(cfg, method)
  if cfg.normalize not in NORMALIZE:
    raise ConfigError(
      f"--normalize={cfg.normalize!r}; use --normalize=sign, --normalize=rms or --normalize=orth."
    )
  if cfg.normalize != "sign" and not method.supports_normalize:
    raise ConfigError(
      f"--normalize={cfg.normalize} shapes DeMo's step from its aggregate; it needs "
      f"--optimizer={_supporting('supports_normalize')}, not {method.name}. Drop --normalize."
    )
  if cfg.lookahead_normalize and (
    cfg.lookahead_normalize not in NORMALIZE or not (cfg.delayed_apply and cfg.lookahead)
  ):
    raise ConfigError(
      f"--lookahead_normalize={cfg.lookahead_normalize!r} shapes the lookahead's guess; it "
      "takes sign, rms or orth, with --delayed_apply and --lookahead. Drop it, or add those."
    )
  if not method.steps_with_muon(cfg) and (cfg.muon_adam_learning_rate or cfg.muon_beta != 0.95):
    raise ConfigError(
      "--muon_beta and --muon_adam_learning_rate set Muon's momentum and its AdamW part's "
      f"rate; they need --optimizer=muon (or sparseloco with --sparseloco_inner=muon), not "
      f"{method.name}. Drop them."
    )
  if not 0.0 <= cfg.muon_beta < 1.0 or cfg.muon_adam_learning_rate < 0:
    raise ConfigError(
      f"--muon_beta={cfg.muon_beta} must be in [0, 1) (optax's default 0.95), and "
      f"--muon_adam_learning_rate={cfg.muon_adam_learning_rate} 0 or more (0: --learning_rate)."
    )
  for flag, where in (("aggregate_momentum", "aggregate"), ("step_momentum", "step")):
    decay = getattr(cfg, flag)
    if decay and not method.supports_normalize:
      raise ConfigError(
        f"--{flag}={decay} is a momentum on DeMo's decoded {where}; it needs "
        f"--optimizer={_supporting('supports_normalize')}, not {method.name}. Drop --{flag}."
      )
    if not 0.0 <= decay < 1.0:
      raise ConfigError(f"--{flag}={decay} must be in [0, 1); e.g. 0.95, Muon's.")
  if cfg.estimate_step and not method.supports_normalize:
    raise ConfigError(
      f"--estimate_step={cfg.estimate_step} changes what DeMo's message carries; it needs "
      f"--optimizer={_supporting('supports_normalize')}, not {method.name}. "
      "Drop --estimate_step."
    )
  if cfg.estimate_step < 0 or (cfg.estimate_step and cfg.delayed_apply):
    raise ConfigError(
      f"--estimate_step={cfg.estimate_step} must be 0 or more, and above 0 it needs this "
      "step's messages, so not --delayed_apply; e.g. 0.5 without --delayed_apply."
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
  method's own check (:attr:`experiments.run.methods.Method.check`), e.g. a
  top-k above the largest chunk. What only the data or the filesystem can
  tell is checked by the trainer, still before compilation.

  Raises:
    ConfigError: naming the flag and the fix.
  """

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
  rec = method.recipe_for(cfg)
  fill = {
    f: getattr(rec, f)
    for f in (
      "learning_rate",
      "compression_decay",
      "warmup_steps",
      "clip_norm",
      "weight_decay",
      "adam_b1",
      "adam_b2",
      "adam_eps",
    )
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

  validate(cfg)
  return _fill(cfg, methods.get(cfg.optimizer), saved or {})
