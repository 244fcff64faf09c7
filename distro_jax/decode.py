"""DeMo's decode stage: every worker's message into each param's ``Q``.

Per tensor: the mean of each coefficient over the workers that chose it
(:func:`distro_jax.codec.aggregate_blocks`, the same bits on every worker),
the inverse of the format's basis, and the param's own shape and dtype
(:func:`to_params`).

A fused kernel is another implementation of this stage: :func:`_fused` is
the one place that asks whether one serves a tensor
(:func:`distro_jax.kernels.for_decode`: :mod:`distro_jax.cpu_kernels` on a
CPU, :mod:`distro_jax.pallas_kernels` on a GPU, whose mean and inverse DCT are
one pass, the workers folded in in the same order, so the mean has the same
bits).
"""

from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp

from distro_jax import codec, dct, exchange, kernels
from distro_jax.message import Received

__all__ = ["aggregate", "contributors", "shared_rows", "to_params"]


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
  fused = kernels.for_decode(plan, like) if basis is dct.DCT_BASIS else None
  if fused is None:
    return None
  idx, val = received.tensors[tensor]
  return fused.decode(idx, val, received.valid, plan.block_shape)


def aggregate(
  received: Received,
  like: list[jax.Array],
  plans: list[dct.ChunkPlan],
  basis: dct.Basis,
  axis_name: Hashable | None,
  skip: Sequence[bool] = (),
) -> list[jax.Array | None]:
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
    skip: per tensor, True to leave it out (its caller reads the messages
      another way, e.g. :func:`shared_rows`); empty for none.

  Returns:
    Per tensor, ``Q`` in its block view, float32, the same on every worker;
    ``None`` for a tensor skipped.

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
  skipped = {i for i, s in enumerate(skip) if s}
  if axis_name is None:
    return [
      None if i in skipped else basis.inverse(_only_message(received, i, m), plan)
      for i, (m, plan) in enumerate(zip(like, plans))
    ]
  out = [
    None if i in skipped else _fused(received, i, plan, basis, m)
    for i, (plan, m) in enumerate(zip(plans, like))
  ]
  rest = [i for i, q in enumerate(out) if q is None and i not in skipped]
  means = codec.aggregate_blocks(
    [received.tensors[i] for i in rest], [plans[i].block_shape for i in rest], received.valid
  )
  for i, (mean, _) in zip(rest, means):
    out[i] = basis.inverse(mean, plans[i])
  return out


def shared_rows(
  received: Received, tensors: Sequence[int], plans: list[dct.ChunkPlan], basis: dct.Basis
) -> list[tuple[jax.Array, jax.Array]]:
  """Shared-rows tensors' aggregates as ``(directions, y)``: ``Q``'s strip ``a`` is ``d_a y_a^T``.

  With ``random_positions="shared_rows"`` every coefficient of a block-row
  lies in one row of its chunk, the same for every worker. Each strip of
  ``c1`` rows of ``Q`` is then one basis vector ``d_a`` (that row's DCT
  cosine, or a unit vector for the identity basis) times a row ``y_a``: the
  mean of the coefficients along the row, through the inverse 1-D transform.
  This reads ``y`` from the messages directly, a matrix ``c1`` times shorter
  than ``Q``, so a caller that only needs ``Q`` through ``y`` (the
  orthogonalized step) never builds ``Q``. The means of all ``tensors`` come
  from one :func:`distro_jax.codec.aggregate_blocks` call, as
  :func:`aggregate`'s do.

  Args:
    received: every worker's message.
    tensors: the positions in the message of the tensors to read.
    plans: every tensor's :class:`~distro_jax.dct.ChunkPlan` (block views
      ``(*lead, A, c1, B, c2)``), indexed by position.
    basis: the basis the coefficients are in.

  Returns:
    Per tensor of ``tensors``, ``directions`` float32 ``(*lead, A, c1)``,
    each strip's unit vector ``d_a``, and ``y`` float32 ``(*lead, A, B * c2)``.
  """
  rows, selections, row_blocks = [], [], []
  for i in tensors:
    *lead, a, _, b, c2 = plans[i].block_shape
    idx, val = received.tensors[i]
    idx = idx.astype(jnp.int32).reshape(idx.shape[0], *lead, a, b, -1)
    # Every sender drew the same row for a block-row, so the first sender's
    # first position of each block-row names it (whether or not it counts).
    rows.append(idx[0, ..., 0, 0] // c2)
    selections.append((idx % c2, val.reshape(idx.shape)))
    row_blocks.append((*lead, a, 1, b, c2))
  means = codec.aggregate_blocks(selections, row_blocks, received.valid)
  out = []
  for i, r, (mean, _) in zip(tensors, rows, means):
    *lead, a, c1, b, c2 = plans[i].block_shape
    mean = mean.reshape(*lead, a, b, c2)
    if basis is dct.DCT_BASIS:
      directions = dct.dct_basis(c1)[r]
      # y_j = sum_c z_c D[c, j] as a weighted sum, elementwise: exact float32 on
      # every backend, where a contraction could run at lower precision.
      mean = jnp.sum(mean[..., :, None] * dct.dct_basis(c2), axis=-2)
    else:
      directions = jnp.eye(c1, dtype=jnp.float32)[r]
    out.append((directions, mean.reshape(*lead, a, b * c2)))
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
