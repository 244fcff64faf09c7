"""What the lab's runs leave behind, as the report reads it.

A :class:`RunResult` per training run, and an :class:`InterruptedRun` for a
run that lost a process mid-run and went on without it
(:mod:`experiments.netlab.interrupt`).
"""

from __future__ import annotations

import dataclasses

from experiments.run import records
from experiments.run.records import StepRecord, Summary

__all__ = ["Attempt", "InterruptedRun", "RunResult"]


@dataclasses.dataclass(frozen=True)
class RunResult:
  """One training run of the lab.

  Attributes:
    method: the method as ``--methods`` named it (``adamw``, ``demo-k8-1bit``).
    shaped: whether the links were rate-limited.
    records: process 0's metrics records, in step order.
    summary: the run's ``summary.json``, or None if it was stopped before writing it.
    stopped_at_limit: the run hit ``--run_time_limit_s`` and was stopped.
    started_at: ``time.time()`` when the lab launched its drivers.
    attempts: one entry per launch of the drivers: ``started``, ``ended``,
      ``resumed``, ``exit_codes``, and the drivers' last ``lines`` when they
      stopped early (preempted, a peer lost) and the lab restarted them.
    blackout: the link taken down during the run, and when
      (:meth:`experiments.netlab.faults.Blackout.summary`), if any.
    run_dir: where the run's files are.
    impairment_counts: per link (process address), the packets that the
      delay-and-loss forwarder saw cross it during the run and those it dropped.
  """

  method: str
  shaped: bool
  records: list[StepRecord]
  summary: Summary | None
  stopped_at_limit: bool = False
  started_at: float | None = None
  attempts: list[dict] = dataclasses.field(default_factory=list)
  blackout: dict | None = None
  run_dir: str | None = None
  impairment_counts: dict | None = None


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
    survivors_exit: how the survivors of the kill stopped: their
      ``exit_codes`` (76: they named the lost peer; None: the lab stopped
      them), the ``seconds`` from the kill, and their last ``lines``.
  """

  method: str
  killed_process: int
  kill_step: int
  killed_at: float
  attempts: list[Attempt]
  final: RunResult
  events: list[records.ResizeEvent]
  survivors_exit: dict = dataclasses.field(default_factory=dict)
