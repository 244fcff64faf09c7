r"""The bandwidth floor: how low a link's rate can go, at a fixed distance, before a step slows.

  sudo python -m experiments.netlab.floor --rate_mbit=10,3,1,0.3,0.1 --delay_ms=25 \
      --loss_pct=0.5 --preset=mini --steps=20 --processes=4 --out_dir=runs/netlab-floor \
      --methods=adamw,muon,diloco,sparseloco,demo,demo-k1-c8-1bit-rand-fb1-orth,demo-k1-c8-1bit-rand-fb1-orth-delayed

Each method runs once on clean links (no shaping, no delay: its compute),
then once per rate with the delay and the loss (25 ms one way per link is a
100 ms round trip; 0.5% per link is 1% end to end). A cell is one run of one
method on one link setting, through :func:`experiments.netlab.lab.run_once`
in a lab of :mod:`experiments.netlab.links`; each is stopped at
``--cell_time_limit_s`` and reported then as not finished, with the time
model's step beside it (:mod:`experiments.study.time_model`, priced as
:mod:`experiments.study.time_to_loss` prices a method, with the step's hops
counted by :func:`experiments.netlab.round_trips.count`).

A method's forms are the method and its ``-delayed`` variants when both are
listed (the message's plain and overlapped exchange); its best clean step is
the fastest clean step among its forms. Each cell's ratio is its median step
over that, and the method's floor is the lowest rate at which the ratio is
within :data:`TOLERANCE` there and at every higher rate of the sweep.

Every cell is written to ``OUT_DIR/cells/<method>/<rate or clean>.json`` as
soon as it ends; a rerun reads the finished ones back and runs the rest (a
cell run with other settings, one that failed, and one stopped at a shorter
limit than the current one are run again). ``floor.md``, ``floor.json`` and
``floor.png`` go to ``OUT_DIR``. Flags it does not define go to every
``experiments.train`` driver, as netlab's do.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from absl import app, flags

from experiments.netlab import faults, lab, links, report, round_trips
from experiments.netlab.impair import Impairment
from experiments.netlab.links import NetlabError
from experiments.netlab.results import RunResult
from experiments.netlab.round_trips import StepCount
from experiments.run import cli, presets, records
from experiments.study import time_to_loss
from experiments.study.time_model import Link

__all__ = [
  "CLEAN",
  "TOLERANCE",
  "Cell",
  "Entry",
  "FloorConfig",
  "FloorReport",
  "Plan",
  "Row",
  "best_clean_steps",
  "build_report",
  "cell_path",
  "cell_settings",
  "floor_of",
  "forms_of",
  "main",
  "markdown",
  "model_step_s",
  "netlab_link",
  "parse_rates",
  "plan_cells",
  "plot",
  "rate_key",
  "read_cell",
  "read_cells",
  "run",
  "settings_line",
  "write_cell",
  "write_report",
]

# Issue 69's target: a step on the far link within 10% of the best clean one.
TOLERANCE = 1.10
# The cache's name for a method's unshaped cell.
CLEAN = "clean"
_PORT = 12355  # the lab's namespaces are fresh, so a fixed port cannot clash

StepCounter = Callable[[str, int, str], StepCount]


def _field(default: Any, help: str) -> Any:  # noqa: A002 - absl's word
  return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class FloorConfig:
  """What one floor sweep does; each field is a flag of ``python -m experiments.netlab.floor``."""

  rate_mbit: str = _field(
    "10,3,1,0.3,0.1", "Comma-separated link rates in Mbit/s to sweep, every link at each."
  )
  delay_ms: float = _field(
    25.0, "One-way delay each link adds (a packet crosses two: 25 is a 100 ms round trip)."
  )
  loss_pct: float = _field(
    0.5, "Percent of packets each link drops (a packet crosses two: 0.5 is 1% end to end)."
  )
  methods: str = _field(
    "adamw,muon,diloco,sparseloco,demo,demo-k1-c8-1bit-rand-fb1-orth,"
    "demo-k1-c8-1bit-rand-fb1-orth-delayed",
    "Comma-separated methods, registry names with options; a method and its -delayed "
    "variant, both listed, are one method's two forms.",
  )
  preset: str = _field("mini", "Model preset (experiments/run/presets.py).")
  steps: int = _field(20, "Training steps per cell.")
  processes: int = _field(4, "Training processes, one namespace each.")
  out_dir: str = _field("runs/netlab-floor", "Where the cells, the runs and the report go.")
  cell_time_limit_s: float = _field(
    300.0,
    "A cell still running after this many seconds is stopped and reported as not finished, "
    "with the time model's step beside it.",
  )
  skip_steps: int = _field(3, "Warm-up steps left out of the step-time medians.")
  latency_ms: float = _field(
    100.0, "tbf latency: the longest a packet may queue on a link before it is dropped."
  )


@dataclasses.dataclass(frozen=True)
class Cell:
  """One run of one method on one link setting, as the cache holds it.

  Attributes:
    method: the method as ``--methods`` names it.
    rate_mbit: the link rate, or None for the clean cell (no shaping, no delay).
    finished: every step ran within the time limit and the run wrote its summary.
    steps_done: the last step process 0 logged.
    elapsed_s: seconds from the drivers' start to their end.
    median_step_s: the median step after the warm-up (validation steps left
      out), also of a cell that did not finish; None when no step was left.
    time_limit_s: the limit the cell ran under.
    settings: what it was run with; a cell read back must match the sweep's.
    optimizer: the method's family, from the run's summary.
    payload_bytes_per_step: what a worker put into the collective per step.
    config: the run's resolved ``TrainConfig`` (a clean cell's prices the model).
    model_step_s: the time model's step on this cell's link (for a cell that
      did not finish), from the method's clean cell.
    error: why the run failed (a driver's failure or interruption), if it did.
    run_dir: where the run's files are.
  """

  method: str
  rate_mbit: float | None
  finished: bool
  steps_done: int
  elapsed_s: float
  median_step_s: float | None
  time_limit_s: float
  settings: dict[str, Any]
  optimizer: str | None = None
  payload_bytes_per_step: float | None = None
  config: dict[str, Any] | None = None
  model_step_s: float | None = None
  error: str | None = None
  run_dir: str | None = None

  def to_json(self) -> dict[str, Any]:
    """The cache file's object."""
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, obj: Mapping[str, Any]) -> Cell:
    """Reads :meth:`to_json`'s object."""
    return cls(**obj)


def rate_key(rate_mbit: float | None) -> str:
  """A cell's name in the cache: ``"clean"``, or the rate as ``"%g"`` (``"0.3"``)."""
  return CLEAN if rate_mbit is None else f"{rate_mbit:g}"


def cell_path(out_dir: str, method: str, rate_mbit: float | None) -> str:
  """``OUT_DIR/cells/<method>/<rate or clean>.json``."""
  return os.path.join(out_dir, "cells", method, f"{rate_key(rate_mbit)}.json")


def write_cell(out_dir: str, cell: Cell) -> str:
  """Writes ``cell`` to its cache file, whole or not at all; returns the path."""
  path = cell_path(out_dir, cell.method, cell.rate_mbit)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  # A sweep killed mid-write must not leave a torn file that a rerun reads back.
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(cell.to_json(), f, indent=2)
  os.replace(tmp, path)
  return path


def read_cell(out_dir: str, method: str, rate_mbit: float | None) -> Cell | None:
  """The cached cell, or None when there is none (or its file cannot be read)."""
  try:
    with open(cell_path(out_dir, method, rate_mbit)) as f:
      return Cell.from_json(json.load(f))
  except (OSError, ValueError, TypeError):
    return None


def parse_rates(text: str) -> list[float]:
  """``"10,3,1,0.3,0.1"`` -> the rates in Mbit/s, highest first.

  Raises:
    NetlabError: not positive numbers, none, or one twice.
  """
  try:
    rates = [float(x) for x in text.split(",") if x.strip()]
  except ValueError:
    rates = []
  if not rates or any(not r > 0 for r in rates) or len(set(rates)) != len(rates):
    raise NetlabError(
      f"--rate_mbit={text!r}: give distinct positive rates in Mbit/s, comma-separated "
      "(e.g. 10,3,1,0.3,0.1)."
    )
  return sorted(rates, reverse=True)


def _wanted(methods: Sequence[str], rates: Sequence[float]) -> list[tuple[str, float | None]]:
  """Every cell in the order the sweep runs them: the clean ones, then rate by rate, highest first.

  The clean cells come first because the lab cannot be unshaped once it routes
  through the delay forwarder.
  """
  cells: list[tuple[str, float | None]] = [(m, None) for m in methods]
  return cells + [(m, r) for r in sorted(rates, reverse=True) for m in methods]


def _settings_for(
  clean: Mapping[str, Any], shaped: Mapping[str, Any], rate_mbit: float | None
) -> dict[str, Any]:
  return dict(clean) if rate_mbit is None else {**clean, **shaped}


def _reusable(cell: Cell | None, settings: Mapping[str, Any], time_limit_s: float) -> bool:
  """Whether a cached cell answers for this sweep: same settings, and nothing to retry."""
  if cell is None or cell.settings != dict(settings) or cell.error is not None:
    return False
  return cell.finished or cell.time_limit_s >= time_limit_s


@dataclasses.dataclass(frozen=True)
class Plan:
  """The cells a sweep runs and those it reads back, each ``(method, rate or None)``."""

  to_run: tuple[tuple[str, float | None], ...]
  read_back: tuple[tuple[str, float | None], ...]

  def text(self) -> str:
    """What the command prints before it starts."""

    def names(cells: Sequence[tuple[str, float | None]]) -> str:
      return ", ".join(f"{m} {_rate_label(r)}" for m, r in cells) or "none"

    return (
      f"floor: {len(self.to_run)} cells to run, {len(self.read_back)} read back from the "
      f"cache\n  to run: {names(self.to_run)}\n  read back: {names(self.read_back)}"
    )


def plan_cells(
  out_dir: str,
  methods: Sequence[str],
  rates: Sequence[float],
  clean_settings: Mapping[str, Any],
  shaped_settings: Mapping[str, Any],
  time_limit_s: float,
) -> Plan:
  """Which cells the sweep must run and which it reads back from ``OUT_DIR/cells``.

  A cached cell is read back when it was run with the same settings and did
  not fail, and either finished or was stopped at a limit no shorter than
  ``time_limit_s``.

  Args:
    out_dir: the sweep's ``--out_dir``.
    methods: the methods, as named.
    rates: the rates in Mbit/s.
    clean_settings: what a clean cell depends on (processes, preset, steps,
      driver flags).
    shaped_settings: what a shaped cell adds (delay, loss, tbf latency).
    time_limit_s: the sweep's limit per cell.

  Returns:
    The cells to run, in the order they run, and those read back.
  """
  to_run, read_back = [], []
  for method, rate in _wanted(methods, rates):
    settings = _settings_for(clean_settings, shaped_settings, rate)
    cached = read_cell(out_dir, method, rate)
    (read_back if _reusable(cached, settings, time_limit_s) else to_run).append((method, rate))
  return Plan(tuple(to_run), tuple(read_back))


def read_cells(
  out_dir: str, methods: Sequence[str], rates: Sequence[float]
) -> dict[tuple[str, float | None], Cell]:
  """Every cached cell of the sweep, keyed by ``(method, rate or None)``."""
  out = {}
  for method, rate in _wanted(methods, rates):
    if (cell := read_cell(out_dir, method, rate)) is not None:
      out[(method, rate)] = cell
  return out


# Options that make a method's overlapped form, or shape only that form's lookahead.
_OVERLAP_TOKENS = ("delayed", "larms")


def _plain_form(method: str) -> str:
  return "-".join(t for t in method.split("-") if t not in _OVERLAP_TOKENS)


def forms_of(methods: Sequence[str]) -> dict[str, tuple[str, ...]]:
  """Each method's forms: its plain form and its overlapped ones (``-delayed``, ``-larms``) listed.

  Example:
    >>> forms_of(["adamw", "demo", "demo-delayed"])["demo-delayed"]
    ('demo', 'demo-delayed')
    >>> forms_of(["demo-a2a", "demo-delayed-larms-a2a"])["demo-a2a"]
    ('demo-a2a', 'demo-delayed-larms-a2a')
  """
  out = {}
  for m in methods:
    base = _plain_form(m)
    forms = (base, *(f for f in methods if f != base and _plain_form(f) == base))
    out[m] = forms if base in methods and len(forms) > 1 else (m,)
  return out


def best_clean_steps(
  cells: Mapping[tuple[str, float | None], Cell], methods: Sequence[str]
) -> dict[str, float | None]:
  """Each method's best clean step: the fastest clean median among its forms (None: none ran)."""
  out = {}
  for m, forms in forms_of(methods).items():
    steps = [c.median_step_s for f in forms if (c := cells.get((f, None))) is not None]
    steps = [s for s in steps if s is not None]
    out[m] = min(steps) if steps else None
  return out


def netlab_link(rate_mbit: float, delay_ms: float, loss_pct: float) -> Link:
  """The time model's link for a lab link: its rate, delay and loss per link, end to end.

  A packet between two processes crosses both their links, so the round trip
  is four one-way delays and the end-to-end loss compounds two links'; the
  tbf bucket (:data:`round_trips.NETLAB_BURST_BYTES`) passes a burst at line rate.

  Example:
    >>> link = netlab_link(10, 25, 0.5)
    >>> link.rtt_s, round(link.loss, 5)
    (0.1, 0.00998)
  """
  return Link(
    f"{rate_mbit:g} Mbit/s",
    rate_mbit * 1e6,
    rate_mbit * 1e6,
    rtt_s=4 * delay_ms / 1e3,
    loss=1 - (1 - loss_pct / 100) ** 2,
    burst_bytes=round_trips.NETLAB_BURST_BYTES,
  )


def _resized(count: StepCount, message_bytes: float) -> StepCount:
  """``count``'s exchange scaled to the bytes the run sent.

  The count compiles the method with its own options, but the lab's drivers
  send what Psyche sends unless told otherwise (top-k 8, 1-bit), so the
  run's summary knows the message and the count only the step's structure.
  """
  total = sum(c.operands * c.operand_bytes for c in count.collectives if c.program != "host")
  scale = message_bytes / total if total else 1.0
  return dataclasses.replace(
    count,
    collectives=tuple(
      c
      if c.program == "host"
      else dataclasses.replace(c, operand_bytes=round(c.operand_bytes * scale))
      for c in count.collectives
    ),
  )


def model_step_s(
  count: StepCount,
  link: Link,
  *,
  clean_step_s: float,
  payload_bytes_per_step: float,
  collective: str,
  every: int = 1,
  overlapped_share: float = 0.0,
) -> float:
  """The time model's mean step on ``link``, the clean step standing for the compute.

  Args:
    count: the step's collectives across processes (:func:`round_trips.count`).
    link: the link (:func:`netlab_link`).
    clean_step_s: the method's median step on clean links.
    payload_bytes_per_step: what a worker puts into the collective per step
      (an exchange every H steps counts 1/H).
    collective: ``"all-gather"`` or ``"all-reduce"``.
    every: steps per exchange.
    overlapped_share: the share of the message sent under the next compute.

  Returns:
    Seconds per step, an exchange every ``every`` steps spread over them.
  """
  message = payload_bytes_per_step * every
  pricing = time_to_loss.pricing_of(
    _resized(count, message),
    compute_s=clean_step_s,
    compute_source="the method's clean cell",
    collective=collective,
    message_bytes=message,
    every=every,
    overlapped_share=overlapped_share,
  )
  return pricing.mean_step_seconds(link)


def _exchange_of(optimizer: str, config: Mapping[str, Any]) -> tuple[str, int, float]:
  """A run's collective, steps per exchange and overlapped share, from its summary."""
  from experiments.run import methods
  from experiments.run.config import TrainConfig

  known = {f.name for f in dataclasses.fields(TrainConfig)}
  cfg = TrainConfig(**{k: v for k, v in config.items() if k in known})
  method = methods.get(optimizer)
  return method.collective, method.exchange_every(cfg), methods.overlapped_share(cfg)


def _add_models(
  out_dir: str,
  cells: dict[tuple[str, float | None], Cell],
  delay_ms: float,
  loss_pct: float,
  counter: StepCounter,
) -> None:
  """Prices every shaped cell that did not finish and has no model yet; writes it back."""
  counts: dict[str, StepCount] = {}
  for (method, rate), cell in list(cells.items()):
    clean = cells.get((method, None))
    if rate is None or cell.finished or cell.model_step_s is not None or clean is None:
      continue
    if clean.median_step_s is None or clean.payload_bytes_per_step is None or not clean.optimizer:
      continue
    if method not in counts:
      counts[method] = counter(method, cell.settings["processes"], cell.settings["preset"])
    collective, every, share = _exchange_of(clean.optimizer, clean.config or {})
    model = model_step_s(
      counts[method],
      netlab_link(rate, delay_ms, loss_pct),
      clean_step_s=clean.median_step_s,
      payload_bytes_per_step=clean.payload_bytes_per_step,
      collective=collective,
      every=every,
      overlapped_share=share,
    )
    cells[(method, rate)] = dataclasses.replace(cell, model_step_s=model)
    write_cell(out_dir, cells[(method, rate)])


@dataclasses.dataclass(frozen=True)
class Entry:
  """One method at one rate, as the report shows it.

  Attributes:
    rate_mbit: the rate.
    status: ``"ok"`` (finished), ``"dnf"`` (stopped at the time limit),
      ``"failed"`` (a driver failed) or ``"not run"`` (no cell yet).
    median_step_s: the cell's median step (also of a cell that did not finish).
    ratio: a finished cell's median step over the method's best clean step.
    steps_done: the last step it logged.
    elapsed_s: how long it ran.
    model_step_s: the time model's step, for a cell that did not finish.
    model_ratio: that over the best clean step.
    error: the failure, for ``"failed"``.
  """

  rate_mbit: float
  status: str
  median_step_s: float | None = None
  ratio: float | None = None
  steps_done: int | None = None
  elapsed_s: float | None = None
  model_step_s: float | None = None
  model_ratio: float | None = None
  error: str | None = None

  @property
  def within(self) -> bool:
    """Finished, and within :data:`TOLERANCE` of the best clean step."""
    return self.status == "ok" and self.ratio is not None and self.ratio <= TOLERANCE

  def text(self) -> str:
    """The table's cell: ``"1.04x"`` (bold when within), ``"dnf (model 12.3x)"``, ...."""
    if self.status == "ok":
      if self.ratio is None:
        return "n/a"
      return f"**{self.ratio:.2f}x**" if self.within else f"{self.ratio:.2f}x"
    if self.status in ("dnf", "failed"):
      model = f" (model {self.model_ratio:.1f}x)" if self.model_ratio is not None else ""
      return f"{self.status}{model}"
    return self.status


def _ratio(a: float | None, b: float | None) -> float | None:
  return a / b if a is not None and b else None


def _entry(cell: Cell | None, rate: float, best: float | None) -> Entry:
  if cell is None:
    return Entry(rate, "not run")
  status = "failed" if cell.error is not None else "ok" if cell.finished else "dnf"
  return Entry(
    rate,
    status,
    median_step_s=cell.median_step_s,
    ratio=_ratio(cell.median_step_s, best) if status == "ok" else None,
    steps_done=cell.steps_done,
    elapsed_s=cell.elapsed_s,
    model_step_s=cell.model_step_s,
    model_ratio=_ratio(cell.model_step_s, best),
    error=cell.error,
  )


def floor_of(entries: Sequence[Entry]) -> float | None:
  """The lowest rate within :data:`TOLERANCE` there and at every higher rate (None: none).

  Example:
    >>> floor_of([Entry(10, "ok", ratio=1.02), Entry(3, "ok", ratio=1.3),
    ...           Entry(1, "ok", ratio=1.05)])
    10
  """
  floor = None
  for e in sorted(entries, key=lambda e: -e.rate_mbit):
    if not e.within:
      break
    floor = e.rate_mbit
  return floor


@dataclasses.dataclass(frozen=True)
class Row:
  """One method's line of the report.

  Attributes:
    method: as named.
    forms: the methods whose clean steps it is measured against.
    clean_step_s: its own clean median step.
    best_clean_step_s: the fastest clean median among its forms.
    entries: one per rate, highest first.
    floor_mbit: :func:`floor_of` its entries.
  """

  method: str
  forms: tuple[str, ...]
  clean_step_s: float | None
  best_clean_step_s: float | None
  entries: tuple[Entry, ...]
  floor_mbit: float | None


@dataclasses.dataclass(frozen=True)
class FloorReport:
  """The sweep's result: what ran, and one row per method.

  Attributes:
    settings: one line saying what was run.
    rates_mbit: the rates, highest first.
    rows: one per method, in ``--methods`` order.
    tolerance: the ratio a cell must stay within.
  """

  settings: str
  rates_mbit: tuple[float, ...]
  rows: tuple[Row, ...]
  tolerance: float = TOLERANCE

  def to_json(self) -> dict[str, Any]:
    """``floor.json``'s object."""
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, obj: Mapping[str, Any]) -> FloorReport:
    """Reads :meth:`to_json`'s object (after a trip through JSON)."""
    rows = tuple(
      Row(
        r["method"],
        tuple(r["forms"]),
        r["clean_step_s"],
        r["best_clean_step_s"],
        tuple(Entry(**e) for e in r["entries"]),
        r["floor_mbit"],
      )
      for r in obj["rows"]
    )
    return cls(obj["settings"], tuple(obj["rates_mbit"]), rows, obj["tolerance"])


def build_report(
  cells: Mapping[tuple[str, float | None], Cell],
  methods: Sequence[str],
  rates: Sequence[float],
  settings: str,
) -> FloorReport:
  """Each method's ratios to its best clean step, rate by rate, and its floor.

  Args:
    cells: the cells there are, keyed by ``(method, rate or None)``.
    methods: the methods, in the report's order.
    rates: the rates in Mbit/s.
    settings: one line saying what was run.
  """
  best = best_clean_steps(cells, methods)
  forms = forms_of(methods)
  ordered = sorted(rates, reverse=True)
  rows = []
  for m in methods:
    entries = tuple(_entry(cells.get((m, r)), r, best[m]) for r in ordered)
    clean = cells.get((m, None))
    rows.append(
      Row(m, forms[m], clean.median_step_s if clean else None, best[m], entries, floor_of(entries))
    )
  return FloorReport(settings, tuple(ordered), tuple(rows))


def _rate_label(rate: float | None) -> str:
  return CLEAN if rate is None else f"{rate:g} Mbit/s"


def _seconds(x: float | None) -> str:
  return "" if x is None else f"{x:.3f} s"


def _notes(rep: FloorReport) -> list[str]:
  """A line per cell that did not finish: how far it got, and the model's step."""
  out = []
  for row in rep.rows:
    for e in row.entries:
      if e.status not in ("dnf", "failed"):
        continue
      where = f"- `{row.method}` at {_rate_label(e.rate_mbit)}: "
      got = f"{e.steps_done} steps in {e.elapsed_s:.0f} s"
      if e.status == "dnf":
        what = f"did not finish: {got}"
      else:
        what = f"failed after {got}: {(e.error or '').strip().splitlines()[0][:200]}"
      model = (
        f"; the time model's step is {e.model_step_s:.3f} s ({e.model_ratio:.1f}x)"
        if e.model_step_s is not None and e.model_ratio is not None
        else ""
      )
      out.append(where + what + model)
  return out


def markdown(rep: FloorReport) -> str:
  """``floor.md``: the table, what its columns mean, and the cells that did not finish."""
  rates = [f"{r:g} Mbit/s" for r in rep.rates_mbit]
  lines = [
    "## The bandwidth floor",
    "",
    rep.settings,
    "",
    f"| method | best clean step | {' | '.join(rates)} | floor |",
    f"| --- | ---: |{' ---: |' * len(rates)} ---: |",
  ]
  for row in rep.rows:
    cells = " | ".join(e.text() for e in row.entries)
    floor = "none" if row.floor_mbit is None else f"{row.floor_mbit:g} Mbit/s"
    lines.append(f"| {row.method} | {_seconds(row.best_clean_step_s)} | {cells} | {floor} |")
  lines += [
    "",
    "Each rate's cell is the method's median step there over its best clean step (the fastest "
    "clean median of its forms: the method and its overlapped variants (`-delayed`, `-larms`) "
    "when both ran); bold: "
    f"within {rep.tolerance:.2f}x. dnf: stopped at the time limit (the time model's ratio "
    f"beside it). floor: the lowest rate within {rep.tolerance:.2f}x there and at every "
    "higher rate.",
  ]
  notes = _notes(rep)
  return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def plot(rep: FloorReport, path: str) -> None:
  """Step-time ratio against link rate, log-log, a line per method; a dashed line at the tolerance.

  A cell that did not finish is drawn hollow at the time model's ratio.

  Args:
    rep: the report.
    path: where the PNG goes.
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 4.5))
  for i, row in enumerate(rep.rows):
    color = f"C{i % 10}"
    done = [(e.rate_mbit, e.ratio) for e in row.entries if e.ratio is not None]
    if done:
      ax.plot(*zip(*done), "o-", color=color, label=row.method)
    model = [(e.rate_mbit, e.model_ratio) for e in row.entries if e.status in ("dnf", "failed")]
    model = [(r, x) for r, x in model if x is not None]
    if model:
      ax.plot(
        *zip(*model), "o", mfc="none", color=color, label=f"{row.method}, did not finish (model)"
      )
  ax.axhline(rep.tolerance, color="k", linestyle="--", linewidth=1, label=f"{rep.tolerance:.2f}x")
  ax.set_xscale("log")
  # Dense steps over slow links are hundreds of times slower; a linear axis hides the rest.
  ax.set_yscale("log")
  ax.invert_xaxis()  # the sweep goes from fast links to slow ones
  ax.set_xlabel("link rate, Mbit/s")
  ax.set_ylabel("median step / best clean step")
  ax.set_title(rep.settings.split(";", 1)[0], fontsize=9)
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_report(out_dir: str, rep: FloorReport) -> str:
  """Writes ``floor.md``, ``floor.json`` and ``floor.png`` to ``out_dir``; returns the markdown."""
  os.makedirs(out_dir, exist_ok=True)
  text = markdown(rep)
  with open(os.path.join(out_dir, "floor.md"), "w") as f:
    f.write(text)
  with open(os.path.join(out_dir, "floor.json"), "w") as f:
    json.dump(rep.to_json(), f, indent=2)
  plot(rep, os.path.join(out_dir, "floor.png"))
  return text


def _check(
  cfg: FloorConfig, passthrough: Sequence[str]
) -> tuple[list[float], dict[str, list[str]], list[str], list[Impairment] | None]:
  """Reads and checks the flags before anything is built: rates, methods, links, driver flags.

  Raises:
    NetlabError: naming the flag and the fix.
  """
  if cfg.processes < 2:
    raise NetlabError(f"--processes must be at least 2, got {cfg.processes}.")
  rates = parse_rates(cfg.rate_mbit)
  runs = lab.parse_methods(cfg.methods)
  try:
    presets.get_preset(cfg.preset)
  except ValueError as e:
    raise NetlabError(str(e).replace("unknown preset", "unknown --preset")) from None
  if cfg.steps <= cfg.skip_steps:
    raise NetlabError(
      f"--steps={cfg.steps} leaves nothing to measure after --skip_steps={cfg.skip_steps}."
    )
  if not cfg.cell_time_limit_s > 0:
    raise NetlabError(f"--cell_time_limit_s={cfg.cell_time_limit_s:g} must be positive.")
  impairments = faults.impairments(f"{cfg.delay_ms!r}", "0", f"{cfg.loss_pct!r}", cfg.processes)
  return rates, runs, lab.driver_flags(passthrough, cfg.processes), impairments


def cell_settings(cfg: FloorConfig, flags_: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
  """What a clean cell depends on, and what a shaped cell adds (a cell read back must match).

  Args:
    cfg: the sweep's settings.
    flags_: the drivers' flags (:func:`lab.driver_flags`), the method's own left out.

  Returns:
    ``(clean, shaped)``: processes, preset, steps, warm-up and driver flags;
    delay, loss and tbf latency.
  """
  clean = {
    "processes": cfg.processes,
    "preset": cfg.preset,
    "steps": cfg.steps,
    "skip_steps": cfg.skip_steps,
    "driver_flags": list(flags_),
  }
  shaped = {"delay_ms": cfg.delay_ms, "loss_pct": cfg.loss_pct, "latency_ms": cfg.latency_ms}
  return clean, shaped


def settings_line(cfg: FloorConfig, flags_: Sequence[str]) -> str:
  """One line saying what was run, for the report's head."""
  return (
    f"{cfg.processes} processes, preset {cfg.preset}, {cfg.steps} steps a cell (the first "
    f"{cfg.skip_steps} left out of the medians), each stopped at {cfg.cell_time_limit_s:g} s; "
    f"shaped cells: {cfg.delay_ms:g} ms one way per link ({4 * cfg.delay_ms:g} ms round trip), "
    f"{cfg.loss_pct:g}% loss per link ({100 * (1 - (1 - cfg.loss_pct / 100) ** 2):.2g}% end to "
    f"end), tbf latency {cfg.latency_ms:g} ms; driver flags: {' '.join(flags_)}"
  )


def _cell_of(
  result: RunResult | None,
  run_dir: str,
  method: str,
  rate: float | None,
  cfg: FloorConfig,
  settings: Mapping[str, Any],
  elapsed_s: float,
  error: str | None,
) -> Cell:
  """What the cache keeps of a run (or of a failed run's files)."""
  if result is not None:
    steps, summary = result.records, result.summary
  else:
    steps = records.read_metrics(run_dir) if os.path.exists(f"{run_dir}/metrics.jsonl") else []
    summary = None
  finished = result is not None and not result.stopped_at_limit and summary is not None
  return Cell(
    method,
    rate,
    finished,
    steps[-1].step if steps else 0,
    elapsed_s,
    report.median_step_s(steps, cfg.skip_steps),
    cfg.cell_time_limit_s,
    dict(settings),
    optimizer=summary.optimizer if summary else None,
    payload_bytes_per_step=summary.payload_bytes_per_step if summary else None,
    config=summary.config if summary else None,
    error=error,
    run_dir=run_dir,
  )


def _run_cell(
  the_lab: links.Lab,
  cfg: FloorConfig,
  method: str,
  rate: float | None,
  *,
  port: int,
  flags_: Sequence[str],
  settings: Mapping[str, Any],
) -> Cell:
  """One cell through :func:`lab.run_once`; a driver's failure ends the cell, not the sweep.

  Returns:
    The cell, also written to the cache.
  """
  key = rate_key(rate)
  lab_cfg = lab.LabConfig(
    processes=cfg.processes,
    methods=method,
    preset=cfg.preset,
    steps=cfg.steps,
    out_dir=os.path.join(cfg.out_dir, "runs", key),
    skip_steps=cfg.skip_steps,
    run_time_limit_s=cfg.cell_time_limit_s,
    # The limit is per cell: a restart would give a cell a second limit.
    max_restarts=0,
  )
  run_dir = os.path.join(
    lab_cfg.out_dir, "runs", f"{method}-{'shaped' if rate is not None else 'unshaped'}"
  )
  started = time.time()
  try:
    result = lab.run_once(
      the_lab, lab_cfg, method, rate is not None, port=port, flags=flags_, env=lab._driver_env()
    )
    error = None
  except NetlabError as e:
    result, error = None, str(e)
  cell = _cell_of(result, run_dir, method, rate, cfg, settings, time.time() - started, error)
  path = write_cell(cfg.out_dir, cell)
  state = "finished" if cell.finished else "failed" if error else "did not finish"
  print(
    f"floor: {method} {_rate_label(rate)}: {state}, {cell.steps_done} steps, median step "
    f"{_seconds(cell.median_step_s) or 'n/a'} ({path})",
    flush=True,
  )
  return cell


def _run_plan(
  cfg: FloorConfig,
  plan: Plan,
  runs: Mapping[str, Sequence[str]],
  flags_: Sequence[str],
  impairments: Sequence[Impairment] | None,
  settings: tuple[Mapping[str, Any], Mapping[str, Any]],
) -> None:
  """Builds the lab, runs the plan's cells (clean, then rate by rate), tears the lab down.

  Teardown happens on success, failure and Ctrl-C alike, as in :func:`lab.run`.
  """
  links.check_prerequisites()
  links.sweep_stale()
  the_lab = links.Lab(cfg.processes)
  with lab._signals((signal.default_int_handler, lab._raise_exit, lab._raise_exit)):
    the_lab.create()
    try:
      port, shaped_at, impaired = _PORT, None, False
      for method, rate in plan.to_run:
        if rate is not None and rate != shaped_at:
          the_lab.shape([rate] * cfg.processes, cfg.latency_ms)
          shaped_at = rate
          if impairments and not impaired:
            stats = os.path.join(cfg.out_dir, "impairment_counts.json")
            the_lab.impair(impairments, stats_path=stats, env=lab._driver_env())
            impaired = True
        own = _settings_for(*settings, rate)
        flags_m = [*flags_, *runs[method]]
        _run_cell(the_lab, cfg, method, rate, port=port, flags_=flags_m, settings=own)
        port += 1
    finally:
      with lab._signals([signal.SIG_IGN] * len(lab._SIGNALS)):
        the_lab.teardown()


def run(
  cfg: FloorConfig, passthrough: Sequence[str] = (), *, counter: StepCounter | None = None
) -> FloorReport:
  """The sweep: plans from the cache, runs what is missing in a lab, reports.

  No lab is built when every cell is read back (no root needed then).

  Args:
    cfg: the sweep's settings.
    passthrough: flags for every ``experiments.train`` driver.
    counter: ``(method, workers, preset) -> StepCount`` for the time model of
      a cell that did not finish (default: :func:`time_to_loss.count_step`,
      which compiles one step and needs ``cfg.processes`` CPU devices in this
      process).

  Returns:
    The report, also written to ``cfg.out_dir``.

  Raises:
    NetlabError: a setting or the machine; the message says which and what to do.
  """
  rates, runs, flags_, impairments = _check(cfg, passthrough)
  methods = list(runs)
  settings = cell_settings(cfg, flags_)
  plan = plan_cells(cfg.out_dir, methods, rates, *settings, cfg.cell_time_limit_s)
  print(plan.text(), flush=True)
  os.makedirs(cfg.out_dir, exist_ok=True)
  if plan.to_run:
    _run_plan(cfg, plan, runs, flags_, impairments, settings)
  cells = read_cells(cfg.out_dir, methods, rates)
  _add_models(cfg.out_dir, cells, cfg.delay_ms, cfg.loss_pct, counter or time_to_loss.count_step)
  rep = build_report(cells, methods, rates, settings_line(cfg, flags_))
  print(write_report(cfg.out_dir, rep), flush=True)
  return rep


def _main(holders: Mapping[str, flags.FlagHolder], argv: Sequence[str]) -> None:
  cfg = cli.config_from_flags(holders, FloorConfig)
  import jax

  # One CPU device per process for the time model's count, before anything starts a backend.
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", max(cfg.processes, 1))
  try:
    run(cfg, argv[1:])
  except NetlabError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except KeyboardInterrupt:
    print("floor: interrupted; processes and links are torn down.", file=sys.stderr)
    sys.exit(130)


def main(argv: Sequence[str] | None = None) -> None:
  """The command: defines its flags (only now, not at import), parses them, runs the sweep."""
  holders = cli.define_flags(FloorConfig)
  app.run(
    functools.partial(_main, holders),
    argv=argv,
    # Flags the floor does not define are the drivers': keep them for the runs.
    flags_parser=lambda args: flags.FLAGS(args, known_only=True),
  )


if __name__ == "__main__":
  main()
