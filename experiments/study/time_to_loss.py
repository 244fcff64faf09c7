r"""Time to loss over a real path: measured loss curves on the time model's links.

  python -m experiments.time_to_loss --cache=runs/screen --horizon=900 --out_dir=runs/time_to_loss
  python -m experiments.time_to_loss --runs=muon:runs/muon,adamw:runs/adamw

Which optimizer trains fastest over a given link? A loss curve says how much
each step learns, the time model (:mod:`experiments.study.time_model`) what
a step costs over a link with a rate, a round trip and a loss rate. This puts
the two together: every recorded point of a method's curve is placed at the
wall-clock time its steps take on the link, and the table gives, per method
and link, the time to reach the target loss, which is the loss the reference
(dense Muon) reaches at the end of its run. A method that never reaches it
gets its loss at the moment the reference, on the same link, finishes (or,
where its own run ended sooner, its last loss and when that was).

Two settings, the same curves:

* ``small``: the runs' own model and workers, each method's compute per step
  measured in its run (``summary.json``'s ``step_seconds`` with
  ``--time_optimizer``, else the median step of its ``metrics.jsonl``, else
  ``--small_compute_s``, a value measured once and named as such);
* ``report-1.2b``: the DisTrO report's 1.2B model and 32 workers, its compute
  per step (``time_model.ReportSetting``) and each method's bytes at that
  size. The loss curves are still the small model's: the projection moves the
  time axis only.

What a step sends and the round trips it waits for come from the method
registry (its collective) and :func:`experiments.netlab.round_trips.count`,
which compiles one step of each method (seconds on CPU) and counts the
collectives that cross workers; for ``report-1.2b`` the same collectives are
resized to that model's message and priced at its worker count.

The inputs: ``--runs=METHOD:RUN_DIR,...`` (any finished run directories), or
``--cache=OUT_DIR`` of a ``frontier`` (or ``compare``-style) cache, whose best
rate of each method is taken at ``--horizon`` steps, or at the longest horizon
it has when it has none at that. Methods of ``--methods`` with no run are
listed as not run. It writes ``time_to_loss.md``, ``time_to_loss.json`` and
``time_to_loss.png`` (loss against wall-clock, a panel per setting and link)
to ``--out_dir``, and prints the table.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from absl import app, flags

from experiments.netlab import round_trips
from experiments.netlab.round_trips import StepCount
from experiments.run import cli
from experiments.run.config import ConfigError
from experiments.run.records import Summary, read_metrics
from experiments.study import frontier, time_model
from experiments.study.time_model import REPORT, Hop, Link, ReportSetting

# The command is experiments.time_to_loss; its flags belong to it, so --helpshort lists them.
flags.disclaim_key_flags()

__all__ = [
  "DEFAULT_METHODS",
  "LINKS",
  "SMALL_COMPUTE_S",
  "Cell",
  "Curve",
  "Pricing",
  "Row",
  "Run",
  "Setting",
  "analyse",
  "count_step",
  "first_reaching",
  "links_with_loss",
  "load_run",
  "loss_at_seconds",
  "main",
  "markdown",
  "parse_runs_flag",
  "pricing_of",
  "read_curve",
  "report_gradient_bytes",
  "report_pricing",
  "runs_from_cache",
  "small_compute",
  "write",
]

# The paths asked for in issue 69 (item 5): rate both ways, and the round trip
# (time_model.Link.rtt_s; a one-way delay is half of it), 1% of the packets
# lost end to end (--loss changes it for all four).
LINKS = (
  Link("1 Gbit/s, 1 ms", 1e9, 1e9, rtt_s=0.001, loss=0.01),
  Link("100 Mbit/s, 20 ms", 100e6, 100e6, rtt_s=0.020, loss=0.01),
  Link("10 Mbit/s, 100 ms", 10e6, 10e6, rtt_s=0.100, loss=0.01),
  Link("1 Mbit/s, 100 ms", 1e6, 1e6, rtt_s=0.100, loss=0.01),
)
# The methods README.md's first table recommends (the best dense optimizer,
# the baseline, the 1,015x message), and the two local-step families; every
# one is in the registry's default comparison (methods.DEFAULT_COMPARISON).
DEFAULT_METHODS = ("muon", "adamw", "demo-k1-c8-1bit-rand-fb1-orth", "diloco", "sparseloco")
# Used only for a run whose step was not timed: the median step of dense Muon's
# 900-step run on `small` (8 simulated workers in one process on this
# project's 2-core CPU machine; /work/runs_66/screen, 0.591 s).
SMALL_COMPUTE_S = 0.59

StepCounter = Callable[[str, int, str], StepCount]


@dataclasses.dataclass(frozen=True)
class Curve:
  """A run's loss against its step, at the steps it was recorded.

  Attributes:
    steps: the steps, increasing.
    losses: the loss at each.
    kind: ``"val"`` (validation, every ``eval_every`` steps) or ``"train"``
      (the training loss's trailing mean over 10 steps, every step).
  """

  steps: tuple[float, ...]
  losses: tuple[float, ...]
  kind: str = "val"

  @property
  def final(self) -> float:
    """The last recorded loss."""
    return self.losses[-1]


def read_curve(run_dir: str, kind: str = "val", window: int = 10) -> Curve:
  """The loss curve a run recorded in its ``metrics.jsonl``, up to its first non-finite loss.

  Args:
    run_dir: a run directory.
    kind: ``"val"`` for the validation losses, ``"train"`` for the training
      loss's trailing mean over ``window`` steps.
    window: the trailing mean's length.

  Raises:
    ConfigError: an unknown kind, or a run with no finite loss of that kind.
  """
  records = read_metrics(run_dir)
  if kind == "val":
    points = [(r.step, r.val_loss) for r in records if r.val_loss is not None]
  elif kind == "train":
    losses = np.array([r.loss for r in records], dtype=float)
    means = [float(np.mean(losses[max(0, i + 1 - window) : i + 1])) for i in range(len(losses))]
    points = [(r.step, m) for r, m in zip(records, means)]
  else:
    raise ConfigError(f"--curve={kind}: use val or train.")
  kept = []
  for step, loss in points:
    if not math.isfinite(loss):
      break
    kept.append((float(step), float(loss)))
  if not kept:
    raise ConfigError(f"{run_dir}: no finite {kind} loss in its metrics.jsonl.")
  steps, losses = zip(*kept)
  return Curve(steps, losses, kind)


def first_reaching(curve: Curve, target: float) -> float | None:
  """The first step at which the curve reaches ``target``, linear between recorded points.

  Example:
    >>> first_reaching(Curve((10, 20, 30), (3.0, 2.0, 1.0)), 1.5)
    25.0
    >>> first_reaching(Curve((10, 20), (3.0, 2.0)), 1.5) is None
    True
  """
  previous = None
  for step, loss in zip(curve.steps, curve.losses):
    if loss <= target:
      if previous is None:
        return step
      s0, l0 = previous
      return s0 + (l0 - target) / (l0 - loss) * (step - s0)
    previous = (step, loss)
  return None


@dataclasses.dataclass(frozen=True)
class Pricing:
  """What a method's steps cost on a link, as the time model prices them.

  Attributes:
    compute_s: a step's compute.
    compute_source: where ``compute_s`` comes from.
    collective: ``"all-gather"`` or ``"all-reduce"`` (the registry's), or
      ``"all-to-all"`` for an ``-a2a`` message.
    message_bytes: one worker's message (or gradient) at an exchange.
    workers: W.
    every: steps per exchange (1 but for the local-step methods).
    overlapped_share: the share of the message sent under the next compute.
    hops: the dependent hops every step waits for (the count's, on the path).
    hidden_hops: the overlapped exchange's hops, beside the compute.
    exchange_hops: the hops of a collective that runs once every ``every`` steps.
  """

  compute_s: float
  compute_source: str
  collective: str
  message_bytes: float
  workers: int
  every: int = 1
  overlapped_share: float = 0.0
  hops: tuple[Hop, ...] = ()
  hidden_hops: tuple[Hop, ...] = ()
  exchange_hops: tuple[Hop, ...] = ()

  @property
  def bytes_per_step(self) -> float:
    """The message spread over the steps between exchanges."""
    return self.message_bytes / self.every

  @property
  def round_trips(self) -> float:
    """Round trips on the path per step, an exchange's spread over its steps."""
    return time_model.round_trips(self.hops) + time_model.round_trips(self.exchange_hops) / max(
      self.every, 1
    )

  def step_seconds(self, link: Link) -> tuple[float, float]:
    """``(a step that does not exchange, a step that does)`` on ``link``, in seconds."""
    # An all-to-all's operand carries the message once per worker.
    copies = self.workers if self.collective == "all-to-all" else 1
    up, down = time_model.link_bytes(self.collective, self.message_bytes * copies, self.workers)
    exchanging = time_model.step_seconds(
      self.compute_s,
      up,
      down,
      link,
      self.overlapped_share,
      hops=self.hops + self.exchange_hops,
      hidden_hops=self.hidden_hops,
    )
    if self.every == 1:
      return exchanging, exchanging
    plain = time_model.step_seconds(
      self.compute_s, 0.0, 0.0, link, hops=self.hops, hidden_hops=self.hidden_hops
    )
    return plain, exchanging

  def mean_step_seconds(self, link: Link) -> float:
    """A step's time on ``link``, an exchange's spread over its steps."""
    plain, exchanging = self.step_seconds(link)
    return plain + (exchanging - plain) / self.every

  def seconds_at(self, step: float, link: Link) -> float:
    """Wall-clock from the start to the end of ``step`` (fractional within a step) on ``link``."""
    plain, exchanging = self.step_seconds(link)
    return step * plain + math.floor(step / self.every) * (exchanging - plain)


def loss_at_seconds(curve: Curve, pricing: Pricing, link: Link, seconds: float) -> float | None:
  """The curve's loss ``seconds`` into the run on ``link``, linear between recorded points.

  ``None`` outside the recorded span: before the first point or past the run's end.
  """
  times = [pricing.seconds_at(s, link) for s in curve.steps]
  if not times[0] <= seconds <= times[-1]:
    return None
  return float(np.interp(seconds, times, curve.losses))


def _exchange_collectives(count: StepCount) -> list[round_trips.Collective]:
  return [c for c in count.collectives if c.program != "host"]


def pricing_of(
  count: StepCount,
  *,
  compute_s: float,
  compute_source: str,
  collective: str,
  message_bytes: float,
  every: int = 1,
  overlapped_share: float = 0.0,
) -> Pricing:
  """A method's pricing from its step's count (:class:`round_trips.StepCount`).

  Args:
    count: the collectives one step runs across workers, and W.
    compute_s: a step's compute.
    compute_source: where it comes from, for the table's notes.
    collective: the registry's collective for the method.
    message_bytes: what a worker puts in at an exchange.
    every: steps per exchange.
    overlapped_share: as in :func:`time_model.step_seconds`.
  """
  periodic = tuple(
    hop
    for c in count.collectives
    if c.every > 1 and not c.hidden
    for hop in round_trips.hops_of(c, count.workers)
  )
  return Pricing(
    compute_s,
    compute_source,
    collective,
    message_bytes,
    count.workers,
    every,
    overlapped_share,
    tuple(count.hops()),
    tuple(count.hops(hidden=True)),
    periodic,
  )


def _carried(c: round_trips.Collective, workers: int) -> float:
  """The message bytes a collective carries: an all-to-all's operand holds W copies."""
  return c.operands * c.operand_bytes / (workers if c.kind == "all-to-all" else 1)


def _resized(count: StepCount, message_bytes: float, workers: int) -> StepCount:
  """The same step's collectives scaled so that the exchange moves ``message_bytes``, at W."""
  total = sum(_carried(c, count.workers) for c in _exchange_collectives(count))
  scale = message_bytes / total if total else 1.0

  def resized(c: round_trips.Collective) -> round_trips.Collective:
    if c.program == "host":
      return c
    if c.kind == "all-to-all":
      whole = round(_carried(c, count.workers) * scale * workers)
      return dataclasses.replace(c, operands=1, operand_bytes=whole)
    return dataclasses.replace(c, operand_bytes=round(c.operand_bytes * scale))

  scaled = tuple(resized(c) for c in count.collectives)
  return dataclasses.replace(count, workers=workers, collectives=scaled)


def _collective(name: str, count: StepCount) -> str:
  """The registry's collective for ``name``, or ``"all-to-all"`` where its step sends one."""
  if any(c.kind == "all-to-all" for c in _exchange_collectives(count)):
    return "all-to-all"
  return time_model.collective_of(name.split("-", 1)[0])


def report_pricing(spec: str, count: StepCount, setting: ReportSetting = REPORT) -> Pricing:
  """A method's pricing in the DisTrO report's setting: its model, W and compute per step.

  The message is this library's byte accounting on ``setting.preset`` with
  bf16 params (shapes only), as :func:`time_model.report_setting` counts it;
  the collectives are ``count``'s (compiled on the runs' model), resized to
  that message and priced at ``setting.workers``.
  """
  import jax

  from experiments.run import checks, config, methods, presets
  from experiments.run import model as model_lib

  params = model_lib.abstract_params(presets.get_preset(setting.preset))
  bf16 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, "bfloat16"), params)
  method, overrides = methods.parse(spec)
  cfg = checks.resolve(
    config.TrainConfig(
      preset=setting.preset, workers=setting.workers, batch_size=setting.workers, **overrides
    )
  )
  payload = method.payload(cfg, bf16)
  return pricing_of(
    _resized(count, payload.message, setting.workers),
    compute_s=setting.compute_seconds,
    compute_source=f"the report's AdamW step ({setting.adamw_hours:g} h / {setting.steps:,} steps)",
    collective=_collective(spec, count),
    message_bytes=payload.message,
    every=method.exchange_every(cfg),
    overlapped_share=method.overlapped_share(cfg, bf16),
  )


def report_gradient_bytes(setting: ReportSetting = REPORT) -> int:
  """A bf16 gradient's bytes on the report's model (the DisTrO report's ratio's numerator)."""
  import distro_jax as dj
  from experiments.run import model as model_lib
  from experiments.run import presets

  params = model_lib.abstract_params(presets.get_preset(setting.preset))
  return dj.wire_bytes(params).grad_bf16


@dataclasses.dataclass(frozen=True)
class Run:
  """One method's finished run: where it is, what it recorded.

  Attributes:
    method: the method's name with its options, as the table shows it.
    run_dir: its directory.
    summary: its ``summary.json``.
    curve: its loss curve.
    settings: the tuned settings it was picked at (from a cache; else empty).
  """

  method: str
  run_dir: str
  summary: Summary
  curve: Curve
  settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def steps(self) -> int:
    """The steps it trained."""
    return int(self.summary.steps)


def load_run(
  method: str, run_dir: str, kind: str = "val", settings: Mapping[str, Any] | None = None
) -> Run:
  """Reads a finished run's summary and loss curve.

  Raises:
    ConfigError: no ``summary.json`` in ``run_dir``, or no loss curve.
  """
  if not os.path.exists(os.path.join(run_dir, "summary.json")):
    raise ConfigError(
      f"{method}:{run_dir}: no summary.json there; give a finished run's directory."
    )
  summary = Summary.load(run_dir)
  return Run(method, run_dir, summary, read_curve(run_dir, kind), dict(settings or {}))


def parse_runs_flag(values: Sequence[str], kind: str = "val") -> dict[str, Run]:
  """``--runs``' ``METHOD:RUN_DIR`` entries as runs.

  Raises:
    ConfigError: an entry without a method or a directory, or one that is no finished run.
  """
  runs = {}
  for value in values:
    method, sep, run_dir = value.partition(":")
    if not sep or not method or not run_dir:
      raise ConfigError(f"--runs={value}: give METHOD:RUN_DIR, e.g. muon:runs/muon.")
    runs[method] = load_run(method, run_dir, kind)
  return runs


def runs_from_cache(
  cache: str, names: Sequence[str], horizon: int, kind: str = "val"
) -> dict[str, Run | None]:
  """Each method's best run in a frontier cache (as :func:`frontier.best_points` picks it).

  Args:
    cache: a frontier ``--out_dir`` (``steps<N>/<method>/<settings>/``).
    names: the methods wanted.
    horizon: the steps wanted; a method with no run of that length gets its
      best run at the longest horizon it has.
    kind: the curve, as in :func:`read_curve`.

  Returns:
    ``{method: run}``, ``None`` for a method with no finished run.
  """
  points = [p for p in frontier.read_runs(cache) if p.method in names]
  best = frontier.best_points(points)
  out: dict[str, Run | None] = {}
  for name in names:
    horizons = sorted(h for m, h in best if m == name)
    if not horizons:
      out[name] = None
      continue
    p = best[(name, horizon if horizon in horizons else horizons[-1])]
    out[name] = load_run(name, p.out_dir, kind, p.tuned)
  return out


def small_compute(run: Run, fallback_s: float = SMALL_COMPUTE_S) -> tuple[float, str]:
  """A run's compute per step and where it comes from.

  In order: ``summary.json``'s ``step_seconds`` (``--time_optimizer``), the
  median step of its ``metrics.jsonl`` (:func:`frontier.step_seconds`), else
  ``fallback_s``.
  """
  if run.summary.step_seconds:
    return float(run.summary.step_seconds), "measured: the run's --time_optimizer median"
  if (seconds := frontier.step_seconds(run.run_dir)) is not None:
    return seconds, "measured: the run's median step (metrics.jsonl)"
  return fallback_s, "not measured in the run: --small_compute_s"


def count_step(method: str, workers: int, preset: str) -> StepCount:
  """:func:`round_trips.count` (compiles one step; needs ``workers`` devices in the process)."""
  return round_trips.count(method, workers, preset=preset)


@dataclasses.dataclass(frozen=True)
class Cell:
  """One method on one link.

  Attributes:
    reached_s: wall-clock to the target, ``None`` if its curve never reaches it.
    finish_s: when the reference finishes on this link.
    loss_at_finish: the method's loss at ``finish_s`` (``None`` outside its curve).
    end_s: when its own run ends on this link.
    end_loss: its last recorded loss.
    end_step: its last recorded step.
  """

  reached_s: float | None
  finish_s: float
  loss_at_finish: float | None
  end_s: float
  end_loss: float
  end_step: float

  def text(self, reference: str) -> str:
    """The table's cell: a time, or what the method had when the reference finished."""
    if self.reached_s is not None:
      return _duration(self.reached_s)
    if self.loss_at_finish is not None:
      return f"never: loss {self.loss_at_finish:.4f} at {reference}'s finish"
    if self.end_s < self.finish_s:
      return (
        f"never in {self.end_step:.0f} steps: {self.end_loss:.4f} at "
        f"{_duration(self.end_s)} ({reference}: {_duration(self.finish_s)})"
      )
    return f"never: no loss recorded by {reference}'s finish ({_duration(self.finish_s)})"


def _cell(curve: Curve, pricing: Pricing, link: Link, target: float, finish_s: float) -> Cell:
  step = first_reaching(curve, target)
  return Cell(
    None if step is None else pricing.seconds_at(step, link),
    finish_s,
    loss_at_seconds(curve, pricing, link, finish_s),
    pricing.seconds_at(curve.steps[-1], link),
    curve.final,
    curve.steps[-1],
  )


@dataclasses.dataclass(frozen=True)
class Row:
  """A method in one setting: its bytes and, if it ran, its pricing and a cell per link.

  Attributes:
    method: its name.
    run: its run, ``None`` if not run.
    pricing: its step's price in this setting (``None`` if not run).
    ratio_vs_bf16_grad: a bf16 gradient's bytes over its bytes per step.
    cells: one per link (empty if not run).
  """

  method: str
  run: Run | None
  pricing: Pricing | None = None
  ratio_vs_bf16_grad: float | None = None
  cells: tuple[Cell, ...] = ()


@dataclasses.dataclass(frozen=True)
class Setting:
  """One table: a model and its workers, their compute, and every method on every link.

  Attributes:
    name: ``"small"`` (or the runs' preset) or ``"report-1.2b"``.
    about: one line on what it is.
    reference: the method whose final loss is the target.
    target: that loss.
    links: the links, in the columns' order.
    rows: one per method.
  """

  name: str
  about: str
  reference: str
  target: float
  links: tuple[Link, ...]
  rows: tuple[Row, ...]


def _rows(
  runs: Mapping[str, Run | None],
  prices: Mapping[str, Pricing],
  ratios: Mapping[str, float],
  reference: str,
  links: Sequence[Link],
) -> tuple[Row, ...]:
  ref = runs[reference]
  target = ref.curve.final
  finish = {link.name: prices[reference].seconds_at(ref.curve.steps[-1], link) for link in links}
  rows = []
  for name, run in runs.items():
    if run is None:
      rows.append(Row(name, None))
      continue
    cells = tuple(_cell(run.curve, prices[name], link, target, finish[link.name]) for link in links)
    rows.append(Row(name, run, prices[name], ratios[name], cells))
  return tuple(rows)


def analyse(
  runs: Mapping[str, Run | None],
  *,
  reference: str = "muon",
  links: Sequence[Link] = LINKS,
  report: ReportSetting | None = REPORT,
  count: StepCounter = count_step,
  small_compute_s: float = SMALL_COMPUTE_S,
) -> list[Setting]:
  """Time to the reference's final loss, per method and link, in the runs' setting and the report's.

  Args:
    runs: ``{method: run}``, ``None`` for a method not run (listed as such).
    reference: the method whose run's final loss is the target (dense Muon).
    links: the links.
    report: the report's setting to project onto (``None``: the runs' only).
    count: ``(method, workers, preset) -> StepCount``; compiles by default.
    small_compute_s: the compute of a run whose step was not timed.

  Returns:
    The runs' setting, then the report's.

  Raises:
    ConfigError: no run of the reference.
  """
  if runs.get(reference) is None:
    raise ConfigError(
      f"no run of {reference}, the reference: the target is its final loss. Add it to --runs "
      "or --methods (or name another with --reference)."
    )
  ran = {name: run for name, run in runs.items() if run is not None}
  counts = {n: count(n, r.summary.workers, r.summary.preset) for n, r in ran.items()}
  small, ratios = {}, {}
  for name, run in ran.items():
    compute, source = small_compute(run, small_compute_s)
    every = _every(run)
    small[name] = pricing_of(
      counts[name],
      compute_s=compute,
      compute_source=source,
      collective=_collective(name, counts[name]),
      message_bytes=run.summary.payload_bytes_per_step * every,
      every=every,
      overlapped_share=_overlapped_share(run),
    )
    ratios[name] = run.summary.ratio_vs_bf16_grad
  ref = runs[reference]
  about = (
    f"{ref.summary.num_params / 1e6:.2f}M parameters, {ref.summary.workers} workers, each "
    "method's compute per step measured in its run"
  )
  out = [
    Setting(
      ref.summary.preset,
      about,
      reference,
      ref.curve.final,
      tuple(links),
      _rows(runs, small, ratios, reference, links),
    )
  ]
  if report is not None:
    projected = {n: report_pricing(n, counts[n], report) for n in ran}
    grad = report_gradient_bytes(report)
    report_ratios = {n: grad / p.bytes_per_step for n, p in projected.items()}
    about = (
      f"{report.workers} workers, {report.compute_seconds:.2f} s compute per step (the "
      f"report's), bf16 messages; the loss curves are the {ref.summary.preset} runs' (the time "
      "axis alone is projected)"
    )
    rows = _rows(runs, projected, report_ratios, reference, links)
    out.append(Setting(report.preset, about, reference, ref.curve.final, tuple(links), rows))
  return out


def _run_config(run: Run) -> Any:
  from experiments.run.config import TrainConfig

  known = {f.name for f in dataclasses.fields(TrainConfig)}
  return TrainConfig(**{k: v for k, v in (run.summary.config or {}).items() if k in known})


def _every(run: Run) -> int:
  from experiments.run import methods

  return methods.get(run.summary.optimizer).exchange_every(_run_config(run))


def _overlapped_share(run: Run) -> float:
  from experiments.run import methods

  return methods.overlapped_share(_run_config(run))


def links_with_loss(loss: float, links: Sequence[Link] = LINKS) -> tuple[Link, ...]:
  """``links`` with another end-to-end loss rate."""
  return tuple(dataclasses.replace(link, loss=loss) for link in links)


def _lossless(link: Link) -> Link:
  return dataclasses.replace(link, loss=0.0)


def _duration(seconds: float) -> str:
  if seconds < 60:
    return f"{seconds:.1f} s"
  if seconds < 3600:
    return f"{seconds / 60:.1f} min"
  if seconds < 48 * 3600:
    return f"{seconds / 3600:.1f} h"
  if seconds < 365 * 86400:
    return f"{seconds / 86400:.1f} days"
  return f"{seconds / (365 * 86400):.1f} years"


def _bytes_cell(row: Row) -> str:
  if row.pricing is None:
    return ""
  ratio = (
    "" if row.ratio_vs_bf16_grad is None else f" ({frontier.ratio_text(row.ratio_vs_bf16_grad)})"
  )
  return f"{row.pricing.bytes_per_step:,.0f}{ratio}"


def _setting_markdown(s: Setting) -> list[str]:
  ref = next(r for r in s.rows if r.method == s.reference)
  picked = ", ".join(
    f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in ref.run.settings.items()
  )
  lines = [
    f"### {s.name}: {s.about}",
    "",
    f"Target: {ref.run.curve.kind} loss {s.target:.4f}, `{s.reference}`'s at step "
    f"{ref.run.curve.steps[-1]:.0f}{f' ({picked})' if picked else ''}. Each link: its rate both "
    f"ways, its round trip (one-way delay: half), {s.links[0].loss:.0%} of packets lost end "
    "to end.",
    "",
    "| method | steps run | bytes / step (vs bf16 gradient) | "
    + " | ".join(link.name for link in s.links)
    + " |",
    "| --- | ---: | ---: |" + " --- |" * len(s.links),
  ]
  for r in s.rows:
    if r.run is None:
      lines.append(f"| `{r.method}` | not run | |" + " not run |" * len(s.links))
      continue
    cells = " | ".join(c.text(s.reference) for c in r.cells)
    lines.append(f"| `{r.method}` | {r.run.steps} | {_bytes_cell(r)} | {cells} |")
  lines += [
    "",
    "Seconds per step (the time model: compute, then the transfer, then the round trips' "
    "latency, a hop that loses a segment waiting a round trip, or a timeout when fewer than "
    "three segments follow it; in brackets, the same link without loss):",
    "",
    "| method | collective | round trips / step on the path | compute / step | "
    + " | ".join(link.name for link in s.links)
    + " |",
    "| --- | --- | ---: | ---: |" + " ---: |" * len(s.links),
  ]
  for r in s.rows:
    if r.pricing is None:
      continue
    p = r.pricing
    trips = f"{p.round_trips:g}" + (
      f" (+{time_model.round_trips(p.hidden_hops):g} beside compute)" if p.hidden_hops else ""
    )
    every = f", every {p.every} steps" if p.every > 1 else ""
    steps = " | ".join(
      f"{p.mean_step_seconds(link):.3f} s ({p.mean_step_seconds(_lossless(link)):.3f})"
      for link in s.links
    )
    lines.append(
      f"| `{r.method}` | {p.collective}{every}, W={p.workers} | {trips} | {p.compute_s:.3f} s | "
      f"{steps} |"
    )
  sources = sorted({(r.method, r.pricing.compute_source) for r in s.rows if r.pricing})
  lines += ["", "Compute per step: " + "; ".join(f"`{m}`: {src}" for m, src in sources) + "."]
  return lines


_NOTES = """\
Notes:

- Round trips per step are counted from each method's compiled step
  (`experiments.netlab.round_trips.count`, with stacked layers, on the runs'
  model and worker count); the collective is the registry's. In `{report}`
  the same collectives carry that model's message and are priced at its
  worker count; nothing was compiled or run at that size.
- What is not measured: the steps' times over these links (the time model's
  prediction; its far-link cells are within 20% of netlab's measurements
  at 100 ms; a segment lost among a sender's last three costs a timeout with
  Linux's 200 ms floor, which a tail-loss probe often beats on short paths,
  so the all-reduces' times on the 1 ms and 20 ms links are upper bounds);
  `{report}`'s loss curves (the small
  model's); the compute of Muon's and DeMo's updates at 1.2B (the report's
  AdamW step for every method).
- The runs' compute per step is their step on this project's 2-core CPU
  machine, all simulated workers in one process, shared with other jobs: a
  real worker's step would be shorter, which favours the methods that send
  less."""


def markdown(settings: Sequence[Setting]) -> str:
  """The tables of :func:`analyse`: per setting, time to target and seconds per step, then notes."""
  lines = []
  for s in settings:
    lines += _setting_markdown(s) + [""]
  report = settings[-1].name if len(settings) > 1 else "report-1.2b"
  return "\n".join(lines) + "\n" + _NOTES.format(report=report) + "\n"


def _record(settings: Sequence[Setting]) -> list[dict[str, Any]]:
  out = []
  for s in settings:
    rows = []
    for r in s.rows:
      row: dict[str, Any] = {"method": r.method, "run": None}
      if r.run is not None:
        p = r.pricing
        row.update(
          run=r.run.run_dir,
          steps=r.run.steps,
          settings=dict(r.run.settings),
          bytes_per_step=p.bytes_per_step,
          ratio_vs_bf16_grad=r.ratio_vs_bf16_grad,
          collective=p.collective,
          workers=p.workers,
          every=p.every,
          round_trips_per_step=p.round_trips,
          compute_s=p.compute_s,
          compute_source=p.compute_source,
          links={
            link.name: {"step_seconds": p.mean_step_seconds(link), **dataclasses.asdict(c)}
            for link, c in zip(s.links, r.cells)
          },
        )
      rows.append(row)
    links = [dataclasses.asdict(link) for link in s.links]
    out.append(
      {"setting": s.name, "about": s.about, "reference": s.reference, "target": s.target}
      | {"links": links, "rows": rows}
    )
  return out


def _plot(settings: Sequence[Setting], path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  n = len(settings[0].links)
  kind = next(r.run.curve.kind for r in settings[0].rows if r.run is not None)
  fig, axes = plt.subplots(len(settings), n, figsize=(4 * n, 3.4 * len(settings)), squeeze=False)
  for ax_row, s in zip(axes, settings):
    for ax, link in zip(ax_row, s.links):
      for i, r in enumerate(x for x in s.rows if x.run is not None):
        xs = [r.pricing.seconds_at(step, link) for step in r.run.curve.steps]
        ax.plot(xs, r.run.curve.losses, "o-", ms=2, color=f"C{i}", label=r.method)
      ax.axhline(s.target, color="k", ls="--", lw=0.8, label=f"target ({s.reference})")
      ax.set(xscale="log", title=f"{s.name}: {link.name}", xlabel="wall-clock (s, time model)")
      ax.set_ylabel(f"{kind} loss")
      ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def write(settings: Sequence[Setting], out_dir: str) -> str:
  """Writes ``time_to_loss.md``, ``.json`` and ``.png`` to ``out_dir``; returns the markdown."""
  os.makedirs(out_dir, exist_ok=True)
  text = markdown(settings)
  with open(os.path.join(out_dir, "time_to_loss.md"), "w") as f:
    f.write(text)
  with open(os.path.join(out_dir, "time_to_loss.json"), "w") as f:
    json.dump(_record(settings), f, indent=2)
  _plot(settings, os.path.join(out_dir, "time_to_loss.png"))
  return text


def _main(own: Mapping[str, flags.FlagHolder], argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")

  def run() -> str:
    kind = own["curve"].value
    if own["runs"].value and own["cache"].value:
      raise ConfigError("give --runs or --cache, not both.")
    if own["runs"].value:
      runs: dict[str, Run | None] = dict(parse_runs_flag(own["runs"].value, kind))
      if own["methods"].present:
        runs |= {m: None for m in own["methods"].value if m not in runs}
    elif own["cache"].value:
      names = list(dict.fromkeys([own["reference"].value, *own["methods"].value]))
      runs = runs_from_cache(own["cache"].value, names, own["horizon"].value, kind)
    else:
      raise ConfigError("give --runs=METHOD:RUN_DIR,... or --cache=FRONTIER_OUT_DIR.")
    import jax

    # One CPU device per worker for round_trips.count, before anything starts a backend.
    workers = max(r.summary.workers for r in runs.values() if r is not None)
    jax.config.update("jax_num_cpu_devices", workers)
    settings = analyse(
      runs,
      reference=own["reference"].value,
      links=links_with_loss(own["loss"].value),
      small_compute_s=own["small_compute_s"].value,
    )
    return write(settings, own["out_dir"].value)

  print(cli.report_user_errors(run))


def main(argv: Sequence[str] | None = None) -> None:
  """The command: ``--runs`` or ``--cache``, and the tables' settings."""
  own = {
    "runs": flags.DEFINE_list("runs", [], "METHOD:RUN_DIR,... finished runs to compare."),
    "cache": flags.DEFINE_string(
      "cache", "", "A frontier --out_dir: each method's best rate at --horizon steps."
    ),
    "horizon": flags.DEFINE_integer(
      "horizon", 900, "With --cache: the steps wanted (else a method's longest horizon)."
    ),
    "methods": flags.DEFINE_list(
      "methods", list(DEFAULT_METHODS), "Methods to show; one with no run is listed as not run."
    ),
    "reference": flags.DEFINE_string(
      "reference", "muon", "The method whose final loss is the target."
    ),
    "curve": flags.DEFINE_enum(
      "curve", "val", ["val", "train"], "val: validation loss; train: 10-step mean train loss."
    ),
    "loss": flags.DEFINE_float("loss", 0.01, "Packets lost end to end on every link, in [0, 1)."),
    "small_compute_s": flags.DEFINE_float(
      "small_compute_s",
      SMALL_COMPUTE_S,
      "Compute per step for a run whose step was not timed (default: measured, dense Muon's "
      "900-step run on small, 8 simulated workers, this project's 2-core machine).",
    ),
    "out_dir": flags.DEFINE_string("out_dir", "runs/time_to_loss", "Where the tables go."),
  }
  app.run(functools.partial(_main, own), argv=argv)


if __name__ == "__main__":
  main()
