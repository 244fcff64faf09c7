"""Orbax checkpoints of a training run: params, per-worker optimizer state, step, data.

Saves go through ``orbax.checkpoint.CheckpointManager``, which writes each
step into a temporary directory and renames it into place only once every
item is on disk, so a save that dies midway leaves nothing that ``latest``
would pick up. Restores check what they read against the run they are meant
for, and fall back to an older checkpoint if the newest cannot be read.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import orbax.checkpoint as ocp

from experiments.data import iterator_checkpoint_args

__all__ = ["CheckpointError", "Checkpointer"]


class CheckpointError(RuntimeError):
  """A checkpoint cannot be used; the message says why and what to do."""


class Checkpointer:
  """Saves and restores ``{"params", "opt_state"}`` plus data-iterator state.

  Args:
    directory: where the step directories live (``OUT_DIR/checkpoints``).
    save_every: save when ``step % save_every == 0`` (and at the end).
    fingerprint: JSON-able description of the run (preset, optimizer, workers,
      ...). A restore refuses a checkpoint whose fingerprint differs.
    max_to_keep: how many recent checkpoints stay on disk.
  """

  def __init__(self, directory: str, *, save_every: int, fingerprint: dict, max_to_keep: int = 3):
    self.directory = os.path.abspath(directory)
    self.save_every = save_every
    self.fingerprint = fingerprint
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      create=True,
      cleanup_tmp_directories=True,
      enable_async_checkpointing=False,
    )
    self._manager = ocp.CheckpointManager(
      self.directory, options=options, item_names=("state", "data", "meta")
    )

  def should_save(self, step: int, last_step: int) -> bool:
    return self.save_every > 0 and (step % self.save_every == 0 or step == last_step)

  def save(self, step: int, state: Any, data_iterator: Any) -> None:
    """Writes one checkpoint and waits until it is complete on disk.

    Args:
      step: the step just finished.
      state: the train state (params and optimizer state).
      data_iterator: the grain iterator; each process saves its own position.
    """
    self._manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=iterator_checkpoint_args(data_iterator),
        meta=ocp.args.JsonSave({"step": step, **self.fingerprint}),
      ),
      force=True,
    )
    self._manager.wait_until_finished()

  def complete_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def restore_latest(self, abstract_state: Any, data_iterator: Any) -> tuple[int, Any]:
    """Restores the newest readable checkpoint.

    Args:
      abstract_state: ``jax.ShapeDtypeStruct`` tree with shardings, the target;
        or a function of the step that returns it, for a target that depends
        on what that checkpoint holds (an elastic resume's worker count).
      data_iterator: the grain iterator, set in place to the saved position.

    Returns:
      ``(step, state)``.

    Raises:
      CheckpointError: if there is no complete checkpoint, none can be read, or
        the checkpoint belongs to a different run configuration.
    """
    steps = self.complete_steps()
    if not steps:
      raise CheckpointError(
        f"--resume: no complete checkpoint in {self.directory}. Start without "
        "--resume, or point --out_dir at the run to continue."
      )
    failures = []
    for step in reversed(steps):
      try:
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
          "meta"
        ]
      except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped
        failures.append(f"step {step}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        continue
      mismatch = {k: (meta.get(k), v) for k, v in self.fingerprint.items() if meta.get(k) != v}
      if mismatch:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs run {b!r}" for k, (a, b) in mismatch.items())
        raise CheckpointError(
          f"--resume: the checkpoint at step {step} in {self.directory} is from a "
          f"different run ({detail}). Resume with the same flags, or use a new --out_dir."
        )
      try:
        target = abstract_state(step) if callable(abstract_state) else abstract_state
        restored = self._manager.restore(
          step,
          args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target),
            data=iterator_checkpoint_args(data_iterator, restore=True),
          ),
        )
      except Exception as e:  # noqa: BLE001
        failures.append(f"step {step}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        continue
      if failures:
        logging.warning("Skipped unreadable checkpoints: %s", "; ".join(failures))
      return step, restored["state"]
    raise CheckpointError(
      f"--resume: no checkpoint in {self.directory} could be read ({'; '.join(failures)}). "
      "Remove the damaged step directories or start without --resume."
    )

  def close(self) -> None:
    self._manager.close()
