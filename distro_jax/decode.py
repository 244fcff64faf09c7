"""DeMo's decode stage: every worker's message into each param's ``Q``.

Per tensor: the mean of each coefficient over the workers that chose it
(:func:`distro_jax.codec.aggregate_blocks`, the same bits on every worker),
the inverse of the format's basis, and the param's own shape and dtype
(:func:`to_params`).

SparseLoCo decodes its top-k message with :func:`clipped_mean` instead: the
mean over every valid worker, each first clipped to the median norm.

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

__all__ = ["aggregate", "clipped_mean", "contributors", "to_params"]

# What the median clip adds to a norm before dividing by it (as Templar does).
_CLIP_EPS = 1e-8


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


def clipped_mean(
  received: Received,
  zeros: list[jax.Array],
  plans: list[dct.ChunkPlan],
  basis: dct.Basis,
  clip: bool,
) -> list[jax.Array]:
  """Each tensor's mean over every valid worker, through the inverse basis: SparseLoCo's decode.

  Unlike :func:`aggregate`, a coefficient's mean is over every valid worker,
  whether it sent that coefficient or not; with ``clip`` each worker's values
  of a tensor are first scaled to at most the lower median of the valid
  workers' norms (:mod:`distro_jax.sparseloco`, "Aggregation"). The workers
  are summed in their order, so every worker computes the same bits.

  Args:
    received: every worker's message.
    zeros: per tensor, float32 zeros in its block view, placed (and typed)
      as the mean is to be.
    plans: each tensor's :class:`~distro_jax.dct.ChunkPlan`.
    basis: the basis the values are in.
    clip: whether to clip each worker's values to the median norm.

  Returns:
    Per tensor, the mean in its block view, float32, the same on every
    worker; zeros when no message is valid.
  """
  valid_W = received.valid
  count = jnp.maximum(jnp.sum(valid_W.astype(jnp.int32)), 1)
  means = []
  for (idx, val), z, plan in zip(received.tensors, zeros, plans):
    per_worker = (-1,) + (1,) * (val.ndim - 1)
    val = jnp.where(valid_W.reshape(per_worker), val, 0.0)
    if clip:
      norms = jnp.sqrt(jnp.sum(jnp.square(val), axis=tuple(range(1, val.ndim))))
      val = val * _clip_factors(norms, valid_W).reshape(per_worker)
    means.append(basis.inverse(_sum_in_worker_order(z, idx, val) / count, plan))
  return means


def _clip_factors(norms_W: jax.Array, valid_W: jax.Array) -> jax.Array:
  """Each worker's scale: its norm at most the valid norms' lower median, ``sorted[(n-1) // 2]``."""
  n = jnp.sum(valid_W.astype(jnp.int32))
  # The invalid sort last, so the first n are the valid ones in order.
  median = jnp.sort(jnp.where(valid_W, norms_W, jnp.inf))[jnp.maximum(n - 1, 0) // 2]
  return jnp.minimum(1.0, median / (norms_W + _CLIP_EPS))


def _sum_in_worker_order(
  zeros_blocks: jax.Array, idx_WxRxK: jax.Array, val_WxRxK: jax.Array
) -> jax.Array:
  """Every worker's sparse message summed into a block view, worker 0 first.

  A fixed order of float additions makes the sum bit-identical on every
  worker. Within one worker an index occurs at most once per chunk, so each
  scatter writes a location once and needs no atomics. ``zeros_blocks``
  carries the param's sharding, so a sharded param's sum stays sharded.
  """
  lead = zeros_blocks.shape[:-4]
  a, b = zeros_blocks.shape[-4], zeros_blocks.shape[-2]
  num_workers, k = idx_WxRxK.shape[0], idx_WxRxK.shape[-1]
  want = (num_workers, *lead, a, b, k)
  idx_W = idx_WxRxK if idx_WxRxK.shape == want else idx_WxRxK.reshape(want)
  val_W = val_WxRxK if val_WxRxK.shape == want else val_WxRxK.reshape(want)

  def add(w, dense):
    here = codec.gather_blocks(dense, idx_W[w])
    return codec.scatter_blocks(dense, idx_W[w], here + val_W[w])

  return jax.lax.fori_loop(0, num_workers, add, zeros_blocks)


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
