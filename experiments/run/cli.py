"""What every command shares: its flags, and which errors are the user's.

Each command builds its absl flags from a config dataclass's fields
(:func:`define_flags`, called inside the command's ``main``, so importing a
command defines nothing) and reads them back (:func:`config_from_flags`).
A command catches only the :data:`USER_ERRORS`, prints one ``error:`` line
naming the flag or file and the fix, and exits with status 2. A run stopped
early on purpose (a preemption notice: :mod:`experiments.run.interruption`)
prints its own line and exits with its own status. Anything else is a bug in
the program and keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any

from absl import flags, logging

from experiments.run.checkpointing import CheckpointError
from experiments.run.config import ConfigError, TrainConfig, flag_kind
from experiments.run.data import DataError
from experiments.run.interruption import RunInterruptedError
from experiments.run.rundir import OutDirError

__all__ = [
  "USER_ERRORS",
  "ReplicaDivergenceError",
  "config_from_flags",
  "define_flags",
  "report_user_errors",
]

# Flags defined through define_flags belong to the command that calls it, so --help lists them.
flags.disclaim_key_flags()


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
  """Calls ``fn``; a :data:`USER_ERRORS` exception becomes one ``error:`` line and exit 2.

  A run stopped early on purpose (``RunInterruptedError``, e.g. preempted)
  becomes its own line and its own exit status (75 for a preemption).
  """
  try:
    return fn(*args, **kwargs)
  except RunInterruptedError as e:
    print(e, file=sys.stderr, flush=True)
    sys.exit(e.exit_code)
  except USER_ERRORS as e:
    logging.debug("failed", exc_info=True)
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


_DEFINE = {
  bool: flags.DEFINE_bool,
  int: flags.DEFINE_integer,
  float: flags.DEFINE_float,
  str: flags.DEFINE_string,
}


def define_flags(
  cls: type = TrainConfig,
  defaults: Mapping[str, Any] | None = None,
  *,
  flag_values: flags.FlagValues = flags.FLAGS,
) -> dict[str, flags.FlagHolder]:
  """Defines one absl flag per field of a config dataclass; call it from a command's ``main``.

  Args:
    cls: :class:`TrainConfig`, or another dataclass whose fields carry
      ``metadata["help"]`` (``experiments.run.launch.LaunchConfig``).
    defaults: a command's own defaults for some fields (``compare`` trains
      ``small`` for 300 steps, for example).
    flag_values: where to define them (absl's global ``FLAGS`` by default).

  Returns:
    The flag holders by field name, for :func:`config_from_flags`.
  """
  from experiments.run import methods

  defaults = dict(defaults or {})
  unknown = set(defaults) - {f.name for f in dataclasses.fields(cls)}
  if unknown:
    raise ValueError(f"define_flags: {cls.__name__} has no field {sorted(unknown)}.")
  holders = {}
  for f in dataclasses.fields(cls):
    default = defaults.get(f.name, f.default)
    help_text = f.metadata["help"]
    if f.metadata.get("enum"):
      holders[f.name] = flags.DEFINE_enum(
        f.name, default, methods.names(), help_text, flag_values=flag_values
      )
    else:
      define = _DEFINE[flag_kind(cls, f.name)]
      holders[f.name] = define(f.name, default, help_text, flag_values=flag_values)
  return holders


def config_from_flags(
  holders: Mapping[str, flags.FlagHolder], cls: type = TrainConfig, **overrides: Any
) -> Any:
  """The config (a :class:`TrainConfig` by default) that parsed flags describe.

  Args:
    holders: what :func:`define_flags` returned, after absl parsed the flags.
    cls: the config dataclass the holders were defined from.
    **overrides: fields to set on top of the flags.

  Returns:
    An instance of ``cls``.
  """
  return cls(**{**{k: v.value for k, v in holders.items()}, **overrides})
