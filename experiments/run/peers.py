"""Peers that stop answering: found in a bounded time, named in one line, exit status 76.

A multi-process run is one SPMD job: every step's exchange waits for every
process. When one stops answering (hung, SIGSTOPped, its machine cut off),
the others wait in a collective that never ends. JAX's coordination service
notices the missing heartbeats after ``heartbeat_timeout_seconds`` (100 s by
default) and then aborts every process with ``Fatal Python error: Aborted``
and a C++ stack, naming nobody; the stopped process stays stopped.

So each process of a multi-process run keeps a watchdog of its own, started
by :func:`experiments.run.launch.setup_devices` right after
``jax.distributed.initialize``:

- a *beat* thread writes a counter under ``distro_jax/alive/<process>`` in
  the coordination service's key-value store every ``--peer_timeout_s / 12``
  seconds (at most 5 s), and reads everyone's;
- a *judge* thread declares a peer lost when its counter has not moved for
  ``--peer_timeout_s`` seconds, and the coordinator (process 0, which hosts
  the store) when this process's own beats have not gone through for that
  long. It posts its verdict under ``distro_jax/lost/<process>``, where the
  other survivors adopt it at their next beat, prints one line (who was
  lost, the last checkpoint, the commands that resume:
  :func:`experiments.run.interruption.peer_lost_line`), the lowest-indexed
  survivor writes ``OUT_DIR/interruption.json``, and the process ends with
  status 76 (``os._exit``: its main thread is blocked in a collective that
  will never return, and JAX's shutdown would wait for the lost peer).
  Process 0 ends last, once the other survivors have posted their verdicts:
  the coordination service lives in it, and JAX aborts every process still
  connected when it goes.

JAX's own heartbeat timeout is raised to three times ``--peer_timeout_s``
(:func:`jax_heartbeat_timeout_s`, at least its default 100 s), since its
service declares a task dead after somewhere between half of it and all of
it: the watchdog always speaks first.

A peer that dies outright (SIGKILL, a crash) closes its sockets, and the
survivors' collective fails at once with a gloo (or NCCL) error. The trainer
hands such an error to :func:`collective_failed`, which waits for the
watchdog's verdict on the dead peer instead of letting a traceback out.

What this cannot catch: when process 0 itself *dies*, the coordination
service dies with it, and JAX's client aborts every other process at once,
in C++ (``Terminating process because the JAX distributed service detected
fatal errors``). jax 0.10.2 offers Python no hook there: its client takes a
``missed_heartbeat_callback``, but a Python callable given to it fails with
``std::bad_cast`` when called. A *stopped* process 0 is caught like any other.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from experiments.run import interruption

__all__ = [
  "Watchdog",
  "collective_failed",
  "jax_heartbeat_timeout_s",
  "start",
  "watch_run",
]

_ROOT = "distro_jax/"
_ALIVE, _VERDICT = f"{_ROOT}alive/", f"{_ROOT}lost/"
_DONE = "done"  # a process that ended normally: never lost
# What a collective's failure says when a peer's socket closed under it.
_COLLECTIVE_FAILURE = ("gloo", "nccl", "connection closed", "connection reset", "socket closed")


def jax_heartbeat_timeout_s(peer_timeout_s: float) -> int:
  """The ``heartbeat_timeout_seconds`` for ``jax.distributed.initialize``.

  JAX's coordination service declared a task dead between half and all of
  its heartbeat timeout after it stopped (5 s at 10, 15 s at 20 and 30, 86 s
  at 100, in this project's runs). Three times the watchdog's timeout keeps
  JAX's abort behind the watchdog's clean exit; 0 (no watchdog) keeps JAX's
  default.
  """
  return max(100, math.ceil(3 * peer_timeout_s)) if peer_timeout_s else 100


@dataclasses.dataclass
class _Run:
  """What the lost-peer line says about the run in progress."""

  cfg: Any
  argv: list[str]
  checkpoint_dir: str


class Watchdog:
  """Beats into the coordination service's key-value store and judges the peers' beats.

  Args:
    client: JAX's distributed runtime client (``key_value_set``,
      ``key_value_dir_get``).
    me: this process's index.
    processes: processes in the run.
    timeout_s: silence after which a peer is lost (``--peer_timeout_s``).
    clock: monotonic seconds (a test's fake clock).
    exit: ends the process with a status (``os._exit``; a test's recorder).
  """

  def __init__(
    self,
    client: Any,
    me: int,
    processes: int,
    timeout_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    exit: Callable[[int], Any] = os._exit,  # noqa: A002 - what it is
  ):
    self.client, self.me, self.processes, self.timeout_s = client, me, processes, timeout_s
    self.beat_s = min(5.0, max(0.5, timeout_s / 12))
    self._clock, self._exit = clock, exit
    now = clock()
    # Per peer: the last counter seen, and when it last changed (this process's clock).
    self.seen: dict[int, tuple[str | None, float]] = {
      p: (None, now) for p in range(processes) if p != me
    }
    self.own_ok = now  # when this process's beat last went through
    self.run: _Run | None = None
    self.verdict: list[int] | None = None
    # Verdicts other survivors posted, by process: who they found lost.
    self.posted: dict[int, list[int]] = {}
    self._count = 0
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._threads: list[threading.Thread] = []

  def start(self) -> None:
    for target, name in (
      (self._beat_loop, "distro-peer-beat"),
      (self._judge_loop, "distro-peer-judge"),
    ):
      thread = threading.Thread(target=target, name=name, daemon=True)
      thread.start()
      self._threads.append(thread)

  def beat(self) -> None:
    """One round: this process's counter written, everyone's read (blocks on a stopped store)."""
    self._count += 1
    self.client.key_value_set(f"{_ALIVE}{self.me}", str(self._count), allow_overwrite=True)
    entries = self.client.key_value_dir_get(_ROOT)
    now = self._clock()
    with self._lock:
      self.own_ok = now
      for key, value in entries:
        kind, _, who = key.rstrip("/").rpartition("/")
        p = int(who)
        if kind.endswith("alive") and p in self.seen and self.seen[p][0] != value:
          self.seen[p] = (value, now)
        elif kind.endswith("lost") and p != self.me:
          self.posted[p] = [int(x) for x in value.split(",") if x]

  def _beat_loop(self) -> None:
    while not self._stop.is_set():
      with contextlib.suppress(Exception):  # a failed round counts as silence
        self.beat()
      self._stop.wait(self.beat_s)

  def lost(self) -> list[int]:
    """The peers silent for longer than the timeout, now, or named by another survivor; or []."""
    now = self._clock()
    with self._lock:
      if self.me != 0 and now - self.own_ok > self.timeout_s:
        return [0]  # the store lives in process 0: it, or the way to it, is gone
      silent = sorted(
        p
        for p, (value, since) in self.seen.items()
        if value != _DONE and now - since > self.timeout_s
      )
      # A survivor that already judged settles it for all: the others stop at
      # once and name the same peers, rather than each on its own clock.
      others = [v for p, v in sorted(self.posted.items()) if self.me not in v]
      return silent or (others[0] if others else [])

  def _judge_loop(self) -> None:
    while not self._stop.wait(1.0):
      if lost := self.lost():
        self.end(lost)
        return

  def end(self, lost: Sequence[int]) -> None:
    """Says who was lost and how to resume, then ends the process with status 76.

    The verdict is posted to the store first, for the other survivors. Process
    0 hosts the store, and the coordination service dies with it, which makes
    JAX abort every process still connected; so it waits (a few beats at
    most) until every other survivor has posted its own verdict, and only then
    ends.
    """
    self.verdict = list(lost)
    if 0 not in lost:  # a stopped store would never answer
      value = ",".join(map(str, lost))
      post = threading.Thread(
        target=lambda: self.client.key_value_set(
          f"{_VERDICT}{self.me}", value, allow_overwrite=True
        ),
        daemon=True,
      )
      post.start()
      post.join(timeout=5)
    line, record = self._describe(lost)
    print(line, file=sys.stderr, flush=True)
    survivors = [p for p in range(self.processes) if p not in lost]
    if self.run is not None and survivors and self.me == survivors[0]:
      with contextlib.suppress(OSError):
        interruption.write_record(self.run.cfg.out_dir, **record)
    sys.stdout.flush()
    if self.me == 0:
      self._wait_for_verdicts([p for p in survivors if p != 0])
    self._exit(interruption.PEER_LOST)

  def _wait_for_verdicts(self, others: Sequence[int]) -> None:
    deadline = time.monotonic() + 2 * self.beat_s + 10
    while time.monotonic() < deadline and not set(others) <= set(self.posted):
      with contextlib.suppress(Exception):
        self.beat()
      time.sleep(0.2)

  def _describe(self, lost: Sequence[int]) -> tuple[str, dict[str, Any]]:
    run = self.run
    if run is None:  # lost before training began (or between runs): nothing to resume
      line = interruption.peer_lost_line(lost, self.processes, self.timeout_s, None, None, None)
      return line, {}
    checkpoint = _newest_checkpoint(run.checkpoint_dir)
    coordinator = _flag_value(run.argv, "coordinator_address")
    resume_all = interruption.command_text(interruption.edit_argv(run.argv, {}))
    edits = interruption.elastic_resume_edits(run.cfg, self.processes, lost, self.me, coordinator)
    survivors = (
      interruption.command_text(interruption.edit_argv(run.argv, edits)) if edits else None
    )
    line = interruption.peer_lost_line(
      lost,
      self.processes,
      self.timeout_s,
      (checkpoint, run.checkpoint_dir) if checkpoint is not None else None,
      resume_all,
      survivors,
    )
    record = {
      "reason": "peer_lost",
      "exit_code": interruption.PEER_LOST,
      "lost_processes": list(lost),
      "processes": self.processes,
      "checkpoint_step": checkpoint,
      "checkpoint_dir": run.checkpoint_dir,
      "resume": resume_all,
      "resume_on_survivors": survivors,
      "line": line,
    }
    return line, record

  def finish(self) -> None:
    """Marks this process done (its peers never count it lost) and stops both threads."""
    if self._stop.is_set():
      return
    self._stop.set()
    with contextlib.suppress(Exception):
      self.client.key_value_set(f"{_ALIVE}{self.me}", _DONE, allow_overwrite=True)


def _newest_checkpoint(directory: str) -> int | None:
  """The step of the newest complete checkpoint (orbax renames a save to its step when done)."""
  try:
    steps = [int(n) for n in os.listdir(directory) if n.isdigit()]
  except OSError:
    return None
  return max(steps) if steps else None


def _flag_value(argv: Sequence[str], name: str) -> str | None:
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      return arg.split("=", 1)[1]
    if arg == f"--{name}" and i + 1 < len(argv):
      return argv[i + 1]
  return None


_watchdog: Watchdog | None = None


def start(timeout_s: float) -> None:
  """Starts this process's watchdog; call right after ``jax.distributed.initialize``.

  Nothing happens in a single process or with ``timeout_s == 0``.

  Args:
    timeout_s: ``--peer_timeout_s``.
  """
  global _watchdog
  import jax
  from jax._src import distributed

  client = distributed.global_state.client
  if not timeout_s or client is None or jax.process_count() < 2 or _watchdog is not None:
    return
  _watchdog = Watchdog(client, jax.process_index(), jax.process_count(), timeout_s)
  _watchdog.start()
  # Registered after JAX's own shutdown, so it runs first: a process that
  # ended normally is marked done before it waits at JAX's shutdown barrier.
  atexit.register(_watchdog.finish)


def watch_run(cfg: Any, argv: Sequence[str], checkpoint_dir: str) -> None:
  """Tells the watchdog about the run in progress, for its line (no-op without a watchdog).

  Args:
    cfg: the run's resolved config.
    argv: its ``experiments.train`` flags
      (:func:`experiments.run.interruption.train_argv`).
    checkpoint_dir: where its checkpoints go.
  """
  if _watchdog is not None:
    _watchdog.run = _Run(cfg, list(argv), checkpoint_dir)


def collective_failed(error: BaseException) -> None:
  """On a collective that failed because a peer went away: wait for the watchdog to end the process.

  Returns at once for any other error, or without a watchdog; after
  ``--peer_timeout_s``, four beats and 10 s with no peer found silent,
  returns too, and the caller raises the error.

  Args:
    error: what the step raised.
  """
  if _watchdog is None or not any(m in str(error).lower() for m in _COLLECTIVE_FAILURE):
    return
  # The dead peer's last beat may reach this process a beat after the
  # failure, its silence is judged once a second, and on a loaded machine
  # each of those threads waits its turn: given up too soon, a lost peer
  # would end this process with a traceback (not 76, which a scheduler
  # restarts). Only a failure with every peer alive waits this long in vain.
  wait_s = _watchdog.timeout_s + 4 * _watchdog.beat_s + 10
  print(
    f"notice: a collective failed ({str(error).splitlines()[0][:160]}); waiting up to "
    f"{wait_s:g} s for the peer that went away to be named.",
    file=sys.stderr,
    flush=True,
  )
  deadline = time.monotonic() + wait_s
  while time.monotonic() < deadline and _watchdog.verdict is None:
    time.sleep(0.2)
