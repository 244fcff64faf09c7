"""A matrix's nearest semi-orthogonal direction, by Muon's Newton-Schulz iteration."""

import jax
import jax.numpy as jnp

__all__ = ["orthogonalize"]

# Muon's quintic coefficients (a, b, c): X <- a X + b (X X^T) X + c (X X^T)^2 X.
_QUINTIC = (3.4445, -4.7750, 2.0315)


def orthogonalize(x_MxN: jax.Array, steps: int = 5) -> jax.Array:
  """``x``'s nearest semi-orthogonal matrix, approximately, in ``x``'s dtype.

  Args:
    x_MxN: a matrix.
    steps: Newton-Schulz steps; Muon takes 5.

  Returns:
    An array like ``x`` with ``x``'s singular vectors and its singular values
    moved into a band around one, about 0.7 to 1.2 (zero stays zero). Computed
    in float32.

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
