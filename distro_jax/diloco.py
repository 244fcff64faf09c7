"""DiLoCo, the strongest low-communication peer, as an optax transformation.

Each worker takes ``sync_every`` steps of its own inner optimizer on its own
copy of the params; then the workers average how far they moved (the
pseudo-gradient, one all-reduce) and take one Nesterov step with it from the
last shared point. Traffic is one fp32 all-reduce of the params every
``sync_every`` steps, plus the 4-byte count of the workers that took part.

A worker whose round went non-finite (a NaN or inf gradient) is left out of
that average, so its NaN reaches no replica, and restarts from the shared
params with a fresh inner optimizer state.

The params that the train step holds, checkpoints and evaluates are the
shared outer params, identical on every worker at every step. Each worker's
inner params live in its optimizer state; compute its gradient there, at
:func:`inner_params`.
"""

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
    count: inner steps taken, int32 scalar, the same on every worker.
    local_params: this worker's inner params; equal to the outer params right
      after each synchronization.
    inner_state: this worker's inner optimizer state.
    outer_momentum: the Nesterov momentum of the outer step, float32, the same
      on every worker.
    contributors: how many workers' pseudo-gradients went into this step's
      outer step; those that were not finite are left out (so
      ``W - contributors`` were excluded). On a step that does not
      synchronize no worker is left out, and it is ``W``. int32 scalar, the
      same on every worker; 0 before the first step.
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

  On every step, the worker's gradient (taken at :func:`inner_params`) moves
  its own inner params by ``inner``. Every ``sync_every``-th step the workers
  all-reduce ``delta = outer - inner`` (its mean over workers is the
  pseudo-gradient ``g``), update ``m <- mu * m + g`` and set
  ``outer <- outer - outer_lr * (g + mu * m)``; every worker restarts its inner
  params from the new outer params. Between synchronizations the update of the
  outer params is zero, so replicas stay identical.

  A worker with a non-finite ``delta`` (a NaN or inf gradient during the
  round) is left out: it adds zeros, the mean is over the workers that stayed
  finite (counted in the same all-reduce), and its inner optimizer state
  starts afresh. A round in which every worker failed moves nothing.

  A run whose length is not a multiple of ``sync_every`` would end with inner
  steps that never reach the outer params. Given ``total_steps``, the last
  step synchronizes too: the final, shorter round's pseudo-gradient takes the
  same outer Nesterov step, so every step of the run counts.

  Args:
    inner: the inner optimizer, e.g. ``optax.adamw(lr)``; its state is per
      worker and carries on across synchronizations.
    sync_every: inner steps between synchronizations (H). Static.
    outer_learning_rate: the outer step size (0.7 in the DiLoCo paper).
    outer_momentum: the outer Nesterov momentum (0.9 in the paper).
    axis_name: the data-parallel axis bound by an enclosing ``jax.shard_map``;
      ``None`` for one worker and no collective.
    total_steps: the run's length in steps; step ``total_steps`` synchronizes
      even when it is not a multiple of ``sync_every``. ``None``: only the
      multiples do. Static.

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
  # A worker whose round went non-finite (a NaN gradient) would spread it through
  # the all-reduce to every replica. It adds zeros instead, and the mean is over
  # the workers that stayed finite, counted in the same all-reduce (COUNT_BYTES
  # more than the pseudo-gradient).
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

  Args:
    opt_state: the worker's optimizer state, possibly a chain containing a
      :class:`DilocoState` or a :class:`~distro_jax.SparseLocoState`.
    params: the shared params.

  Returns:
    The ``local_params`` of the first state in ``opt_state`` that has them
    (a :class:`DilocoState` or a :class:`~distro_jax.SparseLocoState`; the
    search is by that field's name), or ``params`` when there is none (every
    other optimizer here).
  """
  found = optax.tree_utils.tree_get_all_with_path(opt_state, "local_params")
  if not found:
    return params
  return found[0][1]
