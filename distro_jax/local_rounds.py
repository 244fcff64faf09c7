"""The local rounds that :func:`distro_jax.diloco` and :func:`distro_jax.sparseloco` share."""

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from distro_jax import exchange

__all__ = ["init", "inner_step", "restart", "synchronize_when_due"]


def init(inner: optax.GradientTransformation, params: Any) -> tuple[Any, Any, Any, Any]:
  """``(count, local_params, inner_state, contributors)`` of a state before the first step."""
  zero = jnp.zeros([], jnp.int32)
  return zero, jax.tree.map(jnp.asarray, params), inner.init(params), zero


def inner_step(
  inner: optax.GradientTransformation,
  updates: Any,
  state: Any,
  params: Any,
  axis_name: Hashable | None,
  name: str,
) -> tuple[jax.Array, Any, Any]:
  """One step of ``inner`` on this worker's own params: ``(count, local_params, inner_state)``.

  Raises:
    ValueError: ``params`` is ``None`` (the message names ``name``), or
      ``axis_name`` is not bound.
  """
  if params is None:
    raise ValueError(f"{name} needs the outer params: call tx.update(grads, state, params).")
  exchange.bound_axis_size(axis_name)  # Refused here, with the fix, before any use of the axis.
  steps, inner_state = inner.update(updates, state.inner_state, state.local_params)
  local = optax.apply_updates(state.local_params, steps)
  return optax.safe_increment(state.count), local, inner_state


def synchronize_when_due(
  synchronize: Callable[..., tuple[Any, Any, Any, Any, jax.Array]],
  count: jax.Array,
  params: Any,
  carry: Any,
  local_params: Any,
  inner_state: Any,
  *,
  sync_every: int,
  total_steps: int | None,
  axis_name: Hashable | None,
) -> tuple[Any, Any, Any, Any, jax.Array]:
  """``synchronize(local_params, carry, inner_state)`` on a synchronizing step, else nothing.

  ``synchronize`` returns ``(outer_updates, local_params, carry, inner_state,
  contributors)``; other steps return a zero update, the inputs unchanged and
  every worker counted. ``count`` is the step count after the inner step.
  """
  everyone = jnp.full([], exchange.bound_axis_size(axis_name), jnp.int32)

  def keep_going(local_params, carry, inner_state):
    return jax.tree.map(jnp.zeros_like, params), local_params, carry, inner_state, everyone

  due = count % sync_every == 0
  if total_steps is not None:
    due = due | (count == total_steps)
  # A cond, not a select: the collective must run only on synchronizing steps.
  return jax.lax.cond(due, synchronize, keep_going, local_params, carry, inner_state)


def restart(
  inner: optax.GradientTransformation,
  params: Any,
  outer_updates: Any,
  inner_state: Any,
  finite: jax.Array,
  axis_name: Hashable | None,
) -> tuple[Any, Any]:
  """Every worker's inner params at the new outer params, and a failed worker's fresh inner state.

  A worker whose round was not finite takes ``inner.init``'s state, since its
  own may hold the NaN; leaves shared by every worker (a step count) carry on.
  """
  local = exchange.worker_local(optax.apply_updates(params, outer_updates), axis_name)
  inner_state = jax.tree.map(
    lambda s, f: s if exchange.is_shared(s, axis_name) else jnp.where(finite, s, f),
    inner_state,
    inner.init(local),
  )
  return local, inner_state
