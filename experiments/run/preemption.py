"""Preemption notices: SIGTERM, then one agreed step, its checkpoint, and exit status 75.

Spot instances, SLURM's preemption and time limit, and Kubernetes evictions
send SIGTERM and wait a grace time (30 s or more) before SIGKILL. A run that
hears it should save where it is and stop, all processes at the same step.

- **Several processes** (``jax.distributed``): JAX's distributed runtime
  already listens for SIGTERM. ``jax.distributed.initialize`` starts a
  preemption sync manager whose C++ handler takes the signal; the process
  that got it tells the coordination service, every process reports the last
  step it passed to :func:`jax.experimental.multihost_utils.reached_preemption_sync_point`,
  and all agree on the step after the furthest one. That function is true at
  that step on every process, and only there.
- **One process**: that function is always false (there is no distributed
  client), so a Python SIGTERM handler takes its place for the length of the
  run.

The trainer holds a :class:`Notice` while it runs and calls
:meth:`Notice.reached` once per step, after dispatching it. When that is
true, every process saves that step's checkpoint (params, per-worker
optimizer state with any message in flight, and its data position), and the
run ends with :class:`~experiments.run.interruption.PreemptedError`: one line,
``preempted at step N; resume with: ...``, and exit status 75.

JAX counts steps from the first call, so the trainer passes the steps done
since the run (or the resume) started, never the global step: a notice that
lands before the first call (while compiling) makes the first step the agreed
one, on a resumed run too.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from experiments.run import interruption
from experiments.run.config import TrainConfig

__all__ = ["Notice", "stop"]


def _distributed_state() -> tuple[bool, bool]:
  """Whether ``jax.distributed`` joined this process to others, and whether it handles SIGTERM.

  The second is False only where ``jax_enable_preemption_service`` was turned off.
  """
  from jax._src import distributed

  state = distributed.global_state
  return state.client is not None, state.preemption_sync_manager is not None


class Notice:
  """Whether a preemption notice arrived and this is the step to stop at.

  Use it as a context manager around a run (or :meth:`close` it after); in
  between, a single process handles SIGTERM itself, and a SIGTERM that comes
  before the first step (while compiling) stops the run after it. A second
  SIGTERM changes nothing: the checkpoint is already coming.
  """

  def __init__(self):
    self._received = False
    self._previous: Any = None
    self._handled = False
    self._distributed, self._synced = _distributed_state()
    if not self._distributed and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
      self._handled = True

  def _on_sigterm(self, signum: int, frame: Any) -> None:
    self._received = True

  def reached(self, steps_done: int) -> bool:
    """Whether to save and stop after this step.

    Args:
      steps_done: steps dispatched since the loop started (1 for the first),
        the same number on every process.

    Returns:
      True at the one step every process agreed on after a SIGTERM.
    """
    if self._synced:
      from jax.experimental import multihost_utils

      return bool(multihost_utils.reached_preemption_sync_point(steps_done))
    return self._received

  def __enter__(self) -> Notice:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def close(self) -> None:
    """Gives SIGTERM back to whatever handled it before."""
    if self._handled:
      signal.signal(signal.SIGTERM, self._previous)
      self._handled = False


def stop(cfg: TrainConfig, step: int, argv: list[str]) -> interruption.PreemptedError:
  """The error that ends a preempted run once its checkpoint is saved; process 0 records it.

  Args:
    cfg: the run's config.
    step: the step just saved.
    argv: the run's ``experiments.train`` flags
      (:func:`experiments.run.interruption.train_argv`).

  Returns:
    The :class:`~experiments.run.interruption.PreemptedError` to raise.
  """
  import jax

  resume = interruption.command_text(interruption.edit_argv(argv, {}))
  error = interruption.PreemptedError(step, resume)
  if jax.process_index() == 0:
    interruption.write_record(
      cfg.out_dir,
      reason="preempted",
      exit_code=error.exit_code,
      step=step,
      checkpoint_dir=os.path.join(cfg.out_dir, "checkpoints"),
      resume=resume,
      line=str(error),
    )
  return error
