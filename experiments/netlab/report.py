"""netlab's measures and report: step times, time to a target loss, bytes on the links.

Everything here is a pure function of what the runs left behind: each run's
``metrics.jsonl`` (process 0's :class:`~experiments.run.records.StepRecord` lines,
with the wall-clock time each step finished), its ``summary.json``
(:class:`~experiments.run.records.Summary`) and the counter samples of
:mod:`experiments.netlab.counters`. :func:`write_report` writes ``netlab.md``,
``netlab_loss.png`` and ``netlab.json``.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from experiments.netlab import counters
from experiments.netlab.results import InterruptedRun, RunResult
from experiments.run import integrity, methods
from experiments.run.records import StepRecord, Summary
from experiments.run.reporting import human_bytes

__all__ = [
  "Report",
  "fault_figures",
  "interruption_figures",
  "link_bytes_per_step",
  "markdown",
  "measure_window",
  "median_step_s",
  "payload_traffic",
  "plot",
  "step_seconds",
  "summarize",
  "time_to_target_s",
  "write_report",
]

# ``netlab.json``: one entry of figures per method, keyed by its name in ``--methods``.
Report = dict[str, dict[str, Any]]


def step_seconds(records: Sequence[StepRecord], skip: int) -> list[float]:
  """Wall-clock seconds of each step after the first ``skip``.

  A step's time is the gap between its finish and the previous step's. Steps
  that carry a validation loss are left out: their gap includes the evaluation.

  Args:
    records: process 0's metrics records.
    skip: warm-up steps to leave out.

  Returns:
    Seconds per measured step, in step order.
  """
  return [
    b.wall_time - a.wall_time
    for a, b in zip(records, records[1:])
    if b.step == a.step + 1 and b.step > skip and b.val_loss is None
  ]


def median_step_s(records: Sequence[StepRecord], skip: int) -> float | None:
  """The median of :func:`step_seconds`, or None when no step is left to measure."""
  times = step_seconds(records, skip)
  return statistics.median(times) if times else None


def measure_window(records: Sequence[StepRecord], skip: int) -> tuple[float, float, int] | None:
  """The measurement window: from the finish of step ``skip`` to the last step's finish.

  Args:
    records: process 0's metrics records.
    skip: warm-up steps to leave out (at least 1: the window starts at a finish).

  Returns:
    ``(start, end, steps)`` in unix seconds and steps, or None if no step is left.
  """
  first = next((r for r in records if r.step == skip), None) if skip else None
  if first is None or records[-1].step <= skip:
    return None
  return first.wall_time, records[-1].wall_time, records[-1].step - skip


def _first_at_target(records: Sequence[StepRecord], target: float) -> StepRecord | None:
  return next((r for r in records if r.val_loss is not None and r.val_loss <= target), None)


def time_to_target_s(records: Sequence[StepRecord], target: float) -> float | None:
  """Seconds from the finish of step 1 to the first validation loss <= ``target``.

  Args:
    records: process 0's metrics records.
    target: the validation loss to reach.

  Returns:
    The seconds, or None if no validation reached ``target``.
  """
  hit = _first_at_target(records, target)
  return None if hit is None else hit.wall_time - records[0].wall_time


def payload_traffic(summary: Summary, workers: int) -> dict[str, float]:
  """What one process must send per step, computed from the run's summary.

  ``message`` is what each worker puts into the collective (the driver's
  ``payload_bytes_per_step``): the DisTrO message, or the gradient (DiLoCo's
  pseudo-gradient amortized over its H steps). ``payload`` is what the
  method's collective (the registry's ``Method.collective``) then sends per
  process: an all-gather forwards the W-1 other messages, a ring all-reduce
  sends ``2 (W-1)/W`` operands (reduce-scatter, then all-gather), which is
  the driver's ``bytes_sent_per_step``.

  Args:
    summary: the run's ``summary.json``.
    workers: W, one per process.

  Returns:
    ``{"message": bytes, "payload": bytes}`` per process per step.
  """
  message = summary.payload_bytes_per_step
  if methods.get(summary.optimizer).collective == methods.ALL_GATHER:
    return {"message": message, "payload": (workers - 1) * message}
  return {"message": message, "payload": summary.bytes_sent_per_step}


def link_bytes_per_step(
  samples: Sequence[Mapping[str, Any]], ifaces: Sequence[str], window: tuple[float, float, int]
) -> list[dict[str, float]]:
  """Per process, the bytes its link carried per step in ``window``: up (sent) and down.

  ``ifaces[i]`` is process i's veth end on the bridge, so what it receives
  (rx) is what the process sent.

  Args:
    samples: counter samples covering ``window``.
    ifaces: process i's interface on the bridge, by i.
    window: ``(start, end, steps)`` from :func:`measure_window`.

  Returns:
    ``[{"up": bytes, "down": bytes}, ...]`` per step, by process.
  """
  t0, t1, steps = window
  out = []
  for iface in ifaces:
    rx, tx = counters.bytes_between(samples, iface, t0, t1)
    out.append({"up": rx / steps, "down": tx / steps})
  return out


def _final_val_loss(run: RunResult) -> float | None:
  return next((r.val_loss for r in reversed(run.records) if r.val_loss is not None), None)


def _run_measures(
  run: RunResult | None, samples: Sequence[Mapping[str, Any]], ifaces: Sequence[str], skip: int
) -> dict[str, Any]:
  """One run's figures; empty when the run is missing."""
  if run is None:
    return {}
  window = measure_window(run.records, skip)
  links = None
  if window is not None:
    try:
      links = link_bytes_per_step(samples, ifaces, window)
    except ValueError:
      links = None  # the sampler did not cover the run: leave it unmeasured
  return {
    "median_step_s": median_step_s(run.records, skip),
    "steps": run.records[-1].step if run.records else 0,
    "stopped_at_time_limit": run.stopped_at_limit,
    "links": links,
    "final_val_loss": _final_val_loss(run),
  }


def _ratio(a: float | None, b: float | None) -> float | None:
  return a / b if a is not None and b else None


def _link_figures(entry: dict[str, Any], m_s: dict, m_u: dict, rates_mbit: Sequence[float]) -> None:
  """Adds the measured link bytes, and which shaped link bounds the step, to ``entry``."""
  for key, m in (("shaped", m_s), ("unshaped", m_u)):
    links = m.get("links")
    entry[f"link_bytes_per_step_by_process_{key}"] = links
    mean_up = sum(x["up"] for x in links) / len(links) if links else None
    entry["link_bytes_per_step" if key == "shaped" else "link_bytes_per_step_unshaped"] = mean_up
  entry["link_over_payload"] = _ratio(entry["link_bytes_per_step"], entry["payload_bytes_per_step"])
  links = m_s.get("links")
  if links:
    # The link that needs the longest to carry its step's bytes bounds the step.
    need = [max(x["up"], x["down"]) * 8 / (r * 1e6) for x, r in zip(links, rates_mbit)]
    slowest = max(range(len(need)), key=need.__getitem__)
    entry["link_seconds_per_step"] = need
    entry["bounding_link"] = {
      "process": slowest,
      "rate_mbit": rates_mbit[slowest],
      "seconds_per_step": need[slowest],
    }


def _target_figures(
  entry: dict[str, Any], shaped: RunResult | None, unshaped: RunResult | None, target: float
) -> None:
  """Adds the time to the validation-loss target, shaped and unshaped, to ``entry``."""
  for key, run in (("shaped", shaped), ("unshaped", unshaped)):
    entry[f"time_to_target_s_{key}"] = time_to_target_s(run.records, target) if run else None
  hit = _first_at_target(unshaped.records, target) if unshaped else None
  if entry["time_to_target_s_shaped"] is None and hit and entry["median_step_s_shaped"]:
    # The shaped run stopped first: what its own step time gives for the
    # steps the unshaped run needed (labelled as a projection).
    entry["time_to_target_s_shaped_projected"] = hit.step * entry["median_step_s_shaped"]


def summarize(
  runs: Sequence[RunResult],
  *,
  samples: Sequence[Mapping[str, Any]],
  ifaces: Sequence[str],
  rates_mbit: Sequence[float],
  skip: int,
  target_loss: float | None,
  interrupted: Sequence[Any] = (),
) -> Report:
  """The ``netlab.json`` object: one entry per method, in the order they ran.

  Args:
    runs: every run, shaped and unshaped.
    samples: link counter samples covering the runs.
    ifaces: process i's interface name on the bridge, by i.
    rates_mbit: process i's shaped link rate, by i.
    skip: warm-up steps left out of medians and byte counts.
    target_loss: validation loss for the time-to-target figure; None takes the
      worst final validation loss among the unshaped runs, which every method
      then reaches unshaped.
    interrupted: runs with a process killed mid-run
      (:class:`experiments.netlab.results.InterruptedRun`); each method's
      entry gets ``"interrupted"``, what it cost against its shaped run.

  Returns:
    ``{method: {...}}`` with ``median_step_s_shaped``, ``median_step_s_unshaped``,
    ``link_bytes_per_step`` (per process, mean upload on the shaped links),
    ``payload_bytes_per_step`` (computed) and the rest of the report's figures.
    Every method after the first also gets ``shaped_step_speedup_vs_<first>``:
    the first method's median shaped step over its own.
  """
  by = {(r.method, r.shaped): r for r in runs}
  names = list(dict.fromkeys(r.method for r in runs))
  workers = len(ifaces)
  if target_loss is None:
    finals = [f for r in runs if not r.shaped if (f := _final_val_loss(r)) is not None]
    target_loss = max(finals) if finals else None
  report = {}
  for name in names:
    shaped, unshaped = by.get((name, True)), by.get((name, False))
    m_s = _run_measures(shaped, samples, ifaces, skip)
    m_u = _run_measures(unshaped, samples, ifaces, skip)
    summary = next((r.summary for r in (unshaped, shaped) if r and r.summary), None)
    traffic = payload_traffic(summary, workers) if summary else {}
    entry: dict[str, Any] = {
      "processes": workers,
      "rates_mbit": list(rates_mbit),
      "median_step_s_shaped": m_s.get("median_step_s"),
      "median_step_s_unshaped": m_u.get("median_step_s"),
      "shaped_over_unshaped": _ratio(m_s.get("median_step_s"), m_u.get("median_step_s")),
      "payload_bytes_per_step": traffic.get("payload"),
      "message_bytes_per_step": traffic.get("message"),
      "steps_shaped": m_s.get("steps"),
      "steps_unshaped": m_u.get("steps"),
      "stopped_at_time_limit_shaped": m_s.get("stopped_at_time_limit"),
      "stopped_at_time_limit_unshaped": m_u.get("stopped_at_time_limit"),
      "final_val_loss_shaped": m_s.get("final_val_loss"),
      "final_val_loss_unshaped": m_u.get("final_val_loss"),
      "target_val_loss": target_loss,
    }
    _link_figures(entry, m_s, m_u, rates_mbit)
    if target_loss is not None:
      _target_figures(entry, shaped, unshaped, target_loss)
    report[name] = entry
  # The first method listed is the baseline (``adamw`` in the default ``adamw,demo``).
  base = names[0] if names else None
  for name in names[1:]:
    report[name][f"shaped_step_speedup_vs_{base}"] = _ratio(
      report[base]["median_step_s_shaped"], report[name]["median_step_s_shaped"]
    )
  for run in interrupted:
    report[run.method]["interrupted"] = interruption_figures(run, by.get((run.method, True)))
  for name in names:
    shaped, unshaped = by.get((name, True)), by.get((name, False))
    if shaped is not None and (
      shaped.blackout or shaped.impairment_counts or len(shaped.attempts) > 1
    ):
      report[name]["faults"] = fault_figures(shaped, unshaped)
  return report


def _fmt(x: float | None, spec: str = ".2f", unit: str = "") -> str:
  return "n/a" if x is None else f"{x:{spec}}{unit}"


def _bytes(x: float | None) -> str:
  return human_bytes(x) if x else "n/a"


def _main_row(name: str, e: dict[str, Any]) -> str:
  """One method's row of the main table."""
  shaped_ttt = _fmt(e.get("time_to_target_s_shaped"), ".1f", " s")
  if e.get("time_to_target_s_shaped") is None:
    shaped_ttt = f"not reached in {e.get('steps_shaped')} steps"
    if e.get("time_to_target_s_shaped_projected"):
      shaped_ttt += f" (projected {e['time_to_target_s_shaped_projected']:.0f} s)"
  return (
    f"| {name} | {_fmt(e['median_step_s_shaped'], '.3f', ' s')} "
    f"| {_fmt(e['median_step_s_unshaped'], '.3f', ' s')} "
    f"| {_fmt(e['shaped_over_unshaped'], '.2f', 'x')} "
    f"| {_bytes(e['link_bytes_per_step'])} | {_bytes(e['payload_bytes_per_step'])} "
    f"| {_fmt(e['link_over_payload'], '.2f', 'x')} "
    f"| {shaped_ttt} | {_fmt(e.get('time_to_target_s_unshaped'), '.1f', ' s')} |"
  )


def _link_rows(name: str, e: dict[str, Any]) -> list[str]:
  """One method's rows of the per-link table, one per process."""
  # With equal rates every link carries about the same: none stands out.
  mixed = len(set(e["rates_mbit"])) > 1
  bound = (e.get("bounding_link") or {}).get("process") if mixed else None
  links = e.get("link_bytes_per_step_by_process_shaped") or []
  return [
    f"| {name} | {i} | {e['rates_mbit'][i]:g} Mbit/s | {human_bytes(x['up'])} "
    f"| {human_bytes(x['down'])} | {need:.3f} s{' (bounds the step)' if i == bound else ''} |"
    for i, (x, need) in enumerate(zip(links, e.get("link_seconds_per_step", [])))
  ]


def markdown(report: Report, settings: str) -> str:
  """The report as markdown: the settings line, the main table and the per-link table.

  Args:
    report: what :func:`summarize` returned.
    settings: one line saying what was run.

  Returns:
    The markdown text.
  """
  lines = [
    "# netlab",
    "",
    settings,
    "",
    "| method | median step, shaped | median step, unshaped | shaped / unshaped "
    "| link bytes/step (up, mean per process) | computed payload/step | link / payload "
    "| time to val loss target, shaped | unshaped |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    *(_main_row(name, e) for name, e in report.items()),
    "",
  ]
  base = next(iter(report), None)
  for name, e in report.items():
    if e.get(f"shaped_step_speedup_vs_{base}"):
      lines.append(
        f"- {name}'s median shaped step is {e[f'shaped_step_speedup_vs_{base}']:.1f}x shorter "
        f"than {base}'s."
      )
  target = next((e.get("target_val_loss") for e in report.values()), None)
  if target is not None:
    lines.append(f"- Validation loss target: {target:.4f}, timed from the end of step 1.")
  lines += ["", "## Links on the shaped runs", ""]
  lines.append("| method | process | rate | up/step | down/step | seconds/step at its rate |")
  lines.append("| --- | ---: | ---: | ---: | ---: | ---: |")
  for name, e in report.items():
    lines += _link_rows(name, e)

  lines += _fault_rows(report)
  lines += _interruption_rows(report)
  return "\n".join(lines) + "\n"


def plot(runs: Sequence[RunResult], path: str, title: str) -> None:
  """Loss against wall-clock seconds since step 1, one line per run, saved to ``path``.

  Args:
    runs: every run; shaped ones solid, unshaped dashed, one colour per method.
    path: where the PNG goes.
    title: the figure's title.
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 4.5))
  colors: dict[str, str] = {}
  for run in runs:
    if not run.records:
      continue
    t0 = run.records[0].wall_time
    color = colors.setdefault(run.method, f"C{len(colors)}")
    label = f"{run.method}, {'shaped' if run.shaped else 'unshaped'}"
    ax.plot(
      [r.wall_time - t0 for r in run.records],
      [r.loss for r in run.records],
      color=color,
      linestyle="-" if run.shaped else "--",
      label=label + (" (stopped at time limit)" if run.stopped_at_limit else ""),
    )
  ax.set_xscale("symlog", linthresh=10)
  ax.set_xlim(left=0)  # the autoscale margin would reach below step 1
  ax.set_xlabel("wall-clock seconds since step 1")
  ax.set_ylabel("train loss")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_report(out_dir: str, report: Report, runs: Sequence[RunResult], settings: str) -> None:
  """Writes ``netlab.json``, ``netlab.md`` and ``netlab_loss.png`` into ``out_dir``.

  Args:
    out_dir: an existing directory.
    report: what :func:`summarize` returned.
    runs: every run, for the plot.
    settings: one line saying what was run.
  """
  with open(os.path.join(out_dir, "netlab.json"), "w") as f:
    json.dump(report, f, indent=2)
  with open(os.path.join(out_dir, "netlab.md"), "w") as f:
    f.write(markdown(report, settings))
  plot(runs, os.path.join(out_dir, "netlab_loss.png"), settings.split(":", 1)[0])


def _final_val(rs: Sequence[StepRecord]) -> float | None:
  return next((r.val_loss for r in reversed(rs) if r.val_loss is not None), None)


def _elapsed(run: RunResult | None) -> float | None:
  if run is None or not run.records or run.started_at is None:
    return None
  return run.records[-1].wall_time - run.started_at


def interruption_figures(run: InterruptedRun, reference: RunResult | None) -> dict[str, Any]:
  """What a killed process cost ``run``, against ``reference``: the same links, uninterrupted.

  Returns:
    ``killed_process``, ``kill_step``, ``resumed_from_step``, ``steps_redone``,
    ``seconds_to_regain_kill_step`` (from the kill until the resumed run had
    finished the step the kill struck after: restart, restore, compile and the
    steps redone), ``wall_s_interrupted`` and ``wall_s_uninterrupted`` (launch
    to last step), ``wall_s_lost``, the final train and validation losses of
    both, and ``processes`` per attempt.
  """
  resumed = run.events[0].step if run.events else None
  second = run.attempts[1].records if len(run.attempts) > 1 else []
  regained = next((r for r in second if r.step >= run.kill_step), None)
  ref_records = reference.records if reference else []
  out = {
    "killed_process": run.killed_process,
    "kill_step": run.kill_step,
    "resumed_from_step": resumed,
    "steps_redone": None if resumed is None else run.kill_step - resumed,
    "seconds_to_regain_kill_step": regained.wall_time - run.killed_at if regained else None,
    "processes": [a.processes for a in run.attempts],
    "steps": run.final.records[-1].step if run.final.records else 0,
    "wall_s_interrupted": _elapsed(run.final),
    "wall_s_uninterrupted": _elapsed(reference),
    "final_loss_interrupted": run.final.records[-1].loss if run.final.records else None,
    "final_loss_uninterrupted": ref_records[-1].loss if ref_records else None,
    "final_val_loss_interrupted": _final_val(run.final.records),
    "final_val_loss_uninterrupted": _final_val(ref_records),
    "survivors_exit_codes": run.survivors_exit.get("exit_codes"),
    "survivors_stopped_after_s": run.survivors_exit.get("seconds"),
  }
  a, b = out["wall_s_interrupted"], out["wall_s_uninterrupted"]
  out["wall_s_lost"] = a - b if a is not None and b is not None else None
  return out


def _checkpoints_intact(run_dir: str | None) -> bool | None:
  """Whether every checkpoint of the run matches its digest (None: it saved none)."""
  ckpt = os.path.join(run_dir or "", "checkpoints")
  steps = [n for n in os.listdir(ckpt) if n.isdigit()] if os.path.isdir(ckpt) else []
  if not steps:
    return None
  return all(integrity.verify(os.path.join(ckpt, n)) is None for n in steps)


def fault_figures(shaped: RunResult, unshaped: RunResult | None) -> dict[str, Any]:
  """What the shaped links' faults did to a run: drops, the blackout's stall, restarts, losses.

  Args:
    shaped: the run on the faulty links.
    unshaped: the same method on clean links, whose losses it must match
      (the links change the timing, never the arithmetic, and a resume is
      bit-identical).

  Returns:
    ``measured_loss_pct_by_link`` (what the forwarder dropped), ``blackout``
    (which link, when) with ``back_past_step_after_s`` (from the link going
    dark until the run finished a step past the one process 0 had logged
    then: the stall, or after a restart the detection, the restart and the
    steps redone too), ``attempts`` and ``restarts`` (the
    drivers' exit statuses and last lines), ``completed`` (every step from 1
    to the last logged once), ``losses_match_unshaped`` and
    ``checkpoints_intact`` (every checkpoint matches its digest).
  """
  out: dict[str, Any] = {}
  counts = shaped.impairment_counts or {}
  out["measured_loss_pct_by_link"] = {
    a: 100 * c["dropped"] / c["packets"] if c.get("packets") else None for a, c in counts.items()
  }
  records = shaped.records
  if shaped.blackout:
    start, step = shaped.blackout.get("dark_from"), shaped.blackout.get("after_step")
    past = next((r for r in records if step is not None and r.step > step), None)
    out["blackout"] = {
      **shaped.blackout,
      # The stall, or with a restart the whole way back: detection, restart, steps redone.
      "back_past_step_after_s": past.wall_time - start if past and start else None,
    }
  out["attempts"] = len(shaped.attempts)
  out["restarts"] = [
    {"exit_codes": a["exit_codes"], "line": next((x for x in a["lines"] if x), "")}
    for a in shaped.attempts[:-1]
  ]
  steps = [r.step for r in records]
  out["completed"] = bool(steps) and steps == list(range(1, steps[-1] + 1))
  out["last_step"] = steps[-1] if steps else 0
  if unshaped is not None and unshaped.records:
    clean = {r.step: r.loss for r in unshaped.records}
    common = [r for r in records if r.step in clean]
    out["losses_match_unshaped"] = bool(common) and all(r.loss == clean[r.step] for r in common)
  out["checkpoints_intact"] = _checkpoints_intact(shaped.run_dir)
  return out


def _fault_rows(report: Mapping[str, Mapping[str, Any]]) -> list[str]:
  """The report's section on the shaped links' faults (empty when there were none)."""
  rows = [(name, e) for name, e in report.items() if e.get("faults")]
  if not rows:
    return []
  lines = [
    "",
    "## Faults on the shaped links",
    "",
    "| method | median step, faulty links | clean links | ratio | packets dropped "
    "| blackout: back past its step after | restarts | steps done | losses match clean "
    "| checkpoints intact |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
  ]
  for name, e in rows:
    f = e["faults"]
    drops = [x for x in f["measured_loss_pct_by_link"].values() if x is not None]
    drop_text = f"{min(drops):.2f} to {max(drops):.2f}% per link" if drops else "n/a"
    longest = (f.get("blackout") or {}).get("back_past_step_after_s")
    restarts = ", ".join(f"exit {sorted(set(r['exit_codes']))}" for r in f["restarts"]) or "none"
    lines.append(
      f"| {name} | {_num(e['median_step_s_shaped'], '.3f')} s "
      f"| {_num(e['median_step_s_unshaped'], '.3f')} s | {_num(e['shaped_over_unshaped'], '.2f')}x "
      f"| {drop_text} | {_num(longest, '.1f')} s | {restarts} | {f['last_step']} "
      f"| {_yes(f.get('losses_match_unshaped'))} | {_yes(f['checkpoints_intact'])} |"
    )
  for name, e in rows:
    for r in e["faults"]["restarts"]:
      lines.append(f"- {name}: restarted after: `{r['line']}`")
  return lines


def _yes(x: bool | None) -> str:
  return "n/a" if x is None else ("yes" if x else "**no**")


def _num(x: float | None, spec: str) -> str:
  return "n/a" if x is None else format(x, spec)


def _interruption_rows(report: Mapping[str, Mapping[str, Any]]) -> list[str]:
  """The report's section on interrupted runs (empty when there were none)."""
  rows = [(name, e["interrupted"]) for name, e in report.items() if e.get("interrupted")]
  if not rows:
    return []
  lines = [
    "",
    "## A process killed mid-run",
    "",
    "| method | processes | killed after step | survivors stopped | resumed from "
    "| steps redone | back at that step after | wall time | uninterrupted | lost "
    "| final loss | uninterrupted | final val loss | uninterrupted |",
    "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
    "| ---: |",
  ]
  for name, f in rows:
    codes = f.get("survivors_exit_codes") or []
    stopped = (
      f"exit {'/'.join(map(str, sorted(set(codes), key=str)))} after "
      f"{_num(f.get('survivors_stopped_after_s'), '.1f')} s"
      if codes
      else "n/a"
    )
    lines.append(
      f"| {name} | {' -> '.join(map(str, f['processes']))} | {f['kill_step']} | {stopped} "
      f"| {f['resumed_from_step']} | {f['steps_redone']} "
      f"| {_num(f['seconds_to_regain_kill_step'], '.1f')} s "
      f"| {_num(f['wall_s_interrupted'], '.1f')} s | {_num(f['wall_s_uninterrupted'], '.1f')} s "
      f"| {_num(f['wall_s_lost'], '.1f')} s "
      f"| {_num(f['final_loss_interrupted'], '.4f')} "
      f"| {_num(f['final_loss_uninterrupted'], '.4f')} "
      f"| {_num(f['final_val_loss_interrupted'], '.4f')} "
      f"| {_num(f['final_val_loss_uninterrupted'], '.4f')} |"
    )
  return lines
