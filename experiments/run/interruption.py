"""A run that stops before its last step on purpose: its exit status, its line, its resume command.

Two causes end a training process early without a traceback, each with an
exit status of its own, so that whatever restarts the run (SLURM, a
Kubernetes JobSet, netlab's lab; ``experiments/cluster/``) can tell them
from a bug or a bad flag (status 2) and resume without a person:

- :data:`PREEMPTED` (75, ``EX_TEMPFAIL`` of ``sysexits.h``, "try again
  later"): a preemption notice (SIGTERM) arrived; every process saved the
  checkpoint of the same step and stopped (:mod:`experiments.run.preemption`).
- :data:`PEER_LOST` (76): another process of the run stopped answering; the
  survivors stopped (:mod:`experiments.run.peers`). The checkpoints on disk
  are intact, and the last one is where the run resumes.

Each process prints one line to stderr that says what happened and gives the
exact command that resumes it (its own command line with ``--resume``, and
after a lost peer also the elastic resume on the survivors where the batch
allows it). The lowest-indexed process that carries on also writes the same
facts to ``OUT_DIR/interruption.json`` for scripts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any

from experiments.run.config import TrainConfig

__all__ = [
  "PEER_LOST",
  "PREEMPTED",
  "RECORD_NAME",
  "RunInterruptedError",
  "PreemptedError",
  "command_text",
  "edit_argv",
  "elastic_resume_edits",
  "peer_lost_line",
  "train_argv",
  "write_record",
]

PREEMPTED = 75
PEER_LOST = 76
RECORD_NAME = "interruption.json"
_COMMAND = ("python", "-m", "experiments.train")
# Flags of experiments.train that take a value; the rest of those edited here are bools.
_VALUED = {"num_processes", "process_id", "coordinator_address", "workers", "replicas"}


class RunInterruptedError(RuntimeError):
  """A run that stopped early on purpose; ``str()`` is its one line.

  Attributes:
    exit_code: the process's exit status (:data:`PREEMPTED` or :data:`PEER_LOST`).
    step: the last step trained.
  """

  exit_code = 1

  def __init__(self, line: str, step: int):
    super().__init__(line)
    self.step = step


class PreemptedError(RunInterruptedError):
  """SIGTERM arrived; the checkpoint of ``step`` is on disk on every process."""

  exit_code = PREEMPTED

  def __init__(self, step: int, resume: str):
    super().__init__(f"preempted at step {step}; resume with: {resume}", step)
    self.resume = resume


def train_argv(cfg: TrainConfig, argv: Sequence[str] | None = None) -> list[str]:
  """This process's ``experiments.train`` flags: as typed, or rebuilt from ``cfg``.

  Under ``python -m experiments.train`` they are the command line itself
  (``sys.argv``), so the resume command is the one the user typed. A run
  started from Python (Colab, a test) has no such line; its flags are the
  fields of ``cfg`` that differ from their defaults.

  Args:
    cfg: the run's config as given (before the recipe fills it).
    argv: the process's arguments (default ``sys.argv``).

  Returns:
    The flags, without the program.
  """
  argv = list(sys.argv if argv is None else argv)
  if argv and argv[0].replace(os.sep, "/").endswith("experiments/train.py"):
    return argv[1:]
  flags = []
  for f in dataclasses.fields(cfg):
    value = getattr(cfg, f.name)
    if value == f.default:
      continue
    if isinstance(value, bool):
      flags.append(f"--{f.name}" if value else f"--no{f.name}")
    else:
      flags.append(f"--{f.name}={value}")
  return flags


def edit_argv(argv: Sequence[str], edits: dict[str, str | None]) -> list[str]:
  """``argv`` with the flags of ``edits`` set (``str``) or removed (``None``), and ``--resume``.

  Both ``--name=value`` and ``--name value`` are recognised for the flags
  that take a value; ``--resume``, ``--noresume`` and ``--resume=...`` are
  replaced by one ``--resume`` at the end.

  Args:
    argv: the flags, without the program.
    edits: flag name -> its new value, or None to drop it.

  Returns:
    The edited flags.
  """
  out, i = [], 0
  while i < len(argv):
    arg = argv[i]
    m = re.match(r"^--?([a-z_0-9]+)(=.*)?$", arg)
    name = m.group(1) if m else None
    name = "resume" if name == "noresume" else name
    i += 1
    if name == "resume" or name in edits:
      if name in _VALUED and m.group(2) is None and i < len(argv):
        i += 1  # --name value: the value goes too
      continue
    out.append(arg)
  out += [f"--{k}={v}" for k, v in edits.items() if v is not None]
  return [*out, "--resume"]


def command_text(argv: Sequence[str]) -> str:
  """``python -m experiments.train`` and ``argv``, quoted for a POSIX shell."""
  return shlex.join([*_COMMAND, *argv])


def elastic_resume_edits(
  cfg: TrainConfig, processes: int, lost: Sequence[int], me: int, coordinator: str | None
) -> dict[str, str | None] | None:
  """The flags that resume on the survivors of a lost peer, or None when the batch forbids it.

  Each process holds ``devices / processes`` devices; the survivors keep
  theirs, so the run continues on ``survivors x that`` devices (an elastic
  resume, ``experiments.run.elastic``) if the global batch divides by them.

  Args:
    cfg: the run's resolved config.
    processes: processes in the run.
    lost: the processes that were lost.
    me: this process's index (a survivor).
    coordinator: the ``--coordinator_address`` it was given, if any.

  Returns:
    Flag edits for :func:`edit_argv`: the process count and id, the
    coordinator (the first survivor's host when process 0 was lost, which
    this process cannot know, so it is left as a placeholder), and the
    worker (or site) count.
  """
  survivors = [p for p in range(processes) if p not in lost]
  if not survivors or me not in survivors or cfg.devices % processes:
    return None
  devices = cfg.devices // processes * len(survivors)
  if devices % cfg.fsdp or cfg.batch_size % devices:
    return None
  edits: dict[str, str | None] = {}
  if cfg.fsdp == 1:
    edits.update(workers=str(devices), replicas=None)
  else:
    edits.update(replicas=str(devices // cfg.fsdp), workers=None)
  if len(survivors) == 1:
    edits.update(num_processes=None, process_id=None, coordinator_address=None)
    return edits
  edits.update(num_processes=str(len(survivors)), process_id=str(survivors.index(me)))
  if coordinator and 0 in lost:
    port = coordinator.rpartition(":")[2]
    edits["coordinator_address"] = f"HOST_OF_PROCESS_{survivors[0]}:{port}"
  return edits


def _who(lost: Sequence[int]) -> str:
  names = ", ".join(map(str, lost))
  who = f"process {names}" if len(lost) == 1 else f"processes {names}"
  return who + (" (the coordinator)" if 0 in lost else "")


def peer_lost_line(
  lost: Sequence[int],
  processes: int,
  timeout_s: float,
  checkpoint: tuple[int, str] | None,
  resume_all: str | None,
  resume_survivors: str | None,
) -> str:
  """The one line a survivor prints when peers stopped answering.

  Args:
    lost: the lost processes.
    processes: processes in the run.
    timeout_s: how long they were silent (``--peer_timeout_s``).
    checkpoint: ``(step, directory)`` of the newest complete checkpoint, or None.
    resume_all: the command that resumes on all processes, the lost ones
      back; None when no training had begun (nothing to resume).
    resume_survivors: the elastic resume on the survivors, or None when the
      batch does not divide over them.
  """
  who = _who(lost)
  line = (
    f"peer lost: {who} of {processes} sent no heartbeat for {timeout_s:g} s (hung, stopped "
    "or cut off)"
  )
  if resume_all is None:
    return line + " before training began; start the run again with the same command."
  if checkpoint:
    line += f"; the last checkpoint is step {checkpoint[0]} in {checkpoint[1]}; "
  else:
    line += "; no checkpoint was saved yet, so the run starts again from step 0; "
  survivors = processes - len(lost)
  if resume_survivors:
    line += (
      f"resume on the {survivors} surviving process{'es' if survivors > 1 else ''} with: "
      f"{resume_survivors}; or on all {processes} once {who} is back with: {resume_all}"
    )
  else:
    line += f"resume once {who} is back (the batch does not divide over the survivors) with: "
    line += resume_all
  return line


def write_record(out_dir: str, **facts: Any) -> None:
  """Writes ``OUT_DIR/interruption.json``: what the line says, for a script, with the time."""
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, RECORD_NAME)
  with open(path + ".tmp", "w") as f:
    json.dump({**facts, "time": time.time()}, f, indent=2)
  os.replace(path + ".tmp", path)
