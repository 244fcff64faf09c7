"""Orbax checkpoints of a training run: params, per-worker optimizer state, step, data.

Saves go through ``orbax.checkpoint.CheckpointManager``, which writes each
step into a temporary directory and renames it into place only once every
item is on disk, so a save that dies midway leaves nothing that a resume
would pick up (the manager removes such leftovers when it next opens). Once a
save is complete, process 0 records a digest of every file in it
(``experiments.run.integrity``).

A resume takes the newest checkpoint whose files match their digest. A
damaged one (truncated, flipped bytes, a file missing) is set aside into
``OUT_DIR/damaged_checkpoints/`` with a one-line notice, never deleted, and
the run continues from the newest intact one; saving the set-aside step
again later finds the way clear. The checkpoint's metadata must match the run
(its fingerprint, and the data file's size and ends), and it hands back the
settings that steered the run (checkpoint interval, evaluation, logging).

Nothing is deleted unless ``keep`` asks the manager to keep only the newest
``keep`` checkpoints (``--keep_checkpoints``); by default every one stays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import orbax.checkpoint as ocp

from experiments.run import integrity
from experiments.run.data import iterator_checkpoint_args
from experiments.run.rundir import filesystem_error

__all__ = ["CheckpointError", "Checkpointer", "ResumePoint"]

_ITEMS = ("state", "data", "meta")
# Fingerprint entries an older checkpoint may lack; they are compared only when recorded.
_OPTIONAL = ("data_identity",)
# Settings added since checkpoints were first written: a checkpoint that lacks
# one was made with its default.
_ADDED_LATER = {
  "synchronous_params": "",
  "sparseloco_chunk": 64,
  "random_positions": False,
  "frequency_bias": 0.0,
  "normalize": "sign",
  "compression_groups": "",
  "scan_layers": False,
}


class CheckpointError(RuntimeError):
  """A checkpoint cannot be used; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class ResumePoint:
  """The checkpoint a resume continues from.

  Attributes:
    step: its step.
    meta: what it recorded: the run's fingerprint, ``"runtime"`` (the
      settings that steered the run) and ``"data_identity"``.
    verified: whether its files matched their digest (``False``: it has
      none, being older than digests).
  """

  step: int
  meta: dict[str, Any]
  verified: bool


class _DropOrbaxErrors(logging.Filter):
  """Orbax logs a failed save's traceback itself; the run reports it in one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "orbax" not in record.pathname


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
  loggers = [logging.getLogger("absl"), logging.getLogger()]
  quiet = _DropOrbaxErrors()
  for lg in loggers:
    lg.addFilter(quiet)
  try:
    yield
  finally:
    for lg in loggers:
      lg.removeFilter(quiet)


def _difference(key: str, then: Any, now: Any) -> str:
  if key == "data_identity" and then and now:
    return f"the data file changed: {then['bytes']:,} bytes then, {now['bytes']:,} now" + (
      ", and other content" if then["bytes"] == now["bytes"] else ""
    )
  return f"{key}: checkpoint {then!r} vs run {now!r}"


def _one_line(e: BaseException) -> str:
  return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


class Checkpointer:
  """Saves and restores ``{"params", "opt_state"}`` plus data-iterator state.

  Args:
    directory: where the step directories live (``OUT_DIR/checkpoints``).
    fingerprint: JSON-able description of the run (preset, optimizer, workers,
      ..., the data file's identity). A resume refuses a checkpoint whose
      fingerprint differs.
    main: whether this is process 0, which writes digests and sets damaged
      checkpoints aside.
    multiprocess: whether other processes share the directory; they follow
      process 0's choice of the checkpoint to resume from.
  """

  def __init__(
    self, directory: str, *, fingerprint: dict, main: bool = True, multiprocess: bool = False
  ):
    self.directory = os.path.abspath(directory)
    self.fingerprint = fingerprint
    self.main, self.multiprocess = main, multiprocess
    self.save_every, self.keep, self.runtime = 0, 0, {}
    self._manager: ocp.CheckpointManager | None = None

  def configure(self, *, save_every: int, keep: int, runtime: dict[str, Any]) -> None:
    """The run's settings, once resolved: the interval, how many to keep, what to record.

    Args:
      save_every: save when ``step % save_every == 0`` (and at the end); 0: never.
      keep: keep only the newest ``keep`` checkpoints; 0 keeps every one.
      runtime: the settings a resume takes back (``config.runtime_settings``).
    """
    self.save_every, self.keep, self.runtime = save_every, keep, dict(runtime)

  @property
  def manager(self) -> ocp.CheckpointManager:
    if self._manager is None:
      options = ocp.CheckpointManagerOptions(
        max_to_keep=self.keep or None,
        create=True,
        cleanup_tmp_directories=True,
        enable_async_checkpointing=False,
      )
      self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)
    return self._manager

  def should_save(self, step: int, last_step: int) -> bool:
    return self.save_every > 0 and (step % self.save_every == 0 or step == last_step)

  def save(self, step: int, state: Any, data_iterator: Any) -> None:
    """Writes one checkpoint, waits until it is complete on disk, and records its digest.

    Args:
      step: the step just finished.
      state: the train state (params and optimizer state).
      data_iterator: the grain iterator; each process saves its own position.

    Raises:
      OutDirError: the disk is full, read-only or denied the write; the
        checkpoints saved before are untouched.
    """
    meta = {"step": step, **self.fingerprint, "runtime": self.runtime}
    where = f"checkpoint {step} to {self.directory}"
    try:
      with _quiet_orbax():
        self.manager.save(
          step,
          args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=iterator_checkpoint_args(data_iterator),
            meta=ocp.args.JsonSave(meta),
          ),
          force=True,
        )
        self.manager.wait_until_finished()
      if self.main:
        integrity.write_digest(os.path.join(self.directory, str(step)))
    except Exception as e:
      if err := filesystem_error(e, where):
        raise type(err)(f"{err} {self._intact_note(step)}") from None
      raise

  def _intact_note(self, failed: int) -> str:
    done = [s for s in self.steps_on_disk() if s != failed]
    if not done:
      return "No checkpoint was complete before it."
    return f"The checkpoint of step {done[-1]} is intact; --resume continues from it."

  def steps_on_disk(self) -> list[int]:
    """Steps of the complete checkpoints (orbax renames a save to its step once done)."""
    if not os.path.isdir(self.directory):
      return []
    return sorted(int(n) for n in os.listdir(self.directory) if n.isdigit())

  def find_resume_point(self) -> ResumePoint:
    """The newest intact checkpoint; damaged ones newer than it are set aside.

    Process 0 checks the digests and moves damaged checkpoints into
    ``OUT_DIR/damaged_checkpoints/``, with a one-line notice each; the other
    processes take the step it chose. Reads only small files, so a resume
    that cannot work stops before anything is compiled.

    Raises:
      CheckpointError: no intact checkpoint, or one from a different run.
    """
    step = self._choose() if self.main else -1
    if self.multiprocess:
      import numpy as np
      from jax.experimental import multihost_utils

      step = int(multihost_utils.broadcast_one_to_all(np.int32(step)))
    if step < 0:
      raise CheckpointError(
        f"--resume: no intact checkpoint in {self.directory}"
        + (" (damaged ones were set aside, see above)" if step == -2 else "")
        + ". Start without --resume, or point --out_dir at the run to continue."
      )
    verified = integrity.has_digest(os.path.join(self.directory, str(step)))
    meta = self._read_meta(step, verified)
    self._check_fingerprint(step, meta)
    return ResumePoint(step, meta, verified)

  def _choose(self) -> int:
    """Process 0's pick: the newest intact step, -1 if there is none, -2 if all were damaged."""
    steps = self.steps_on_disk()
    out_dir = os.path.dirname(self.directory)
    for step in reversed(steps):
      step_dir = os.path.join(self.directory, str(step))
      if not integrity.has_digest(step_dir):
        print(
          f"notice: the checkpoint of step {step} has no digest (it predates them, or the "
          "run stopped as it was saved); it is restored unverified.",
          file=sys.stderr,
          flush=True,
        )
        return step
      if (problem := integrity.verify(step_dir)) is None:
        return step
      where = integrity.set_aside(step_dir, out_dir)
      print(
        f"notice: the checkpoint of step {step} is damaged ({problem}); set aside as "
        f"{where}, resuming from an older one.",
        file=sys.stderr,
        flush=True,
      )
    return -2 if steps else -1

  def _read_meta(self, step: int, verified: bool) -> dict[str, Any]:
    reader = ocp.CheckpointManager(
      self.directory, options=ocp.CheckpointManagerOptions(read_only=True), item_names=_ITEMS
    )
    try:
      return reader.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is the checkpoint's fault
      raise self._unreadable(step, verified, e) from None
    finally:
      reader.close()

  def _unreadable(self, step: int, verified: bool, e: BaseException) -> CheckpointError:
    step_dir = os.path.join(self.directory, str(step))
    if verified:
      return CheckpointError(
        f"--resume: the checkpoint of step {step} is intact but cannot be restored "
        f"({_one_line(e)}); resume with the version of the program that wrote it, or use "
        "a new --out_dir."
      )
    return CheckpointError(
      f"--resume: the checkpoint of step {step} cannot be read ({_one_line(e)}) and has "
      f"no digest to tell damage from a format change; move {step_dir} out of the way "
      "to resume from the one before, or start without --resume."
    )

  def _check_fingerprint(self, step: int, meta: dict[str, Any]) -> None:
    meta = {**_ADDED_LATER, **meta}
    mismatch = {
      k: (meta.get(k), v)
      for k, v in self.fingerprint.items()
      if meta.get(k) != v and not (k in _OPTIONAL and k not in meta)
    }
    if mismatch:
      detail = ", ".join(_difference(k, a, b) for k, (a, b) in mismatch.items())
      raise CheckpointError(
        f"--resume: the checkpoint at step {step} in {self.directory} is from a "
        f"different run ({detail}). Resume with the same flags and data, or use a new "
        "--out_dir."
      )

  def restore(self, point: ResumePoint, abstract_state: Any, data_iterator: Any) -> Any:
    """The train state of ``point``; sets ``data_iterator`` to the saved position.

    Args:
      point: from :meth:`find_resume_point`.
      abstract_state: ``jax.ShapeDtypeStruct`` tree with shardings, the target.
      data_iterator: the grain iterator, set in place.

    Raises:
      CheckpointError: the checkpoint cannot be read.
    """
    try:
      restored = self.manager.restore(
        point.step,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state),
          data=iterator_checkpoint_args(data_iterator, restore=True),
        ),
      )
    except Exception as e:  # noqa: BLE001 - reported with what to do
      raise self._unreadable(point.step, point.verified, e) from None
    return restored["state"]

  def close(self) -> None:
    if self._manager is not None:
      self._manager.close()
