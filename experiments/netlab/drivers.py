"""The lab's driver processes: waiting on them, telling a failure, stopping them.

Shared by the plain runs (:mod:`experiments.netlab.lab`) and the interrupted
ones (:mod:`experiments.netlab.interrupt`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence

from experiments.netlab.links import NetlabError

__all__ = ["failure", "raised", "stop", "tail", "wait"]


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


def wait(name: str, procs: Sequence[subprocess.Popen], logs: Sequence[str], limit_s: float) -> bool:
  """Waits for every driver to finish; returns whether the time limit stopped them.

  Raises:
    NetlabError: a driver failed.
  """
  start = time.monotonic()
  while any(p.poll() is None for p in procs):
    # A driver that raised can hang at exit in JAX's shutdown barrier, waiting
    # for peers that wait for it; its traceback is the failure.
    for i, p in enumerate(procs):
      if p.returncode not in (None, 0) or raised(logs[i]):
        raise failure(name, i, p, logs[i])
    if limit_s and time.monotonic() - start > limit_s:
      print(f"netlab: {name}: stopped at --run_time_limit_s={limit_s:g}", flush=True)
      return True
    time.sleep(0.2)
  for i, p in enumerate(procs):
    if p.returncode:
      raise failure(name, i, p, logs[i])
  return False
