"""A matrix's nearest semi-orthogonal direction, by Muon's Newton-Schulz iteration.

DeMo's decoded aggregate of a hidden weight matrix is a few DCT cosines per
chunk, and its sign or its RMS-scaled self keeps whatever few directions
dominate them. Muon (Jordan et al., 2024) steps along ``U V^T`` of the
update's SVD instead, so every direction of the matrix moves by the same
amount; ``normalize="orth"`` of :func:`distro_jax.demo` does the same with
DeMo's aggregate. The iteration is five steps of an odd quintic in ``X``
whose coefficients push the singular values into a band around one (about
0.7 to 1.2, not exactly one: it trades exactness for speed, as Muon's does).
Five steps lift a singular value of about 1/500 of the Frobenius norm or
more into the band; smaller ones grow but stay below it.

:func:`orthogonalize_shared_rows` is the same step for an aggregate whose
every strip of ``c1`` rows lies along one DCT cosine, ``Q = R^T Y`` with
``R`` of orthonormal rows (``random_positions="shared_rows"``): the
iteration on ``Q`` is ``R^T`` times the iteration on ``Y``, a matrix
``c1`` times shorter, so it costs about ``c1**2`` times fewer flops.
"""

import jax
import jax.numpy as jnp

from distro_jax import dct

__all__ = ["orthogonalize", "orthogonalize_shared_rows"]

# Muon's quintic coefficients (a, b, c): X <- a X + b (X X^T) X + c (X X^T)^2 X.
_QUINTIC = (3.4445, -4.7750, 2.0315)


def orthogonalize(x_MxN: jax.Array, steps: int = 5) -> jax.Array:
  """``x``'s nearest semi-orthogonal matrix, approximately, in ``x``'s dtype.

  Args:
    x_MxN: a matrix.
    steps: Newton-Schulz steps; Muon takes 5.

  Returns:
    An array like ``x`` with ``x``'s singular vectors and its singular values
    moved into a band around one (zero stays zero). Computed in float32.

  References:
    Jordan et al., "Muon: An optimizer for hidden layers in neural networks",
    2024, https://kellerjordan.github.io/posts/muon/.

  Example:
    >>> import jax.numpy as jnp, distro_jax as dj
    >>> s = jnp.linalg.svd(dj.orthogonalize(jnp.diag(jnp.array([5.0, 1.0, 0.2]))))[1]
    >>> print(bool(jnp.all((s > 0.6) & (s < 1.3))))
    True
  """
  if x_MxN.ndim != 2:
    raise ValueError(f"orthogonalize takes a matrix; got shape {x_MxN.shape}.")
  if x_MxN.size == 0:
    return x_MxN
  x = x_MxN.astype(jnp.float32)
  # The iteration multiplies by X X^T, so it runs on the short side.
  wide = x.T if x.shape[0] > x.shape[1] else x
  # A Frobenius norm of one puts every singular value in (0, 1], where the
  # quintic converges; the floor keeps a zero matrix zero.
  wide = wide / jnp.maximum(jnp.linalg.norm(wide), 1e-30)
  # On a mesh with explicit sharding a split long side makes the Gram matrix
  # a sum over shards, which JAX asks to be placed: it is small (short side
  # squared), so every device keeps all of it, and the long side stays split.
  explicit = jax.typeof(wide).sharding.mesh.explicit_axes
  gram_sharding = jax.sharding.PartitionSpec() if explicit else None
  a, b, c = _QUINTIC
  for _ in range(steps):
    gram = jnp.matmul(wide, wide.T, out_sharding=gram_sharding)
    wide = a * wide + (b * gram + c * (gram @ gram)) @ wide
  out = wide.T if x.shape[0] > x.shape[1] else wide
  return out.astype(x_MxN.dtype)


def orthogonalize_shared_rows(q_blocks: jax.Array, rows: jax.Array, steps: int = 5) -> jax.Array:
  """:func:`orthogonalize` of a matrix (or a stack of them) whose row strips are single cosines.

  Every strip ``a`` of ``c1`` rows of the matrix is ``d_r y_a^T``, with
  ``d_r`` the DCT cosine ``r = rows[a]`` of length ``c1``, as the aggregate
  of ``random_positions="shared_rows"`` is. The matrix is then
  ``R^T Y`` with ``R``'s rows orthonormal, each Newton-Schulz step on it is
  ``R^T`` times the step on ``Y`` (``X X^T`` becomes ``R^T Y Y^T R`` and the
  Frobenius norm is kept), so this runs the iteration on ``Y``, ``c1``
  times shorter, and spreads the result back along the cosines. In exact
  arithmetic it is :func:`orthogonalize` of the matrix; in floats it agrees
  to rounding.

  Args:
    q_blocks: the matrix's block view ``(*lead, A, c1, B, c2)``
      (:func:`distro_jax.dct.to_blocks`), one matrix per index of ``lead``.
    rows: int ``(*lead, A)``, each strip's cosine, in ``[0, c1)``.
    steps: Newton-Schulz steps; Muon takes 5.

  Returns:
    Float32 ``(*lead, A, c1, B, c2)``: each matrix orthogonalized, in the block view.

  Example:
    >>> import jax.numpy as jnp, distro_jax as dj
    >>> plan = dj.dct.plan_chunks((16, 24), 8)
    >>> rows = jnp.array([1, 5])
    >>> y = jnp.arange(48.0).reshape(2, 24) % 7 - 3
    >>> d = dj.dct.dct_basis(8)[rows]
    >>> q = d[:, :, None] * y[:, None, :]  # strip a is d_rows[a] y_a^T
    >>> fast = dj.orthogonalize_shared_rows(dj.dct.to_blocks(q.reshape(16, 24), plan), rows)
    >>> ref = dj.orthogonalize(q.reshape(16, 24))
    >>> bool(jnp.allclose(dj.dct.from_blocks(fast, plan), ref, atol=1e-5))
    True
  """
  *lead, a, c1, b, c2 = q_blocks.shape
  cosines = dct.dct_basis(c1)[rows]  # (*lead, A, c1)
  # A weighted sum over each strip's rows, elementwise: exact float32 on
  # every backend, where a contraction could run at lower precision.
  y = jnp.sum(cosines[..., :, :, None, None] * q_blocks.astype(jnp.float32), axis=-3)
  return orthogonalize_strips(cosines, y.reshape(*lead, a, b * c2), c2, steps)


def orthogonalize_strips(directions: jax.Array, y: jax.Array, c2: int, steps: int = 5) -> jax.Array:
  """:func:`orthogonalize` of ``Q = R^T Y``, given ``R``'s rows and ``Y``, in ``Q``'s block view.

  Strip ``a`` of ``Q`` is ``directions[a] y[a]^T``; with the directions of
  unit length this is :func:`orthogonalize_shared_rows` after its projection
  (and what :func:`distro_jax.decode.shared_rows` reads from the messages).

  Args:
    directions: float32 ``(*lead, A, c1)``, each strip's unit vector.
    y: float32 ``(*lead, A, N)``, each strip's row, ``N = B * c2``.
    c2: the chunk's length along the rows.
    steps: Newton-Schulz steps; Muon takes 5.

  Returns:
    Float32 ``(*lead, A, c1, B, c2)``: each matrix orthogonalized, in the block view.
  """
  *lead, a, n = y.shape
  flat = y.astype(jnp.float32).reshape(-1, a, n)
  p = jax.vmap(lambda m: orthogonalize(m, steps))(flat).reshape(*lead, a, 1, n // c2, c2)
  return directions[..., :, :, None, None] * p
