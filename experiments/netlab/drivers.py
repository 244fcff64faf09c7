"""The lab's driver processes: waiting on them, telling a failure from a restart, stopping them.

Shared by the plain runs (:mod:`experiments.netlab.lab`) and the interrupted
ones (:mod:`experiments.netlab.interrupt`). A driver that stops with status
75 (preempted) or 76 (a peer lost) asks to be restarted, as it would ask a
scheduler; any other nonzero status is a failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence

from experiments.netlab.links import NetlabError
from experiments.run.interruption import PEER_LOST, PREEMPTED

__all__ = ["RESTARTABLE", "failure", "last_line", "raised", "stop", "tail", "wait"]

# What a scheduler restarts: a run preempted, or one that lost a peer
# (experiments.run.interruption). Anything else nonzero is a failure.
RESTARTABLE = (PREEMPTED, PEER_LOST)


def stop(procs: Sequence[subprocess.Popen]) -> None:
  """SIGKILLs each process's session and waits for it.

  Not SIGTERM: JAX's distributed runtime installs a handler for it (its
  preemption service), and a driver so signalled kept running for seconds.
  Nothing is lost: the driver flushes every metrics line.
  """
  for p in procs:
    if p.poll() is None:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
  for p in procs:
    p.wait(timeout=30)


def tail(path: str, chars: int = 2500) -> str:
  try:
    with open(path, errors="replace") as f:
      return f.read()[-chars:]
  except OSError:
    return ""


def raised(log_path: str) -> bool:
  """Whether a driver's log shows an uncaught exception or the driver's error line."""
  text = tail(log_path, 20000)
  return "Traceback (most recent call last)" in text or "\nerror: " in text


def failure(name: str, i: int, proc: subprocess.Popen, log: str) -> NetlabError:
  status = "" if proc.returncode is None else f" with exit status {proc.returncode}"
  return NetlabError(f"{name}: process {i} failed{status}; the end of {log}:\n{tail(log)}")


def wait(
  name: str,
  procs: Sequence[subprocess.Popen],
  logs: Sequence[str],
  limit_s: float,
  *,
  tick: Callable[[], None] | None = None,
  grace_s: float = 90.0,
) -> str:
  """Waits for every driver to finish.

  A driver that stops with a nonzero status without a traceback (a
  :data:`RESTARTABLE` status, or killed or aborted: JAX aborts a process
  whose link to the coordination service broke) starts a grace period of
  ``grace_s``: the others get that long to stop on their own, as they do
  when they hear the same notice or find the same peer gone. Whatever still
  runs then (a stopped or hung peer) is killed, so nothing is left behind.
  The run was interrupted, and is to be restarted, if any driver stopped
  with a restartable status; otherwise it failed. A traceback or an
  ``error:`` line in a driver's log is a failure at once.

  Args:
    name: the run, for messages.
    procs: its drivers.
    logs: their logs.
    limit_s: stop them after this long (0: no limit).
    tick: called every poll (the lab's blackout).
    grace_s: how long the others get after the first nonzero exit; more
      than the drivers' ``--peer_timeout_s``.

  Returns:
    ``"done"``, ``"limit"`` (stopped at ``limit_s``) or ``"interrupted"``.

  Raises:
    NetlabError: a driver failed.
  """
  start = time.monotonic()
  first_exit = None
  while any(p.poll() is None for p in procs):
    if tick is not None:
      tick()
    if first_exit is None and any(p.returncode not in (None, 0) for p in procs):
      first_exit = time.monotonic()
    restartable = any(p.returncode in RESTARTABLE for p in procs)
    for i, p in enumerate(procs):
      # A driver that raised can hang at exit in JAX's shutdown barrier, waiting
      # for peers that wait for it; its traceback is the failure.
      if not restartable and raised(logs[i]):
        raise failure(name, i, p, logs[i])
    if first_exit is not None and time.monotonic() - first_exit > grace_s:
      stop(procs)
      break
    if limit_s and time.monotonic() - start > limit_s:
      print(f"netlab: {name}: stopped at --run_time_limit_s={limit_s:g}", flush=True)
      return "limit"
    time.sleep(0.2)
  if any(p.returncode in RESTARTABLE for p in procs):
    return "interrupted"
  for i, p in enumerate(procs):
    if p.returncode:
      raise failure(name, i, p, logs[i])
  return "done"


def last_line(log_path: str) -> str:
  """A driver's last line: its one-line account when it stopped early on purpose."""
  lines = tail(log_path, 4000).strip().splitlines()
  return lines[-1] if lines else ""
