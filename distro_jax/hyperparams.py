"""Checks of hyperparameters, and defaults that ``optax.inject_hyperparams`` leaves alone."""

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "StaticFloat",
  "StaticInt",
  "check_decay",
  "static_nonnegative_float",
  "static_positive_int",
  "unwrap_static",
]


class _Static:
  """A default that ``optax.inject_hyperparams`` does not take for a number."""

  __slots__ = ("value",)

  def __eq__(self, other: object) -> bool:
    return self.value == other

  def __hash__(self) -> int:
    return hash(self.value)

  def __repr__(self) -> str:
    return repr(self.value)


class StaticInt(_Static):
  """An int default that ``optax.inject_hyperparams`` leaves static.

  For sizes that fix a message's shape; it compares, hashes and prints as its value.
  """

  __slots__ = ()

  def __init__(self, value: int):
    self.value = int(value)

  def __index__(self) -> int:
    return self.value

  __int__ = __index__


class StaticFloat(_Static):
  """A float default that ``optax.inject_hyperparams`` does not cast to the params' dtype.

  For decays that bfloat16 would round to 1 (0.999).
  """

  __slots__ = ()

  def __init__(self, value: float):
    self.value = float(value)

  def __float__(self) -> float:
    return self.value


def unwrap_static(value: Any) -> Any:
  """The plain value of a :class:`StaticInt` or :class:`StaticFloat`; anything else as is."""
  return value.value if isinstance(value, _Static) else value


def static_positive_int(name: str, value: Any, example: int) -> int:
  """``value`` (an int, a :class:`StaticInt` or a concrete 0-d array) as a positive int.

  Raises:
    TypeError: a traced value, or anything that is not an integer (bools included).
    ValueError: zero or a negative int.
  """
  if isinstance(value, StaticInt):
    value = value.value
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
      f"{name} is a traced value. It fixes the message's shape or the schedule of "
      "synchronizations, so it must be a static Python int. Under "
      f"optax.inject_hyperparams, pass static_args=({name!r},) when you set it."
    )
  if isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0:
    value = value.item()
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be a positive int, got {value!r}; use e.g. {name}={example}.")
  if value <= 0:
    raise ValueError(f"{name} must be a positive int, got {value}; use e.g. {name}={example}.")
  return int(value)


def check_learning_rate(name: str, value: Any) -> None:
  """Raises a TypeError unless ``value`` is a number, a numeric array or a schedule."""
  if callable(value):
    return
  # An injected rate (a traced or concrete array) is checked by its dtype.
  dtype = getattr(value, "dtype", None)
  if dtype is not None and (
    jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
  ):
    return
  if isinstance(value, numbers.Real) and not isinstance(value, bool):
    return
  raise TypeError(
    f"{name} must be a number or a schedule (a function of the step count), got {value!r} "
    f"({type(value).__name__}); use e.g. {name}=1e-3 or "
    f"{name}=optax.cosine_decay_schedule(1e-3, decay_steps=1000)."
  )


def check_decay(name: str, value: Any, *, one_allowed: bool, hint: str) -> None:
  """Raises if a concrete ``value`` is outside ``[0, 1)`` (or ``[0, 1]`` when ``one_allowed``).

  A traced value is checked by its dtype only: one narrower than 32 bits is
  refused. ``hint``, what to use instead, ends the message.

  Raises:
    ValueError: a decay out of range, or in a dtype narrower than 32 bits.
  """
  dtype = getattr(value, "dtype", None)
  if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
    # optax.inject_hyperparams casts floats to the params' dtype. Traced (a
    # jitted init, dj.init_worker_state), 0.999 in bf16 would be 1 unseen.
    raise ValueError(
      f"{name} arrived as {np.dtype(dtype).name}, which rounds decays near 1 up to 1 "
      "(bf16 holds 0.999 as 1.0): optax.inject_hyperparams casts float hyperparameters to "
      "the params' dtype, so pass hyperparam_dtype=jnp.float32 to optax.inject_hyperparams."
    )
  try:
    concrete = float(value)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return
  ok = 0.0 <= concrete <= 1.0 if one_allowed else 0.0 <= concrete < 1.0
  if not ok:
    interval = "[0, 1]" if one_allowed else "[0, 1)"
    raise ValueError(f"{name} must be in {interval}, got {concrete}. {hint}")


def static_nonnegative_float(name: str, value: Any, example: float) -> float:
  """``value`` as a finite Python float of 0 or more, for numbers used at trace time.

  Raises:
    TypeError: a traced value, or anything that is not a real number (bools included).
    ValueError: a negative or non-finite number.
  """
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
      f"{name} is a traced value; it must be a static Python float. Under "
      f"optax.inject_hyperparams, pass static_args=({name!r},) when you set it."
    )
  if isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0:
    value = value.item()
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a number, got {value!r}; use e.g. {name}={example}.")
  if not np.isfinite(value) or value < 0:
    raise ValueError(
      f"{name} must be a finite number of 0 or more, got {value}; use e.g. {name}={example}."
    )
  return float(value)
