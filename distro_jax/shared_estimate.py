"""EF21 around an exchange: a shared estimate of the workers' mean momentum (docs/results.md)."""

from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from distro_jax import exchange

__all__ = ["EstimateState", "track_shared_estimate"]


class EstimateState(NamedTuple):
  """State of :func:`track_shared_estimate`.

  Attributes:
    exchange: the wrapped exchange's state, per worker.
    momentum: this worker's float32 momentum of its gradients (restarted from
      zero when it is not finite).
    estimate: ``E``, the workers' mean unit-RMS momentum, float32, built from
      what every worker decoded, so the same bits on every worker.
  """

  exchange: Any
  momentum: Any
  estimate: Any


def _unit_rms(m: jax.Array, axis_name: Hashable | None) -> jax.Array:
  """``m`` over its root mean square; over the whole tensor when a site shards it."""
  if m.size == 0:
    return m
  squares, count = jnp.sum(jnp.square(m)), jnp.asarray(m.size, jnp.float32)
  # Under FSDP a worker's tensor is split over the site's devices; the scale
  # must be the whole tensor's, or its shards would be scaled apart.
  sites = tuple(sorted(exchange.varying_axes(m) - {axis_name}, key=str))
  if sites:
    squares, count = jax.lax.psum((squares, count), sites)
  return m * jax.lax.rsqrt(squares / count + 1e-30)


def track_shared_estimate(
  exchange_stage: optax.GradientTransformationExtraArgs,
  *,
  decay: float,
  step: float,
  axis_name: Hashable | None,
) -> optax.GradientTransformationExtraArgs:
  """Steps along a shared estimate of the mean momentum that the messages correct.

  Per tensor: ``M <- decay * M + (1 - decay) * g``; ``D = M / rms(M) - E``;
  ``Q`` = the exchange's decoded mean of ``D``; ``E <- E + step * Q``; the
  output is ``E``. ``exchange_stage`` should keep no error feedback of its own:
  what a message leaves out stays in the next step's ``D``.

  Args:
    exchange_stage: the compressed exchange, e.g.
      ``dj.scale_by_demo(1.0, compression_decay=0.0, ...)``.
    decay: each worker's momentum decay, in ``[0, 1)`` (Muon's is 0.95).
    step: how far ``E`` moves per unit of the decoded mean.
    axis_name: the workers' axis, as the exchange's.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    :class:`EstimateState`; extra arguments go on to the exchange.

  References:
    Richtarik, Sokolov, Fatkhullin, "EF21: A New, Simpler, Theoretically
    Better, and Practically Faster Error Feedback", arXiv:2106.05203, 2021.

  Example:
    >>> import jax.numpy as jnp, distro_jax as dj
    >>> ex = dj.scale_by_demo(1.0, compression_decay=0.0, compression_topk=64,
    ...                       compression_chunk=8, axis_name=None)
    >>> tx = dj.track_shared_estimate(ex, decay=0.5, step=1.0, axis_name=None)
    >>> state = tx.init({"w": jnp.zeros((8, 8))})
    >>> e, state = tx.update({"w": jnp.full((8, 8), 3.0)}, state)
    >>> round(float(e["w"][0, 0]), 4)  # the whole unit-RMS momentum, sent
    1.0
  """

  def init_fn(params: Any) -> EstimateState:
    zeros = lambda p: jnp.zeros_like(p, dtype=jnp.float32)
    return EstimateState(
      exchange=exchange_stage.init(params),
      momentum=jax.tree.map(zeros, params),
      estimate=jax.tree.map(zeros, params),
    )

  def update_fn(updates: Any, state: EstimateState, params: Any = None, **extra_args: Any):
    def fold(m: jax.Array, g: jax.Array) -> jax.Array:
      m = decay * m + (1 - decay) * g.astype(jnp.float32)
      return jnp.where(jnp.all(jnp.isfinite(m)), m, jnp.zeros_like(m))

    momentum = jax.tree.map(fold, state.momentum, updates)
    # A momentum restarted for non-finite values sends this step's non-finite
    # difference, so the exchange still leaves the worker out.
    sent_from = jax.tree.map(
      lambda m, g: jnp.where(jnp.all(jnp.isfinite(g)), m, g.astype(jnp.float32)),
      momentum,
      updates,
    )
    difference = jax.tree.map(lambda m, e: _unit_rms(m, axis_name) - e, sent_from, state.estimate)
    q, exchange_state = exchange_stage.update(difference, state.exchange, params, **extra_args)
    estimate = jax.tree.map(lambda e, d: e + step * d.astype(jnp.float32), state.estimate, q)
    out = jax.tree.map(lambda e, g: e.astype(g.dtype), estimate, updates)
    return out, EstimateState(exchange_state, momentum, estimate)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
