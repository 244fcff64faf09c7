"""DeMo's step scaled to unit RMS per tensor, in place of its sign.

DeMo turns the decoded aggregate into a step with its sign, so every entry
moves by the learning rate. With one drawn coefficient of each 8x8 chunk per
worker (``random_positions``), the aggregate of a chunk is a few cosines, and
its sign gives an entry where they cancel the same step as one where they
agree. Scaling each tensor to a root mean square of one keeps the step's size
(the sign's RMS is one too) and the entries' relative sizes (docs/results.md).
"""

from collections.abc import Hashable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from distro_jax import exchange

__all__ = ["NORMALIZE", "scale_to_unit_rms", "to_unit_rms"]

# How dj.demo turns the decoded aggregate into a step.
NORMALIZE = ("sign", "rms")


def check_normalize(normalize: str) -> str:
  """``normalize``, refused unless it is one of :data:`NORMALIZE`."""
  if normalize not in NORMALIZE:
    raise ValueError(
      f"normalize={normalize!r}; use normalize='sign' (DeMo's: every entry moves by the "
      "learning rate) or normalize='rms' (each tensor's step scaled to unit RMS)."
    )
  return normalize


def to_unit_rms(x: jax.Array, sharded_over: Iterable[Hashable] = ()) -> jax.Array:
  """``x`` divided by its root mean square (zero stays zero), in ``x``'s dtype.

  Args:
    x: one tensor, or under ``shard_map`` this device's block of it.
    sharded_over: the mesh axes whose devices hold the other blocks of the
      tensor; the mean is over all of them.

  Returns:
    An array like ``x``.
  """
  axes = tuple(sorted(sharded_over, key=str))
  sq = jnp.sum(jnp.square(x.astype(jnp.float32)))
  size = jnp.asarray(x.size, jnp.float32)
  if axes:
    # Gathered and summed in index order rather than psum'd: an all-reduce may
    # add the blocks in another order on another group of devices, and every
    # worker's copy of the tensor must get the same bits.
    sq = jnp.sum(jax.lax.all_gather(sq, axes, to="invarying"))
    size = size * jax.lax.psum(1, axes)
  mean_sq = sq / size
  rms = jnp.sqrt(jnp.where(mean_sq > 0, mean_sq, 1.0))
  return jnp.where(mean_sq > 0, x.astype(jnp.float32) / rms, 0.0).astype(x.dtype)


def scale_to_unit_rms(axis_name: Hashable | None = None) -> optax.GradientTransformation:
  """Scales each tensor of the updates to a root mean square of one.

  Under ``shard_map``, a tensor split over mesh axes other than
  ``axis_name`` (FSDP within a worker) is scaled by the RMS of the whole
  tensor, the same on each of its blocks.

  Args:
    axis_name: the workers' axis, across which each worker holds a whole copy;
      ``None`` when there is none.

  Returns:
    An ``optax.GradientTransformation`` with no state.

  Example:
    >>> import jax.numpy as jnp, distro_jax as dj
    >>> tx = dj.scale_to_unit_rms()
    >>> updates, _ = tx.update({"w": jnp.array([3.0, -1.0, 1.0, 1.0])}, tx.init(None))
    >>> print(*(round(float(u), 3) for u in updates["w"]))
    1.732 -0.577 0.577 0.577
  """

  def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
    del params
    return jax.tree.map(
      lambda u: to_unit_rms(u, exchange.varying_axes(u) - {axis_name}), updates
    ), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)
