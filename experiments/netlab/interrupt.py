"""A training process killed mid-run, and the run continued without it (``--kill_step``).

What a preempted machine does to a run: the lab SIGKILLs one driver once
process 0 has logged ``--kill_step``. The others cannot go on (an SPMD job's
processes are fixed at start, and a collective now waits for a peer that is
gone), so the lab stops them, as a scheduler would, and restarts the
survivors in their own namespaces from the last checkpoint with one process
(and one worker) fewer: ``--resume --num_processes=N-1 --workers=N-1``, an
elastic resume (``experiments.elastic``). With ``--rejoin_step`` the survivors
stop at that step (a checkpoint) and all N continue from it, the lost process
back.

:func:`figures` says what it cost against the same method's uninterrupted run
on the same links: the steps redone (from the checkpoint to where the kill
struck), the seconds from the kill until the run was back at that step, the
end-to-end wall time lost, and the final loss against the uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from experiments import records
from experiments.netlab import lab as lab_lib
from experiments.netlab import links
from experiments.netlab.links import NetlabError
from experiments.netlab.report import RunResult
from experiments.records import StepRecord

__all__ = ["Attempt", "InterruptedRun", "figures", "markdown_rows", "run_interrupted"]


@dataclasses.dataclass(frozen=True)
class Attempt:
  """One launch of the run's drivers.

  Attributes:
    processes: how many drivers ran.
    started: ``time.time()`` when the lab launched them.
    records: process 0's records of the steps this attempt ran.
  """

  processes: int
  started: float
  records: list[StepRecord]


@dataclasses.dataclass(frozen=True)
class InterruptedRun:
  """A run with a process killed mid-run, continued on the survivors.

  Attributes:
    method: the method as ``--methods`` named it.
    killed_process: the process the lab killed.
    kill_step: the last step process 0 had logged when the run stopped.
    killed_at: ``time.time()`` of the kill.
    attempts: the launches, in order: N processes, N-1, (N again, rejoined).
    final: the run's records as ``metrics.jsonl`` holds them at the end (the
      steps redone replaced), and its summary.
    events: the elastic resumes the driver logged.
  """

  method: str
  killed_process: int
  kill_step: int
  killed_at: float
  attempts: list[Attempt]
  final: RunResult
  events: list[records.ResizeEvent]


def _launch(
  lab: links.Lab,
  cfg: Any,
  run_dir: str,
  namespaces: Sequence[int],
  flags: Sequence[str],
  *,
  port: int,
  env: Mapping[str, str],
  tag: str,
) -> tuple[list[subprocess.Popen], list[str]]:
  """One driver per namespace, process k in ``namespaces[k]``, the first one coordinating."""
  n = len(namespaces)
  procs, logs = [], []
  coordinator = f"{lab.address(namespaces[0])}:{port}"
  for k, ns in enumerate(namespaces):
    logs.append(os.path.join(run_dir, f"{tag}.process{k}.log"))
    argv = [
      sys.executable, "-m", "experiments.train",
      f"--preset={cfg.preset}", f"--steps={cfg.steps}", f"--out_dir={run_dir}",
      f"--workers={n}", f"--num_processes={n}", f"--process_id={k}",
      f"--coordinator_address={coordinator}", *flags,
    ]  # fmt: skip
    with open(logs[-1], "w") as log:
      procs.append(lab.popen(ns, argv, stdout=log, stderr=subprocess.STDOUT, env=env))
  return procs, logs


def _logged(run_dir: str) -> list[StepRecord]:
  path = os.path.join(run_dir, "metrics.jsonl")
  return records.read_metrics(run_dir) if os.path.exists(path) else []


def _kill_at(
  name: str, procs: Sequence[subprocess.Popen], logs: Sequence[str], run_dir: str, cfg: Any
) -> float:
  """Waits until process 0 has logged ``cfg.kill_step``, then SIGKILLs the chosen process.

  Returns:
    ``time.time()`` of the kill.

  Raises:
    NetlabError: a driver failed, or the run ended before the step.
  """
  victim = cfg.kill_process % len(procs)
  while True:
    for i, p in enumerate(procs):
      if p.poll() not in (None, 0) or lab_lib._raised(logs[i]):
        raise lab_lib._failure(name, i, p, logs[i])
    logged = _logged(run_dir)
    if logged and logged[-1].step >= cfg.kill_step:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(procs[victim].pid, signal.SIGKILL)
      return time.time()
    if all(p.poll() is not None for p in procs):
      raise NetlabError(
        f"{name}: the run ended at step {logged[-1].step if logged else 0} before "
        f"--kill_step={cfg.kill_step}; use a --kill_step below --steps={cfg.steps}."
      )
    time.sleep(0.1)


def run_interrupted(
  lab: links.Lab,
  cfg: Any,
  method: str,
  *,
  port: int,
  flags: Sequence[str],
  env: Mapping[str, str],
) -> InterruptedRun:
  """Runs ``method`` with one process killed at ``cfg.kill_step``, then on the survivors.

  Args:
    lab: the built lab (shaped or not, as the comparison run was).
    cfg: the lab's settings (``kill_step``, ``kill_process``, ``rejoin_step``, ...).
    method: the method as named in ``--methods``; the run is ``<method>-interrupted``.
    port: the first coordinator port; each launch takes the next.
    flags: driver flags for every process, with ``--checkpoint_every``.
    env: the drivers' environment.

  Returns:
    The attempts, the kill, and the final records.

  Raises:
    NetlabError: a driver failed, or the run ended before the kill step.
  """
  name = f"{method}-interrupted"
  run_dir = os.path.join(cfg.out_dir, "runs", name)
  shutil.rmtree(run_dir, ignore_errors=True)
  os.makedirs(run_dir)
  n = lab.num_processes
  victim = cfg.kill_process % n
  survivors = [i for i in range(n) if i != victim]
  plan = [(list(range(n)), [], "attempt1")]
  plan.append((survivors, ["--resume"], "attempt2"))
  if cfg.rejoin_step:
    plan[1][1].append(f"--stop_at_step={cfg.rejoin_step}")
    plan.append((list(range(n)), ["--resume"], "attempt3"))
  attempts, killed_at, kill_step = [], 0.0, 0
  for number, (namespaces, extra, tag) in enumerate(plan):
    started = time.time()
    procs, logs = _launch(
      lab, cfg, run_dir, namespaces, [*flags, *extra], port=port + number, env=env, tag=tag
    )
    print(f"netlab: {name}: {tag} on {len(procs)} processes (logs in {run_dir})", flush=True)
    try:
      if number == 0:
        killed_at = _kill_at(name, procs, logs, run_dir, cfg)
      else:
        lab_lib._wait(name, procs, logs, cfg.run_time_limit_s)
    finally:
      lab_lib._stop(procs)
    logged = _logged(run_dir)
    first = attempts[-1].records[-1].step if attempts else 0
    if number == 0:
      kill_step = logged[-1].step if logged else 0
      print(f"netlab: {name}: killed process {victim} after step {kill_step}", flush=True)
    events = records.read_events(run_dir)
    resumed = events[-1].step if number and events else first
    own = [r for r in logged if r.step > resumed] if number else logged
    attempts.append(Attempt(len(procs), started, own))
  summary_path = os.path.join(run_dir, "summary.json")
  summary = records.Summary.load(summary_path) if os.path.exists(summary_path) else None
  final = RunResult(name, True, _logged(run_dir), summary, started_at=attempts[0].started)
  return InterruptedRun(
    method, victim, kill_step, killed_at, attempts, final, records.read_events(run_dir)
  )


def _final_val(rs: Sequence[StepRecord]) -> float | None:
  return next((r.val_loss for r in reversed(rs) if r.val_loss is not None), None)


def _elapsed(run: RunResult | None) -> float | None:
  if run is None or not run.records or run.started_at is None:
    return None
  return run.records[-1].wall_time - run.started_at


def figures(run: InterruptedRun, reference: RunResult | None) -> dict[str, Any]:
  """What the interruption cost, against ``reference``, the uninterrupted run on the same links.

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
  }
  a, b = out["wall_s_interrupted"], out["wall_s_uninterrupted"]
  out["wall_s_lost"] = a - b if a is not None and b is not None else None
  return out


def _num(x: float | None, spec: str) -> str:
  return "n/a" if x is None else format(x, spec)


def markdown_rows(report: Mapping[str, Mapping[str, Any]]) -> list[str]:
  """The report's section on interrupted runs (empty when there were none)."""
  rows = [(name, e["interrupted"]) for name, e in report.items() if e.get("interrupted")]
  if not rows:
    return []
  lines = [
    "",
    "## A process killed mid-run",
    "",
    "| method | processes | killed after step | resumed from | steps redone "
    "| back at that step after | wall time | uninterrupted | lost "
    "| final loss | uninterrupted | final val loss | uninterrupted |",
    "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for name, f in rows:
    lines.append(
      f"| {name} | {' -> '.join(map(str, f['processes']))} | {f['kill_step']} "
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
