"""The method registry: every optimizer the experiments train with, and what it is.

One :class:`Method` entry says how to build the optimizer from a
:class:`~experiments.run.config.TrainConfig`, which collective it exchanges with
and how often, how many bytes one worker puts into it, its default
hyperparameters per preset, and what it supports. The trainer, ``compare``,
``sweep``, ``netlab``, the time model and the notebooks ask the registry;
none of them compares an optimizer's name.

Method names on the command line (``compare --methods``, ``netlab
--methods``) are a family followed by options, dash-separated:
``demo-k8-1bit-delayed`` is DeMo with top-k 8, 1-bit values and the
overlapped exchange; ``diloco-h20`` is DiLoCo synchronizing every 20 steps.
:func:`parse` turns a name into its family and the config fields it sets.

Adding a method: write its ``build`` and ``message_bytes``, then one
``register(Method(...))`` below with its recipe and options; the conformance
and registry tests pick it up from :func:`names`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import optax

import distro_jax as dj
from distro_jax.diloco import COUNT_BYTES as DILOCO_COUNT_BYTES
from experiments.run import config, model, presets
from experiments.run.config import ConfigError, TrainConfig, model_config
from experiments.run.launch import FSDP, REPLICA

__all__ = [
  "ALL_GATHER",
  "ALL_REDUCE",
  "BASELINE",
  "DEFAULT_COMPARISON",
  "NEAR_3000X",
  "Axes",
  "CompressionGroup",
  "Method",
  "Option",
  "Payload",
  "Recipe",
  "compression_groups",
  "muon_dimensions",
  "get",
  "grammar",
  "largest_chunk",
  "lr_schedule",
  "names",
  "parse",
  "register",
]

ALL_GATHER = "all-gather"
ALL_REDUCE = "all-reduce"
# The method every other is measured against: AdamW with a gradient all-reduce.
BASELINE = "adamw"
# What compare and frontier run with no --methods: the dense baselines, the
# families, Psyche's message, the best point measured past 1,000x fewer
# bytes than a bf16 gradient at 1,000 steps (docs/results.md: drawn
# positions, each hidden matrix's step orthogonalized), and the best point
# measured past 3,000x: the same step from one drawn coefficient of each
# 16x16 chunk (4,012x; +5.6% to +8.8% behind AdamW at 1,000 steps on the
# English file). The local-step form near 3,000x (that 1,014x message every
# third SGD step, 3,044x) ended 12.6% behind AdamW read once at 900 steps
# (docs/results.md, "Past 1,000x, read once"); the two were not run side
# by side.
NEAR_3000X = "demo-k1-c16-1bit-rand-fb1-orth"
DEFAULT_COMPARISON = (
  "adamw",
  "muon",
  "demo",
  "demo-k8-1bit",
  "demo-k2-1bit",
  "demo-k1-c8-1bit-rand-fb1-orth",
  NEAR_3000X,
  "diloco",
  "sparseloco",
)


@dataclasses.dataclass(frozen=True)
class Recipe:
  """Default hyperparameters for a method on a preset; a flag left unset takes these."""

  learning_rate: float
  warmup_steps: int
  compression_decay: float = 0.999
  clip_norm: float = 1.0
  weight_decay: float = 0.0
  adam_b1: float = 0.9
  adam_b2: float = 0.999
  adam_eps: float = 1e-8


class Axes(NamedTuple):
  """Mesh axes an optimizer runs over.

  Attributes:
    replica: the data-parallel axis between sites; only messages cross it.
      ``None`` is one worker with no collective, outside ``shard_map``.
    fsdp: the axis within a site that shards the params, or ``None`` when
      each site is one device.
  """

  replica: str | None
  fsdp: str | None


class Payload(NamedTuple):
  """Bytes per worker per step, as the driver reports them.

  Attributes:
    message: what one worker puts into the collective at each exchange.
    per_step: ``message`` spread over the steps between exchanges.
    sent: what the collective's algorithm moves up one worker's link per
      step: the message itself for an all-gather (the report's count), a
      ring's ``2 (W-1)/W`` operands for an all-reduce.
  """

  message: float
  per_step: float
  sent: float


@dataclasses.dataclass(frozen=True)
class Option:
  """One dash-separated token of a method name, and the config field it sets.

  Attributes:
    pattern: a regular expression for the whole token, e.g. ``r"k(\\d+)"``.
    field: the :class:`~experiments.run.config.TrainConfig` field it sets.
    value: the field's value, from the token's match.
    example: a token that matches, for help texts.
  """

  pattern: str
  field: str
  value: Callable[[re.Match[str]], Any]
  example: str


def _int(m: re.Match[str]) -> int:
  return int(m[1])


def _float(m: re.Match[str]) -> float:
  return float(m[1])


@dataclasses.dataclass(frozen=True)
class Method:
  """What one optimizer family is, for the experiments.

  Attributes:
    name: the family's name, the value of ``--optimizer``.
    description: one line for help texts and docs.
    build: ``build(cfg, axes)``, the optax transformation each worker runs,
      fed its own local gradient (taken at ``dj.inner_params``).
    message_bytes: ``message_bytes(cfg, params)``, what one worker puts into
      the collective at each exchange, for one device's params (shapes).
    collective: :data:`ALL_GATHER` or :data:`ALL_REDUCE`.
    recipe: default hyperparameters.
    preset_recipes: recipes that replace ``recipe`` on some presets.
    long_recipes: per preset, ``(steps, recipe)``: a run of at least that many
      steps on that preset takes that recipe (``experiments.frontier`` found
      lower rates better for longer runs).
    takes_long_recipes: ``takes_long_recipes(cfg)``, whether ``long_recipes``
      apply to a run of ``cfg`` (every run by default).
    options: the tokens that may follow the name on the command line.
    exchange_every: ``exchange_every(cfg)``, steps between exchanges.
    supports_fsdp: runs on sites of more than one device.
    supports_delayed_apply: has an overlapped (one step late) exchange.
    excludes_nonfinite: leaves a worker with a non-finite message out of the
      aggregate, and reports how many it left out.
    supports_skip_nonfinite: ``--skip_nonfinite`` applies to it.
    tuning: the grid ``experiments.frontier`` tries for it, field by field;
      the best point by validation loss is its recipe for that horizon.
    final_exchange: the last step of a run exchanges too, whatever
      ``exchange_every`` says (DiLoCo's final outer step), so a last partial
      round is not thrown away.
    gradient_point: ``gradient_point(cfg)``, a function ``(opt_state,
      params) -> params`` giving where each worker takes its gradient
      (default ``dj.inner_params``: DiLoCo's local params, else the params).
    overlapped_share: ``overlapped_share(cfg, params)``, the share of the
      message that an overlapped exchange sends during the next step's
      compute, for the time model (0 for an exchange that waits).
    check: ``check(cfg)``, the method's own refusals of a config whose
      recipe is filled in, raising ``ConfigError`` naming the flag and the
      fix; ``checks.validate`` calls it, so no other module branches on a
      method's name.
    supports_cold_start: a joining worker's message can be marked invalid
      (``--cold_start_steps``, an elastic resume onto more workers).
    supports_normalize: ``--normalize`` chooses how its aggregate becomes a
      step (DeMo's sign, or unit RMS per tensor).
    supports_compression_groups: ``--compression_groups`` gives groups of
      params messages of their own sizes.
    steps_with_muon: whether ``cfg``'s run steps with optax's Muon somewhere,
      so that ``--muon_beta`` and ``--muon_adam_learning_rate`` mean something.
    dense: a dense baseline: every step all-reduces the whole gradient, and
      every worker steps with it (AdamW, Muon). ``compare`` and ``frontier``
      measure every method's gap to the best of these.
  """

  name: str
  description: str
  build: Callable[[TrainConfig, Axes], optax.GradientTransformation]
  message_bytes: Callable[[TrainConfig, Any], float]
  collective: str
  recipe: Recipe
  preset_recipes: Mapping[str, Recipe] = dataclasses.field(default_factory=dict)
  long_recipes: Mapping[str, tuple[int, Recipe]] = dataclasses.field(default_factory=dict)
  takes_long_recipes: Callable[[TrainConfig], bool] = lambda cfg: True
  options: tuple[Option, ...] = ()
  exchange_every: Callable[[TrainConfig], int] = lambda cfg: 1
  supports_fsdp: bool = True
  supports_delayed_apply: bool = False
  excludes_nonfinite: bool = False
  supports_skip_nonfinite: bool = False
  tuning: Mapping[str, tuple[Any, ...]] = dataclasses.field(
    default_factory=lambda: {"learning_rate": (1.5e-3, 3e-3, 6e-3)}
  )
  final_exchange: bool = False
  check: Callable[[TrainConfig], None] = lambda cfg: None
  gradient_point: Callable[[TrainConfig], Callable[[Any, Any], Any]] = lambda cfg: dj.inner_params
  overlapped_share: Callable[[TrainConfig, Any], float] = lambda cfg, params: 0.0
  supports_cold_start: bool = False
  supports_normalize: bool = False
  supports_compression_groups: bool = False
  steps_with_muon: Callable[[TrainConfig], bool] = lambda cfg: False
  dense: bool = False

  def recipe_for(self, cfg: TrainConfig) -> Recipe:
    """The defaults for a run of ``cfg``, by its preset, steps and :attr:`takes_long_recipes`."""
    preset = cfg.preset
    if preset in self.long_recipes and self.takes_long_recipes(cfg):
      min_steps, longer = self.long_recipes[preset]
      if cfg.steps >= min_steps:
        return longer
    return self.preset_recipes.get(preset, self.recipe)

  def payload(self, cfg: TrainConfig, params: Any) -> Payload:
    """Bytes per worker per step for ``cfg`` (resolved) and one device's ``params``."""
    message = float(self.message_bytes(cfg, params))
    per_step = message / self.exchange_every(cfg)
    if self.collective == ALL_REDUCE:
      return Payload(message, per_step, per_step * dj.wire.ring_allreduce_factor(cfg.sites))
    return Payload(message, per_step, per_step)

  def exchanges(self, cfg: TrainConfig, steps_done: int) -> int:
    """How many exchanges steps ``1..steps_done`` of a run of ``cfg.steps`` made."""
    every = self.exchange_every(cfg)
    last = self.final_exchange and steps_done == cfg.steps and steps_done % every
    return steps_done // every + bool(last)

  def sent_over(self, cfg: TrainConfig, payload: Payload, steps_done: int) -> float:
    """Bytes up one worker's link over steps ``1..steps_done``, every exchange counted."""
    return payload.sent * self.exchange_every(cfg) * self.exchanges(cfg, steps_done)


_REGISTRY: dict[str, Method] = {}
# Older spellings kept working: ``topk-nodct`` is DeMo without the DCT.
_ALIASES = {"topk-nodct": "demo-nodct"}


def register(method: Method) -> Method:
  """Adds ``method`` to the registry; its name must be new."""
  if method.name in _REGISTRY:
    raise ValueError(f"method {method.name!r} is already registered.")
  _REGISTRY[method.name] = method
  return method


def names() -> tuple[str, ...]:
  """Every registered family, in registration order."""
  return tuple(_REGISTRY)


def get(name: str) -> Method:
  """The family called ``name``.

  Raises:
    ConfigError: for a name that is not registered, listing those that are.
  """

  if name not in _REGISTRY:
    raise ConfigError(f"unknown optimizer {name!r}; use --optimizer= one of {', '.join(names())}.")
  return _REGISTRY[name]


def grammar() -> str:
  """The method-name grammar, one line per family, for help texts and errors."""
  lines = []
  for m in _REGISTRY.values():
    opts = "".join(f"[-{o.example}]" for o in m.options)
    lines.append(f"{m.name}{opts}: {m.description}")
  lines += [f"{alias}: the same as {target}" for alias, target in _ALIASES.items()]
  return "\n".join(lines)


def parse(spec: str) -> tuple[Method, dict[str, Any]]:
  """A method name as ``compare`` takes it: the family and the config fields it sets.

  Args:
    spec: e.g. ``"demo-k8-1bit"``, ``"topk-nodct-k8"`` or ``"diloco-h100"``.

  Returns:
    ``(method, overrides)``; ``overrides`` always sets ``optimizer``.

  Raises:
    ConfigError: for a name that is not a family followed by its options.
  """

  name = spec
  for alias, target in _ALIASES.items():
    if name == alias or name.startswith(alias + "-"):
      name = target + name[len(alias) :]
  family, *tokens = name.split("-")
  method = _REGISTRY.get(family)
  overrides: dict[str, Any] = {"optimizer": family}
  for token in tokens if method else ():
    match = next(((o, m) for o in method.options if (m := re.fullmatch(o.pattern, token))), None)
    if match is None:
      method = None
      break
    option, m = match
    overrides[option.field] = option.value(m)
  if method is None:
    raise ConfigError(f"unknown method {spec!r}. Methods:\n{grammar()}")
  return method, overrides


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
  """The reference's schedule: linear warmup from 0, then cosine down to 0.1x.

  Every method steps with it and the metrics log it, so both see one schedule.
  """
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=cfg.learning_rate,
    warmup_steps=min(cfg.warmup_steps, max(cfg.steps - 1, 0)),
    decay_steps=max(cfg.steps, cfg.warmup_steps + 1),
    end_value=0.1 * cfg.learning_rate,
  )


def _clip(cfg: TrainConfig, axes: Axes) -> optax.GradientTransformation:
  """Clipping by the global norm of the whole gradient, also when it is sharded."""
  if not cfg.clip_norm:
    return optax.identity()
  if axes.fsdp is not None:
    return dj.clip_by_sharded_global_norm(cfg.clip_norm, axes.fsdp)
  return optax.clip_by_global_norm(cfg.clip_norm)


def synchronous_mask(pattern: str) -> Callable[[Any], Any] | None:
  """``--synchronous_params`` as ``synchronous`` of :func:`distro_jax.distro`: matching params.

  ``None`` for an empty pattern (every param overlapped).
  """
  if not pattern:
    return None
  compiled = re.compile(pattern)

  def mask(params: Any) -> Any:
    return jax.tree_util.tree_map_with_path(
      lambda path, _: compiled.search(jax.tree_util.keystr(path)) is not None, params
    )

  return mask


class CompressionGroup(NamedTuple):
  """One entry of ``--compression_groups``: the params it takes and their message sizes.

  Attributes:
    pattern: a regular expression searched in each param's path.
    chunk: the chunk length target per axis for those params.
    topk: coefficients sent per chunk for those params.
  """

  pattern: str
  chunk: int
  topk: int


def compression_groups(spec: str) -> tuple[CompressionGroup, ...]:
  """``--compression_groups`` (``REGEX=CHUNK:TOPK;...``) as :class:`CompressionGroup` s.

  Raises:
    ConfigError: for an entry that is not ``REGEX=CHUNK:TOPK`` with a valid
      regular expression and positive integers.
  """

  example = "e.g. --compression_groups=\"'attn'=8:2;'mlp'=16:1\""
  groups = []
  for entry in (e.strip() for e in spec.split(";")):
    if not entry:
      continue
    pattern, equals, sizes = entry.rpartition("=")
    chunk, colon, topk = sizes.partition(":")
    if not (pattern and equals and colon and chunk.isdigit() and topk.isdigit()):
      raise ConfigError(
        f"--compression_groups: {entry!r} is not REGEX=CHUNK:TOPK with whole numbers; {example}."
      )
    if int(chunk) < 1 or int(topk) < 1:
      raise ConfigError(
        f"--compression_groups: {entry!r} sends nothing; CHUNK and TOPK are 1 or more, {example}."
      )
    try:
      re.compile(pattern)
    except re.error as e:
      raise ConfigError(
        f"--compression_groups: {pattern!r} is not a regular expression ({e}); {example}."
      ) from None
    groups.append(CompressionGroup(pattern, int(chunk), int(topk)))
  return tuple(groups)


def _group_labels(groups: tuple[CompressionGroup, ...], params: Any) -> Any:
  """Each param's group, ``"group<i>"`` of the first pattern found in its path, else ``"rest"``."""
  compiled = [re.compile(g.pattern) for g in groups]

  def label(path: Any, _: Any) -> str:
    key = jax.tree_util.keystr(path)
    found = next((i for i, c in enumerate(compiled) if c.search(key)), None)
    return "rest" if found is None else f"group{found}"

  return jax.tree_util.tree_map_with_path(label, params)


def compression(cfg: TrainConfig) -> dj.Compression:
  """The run's DeMo message options, from the flags of the same names."""
  options = {name: getattr(cfg, name) for name in dj.Compression._fields}
  return dj.Compression.of(options)._replace(frequency_bias=cfg.frequency_bias or None)


def _exchange(cfg: TrainConfig, axes: Axes) -> dict[str, Any]:
  """The exchange's options besides the message's: the axis and the overlap."""
  return {
    "axis_name": axes.replica,
    "delayed_apply": cfg.delayed_apply,
    "synchronous": synchronous_mask(cfg.synchronous_params),
    "collective": cfg.collective,
  }


def _demo_messages(cfg: TrainConfig, params: Any) -> tuple[int, int]:
  """One worker's message bytes per step: ``(synchronous, overlapped)``."""
  leaves = jax.tree.leaves(params)
  mask = synchronous_mask(cfg.synchronous_params)
  if not cfg.delayed_apply:
    sync = [True] * len(leaves)
  elif mask is None:
    sync = [False] * len(leaves)
  else:
    sync = jax.tree.leaves(mask(params))

  def payload(group: list[Any]) -> int:
    return compression(cfg).layout(group).num_bytes if group else 0

  return (
    payload([x for x, s in zip(leaves, sync) if s]),
    payload([x for x, s in zip(leaves, sync) if not s]),
  )


def _demo_message(cfg: TrainConfig, params: Any) -> int:
  """One worker's message bytes per step; with a partial overlap or groups, every message's."""
  groups = compression_groups(cfg.compression_groups)
  if not groups:
    return sum(_demo_messages(cfg, params))
  labels = jax.tree.leaves(_group_labels(groups, params))
  total = 0
  for label, options in _group_compressions(cfg, groups).items():
    members = [x for x, lab in zip(jax.tree.leaves(params), labels) if lab == label]
    if members:
      total += options.layout(members).num_bytes
  return total


def _group_compressions(
  cfg: TrainConfig, groups: tuple[CompressionGroup, ...]
) -> dict[str, dj.Compression]:
  """Each group's message options by label: its own sizes, the rest the run's."""
  rest = compression(cfg)
  sizes = {
    f"group{i}": rest._replace(compression_chunk=g.chunk, compression_topk=g.topk)
    for i, g in enumerate(groups)
  }
  return {**sizes, "rest": rest}


def _demo_overlapped_share(cfg: TrainConfig, params: Any) -> float:
  sync, overlapped = _demo_messages(cfg, params)
  return overlapped / (sync + overlapped)


def _gradient_bytes(params: Any) -> int:
  return dj.wire_bytes(params).grad


def _gradient_bytes_fp32(params: Any) -> int:
  return dj.wire_bytes(params).grad_fp32


# Muon leaves the embedding and the output head to another optimizer; the
# orthogonalized runs in docs/results.md step them at unit RMS.
_NOT_ORTHOGONALIZED = re.compile(r"'embedding'|'lm_head'")


# A scanned model's stacked layers: everything under its blocks.
_STACKED = re.compile(r"^\['blocks'\]")


def demo_normalize(
  name: str, scan_layers: bool = False, split: Mapping[str, int] | None = None
) -> Any:
  """``--normalize`` as ``normalize`` of :func:`distro_jax.demo`.

  ``"orth"`` orthogonalizes the hidden matrices only: the embedding and the
  output head step at unit RMS, as Muon leaves them out. With
  ``scan_layers``, the stacked blocks are :class:`distro_jax.PerLayer`, so
  each layer steps as it would as a param of its own. ``split`` maps the
  path of each param that FSDP cuts to the cut axis (:func:`fsdp_split`);
  those that need the whole tensor (an orthogonalized matrix, a stack's
  layers) are :class:`distro_jax.Split`, so each device takes its block of
  the whole tensor's step. (A whole tensor's unit RMS takes its sum over
  the blocks without a gather.)
  """
  if name == "sign" or (name == "rms" and not scan_layers):
    return name

  def mode(path: Any, _: Any) -> Any:
    key = jax.tree_util.keystr(path)
    m = "rms" if name == "orth" and _NOT_ORTHOGONALIZED.search(key) else name
    m = dj.PerLayer(m) if scan_layers and _STACKED.search(key) else m
    if split and key in split and m != "rms":
      m = dj.Split(m, axis=split[key], over=FSDP)
    return m

  return lambda params: jax.tree_util.tree_map_with_path(mode, params)


def fsdp_split(cfg: TrainConfig) -> dict[str, int]:
  """Each param's path to the axis the run's FSDP plan cuts (none with ``--fsdp=1``)."""
  if cfg.fsdp == 1:
    return {}

  abstract = model.abstract_params(config.model_config(cfg))
  plan = dj.plan_fsdp(abstract, cfg.fsdp, compression_chunk=cfg.compression_chunk)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
  return {p: axis for p, axis in zip(paths, plan.axes) if axis is not None}


# DisTrO clips each worker's own gradient before it enters the momentum.
def _build_demo(cfg: TrainConfig, axes: Axes) -> optax.GradientTransformation:
  def demo(options: dj.Compression) -> optax.GradientTransformation:
    return dj.demo(
      lr_schedule(cfg),
      weight_decay=cfg.weight_decay,
      normalize=demo_normalize(cfg.normalize, cfg.scan_layers, fsdp_split(cfg)),
      aggregate_momentum=cfg.aggregate_momentum,
      step_momentum=cfg.step_momentum,
      estimate_step=cfg.estimate_step,
      **_exchange(cfg, axes),
      **options._asdict(),
    )

  groups = compression_groups(cfg.compression_groups)
  if not groups:
    return optax.chain(_clip(cfg, axes), demo(compression(cfg)))
  # One DeMo, one message and one all-gather per group; a group whose
  # pattern takes no param sends nothing.
  transforms = {label: demo(o) for label, o in _group_compressions(cfg, groups).items()}
  labels = functools.partial(_group_labels, groups)
  return optax.chain(_clip(cfg, axes), optax.multi_transform(transforms, labels))


def _demo_gradient_point(cfg: TrainConfig) -> Callable[[Any, Any], Any]:
  """With ``--delayed_apply`` (and ``--lookahead``), Psyche's lookahead; else the params."""

  if not (cfg.delayed_apply and cfg.lookahead):
    return dj.inner_params
  return functools.partial(
    dj.gradient_point,
    learning_rate=lr_schedule(cfg),
    weight_decay=cfg.weight_decay,
    normalize=cfg.lookahead_normalize
    or demo_normalize(cfg.normalize, cfg.scan_layers, fsdp_split(cfg)),
    axis_name=REPLICA,
    **compression(cfg)._asdict(),
  )


def _build_distro_adamw(cfg: TrainConfig, axes: Axes) -> optax.GradientTransformation:
  options = {**_exchange(cfg, axes), **compression(cfg)._asdict()}
  tx = dj.distro_adamw(lr_schedule(cfg), weight_decay=cfg.weight_decay, **options)
  return optax.chain(_clip(cfg, axes), tx)


def _clipped_adamw(cfg: TrainConfig, axes: Axes) -> optax.GradientTransformation:
  adamw = optax.adamw(
    lr_schedule(cfg),
    b1=cfg.adam_b1,
    b2=cfg.adam_b2,
    eps=cfg.adam_eps,
    weight_decay=cfg.weight_decay,
  )
  return optax.chain(_clip(cfg, axes), adamw)


def _all_reduced(cfg: TrainConfig, axes: Axes, tx: optax.GradientTransformation):
  """``tx`` stepping with the mean gradient over the workers: a dense baseline."""
  if cfg.skip_nonfinite:
    # What optax users reach for: skip a step whose gradient is not finite. It
    # wraps the part after the all-reduce, so every worker makes the same call.
    tx = optax.apply_if_finite(tx, max_consecutive_errors=1000)
  return optax.chain(dj.pmean_gradients(axes.replica), tx)


# AdamW clips the all-reduced gradient, as data-parallel AdamW does.
def _build_adamw(cfg: TrainConfig, axes: Axes) -> optax.GradientTransformation:
  return _all_reduced(cfg, axes, _clipped_adamw(cfg, axes))


# Muon's update of a hidden matrix has an RMS of 0.2 times the rate (Liu et
# al., 2025), about AdamW's, so the AdamW part and the Muon part share one
# learning rate, and one grid tunes both.
MUON_CONSISTENT_RMS = 0.2


def muon_dimensions(params: Any) -> Any:
  """Which params Muon orthogonalizes, as ``muon_weight_dimension_numbers`` of optax's Muon.

  A hidden matrix, a param of the blocks whose last two axes are both longer
  than one, is orthogonalized over those two axes (input, output); leading
  axes, the layers of a ``--scan_layers`` stack, are batch axes, so each
  layer is orthogonalized on its own. Everything else (``None``) steps with
  AdamW: the embedding and the output head, which Muon's authors leave to
  AdamW, and the norm scales, which are vectors (a stack's scales are
  ``(n_layers, 1, d_model)``).
  """

  def dims(path: Any, x: Any) -> optax.contrib.MuonDimensionNumbers | None:
    key = jax.tree_util.keystr(path)
    hidden = _STACKED.search(key) and not _NOT_ORTHOGONALIZED.search(key)
    if not hidden or x.ndim < 2 or min(x.shape[-2:]) < 2:
      return None
    return optax.contrib.MuonDimensionNumbers(reduction_axis=x.ndim - 2, output_axis=x.ndim - 1)

  return jax.tree_util.tree_map_with_path(dims, params)


def _muon(cfg: TrainConfig) -> optax.GradientTransformation:
  """optax's Muon: Nesterov momentum 0.95 orthogonalized by five Newton-Schulz steps on the
  hidden matrices, AdamW (optax's, Nesterov too) on the rest."""
  return optax.contrib.muon(
    lr_schedule(cfg),
    beta=cfg.muon_beta,
    eps=cfg.adam_eps,
    weight_decay=cfg.weight_decay,
    adam_b1=cfg.adam_b1,
    adam_b2=cfg.adam_b2,
    adam_weight_decay=cfg.weight_decay,
    muon_weight_dimension_numbers=muon_dimensions,
    consistent_rms=MUON_CONSISTENT_RMS,
    adam_learning_rate=_muon_adam_schedule(cfg),
  )


def _muon_adam_schedule(cfg: TrainConfig) -> optax.Schedule | None:
  """The schedule of Muon's AdamW part: ``lr_schedule``'s at its own peak, or ``None`` (Muon's)."""
  if not cfg.muon_adam_learning_rate:
    return None
  return lr_schedule(dataclasses.replace(cfg, learning_rate=cfg.muon_adam_learning_rate))


# Muon clips the all-reduced gradient as AdamW does, then optax's Muon steps.
def _build_muon(cfg: TrainConfig, axes: Axes) -> optax.GradientTransformation:
  return _all_reduced(cfg, axes, optax.chain(_clip(cfg, axes), _muon(cfg)))


# Each DiLoCo worker clips and steps its own gradient between synchronizations;
# the run's last step synchronizes too, so a last partial round is not lost.
def _build_diloco(cfg: TrainConfig, axes: Axes) -> optax.GradientTransformation:
  return dj.diloco(
    _clipped_adamw(cfg, axes),
    sync_every=cfg.diloco_sync_every,
    outer_learning_rate=cfg.diloco_outer_lr,
    outer_momentum=cfg.diloco_outer_momentum,
    axis_name=axes.replica,
    total_steps=cfg.steps,
  )


def _check_diloco(cfg: TrainConfig) -> None:

  if cfg.steps < cfg.diloco_sync_every:
    raise ConfigError(
      f"--steps={cfg.steps} is shorter than --diloco_sync_every={cfg.diloco_sync_every}, "
      "so DiLoCo would train each worker alone and average only once, at the end; use "
      f"--diloco_sync_every<={cfg.steps} (e.g. the method diloco-h{max(cfg.steps // 4, 1)}), "
      "or more --steps."
    )


def _sparseloco_bits(cfg: TrainConfig) -> int | None:
  return cfg.sparseloco_value_bits or None


# The inner optimizers SparseLoCo's workers may step with between exchanges.
SPARSELOCO_INNER = ("adamw", "muon", "sgd")
# How its mean may become the outer step ("" is the mean itself, the paper's).
SPARSELOCO_NORMALIZE = ("", "rms", "orth")


def _sparseloco_inner(cfg: TrainConfig, axes: Axes) -> optax.GradientTransformation:
  """Each worker's clipped inner optimizer: AdamW, Muon as MuLoCo steps, or plain SGD.

  SGD at the schedule's rate keeps the gradient's own spectrum in the
  pseudo-gradient (AdamW's per-entry scaling flattens it, and with it what
  a chunk's low DCT frequencies hold); with H=1 and the drawn, orthogonalized
  message it is DeMo's update with ``normalize="orth"``.
  """
  if cfg.sparseloco_inner == "muon":
    return optax.chain(_clip(cfg, axes), _muon(cfg))
  if cfg.sparseloco_inner == "sgd":
    return optax.chain(_clip(cfg, axes), optax.sgd(lr_schedule(cfg)))
  return _clipped_adamw(cfg, axes)


def _sparseloco_outer_lr(cfg: TrainConfig) -> optax.ScalarOrSchedule:
  """The outer rate: the paper's constant, or, for a normalized step, one that follows lr.

  A unit-RMS (or orthogonalized) step has no size of its own, so each entry
  moves ``outer_lr * H * lr_t``: over the H steps it covers, DeMo's ``lr_t``
  a step, on the run's schedule.
  """
  if not cfg.sparseloco_normalize:
    return cfg.sparseloco_outer_lr
  schedule, scale = lr_schedule(cfg), cfg.sparseloco_outer_lr * cfg.sparseloco_sync_every
  return lambda count: scale * schedule(count)


def _build_sparseloco(cfg: TrainConfig, axes: Axes) -> optax.GradientTransformation:
  normalize = None
  if cfg.sparseloco_normalize:
    normalize = demo_normalize(cfg.sparseloco_normalize, cfg.scan_layers)
  return dj.sparseloco(
    _sparseloco_inner(cfg, axes),
    sync_every=cfg.sparseloco_sync_every,
    outer_learning_rate=_sparseloco_outer_lr(cfg),
    error_decay=cfg.sparseloco_error_decay,
    compression_topk=cfg.sparseloco_topk,
    compression_chunk=cfg.sparseloco_chunk,
    value_bits=_sparseloco_bits(cfg),
    clip_to_median_norm=cfg.sparseloco_clip,
    use_dct=cfg.sparseloco_dct,
    axis_name=axes.replica,
    random_positions=cfg.sparseloco_random_positions,
    frequency_bias=cfg.sparseloco_frequency_bias or None,
    normalize=normalize,
  )


def _sparseloco_message(cfg: TrainConfig, params: Any) -> int:
  return dj.sparseloco_bytes(
    params,
    sync_every=cfg.sparseloco_sync_every,
    compression_topk=cfg.sparseloco_topk,
    compression_chunk=cfg.sparseloco_chunk,
    value_bits=_sparseloco_bits(cfg),
    random_positions=cfg.sparseloco_random_positions,
  ).payload


def _check_sparseloco(cfg: TrainConfig) -> None:

  if cfg.sparseloco_value_bits > 2:
    raise ConfigError(
      f"--sparseloco_value_bits={cfg.sparseloco_value_bits}: SparseLoCo's quantizer has 1 or 2 "
      "bits (or 0 for float values); use --sparseloco_value_bits=2, the paper's."
    )
  if cfg.steps < cfg.sparseloco_sync_every:
    raise ConfigError(
      f"--steps={cfg.steps} is shorter than --sparseloco_sync_every="
      f"{cfg.sparseloco_sync_every}, so no synchronization would run; use "
      f"--sparseloco_sync_every<={cfg.steps} (e.g. the method sparseloco-h"
      f"{max(cfg.steps // 4, 1)}), or more --steps."
    )
  _check_sparseloco_drawn(cfg)
  if cfg.scan_layers and cfg.sparseloco_clip and not cfg.sparseloco_random_positions:
    raise ConfigError(
      "SparseLoCo clips each worker's contribution to each tensor at the median norm, "
      "so with --scan_layers it would clip the stack of all layers as one tensor. Add "
      "--nosparseloco_clip, or drop --scan_layers."
    )
  _check_topk_fits(cfg, "sparseloco", "the paper sends 64 of 4096")


def _check_sparseloco_drawn(cfg: TrainConfig) -> None:
  """The drawn message's, the outer step's and the inner optimizer's settings."""
  if cfg.sparseloco_inner not in SPARSELOCO_INNER:
    raise ConfigError(
      f"--sparseloco_inner={cfg.sparseloco_inner!r}; use --sparseloco_inner=adamw, muon or sgd."
    )
  if cfg.sparseloco_normalize not in SPARSELOCO_NORMALIZE:
    raise ConfigError(
      f"--sparseloco_normalize={cfg.sparseloco_normalize!r}; use '' (the mean), 'rms' or 'orth'."
    )
  if cfg.sparseloco_frequency_bias and not cfg.sparseloco_random_positions:
    raise ConfigError(
      f"--sparseloco_frequency_bias={cfg.sparseloco_frequency_bias:g} shapes the draw of "
      "--sparseloco_random_positions; add it (method option rand), or drop the bias."
    )
  if cfg.sparseloco_random_positions and cfg.sparseloco_value_bits == 2:
    raise ConfigError(
      "--sparseloco_random_positions sends DeMo's drawn message, whose values are 1-bit "
      "signs or floats; use --sparseloco_value_bits=1 (method option 1bit) or 0."
    )


def overlapped_share(cfg: TrainConfig) -> float:
  """The share of ``cfg``'s message sent during the next step's compute (the time model's)."""

  params = model.abstract_params(config.model_config(cfg))
  return get(cfg.optimizer).overlapped_share(cfg, params)


@functools.cache
def largest_chunk(preset: str, compression_chunk: int) -> int:
  """Coefficients in the largest DCT chunk of ``preset``'s params at ``compression_chunk``."""

  params = model.abstract_params(presets.get_preset(preset))
  return max(
    dj.dct.plan_chunks(x.shape, compression_chunk).chunk_size for x in jax.tree.leaves(params)
  )


# A top-k above every chunk is clamped to the chunk: each chunk goes whole,
# indices and all, so the "compressed" message outgrows the gradient.
def _check_topk_fits(cfg: TrainConfig, prefix: str, usual: str) -> None:
  """Refuses ``--{prefix}_topk`` above every chunk that ``--{prefix}_chunk`` plans."""

  topk, chunk = getattr(cfg, f"{prefix}_topk"), getattr(cfg, f"{prefix}_chunk")
  largest = largest_chunk(cfg.preset, chunk)
  if topk > largest:
    raise ConfigError(
      f"--{prefix}_topk={topk} is above the largest chunk of preset {cfg.preset!r} "
      f"({largest} coefficients at --{prefix}_chunk={chunk}), so every chunk would be sent "
      f"whole and the message would be larger than the gradient; use --{prefix}_topk<="
      f"{largest} ({usual}), or a larger --{prefix}_chunk."
    )


def _check_groups(cfg: TrainConfig) -> None:
  """``--compression_groups``: well formed, each pattern takes a param, each top-k fits."""

  groups = compression_groups(cfg.compression_groups)
  if not groups:
    return
  if cfg.delayed_apply:
    raise ConfigError(
      "--compression_groups sends each group's message in the step that computes it; it "
      "is not built for --delayed_apply. Drop --delayed_apply or --compression_groups."
    )
  if cfg.fsdp > 1:
    raise ConfigError(
      "--compression_groups is not built for --fsdp > 1; use --fsdp=1, or drop "
      "--compression_groups."
    )
  paths = model.param_paths(model_config(cfg))
  for g in groups:
    if not any(re.search(g.pattern, p) for p in paths):
      raise ConfigError(
        f"--compression_groups: {g.pattern!r} matches no param of preset {cfg.preset!r}; "
        f"its paths look like {paths[0]!r}, e.g. --compression_groups=\"'attn'=8:2\"."
      )
    largest = largest_chunk(cfg.preset, g.chunk)
    if g.topk > largest:
      raise ConfigError(
        f"--compression_groups: {g.pattern}={g.chunk}:{g.topk} keeps more than the "
        f"{largest} coefficients of its largest chunk; use a top-k <={largest}."
      )


def _check_compression(cfg: TrainConfig) -> None:

  _check_topk_fits(cfg, "compression", "the reference sends 32 of 4096")
  if cfg.frequency_bias and not cfg.random_positions:
    raise ConfigError(
      f"--frequency_bias={cfg.frequency_bias:g} shapes the draw of --random_positions; add "
      "--random_positions, or drop --frequency_bias."
    )


def _check_demo(cfg: TrainConfig) -> None:
  _check_compression(cfg)
  _check_groups(cfg)


# The group whose exact gradient point closed most of the overlapped
# exchange's gap at top-k 32 (docs/overlapped.md): attention, embedding and
# output head, a third of the message.
PARTIAL_OVERLAP = r"'attn'|'embedding'|'lm_head'"

_COMPRESSION_OPTIONS = (
  Option(r"k(\d+)", "compression_topk", _int, "kK"),
  Option(r"c(\d+)", "compression_chunk", _int, "cC"),
  Option(r"1bit", "quantize_1bit", lambda m: True, "1bit"),
  Option(r"nodct", "use_dct", lambda m: False, "nodct"),
  Option(r"rand", "random_positions", lambda m: True, "rand"),
  Option(r"fb(\d+(?:\.\d+)?)", "frequency_bias", lambda m: float(m.group(1)), "fbB"),
  Option(r"stateless", "compression_decay", lambda m: 0.0, "stateless"),
  Option(r"delayed", "delayed_apply", lambda m: True, "delayed"),
  Option(r"partial", "synchronous_params", lambda m: PARTIAL_OVERLAP, "partial"),
  # Each message straight to every peer: one hop where gloo's ring takes W - 1.
  Option(r"a2a", "collective", lambda m: "all_to_all", "a2a"),
)
_DEMO_OPTIONS = (
  *_COMPRESSION_OPTIONS,
  Option(r"rms", "normalize", lambda m: "rms", "rms"),
  Option(r"orth", "normalize", lambda m: "orth", "orth"),
  Option(r"am(0?\.\d+)", "aggregate_momentum", lambda m: float(m.group(1)), "amB"),
  # Muon's momentum after --normalize: each step's orthogonalized aggregate averaged.
  Option(r"sm(0?\.\d+)", "step_momentum", lambda m: float(m.group(1)), "smB"),
  Option(r"est(\d*\.?\d+)", "estimate_step", lambda m: float(m.group(1)), "estS"),
  # The overlapped form's lookahead guess at unit RMS, not orthogonalized (cheaper).
  Option(r"larms", "lookahead_normalize", lambda m: "rms", "larms"),
  # The momentum keeps what was sent: Muon's momentum, sampled by the message.
  Option(r"noef", "error_feedback", lambda m: False, "noef"),
  # The sent coefficients stay in the momentum at this share (Dion's feedback).
  Option(r"keep(0?\.\d+)", "sent_keep", lambda m: float(m.group(1)), "keepB"),
)
# The DisTrO report's 1.2B run used 4e-4 with 250 warmup steps.
_REPORT_RECIPE = Recipe(learning_rate=4e-4, warmup_steps=250)

# From the sweep in docs/results.md (small preset, 300 steps, 8 workers, 1 MB of
# English): lr 3e-3 was best for both DeMo and AdamW, and the short run favours
# decay 0.95 over the reference's 0.999, which report-1.2b keeps.
_DEMO_RECIPE = Recipe(learning_rate=3e-3, warmup_steps=30, compression_decay=0.95)
_DEFAULT_RECIPE = Recipe(learning_rate=3e-3, warmup_steps=30)


# Muon at its consistent RMS (MUON_CONSISTENT_RMS). Tuned at 300 steps on the
# fetched corpus read once (small, 8 workers, seed 0; docs/results.md): 1.6084
# at 6e-3, 1.6086 at 1.2e-2, 1.7282 at 3e-3, 1.9946 at 1.5e-3. At 900 steps
# 6e-3 gave 1.4196 against 3e-3's 1.4279 (one seed, two rates).
_MUON_RECIPE = Recipe(learning_rate=6e-3, warmup_steps=30)
_MUON_RATES = (3e-3, 6e-3, 1.2e-2)


# Where the long recipes start. Their rates were measured at 1,000 steps; the
# 300-step recipes were tuned at 300. Issue 54's acceptance check runs about
# 900 steps, far nearer the first, so runs from 900 steps take the long
# recipe. No rate was measured at 900 itself.
LONG_RUN_STEPS = 900


def _long_runs(recipe: Recipe, learning_rate: float) -> dict[str, tuple[int, Recipe]]:
  """``recipe`` at ``learning_rate`` for runs of :data:`LONG_RUN_STEPS` or more on ``small``.

  ``experiments.frontier`` at 1,000 steps (small, 8 workers, English; the
  grids in docs/results.md) found every family's best peak rate below the
  300-step recipe's. Measured on ``small`` only, so only ``small`` takes it.
  """
  return {"small": (LONG_RUN_STEPS, dataclasses.replace(recipe, learning_rate=learning_rate))}


register(
  Method(
    name="demo",
    description="DeMo: compressed momentum exchange, then sign (docs/design.md section 2)",
    build=_build_demo,
    message_bytes=_demo_message,
    collective=ALL_GATHER,
    recipe=_DEMO_RECIPE,
    preset_recipes={"report-1.2b": _REPORT_RECIPE},
    # demo-k8-1bit: 1.9982 at 1.5e-3, 2.0185 at 7.5e-4; the defaults are flat
    # there (1.8829, 1.8816), so the family takes 1.5e-3.
    long_recipes=_long_runs(_DEMO_RECIPE, 1.5e-3),
    # The orthogonalized step keeps 3e-3 at 900 steps: the 1,015x message
    # (demo-k1-c8-1bit-rand-fb1-orth, seed 0) ended at 1.6316 there against
    # 1.6472 at 1.5e-3 and 1.6438 at 6e-3 (docs/results.md).
    takes_long_recipes=lambda cfg: cfg.normalize != "orth",
    options=_DEMO_OPTIONS,
    supports_delayed_apply=True,
    excludes_nonfinite=True,
    tuning={"learning_rate": (2e-3, 4e-3), "compression_decay": (0.95, 0.98)},
    check=_check_demo,
    gradient_point=_demo_gradient_point,
    overlapped_share=_demo_overlapped_share,
    supports_cold_start=True,
    supports_normalize=True,
    supports_compression_groups=True,
  )
)
register(
  Method(
    name="distro_adamw",
    description="DisTrO-AdamW: the DeMo exchange, then AdamW on the aggregate",
    build=_build_distro_adamw,
    message_bytes=_demo_message,
    collective=ALL_GATHER,
    recipe=_DEFAULT_RECIPE,
    preset_recipes={"report-1.2b": _REPORT_RECIPE},
    options=_COMPRESSION_OPTIONS,
    supports_delayed_apply=True,
    excludes_nonfinite=True,
    check=_check_compression,
    gradient_point=_demo_gradient_point,
    overlapped_share=_demo_overlapped_share,
    supports_cold_start=True,
  )
)
register(
  Method(
    name="adamw",
    description="AdamW with a gradient all-reduce every step (the baseline)",
    build=_build_adamw,
    message_bytes=lambda cfg, params: _gradient_bytes(params),
    collective=ALL_REDUCE,
    recipe=_DEFAULT_RECIPE,
    preset_recipes={"report-1.2b": _REPORT_RECIPE},
    # 1.7898 at 7.5e-4; 1.8388, 1.8034, 1.8244 at 3.75e-4, 1.5e-3, 3e-3.
    long_recipes=_long_runs(_DEFAULT_RECIPE, 7.5e-4),
    supports_skip_nonfinite=True,
    dense=True,
  )
)
register(
  Method(
    name="diloco",
    description="DiLoCo: H local AdamW steps, then an fp32 all-reduce and an outer Nesterov step",
    build=_build_diloco,
    message_bytes=lambda cfg, params: _gradient_bytes_fp32(params) + DILOCO_COUNT_BYTES,
    collective=ALL_REDUCE,
    recipe=_DEFAULT_RECIPE,
    preset_recipes={"report-1.2b": _REPORT_RECIPE},
    options=(Option(r"h(\d+)", "diloco_sync_every", _int, "hH"),),
    exchange_every=lambda cfg: cfg.diloco_sync_every,
    supports_fsdp=False,
    tuning={"learning_rate": (1.5e-3, 3e-3), "diloco_outer_lr": (0.7, 1.0)},
    final_exchange=True,
    excludes_nonfinite=True,
    check=_check_diloco,
  )
)

register(
  Method(
    name="sparseloco",
    description="SparseLoCo: H local AdamW (or Muon) steps, then a top-k 2-bit (or drawn 1-bit) "
    "error-fed outer step, optionally orthogonalized",
    build=_build_sparseloco,
    message_bytes=_sparseloco_message,
    collective=ALL_GATHER,
    recipe=_DEFAULT_RECIPE,
    preset_recipes={"report-1.2b": _REPORT_RECIPE},
    # H 30: 2.2488 at 1.5e-3, 2.3011 at 3e-3, 2.3292 at 7.5e-4.
    long_recipes=_long_runs(_DEFAULT_RECIPE, 1.5e-3),
    options=(
      Option(r"h(\d+)", "sparseloco_sync_every", _int, "hH"),
      Option(r"k(\d+)", "sparseloco_topk", _int, "kK"),
      Option(r"c(\d+)", "sparseloco_chunk", _int, "cC"),
      Option(r"([012])bit", "sparseloco_value_bits", _int, "Nbit"),
      Option(r"noclip", "sparseloco_clip", lambda m: False, "noclip"),
      Option(r"dct", "sparseloco_dct", lambda m: True, "dct"),
      # DeMo's drawn message (with -dct in its basis, where -fbB's low
      # frequencies mean something), and the outer step's shape:
      # sparseloco-h2-k1-c8-1bit-dct-rand-fb1-orth.
      Option(r"rand", "sparseloco_random_positions", lambda m: True, "rand"),
      Option(r"fb(\d+(?:\.\d+)?)", "sparseloco_frequency_bias", _float, "fbB"),
      Option(r"(rms|orth)", "sparseloco_normalize", lambda m: m[1], "orth"),
      Option(r"(muon|sgd)", "sparseloco_inner", lambda m: m[1], "muon"),
    ),
    exchange_every=lambda cfg: cfg.sparseloco_sync_every,
    supports_fsdp=False,
    tuning={"learning_rate": (1.5e-3, 3e-3), "sparseloco_outer_lr": (0.7, 1.0)},
    excludes_nonfinite=True,
    check=_check_sparseloco,
    steps_with_muon=lambda cfg: cfg.sparseloco_inner == "muon",
  )
)

register(
  Method(
    name="muon",
    description="Muon (optax.contrib.muon) with a gradient all-reduce every step; "
    "embedding, head and norms on AdamW",
    build=_build_muon,
    message_bytes=lambda cfg, params: _gradient_bytes(params),
    collective=ALL_REDUCE,
    recipe=_MUON_RECIPE,
    preset_recipes={"report-1.2b": _REPORT_RECIPE},
    options=(Option(r"beta(0|0?\.\d+)", "muon_beta", _float, "beta0"),),
    supports_fsdp=False,
    supports_skip_nonfinite=True,
    tuning={"learning_rate": _MUON_RATES},
    steps_with_muon=lambda cfg: True,
    dense=True,
  )
)


def main() -> None:
  """``python -m experiments.methods``: every family and its options, one line each."""
  print(grammar())


if __name__ == "__main__":
  main()
