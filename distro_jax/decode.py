"""DeMo's decode stage: every worker's message into each param's ``Q``.

Per tensor: the mean of each coefficient over the workers that chose it
(:func:`distro_jax.codec.aggregate_blocks`, the same bits on every worker),
the inverse of the format's basis, and the param's own shape and dtype
(:func:`to_params`).

A fused kernel is another implementation of this stage: :func:`_fused` is
the one place that asks whether one serves a tensor (the ``serves`` of
:mod:`distro_jax.cpu_kernels`, then of :mod:`distro_jax.pallas_kernels`: the
CPU's on a CPU, the Pallas ones on a GPU, whose mean and inverse DCT are one
pass, the workers folded in in the same order, so the mean has the same
bits).
"""

from collections.abc import Hashable

import jax
import jax.numpy as jnp

from distro_jax import codec, cpu_kernels, dct, exchange, pallas_kernels
from distro_jax.message import Received

__all__ = ["aggregate", "contributors", "to_params"]


def _only_message(received: Received, tensor: int, like: jax.Array) -> jax.Array:
  """One worker's message and no collective: the mean of one message is itself."""
  idx, val = received.tensors[tensor]
  shape = (*like.shape[:-4], like.shape[-4], like.shape[-2], idx.shape[-1])
  val = jnp.where(received.valid[0], val[0], 0.0)
  return codec.scatter_blocks(jnp.zeros_like(like), idx[0].reshape(shape), val.reshape(shape))


def _fused(
  received: Received, tensor: int, plan: dct.ChunkPlan, basis: dct.Basis, like: jax.Array
) -> jax.Array | None:
  """One tensor's mean and inverse transform from a fused kernel, or ``None`` where none serves."""
  if basis is not dct.DCT_BASIS:
    return None
  for fused in (cpu_kernels, pallas_kernels):
    if fused.serves(plan, like):
      idx, val = received.tensors[tensor]
      return fused.decode(idx, val, received.valid, plan.block_shape)
  return None


def aggregate(
  received: Received,
  like: list[jax.Array],
  plans: list[dct.ChunkPlan],
  basis: dct.Basis,
  axis_name: Hashable | None,
) -> list[jax.Array]:
  """Each tensor's aggregate, through the inverse basis, in its block view.

  Args:
    received: every worker's message.
    like: per tensor, a float32 block view to shape (and place) the result
      like: this worker's momentum.
    plans: each tensor's :class:`~distro_jax.dct.ChunkPlan`.
    basis: the basis the coefficients are in.
    axis_name: the workers' axis; with ``None`` the one message is its own
      mean (with an axis bound, even of size 1, the all-gather types the
      aggregate as identical on every worker; that path is kept).

  Returns:
    Per tensor, ``Q`` in its block view, float32, the same on every worker.

  Example:
    Two workers, both sending coefficient 0 of one 1x4 chunk, one also 3:

    >>> import jax.numpy as jnp
    >>> from distro_jax import dct, decode, message
    >>> plan = dct.plan_chunks((4,), 4)
    >>> idx = jnp.array([[[[0, 3]]], [[[0, 1]]]])  # (W, A, B, k)
    >>> val = jnp.array([[[[1.0, 4.0]]], [[[3.0, 0.0]]]])
    >>> got = message.Received([(idx, val)], jnp.array([True, True]))
    >>> like = [jnp.zeros(plan.block_shape)]
    >>> q = decode.aggregate(got, like, [plan], dct.IDENTITY_BASIS, axis_name="data")
    >>> q[0].reshape(-1).tolist()  # each over the workers that chose it
    [2.0, 0.0, 0.0, 4.0]
  """
  if axis_name is None:
    return [
      basis.inverse(_only_message(received, i, m), plan)
      for i, (m, plan) in enumerate(zip(like, plans))
    ]
  out = [_fused(received, i, plan, basis, m) for i, (plan, m) in enumerate(zip(plans, like))]
  rest = [i for i, q in enumerate(out) if q is None]
  means = codec.aggregate_blocks(
    [received.tensors[i] for i in rest], [plans[i].block_shape for i in rest], received.valid
  )
  for i, (mean, _) in zip(rest, means):
    out[i] = basis.inverse(mean, plans[i])
  return out


def contributors(received: Received, site_axes: list[Hashable]) -> jax.Array:
  """How many workers' messages count, int32, typed as the same on a site's devices."""
  count = jnp.sum(received.valid, dtype=jnp.int32)
  if site_axes:
    # Equal on every device of a site already; this only types it so.
    count = jax.lax.pmax(count, tuple(site_axes))
  return count


def to_params(
  q_blocks: list[jax.Array],
  plans: list[dct.ChunkPlan],
  params: list[jax.ShapeDtypeStruct],
  grads: list[jax.Array],
  site_axes: list[Hashable],
) -> list[jax.Array]:
  """Each ``Q`` in its param's shape and dtype, placed and typed as its gradient.

  Args:
    q_blocks: per tensor, ``Q`` in its block view.
    plans: each tensor's :class:`~distro_jax.dct.ChunkPlan`.
    params: per tensor, the shape and dtype of the update.
    grads: this worker's gradients, whose sharding the result takes.
    site_axes: the mesh axes other than the workers' that the gradients vary
      over (FSDP within a site).

  Returns:
    Per tensor, ``Q``.
  """
  directions = []
  for q, plan, x, g in zip(q_blocks, plans, params, grads):
    direction = dct.from_blocks(q, plan, like=g).astype(x.dtype)
    whole = tuple(a for a in site_axes if not exchange.varies_over(g, a))
    if whole:
      # A param kept whole on every device of a site is decoded identically
      # on each, but from a message typed as differing; a max over equal
      # values (on the site's fast links) restores the type, not the value.
      direction = jax.lax.pmax(direction, whole)
    directions.append(direction)
  return directions
