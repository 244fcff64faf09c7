"""Chunked orthonormal DCT-II: how a tensor is cut into chunks, and the transform.

Every tensor is viewed as ``(*batch, n1, n2)``: a scalar as ``(1, 1)``, a vector
``(n,)`` as ``(1, n)`` (which is exactly the reference's 1-D chunking, since a
length-1 axis gets a 1x1 identity transform), and anything of higher rank keeps
its leading axes as batch axes. Each of the last two axes is cut into chunks of
the largest divisor that does not exceed the target, and every
``(c1, c2)`` block gets a separable 2-D DCT. Coefficients are laid out as
``(rows, c1 * c2)``, one row per chunk, rows ordered row-major over
``(*batch, n1 // c1, n2 // c2)`` and each row flattened with the c1 axis first.

The transform is a pair of small matmuls with a precomputed basis, not an FFT:
chunks are at most a few dozen long, where a dense basis is fastest on every
accelerator.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "ChunkPlan",
  "chunk_length",
  "dct_basis",
  "decode",
  "encode",
  "from_chunks",
  "plan_chunks",
  "to_chunks",
]


def chunk_length(n: int, target: int) -> int:
  """Largest divisor of ``n`` that is at most ``target``.

  Examples: ``(4096, 64) -> 64``, ``(40, 64) -> 40``, ``(96, 64) -> 48``,
  ``(7, 64) -> 7``, and a prime above the target gives 1.

  Args:
    n: axis length, at least 1.
    target: the chunk length aimed for, at least 1.

  Returns:
    The chunk length for that axis.
  """
  if n < 1 or target < 1:
    raise ValueError(f"chunk_length needs n >= 1 and target >= 1, got {n=}, {target=}.")
  if n <= target:
    return n
  best = 1
  for d in range(1, math.isqrt(n) + 1):
    if n % d == 0:
      for c in (d, n // d):
        if best < c <= target:
          best = c
  return best


class ChunkPlan(NamedTuple):
  """How one tensor is chunked. Static: hashable and free of arrays.

  Attributes:
    shape: the tensor's own shape.
    batch: the product of the leading (batch) axes, 1 if there are none.
    n1: length of the second-to-last axis of the 2-D view.
    n2: length of the last axis of the 2-D view.
    c1: chunk length along ``n1``.
    c2: chunk length along ``n2``.
  """

  shape: tuple[int, ...]
  batch: int
  n1: int
  n2: int
  c1: int
  c2: int

  @property
  def chunk_size(self) -> int:
    """Coefficients per chunk, ``c1 * c2``."""
    return self.c1 * self.c2

  @property
  def rows(self) -> int:
    """Number of chunks in the tensor."""
    return self.batch * (self.n1 // self.c1) * (self.n2 // self.c2)

  @property
  def coeff_shape(self) -> tuple[int, int]:
    """Shape of the coefficient array, ``(rows, chunk_size)``."""
    return (self.rows, self.chunk_size)


def plan_chunks(shape: tuple[int, ...], target: int) -> ChunkPlan:
  """Plans the chunking of a tensor of ``shape`` for a chunk target ``target``.

  Args:
    shape: the tensor's shape; any rank, including 0.
    target: the chunk length aimed for on each of the last two axes.

  Returns:
    A :class:`ChunkPlan`.
  """
  shape = tuple(int(d) for d in shape)
  if any(d == 0 for d in shape):
    raise ValueError(f"Cannot chunk a tensor with a zero-length axis, shape {shape}.")
  if len(shape) == 0:
    n1, n2, batch = 1, 1, 1
  elif len(shape) == 1:
    n1, n2, batch = 1, shape[0], 1
  else:
    n1, n2, batch = shape[-2], shape[-1], math.prod(shape[:-2])
  return ChunkPlan(shape, batch, n1, n2, chunk_length(n1, target), chunk_length(n2, target))


@functools.cache
def _basis_np(n: int) -> np.ndarray:
  k = np.arange(n)[:, None]
  i = np.arange(n)[None, :]
  basis = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * i + 1) * k / (2 * n))
  basis[0] /= np.sqrt(2.0)
  return basis.astype(np.float32)


def dct_basis(n: int) -> jax.Array:
  """The orthonormal DCT-II matrix ``D`` of size ``n``: ``y = D @ x``, ``x = D.T @ y``.

  Args:
    n: transform length.

  Returns:
    A float32 array of shape ``(n, n)`` whose rows are the basis vectors.
  """
  return jnp.asarray(_basis_np(n))


_HIGHEST = jax.lax.Precision.HIGHEST


def encode(x: jax.Array, plan: ChunkPlan) -> jax.Array:
  """Chunked 2-D DCT of ``x``; arithmetic in float32.

  Args:
    x: a tensor of shape ``plan.shape``, any float dtype.
    plan: its :class:`ChunkPlan`.

  Returns:
    Float32 coefficients of shape ``plan.coeff_shape``.
  """
  a, b = plan.n1 // plan.c1, plan.n2 // plan.c2
  x_BxAxPxBxQ = x.astype(jnp.float32).reshape(plan.batch, a, plan.c1, b, plan.c2)
  d1, d2 = dct_basis(plan.c1), dct_basis(plan.c2)
  t = jnp.einsum("jq,zapbq->zapbj", d2, x_BxAxPxBxQ, precision=_HIGHEST)
  y = jnp.einsum("ip,zapbj->zabij", d1, t, precision=_HIGHEST)
  return y.reshape(plan.coeff_shape)


def decode(y: jax.Array, plan: ChunkPlan) -> jax.Array:
  """Inverse of :func:`encode`.

  Args:
    y: float32 coefficients of shape ``plan.coeff_shape``.
    plan: the :class:`ChunkPlan` they were made with.

  Returns:
    A float32 tensor of shape ``plan.shape``.
  """
  a, b = plan.n1 // plan.c1, plan.n2 // plan.c2
  y_BxAxBxIxJ = y.reshape(plan.batch, a, b, plan.c1, plan.c2)
  d1, d2 = dct_basis(plan.c1), dct_basis(plan.c2)
  t = jnp.einsum("ip,zabij->zapbj", d1, y_BxAxBxIxJ, precision=_HIGHEST)
  x = jnp.einsum("jq,zapbj->zapbq", d2, t, precision=_HIGHEST)
  return x.reshape(plan.shape)


def to_chunks(x: jax.Array, plan: ChunkPlan) -> jax.Array:
  """The blocks of :func:`encode` with no transform: the no-DCT ablation's "coefficients".

  Args:
    x: a tensor of shape ``plan.shape``, any float dtype.
    plan: its :class:`ChunkPlan`.

  Returns:
    Float32 array of shape ``plan.coeff_shape``; row ``r`` holds the entries
    of chunk ``r``, row-major with the ``c1`` axis first, as :func:`encode`
    lays out coefficients.
  """
  a, b = plan.n1 // plan.c1, plan.n2 // plan.c2
  x_BxAxPxBxQ = x.astype(jnp.float32).reshape(plan.batch, a, plan.c1, b, plan.c2)
  return x_BxAxPxBxQ.transpose(0, 1, 3, 2, 4).reshape(plan.coeff_shape)


def from_chunks(y: jax.Array, plan: ChunkPlan) -> jax.Array:
  """Inverse of :func:`to_chunks`.

  Args:
    y: float32 array of shape ``plan.coeff_shape``.
    plan: the :class:`ChunkPlan` it was made with.

  Returns:
    A float32 tensor of shape ``plan.shape``.
  """
  a, b = plan.n1 // plan.c1, plan.n2 // plan.c2
  y_BxAxBxPxQ = y.reshape(plan.batch, a, b, plan.c1, plan.c2)
  return y_BxAxBxPxQ.transpose(0, 1, 3, 2, 4).reshape(plan.shape)
