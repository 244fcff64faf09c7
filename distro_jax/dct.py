"""The chunked orthonormal DCT-II: how a tensor is cut into chunks, and the transform.

What is chunked and where the coefficients live is docs/design.md, "The chunked
DCT". Everything here works on a tensor's block view
``(*batch, n1 // c1, c1, n2 // c2, c2)`` (:func:`to_blocks`, a reshape).
"""

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Some jax versions have no shard_alike; from_blocks then skips a sharding hint.
try:
  from jax.experimental.shard_alike import shard_alike
except ImportError:
  shard_alike = None

__all__ = [
  "DCT_BASIS",
  "IDENTITY_BASIS",
  "Basis",
  "ChunkPlan",
  "basis",
  "chunk_length",
  "dct_basis",
  "from_blocks",
  "from_chunks",
  "in_place_zeros",
  "plan_chunks",
  "refuse_non_float",
  "to_blocks",
  "to_chunks",
]


def chunk_length(n: int, target: int) -> int:
  """The chunk length of an axis of length ``n``: its largest divisor up to ``target`` (>= 1)."""
  if n < 1 or target < 1:
    raise ValueError(f"chunk_length needs n >= 1 and target >= 1, got {n=}, {target=}.")
  divisors = (c for d in range(1, math.isqrt(n) + 1) if n % d == 0 for c in (d, n // d))
  return max(c for c in divisors if c <= target)


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
    """Shape of :func:`to_chunks`'s rows, ``(rows, chunk_size)``."""
    return (self.rows, self.chunk_size)

  @property
  def state_shape(self) -> tuple[int, ...]:
    """Shape of DeMo's in-place momentum: the tensor's own, ``(1,)`` for a scalar."""
    return self.shape or (1,)

  @property
  def batch_dims(self) -> int:
    """Number of leading (batch) axes of the block view."""
    return max(len(self.shape) - 2, 0)

  @property
  def block_shape(self) -> tuple[int, ...]:
    """The block view's shape, ``(*batch, n1 // c1, c1, n2 // c2, c2)``."""
    return (*self.shape[:-2], self.n1 // self.c1, self.c1, self.n2 // self.c2, self.c2)


def in_place_zeros(p: Any) -> jax.Array:
  """Float32 zeros of :attr:`ChunkPlan.state_shape` for param ``p``, sharded like it."""
  if np.ndim(p) == 0:
    return jnp.zeros((1,), jnp.float32)
  return jnp.zeros_like(p, dtype=jnp.float32)


def refuse_non_float(params: Any, method: str, real_only: str) -> None:
  """Refuses complex, integer and bool params, naming each and the fixes.

  Args:
    params: the params tree given to ``init``.
    method: the optimizer's name, e.g. ``"DeMo"``.
    real_only: the parts of it that need real values, e.g. ``"top-k by magnitude"``.

  Raises:
    ValueError: for the first param that is not a real float.
  """
  leave_out = (
    f"leave it out of {method} with optax.masked or optax.multi_transform (e.g. "
    "optax.set_to_zero() for it)"
  )
  for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
    dtype = getattr(p, "dtype", None)
    if dtype is None or jnp.issubdtype(dtype, jnp.floating):
      continue
    name = jax.tree_util.keystr(path)
    if jnp.issubdtype(dtype, jnp.complexfloating):
      raise ValueError(
        f"Parameter {name} is complex ({dtype}). {method}'s {real_only} are defined for "
        "real values only. Keep it as two real parameters (e.g. jnp.stack([z.real, z.imag]), "
        f"recombined in the model), or {leave_out}."
      )
    raise ValueError(
      f"Parameter {name} has the non-float dtype {dtype}, which has no gradient to compress "
      f"(jax.grad gives it none). Make it a float param if it is meant to train, or {leave_out}."
    )


def plan_chunks(shape: tuple[int, ...], target: int) -> ChunkPlan:
  """The :class:`ChunkPlan` of a ``shape`` (any rank, no empty axis) for chunk target ``target``."""
  shape = tuple(int(d) for d in shape)
  if any(d == 0 for d in shape):
    raise ValueError(f"Cannot chunk a tensor with a zero-length axis, shape {shape}.")
  n1, n2 = (1, 1, *shape)[-2:]
  return ChunkPlan(
    shape, math.prod(shape[:-2]), n1, n2, chunk_length(n1, target), chunk_length(n2, target)
  )


@functools.cache
def _basis_np(n: int) -> np.ndarray:
  k, i = np.ogrid[:n, :n]
  basis = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * i + 1) * k / (2 * n))
  basis[0] /= np.sqrt(2.0)
  return basis.astype(np.float32)


def dct_basis(n: int) -> jax.Array:
  """The float32 orthonormal DCT-II matrix ``D``, ``(n, n)``: ``y = D @ x``, ``x = D.T @ y``."""
  return jnp.asarray(_basis_np(n))


_HIGHEST = jax.lax.Precision.HIGHEST


def explicit_sharding(x: jax.Array) -> Any:
  """``x``'s sharding when its type shards it over explicit mesh axes, else ``None``."""
  sharding = jax.typeof(x).sharding if placed_on_mesh(x) else None
  if sharding is None or jax.sharding.AxisType.Explicit not in sharding.mesh.axis_types:
    return None
  return sharding if any(e is not None for e in sharding.spec) else None


def placed_on_mesh(x: jax.Array) -> bool:
  """Whether ``x``'s type places it on mesh axes the compiler shards (not manual ones)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or not mesh.axis_names:
    return False
  return any(t != jax.sharding.AxisType.Manual for t in mesh.axis_types)


def _axis_entry_size(mesh: Any, entry: Any) -> int:
  names = entry if isinstance(entry, tuple) else (entry,)
  return math.prod(mesh.shape[n] for n in names)


def _padded_spec(sharding: Any, ndim: int) -> tuple[Any, ...]:
  """``sharding``'s spec with an entry for each of ``ndim`` axes."""
  spec = tuple(sharding.spec)
  return spec + (None,) * (ndim - len(spec))


def _chunk_whole_spec(sharding: Any, plan: ChunkPlan) -> tuple[Any, ...]:
  """The tensor's spec with every entry that would cut a chunk dropped."""
  nd = len(plan.shape)
  chunks = {nd - 2: plan.n1 // plan.c1, nd - 1: plan.n2 // plan.c2}
  return tuple(
    None if e is not None and d in chunks and chunks[d] % _axis_entry_size(sharding.mesh, e) else e
    for d, e in enumerate(_padded_spec(sharding, nd))
  )


def _block_spec(spec: tuple[Any, ...], plan: ChunkPlan) -> P:
  """Where a chunk-whole spec of a tensor's axes goes in its block view."""
  if len(plan.shape) >= 2:
    return P(*spec[:-2], spec[-2], None, spec[-1], None)
  if len(plan.shape) == 1:
    return P(None, None, spec[0], None)
  return P()


def to_blocks(x: jax.Array, plan: ChunkPlan) -> jax.Array:
  """The block view of ``x``, ``plan.block_shape``: block ``(..., a, :, b, :)`` is chunk ``(a, b)``.

  An explicit sharding moves to the chunk-count axes; an axis whose chunks do
  not divide over its shards is gathered first.

  Args:
    x: a tensor of shape ``plan.shape`` (or ``plan.state_shape``), any dtype.
    plan: its :class:`ChunkPlan`.
  """
  sharding = explicit_sharding(x)
  if sharding is None:
    return jnp.reshape(x, plan.block_shape)
  whole = _chunk_whole_spec(sharding, plan)
  if whole != _padded_spec(sharding, x.ndim):
    x = jax.sharding.reshard(x, NamedSharding(sharding.mesh, P(*whole)))
  out = NamedSharding(sharding.mesh, _block_spec(whole, plan))
  return jnp.reshape(x, plan.block_shape, out_sharding=out)


def from_blocks(
  y: jax.Array,
  plan: ChunkPlan,
  shape: tuple[int, ...] | None = None,
  like: jax.Array | None = None,
) -> jax.Array:
  """Inverse of :func:`to_blocks` for a ``y`` of ``plan.block_shape``.

  Args:
    plan: the :class:`ChunkPlan` it was made with.
    shape: the shape to return, ``plan.shape`` by default.
    like: an array whose sharding the result takes, e.g. the tensor given to :func:`to_blocks`.
  """
  shape = tuple(plan.shape if shape is None else shape)
  sharding = explicit_sharding(y)
  if y.shape != shape:
    if sharding is None or len(plan.shape) < 1:
      y = jnp.reshape(y, shape)
    else:
      spec = _padded_spec(sharding, y.ndim)
      nb = plan.batch_dims
      kept = (*spec[:nb], spec[nb], spec[nb + 2]) if len(plan.shape) >= 2 else (spec[2],)
      y = jnp.reshape(y, shape, out_sharding=NamedSharding(sharding.mesh, P(*kept)))
  if like is None or not placed_on_mesh(like):
    return y
  want = explicit_sharding(like)
  if want is not None:
    return y if jax.typeof(y).sharding.spec == want.spec else jax.sharding.reshard(y, want)
  if explicit_sharding(y) is None:
    # On an auto mesh ask for ``like``'s sharding, or a decoded result stays replicated.
    if shard_alike is None:
      _warn_no_shard_alike()
    else:
      y, _ = shard_alike(y, like)
  return y


@functools.cache
def _warn_no_shard_alike() -> None:
  warnings.warn(
    f"jax {jax.__version__} has no shard_alike, so on an AxisType.Auto mesh DeMo's and "
    "SparseLoCo's update and state may come back replicated, not sharded like the params "
    "(same values). Use an AxisType.Explicit mesh, or a jax with jax.experimental.shard_alike.",
    stacklevel=3,
  )


def _along_c1(basis: jax.Array, x: jax.Array) -> jax.Array:
  """``basis @ block`` for every block: the transform along ``c1``."""
  *lead, a, c1, b, c2 = x.shape
  # A batched matmul over each band writes in place, where an einsum adds a
  # transpose; unless that is free (b == 1) or the bands are explicitly sharded.
  if b == 1 or explicit_sharding(x) is not None:
    return jnp.einsum("ip,...apbj->...aibj", basis, x, precision=_HIGHEST)
  bands = x.reshape(*lead, a, c1, b * c2)
  batched = jnp.broadcast_to(basis, (*lead, a, c1, c1))
  out = jnp.einsum("...aip,...apn->...ain", batched, bands, precision=_HIGHEST)
  return out.reshape(x.shape)


def forward_blocks(x_blocks: jax.Array, plan: ChunkPlan) -> jax.Array:
  """The float32 2-D DCT of every block of a block view ``x_blocks`` (any float dtype)."""
  d1, d2 = dct_basis(plan.c1), dct_basis(plan.c2)
  x = x_blocks.astype(jnp.float32)
  t = jnp.einsum("jq,...apbq->...apbj", d2, x, precision=_HIGHEST)
  return _along_c1(d1, t)


def inverse_blocks(y_blocks: jax.Array, plan: ChunkPlan) -> jax.Array:
  """Inverse of :func:`forward_blocks`."""
  d1, d2 = dct_basis(plan.c1), dct_basis(plan.c2)
  t = _along_c1(d1.T, y_blocks)
  return jnp.einsum("jq,...apbj->...apbq", d2, t, precision=_HIGHEST)


class Basis(NamedTuple):
  """The basis a chunk's coefficients are in, as a pair of block-view functions. Static.

  Attributes:
    name: ``"dct"`` or ``"identity"``.
    forward: ``forward(x_blocks, plan)``: float32 coefficients of a block view.
    inverse: ``inverse(y_blocks, plan)``: the block view they came from.
  """

  name: str
  forward: Callable[[jax.Array, ChunkPlan], jax.Array]
  inverse: Callable[[jax.Array, ChunkPlan], jax.Array]


DCT_BASIS = Basis("dct", forward_blocks, inverse_blocks)
"""Every chunk's orthonormal 2-D DCT: :func:`forward_blocks`, :func:`inverse_blocks`."""
IDENTITY_BASIS = Basis("identity", lambda x, plan: x.astype(jnp.float32), lambda y, plan: y)
"""A chunk's own entries, in float32 (the ``use_dct=False`` ablation)."""


def basis(use_dct: bool) -> Basis:
  """:data:`DCT_BASIS` if ``use_dct``, else :data:`IDENTITY_BASIS`.

  Example:
    >>> import jax.numpy as jnp, distro_jax as dj
    >>> plan = dj.dct.plan_chunks((8, 8), 8)
    >>> y = dj.dct.basis(True).forward(jnp.ones(plan.block_shape), plan)
    >>> round(float(y[0, 0, 0, 0]), 4)  # the one chunk's DC term
    8.0
  """
  return DCT_BASIS if use_dct else IDENTITY_BASIS


def to_chunks(x: jax.Array, plan: ChunkPlan) -> jax.Array:
  """``x`` (``plan.shape`` or ``plan.state_shape``) as float32 rows, one chunk per row.

  Row ``r`` is chunk ``r`` in chunk-local order ``i * c2 + j``; no transform.
  """
  x = jnp.reshape(x.astype(jnp.float32), plan.block_shape)
  return jnp.swapaxes(x, -3, -2).reshape(plan.coeff_shape)


def from_chunks(y: jax.Array, plan: ChunkPlan) -> jax.Array:
  """Inverse of :func:`to_chunks`: ``plan.coeff_shape`` back to ``plan.shape``."""
  *lead, a, c1, b, c2 = plan.block_shape
  return jnp.swapaxes(y.reshape(*lead, a, b, c1, c2), -3, -2).reshape(plan.shape)
