"""DiLoCo, the low-communication peer, as an optax transformation (docs/library.md)."""

from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from distro_jax import exchange, local_rounds
from distro_jax.hyperparams import StaticInt, static_positive_int, unwrap_static

__all__ = ["DilocoState", "diloco", "inner_params"]

# What a synchronization all-reduces besides the float32 pseudo-gradient: the
# count of workers whose round stayed finite, as one float32.
COUNT_BYTES = 4


class DilocoState(NamedTuple):
  """State of :func:`diloco`.

  Attributes:
    count: inner steps taken, int32 scalar.
    local_params: this worker's inner params.
    inner_state: this worker's inner optimizer state.
    outer_momentum: the outer step's Nesterov momentum, float32, shared.
    contributors: the workers whose finite pseudo-gradients went into this
      step's outer step (``W`` on other steps, 0 before the first), int32.
  """

  count: jax.Array
  local_params: Any
  inner_state: Any
  outer_momentum: Any
  contributors: jax.Array


def diloco(
  inner: optax.GradientTransformation,
  *,
  sync_every: int = StaticInt(50),
  outer_learning_rate: float = 0.7,
  outer_momentum: float = 0.9,
  axis_name: Hashable | None = "data",
  total_steps: int | None = None,
) -> optax.GradientTransformation:
  """DiLoCo: ``sync_every`` local steps of ``inner``, then an outer Nesterov step.

  The params are the shared outer ones; each worker's inner params live in its
  state, and its gradient is taken there, at :func:`inner_params`.

  Every ``sync_every``-th step the pseudo-gradient ``g``, the workers' mean of
  ``outer - inner``, takes a Nesterov step: ``m <- mu * m + g``,
  ``outer <- outer - outer_lr * (g + mu * m)``; the workers restart there.
  Other steps' updates are zero. A worker whose round went non-finite is left
  out of the mean and restarts with a fresh inner state.

  Args:
    inner: the inner optimizer, e.g. ``optax.adamw(lr)``; per worker.
    sync_every: inner steps between synchronizations (H). Static.
    outer_learning_rate: the outer step size (0.7 in the DiLoCo paper).
    outer_momentum: the outer Nesterov momentum (0.9 in the paper).
    axis_name: the workers' axis in ``jax.shard_map``; ``None`` for one worker.
    total_steps: the run's length; its last step synchronizes too, so a last
      partial round is not lost. ``None``: only the multiples do. Static.

  Returns:
    An ``optax.GradientTransformation`` whose state is a :class:`DilocoState`.

  References:
    Douillard et al., "DiLoCo: Distributed Low-Communication Training of
    Language Models", arXiv:2311.08455, 2023.

  Example:
    >>> import jax.numpy as jnp, optax, distro_jax as dj
    >>> tx = dj.diloco(optax.adamw(1e-3), sync_every=2, axis_name=None)
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> g = {"w": jnp.ones(3)}  # in training: the gradient at dj.inner_params(state, params)
    >>> updates, state = tx.update(g, state, params)  # no sync yet: the update is zero
    >>> updates, state = tx.update(g, state, params)  # sync: the outer step
  """
  sync_every = unwrap_static(sync_every)
  for name, value in (("sync_every", sync_every), ("total_steps", total_steps)):
    if isinstance(value, (jax.Array, np.ndarray)):
      # optax.inject_hyperparams turns every int it is given into an array.
      raise TypeError(
        f"{name} fixes when the workers synchronize, so it must be a static Python int, "
        f"got an array. Under optax.inject_hyperparams, pass static_args=({name!r},)."
      )
  sync_every = static_positive_int("sync_every", sync_every, example=50)
  if total_steps is not None:
    total_steps = static_positive_int("total_steps", total_steps, example=1000)

  def init_fn(params):
    count, local, inner_state, contributors = local_rounds.init(inner, params)
    momentum = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
    return DilocoState(count, local, inner_state, momentum, contributors)

  def update_fn(updates, state, params=None):
    count, local, inner_state = local_rounds.inner_step(
      inner, updates, state, params, axis_name, "dj.diloco"
    )

    def synchronize(local, momentum, inner_state):
      return _synchronize(
        inner, params, local, momentum, inner_state, outer_learning_rate, outer_momentum, axis_name
      )

    outer_updates, local, momentum, inner_state, contributors = local_rounds.synchronize_when_due(
      synchronize,
      count,
      params,
      state.outer_momentum,
      local,
      inner_state,
      sync_every=sync_every,
      total_steps=total_steps,
      axis_name=axis_name,
    )
    return outer_updates, DilocoState(count, local, inner_state, momentum, contributors)

  return optax.GradientTransformation(init_fn, update_fn)


def _synchronize(
  inner: optax.GradientTransformation,
  params: Any,
  local: Any,
  momentum: Any,
  inner_state: Any,
  outer_learning_rate: float,
  outer_momentum: float,
  axis_name: Hashable | None,
) -> tuple[Any, Any, Any, Any, jax.Array]:
  """A synchronization: the finite workers' mean pseudo-gradient, a Nesterov step, restart."""
  delta = jax.tree.map(lambda p, q: p.astype(jnp.float32) - q.astype(jnp.float32), params, local)
  # A non-finite round would spread its NaN to every replica: it adds zeros, and the
  # mean is over the finite workers, counted in the same all-reduce (COUNT_BYTES).
  finite = exchange.all_finite(jax.tree.leaves(delta))
  delta = jax.tree.map(lambda d: jnp.where(finite, d, 0.0), delta)
  contributors = finite.astype(jnp.float32)
  if axis_name is not None:
    delta, contributors = jax.lax.psum((delta, contributors), axis_name)
  delta = jax.tree.map(lambda d: d / jnp.maximum(contributors, 1.0), delta)
  # A round in which every worker failed moves nothing, momentum included.
  moved = contributors > 0
  momentum = jax.tree.map(lambda m, g: jnp.where(moved, outer_momentum * m + g, m), momentum, delta)

  def nesterov(g, m, p):
    return jnp.where(moved, -outer_learning_rate * (g + outer_momentum * m), 0.0).astype(p.dtype)

  outer_updates = jax.tree.map(nesterov, delta, momentum, params)
  local, inner_state = local_rounds.restart(
    inner, params, outer_updates, inner_state, finite, axis_name
  )
  return outer_updates, local, momentum, inner_state, contributors.astype(jnp.int32)


def inner_params(opt_state: Any, params: Any) -> Any:
  """Where this worker's gradient is taken: DiLoCo's or SparseLoCo's inner params, else ``params``.

  Returns the ``local_params`` of the first :class:`DilocoState` or
  :class:`~distro_jax.SparseLocoState` in ``opt_state`` (at any depth), else ``params``.
  """
  found = optax.tree_utils.tree_get_all_with_path(opt_state, "local_params")
  if not found:
    return params
  return found[0][1]
