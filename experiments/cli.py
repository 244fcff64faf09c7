"""What every command shares: which errors are the user's, and how they are reported.

A command catches only these, prints one ``error:`` line naming the flag or
file and the fix, and exits with status 2. Anything else is a bug in the
program and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from absl import logging

from experiments.checkpointing import CheckpointError
from experiments.config import ConfigError
from experiments.data import DataError
from experiments.rundir import OutDirError

__all__ = ["USER_ERRORS", "ReplicaDivergenceError", "report_user_errors"]


class ReplicaDivergenceError(RuntimeError):
  """Workers no longer hold bit-identical params (``--check_replicas``)."""


# A loss that became NaN on every worker is the settings' doing (too high a
# learning rate); its message says which flags to change.
USER_ERRORS = (
  ConfigError,
  DataError,
  CheckpointError,
  OutDirError,
  ReplicaDivergenceError,
  FloatingPointError,
)


def report_user_errors(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
  """Calls ``fn``; a :data:`USER_ERRORS` exception becomes one ``error:`` line and exit 2."""
  try:
    return fn(*args, **kwargs)
  except USER_ERRORS as e:
    logging.debug("failed", exc_info=True)
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
