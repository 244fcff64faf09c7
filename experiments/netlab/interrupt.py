"""A training process killed mid-run, and the run continued without it (``--kill_step``).

What a lost machine does to a run: the lab SIGKILLs one driver once process
0 has logged ``--kill_step``. The others cannot go on (an SPMD job's
processes are fixed at start, and a collective now waits for a peer that is
gone): each finds the peer silent and stops on its own, with status 76 and a
line naming it (:mod:`experiments.run.peers`). The lab, as a scheduler would
on that status, restarts the survivors in their own namespaces from the last
checkpoint with one process (and one worker) fewer: ``--resume
--num_processes=N-1 --workers=N-1``, an elastic resume
(``experiments.run.elastic``). With ``--rejoin_step`` the survivors stop at
that step (a checkpoint) and all N continue from it, the lost process back.

:func:`experiments.netlab.report.interruption_figures` says what it cost
against the same method's uninterrupted run on the same links: the steps
redone (from the checkpoint to where the kill struck), the seconds from the
kill until the run was back at that step, the end-to-end wall time lost, and
the final loss against the uninterrupted one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from experiments.netlab import drivers, links
from experiments.netlab.links import NetlabError
from experiments.netlab.results import Attempt, InterruptedRun, RunResult
from experiments.run import records
from experiments.run.records import StepRecord

__all__ = ["run_interrupted"]


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
      if p.poll() not in (None, 0) or drivers.raised(logs[i]):
        raise drivers.failure(name, i, p, logs[i])
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


def _survivors_stop(
  procs: Sequence[subprocess.Popen], logs: Sequence[str], victim: int, killed_at: float
) -> dict[str, Any]:
  """Waits for the survivors of a kill to stop on their own, as they do when a peer is lost.

  Each finds the killed peer silent (``--peer_timeout_s``) and exits with
  status 76 and one line; the lab then restarts the run as a scheduler
  would. Whatever still runs after the timeout and a margin is stopped.

  Returns:
    ``exit_codes`` of the survivors (None: the lab had to stop it), the
    seconds from the kill until the last of them stopped, and their last lines.
  """
  survivors = [p for i, p in enumerate(procs) if i != victim]
  deadline = time.monotonic() + 120
  while any(p.poll() is None for p in survivors) and time.monotonic() < deadline:
    time.sleep(0.2)
  return {
    "exit_codes": [p.poll() for p in survivors],
    "seconds": time.time() - killed_at,
    "lines": [drivers.last_line(log) for i, log in enumerate(logs) if i != victim],
  }


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
  attempts, killed_at, kill_step, survivors_exit = [], 0.0, 0, {}
  for number, (namespaces, extra, tag) in enumerate(plan):
    started = time.time()
    procs, logs = _launch(
      lab, cfg, run_dir, namespaces, [*flags, *extra], port=port + number, env=env, tag=tag
    )
    print(f"netlab: {name}: {tag} on {len(procs)} processes (logs in {run_dir})", flush=True)
    try:
      if number == 0:
        killed_at = _kill_at(name, procs, logs, run_dir, cfg)
        survivors_exit = _survivors_stop(procs, logs, victim, killed_at)
      else:
        drivers.wait(name, procs, logs, cfg.run_time_limit_s)
    finally:
      drivers.stop(procs)
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
    method,
    victim,
    kill_step,
    killed_at,
    attempts,
    final,
    records.read_events(run_dir),
    survivors_exit=survivors_exit,
  )
