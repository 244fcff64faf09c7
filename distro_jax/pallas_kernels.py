"""DeMo's fused GPU kernels in Pallas (Triton): compress and decode, one pass per chunk.

What they compute: docs/performance.md, "On the GPU: Pallas kernels"; their
contract is :mod:`distro_jax.cpu_kernels`'s. ``DISTRO_JAX_PALLAS=0`` or
:func:`disabled` turns them off; :func:`interpreted` runs them on any backend, for tests.
"""

import contextlib
import functools
import threading
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from distro_jax import codec, dct, exchange, kernel_switch

__all__ = ["available", "compress", "decode", "disabled", "interpreted", "interpreting", "serves"]

SWITCH = "DISTRO_JAX_PALLAS"
SIDES = (8, 64)  # 8x8 chunks only with drawn positions and in the decode
# The top-k runs k rounds over the chunk; past this the two-stage XLA top-k wins.
MAX_K = 64
_BAND = 16  # 8x8 chunks a program takes along a band, at most
_HIGHEST = jax.lax.Precision.HIGHEST
_switch = kernel_switch.Switch(SWITCH)
_local = threading.local()  # interpret: set by interpreted()


def available() -> bool:
  """Whether DeMo's update takes the kernels where they serve: on a GPU or interpreted, not off."""
  return not _switch.off() and (interpreting() or jax.default_backend() == "gpu")


@contextlib.contextmanager
def interpreted() -> Iterator[None]:
  """Traces DeMo's update with the kernels in Pallas's interpret mode, on any backend (this thread).

  Example:
    >>> import distro_jax as dj
    >>> with dj.pallas_kernels.interpreted():
    ...   dj.pallas_kernels.available()
    True
  """
  before = interpreting()
  _local.interpret = True
  try:
    yield
  finally:
    _local.interpret = before


def interpreting() -> bool:
  """Whether an :func:`interpreted` block is open in this thread."""
  return getattr(_local, "interpret", False)


def disabled() -> contextlib.AbstractContextManager[None]:
  """Traces DeMo's update on XLA's path within the block (this thread only).

  Example:
    >>> import distro_jax as dj
    >>> with dj.pallas_kernels.disabled():
    ...   dj.pallas_kernels.available()
    False
  """
  return _switch.disabled()


def serves(
  plan: dct.ChunkPlan, *arrays: jax.Array, k: int | None = None, drawn: bool = False
) -> bool:
  """:func:`distro_jax.cpu_kernels.serves` for these kernels."""
  return available() and kernel_switch.fits(
    plan, arrays, k=k, drawn=drawn, sides=SIDES, top_k_side=64, max_k=MAX_K
  )


def _pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def _band(side: int, b: int) -> int | None:
  """The chunks a program takes: a 64x64 one (``None``), or a band of 8x8 ones up to ``_BAND``."""
  if side == 64:
    return None
  t = _BAND
  while b % t:
    t //= 2
  return t


@functools.cache
def _bases(side: int) -> tuple[np.ndarray, ...]:
  """The DCT bases the kernels read: ``D`` and ``D.T`` for 64x64 chunks, ``D`` for 8x8."""
  d = dct._basis_np(side)
  return (d, np.ascontiguousarray(d.T)) if side == 64 else (d,)


def _together(*arrays: jax.Array) -> tuple[list[jax.Array], dict]:
  """``arrays`` typed as varying over all their mesh axes, and ``out_shape``'s typing to match."""
  axes = frozenset().union(*(exchange.varying_axes(x) for x in arrays))
  typed = [exchange.as_varying(x, axes) for x in arrays]
  manual = getattr(jax.typeof(typed[0]), "manual_axis_type", None)
  return typed, ({} if manual is None else {"manual_axis_type": manual})


def _whole(shape: tuple[int, ...]) -> pl.BlockSpec:
  """The block spec that hands every program the whole array."""
  return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _params(interpret: bool) -> dict:
  if interpret or interpreting():
    return {"interpret": True}
  from jax.experimental.pallas import triton as pl_triton

  return {"compiler_params": pl_triton.CompilerParams(num_warps=4)}


def _largest_first(mag, flat, size, k, kp):
  """Positions of the k largest ``mag``, ties to the lower position, in k rounds."""
  slots = jax.lax.broadcasted_iota(jnp.int32, (kp,), 0)

  def round_(e, carry):
    mag, picked = carry
    top = jnp.max(mag)
    p = jnp.min(jnp.where(mag == top, flat, size))
    # Taken entries drop below every magnitude (all are >= 0).
    return jnp.where(flat == p, -1.0, mag), jnp.where(slots == e, p, picked)

  _, picked = jax.lax.fori_loop(0, k, round_, (mag, jnp.zeros((kp,), jnp.int32)))
  return picked


def _compress64_kernel(s_ref, d_ref, dt_ref, g_ref, m_ref, mo_ref, *idx_ref, k, kp):
  y = jnp.dot(jnp.dot(d_ref[...], g_ref[...], precision=_HIGHEST), dt_ref[...], precision=_HIGHEST)
  m_new = s_ref[0] * m_ref[...] + s_ref[1] * y
  mo_ref[...] = m_new
  if idx_ref:
    rows = jax.lax.broadcasted_iota(jnp.int32, m_new.shape, 0)
    flat = rows * 64 + jax.lax.broadcasted_iota(jnp.int32, m_new.shape, 1)
    # A NaN has no rank: such a chunk sends positions 0..k-1 (and NaN values,
    # read back from m'), which mark the message to be left out.
    bad = jnp.max(jnp.where(m_new != m_new, 1, 0)) > 0
    picked = _largest_first(jnp.abs(m_new), flat, 4096, k, kp)
    idx_ref[0][...] = jnp.where(bad, jax.lax.broadcasted_iota(jnp.int32, (kp,), 0), picked)


def _compress8_kernel(s_ref, d_ref, g_ref, m_ref, mo_ref):
  # A band of bt chunks of 8x8, as the block view holds them: x[i, b, j].
  d = d_ref[...]
  decay, lr = s_ref[0], s_ref[1]
  for i in range(8):
    t = d_ref[i, 0] * g_ref[0]
    for p in range(1, 8):
      t = t + d_ref[i, p] * g_ref[p]
    # y[i, b, j] = sum_q D[j, q] t[b, q]
    y = jnp.sum(t[:, None, :] * d[None, :, :], axis=-1)
    mo_ref[i] = decay * m_ref[i] + lr * y


def compress(
  g_blocks: jax.Array,
  m_blocks: jax.Array,
  decay: jax.Array | float,
  lr: jax.Array | float,
  k: int,
  positions: jax.Array | None = None,
  *,
  interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """:func:`distro_jax.cpu_kernels.compress` on the GPU; 8x8 chunks only with ``positions``.

  ``interpret`` runs it in Pallas's interpret mode, on any backend.
  """
  *lead, a, side, b, _ = g_blocks.shape
  top_k = positions is None
  if side != 64 and top_k:
    raise ValueError("pallas_kernels.compress takes 8x8 chunks only at drawn positions.")
  bands = int(np.prod(lead, dtype=np.int64)) * a
  kp = _pow2(k)
  scalars = jnp.stack([jnp.asarray(decay, jnp.float32), jnp.asarray(lr, jnp.float32)])
  g = g_blocks.reshape(bands, side, b, side)
  m = m_blocks.reshape(bands, side, b, side)
  bases = [jnp.asarray(x) for x in _bases(side)]
  (scalars, *bases, g, m), typing = _together(scalars, *bases, g, m)
  m_shape = jax.ShapeDtypeStruct(g.shape, jnp.float32, **typing)
  bt = _band(side, b)
  band = pl.BlockSpec((None, side, bt, side), lambda r, c: (r, 0, c, 0))
  kernel = functools.partial(_compress64_kernel, k=k, kp=kp) if side == 64 else _compress8_kernel
  outs = pl.pallas_call(
    kernel,
    out_shape=(m_shape, *[jax.ShapeDtypeStruct((bands, b, kp), jnp.int32, **typing)] * top_k),
    grid=(bands, b // (bt or 1)),
    in_specs=[_whole((2,)), *[_whole((side, side))] * len(bases), band, band],
    out_specs=(band, *[pl.BlockSpec((None, None, kp), lambda r, c: (r, c, 0))] * top_k),
    **_params(interpret),
  )(scalars, *bases, g, m)
  m_new = outs[0].reshape(g_blocks.shape)
  idx = outs[1][..., :k].reshape(*lead, a, b, k) if top_k else positions.astype(jnp.int32)
  # Values read back from the stored m' are its bits whatever the compiler did.
  idx = exchange.as_varying(idx, exchange.varying_axes(m_new))
  return m_new, idx, codec.gather_blocks(m_new, idx)


def _decode64_kernel(order_ref, ok_ref, d_ref, dt_ref, idx_ref, val_ref, q_ref, *, workers, k):
  shape = (64, 64)
  flat = jax.lax.broadcasted_iota(jnp.int32, shape, 0) * 64
  flat = flat + jax.lax.broadcasted_iota(jnp.int32, shape, 1)

  def entry(n, carry):
    mean, count = carry
    # lax's integer division, not jnp's: the operands are non-negative, and
    # jnp's sign corrections do not lower inside a Triton loop.
    w, e = order_ref[jax.lax.div(n, k)], jax.lax.rem(n, k)
    hit = (flat == (idx_ref[w, e] & 4095)) & (ok_ref[w] > 0)
    count = count + hit.astype(jnp.int32)
    step = (val_ref[w, e] - mean) / jnp.maximum(count, 1).astype(jnp.float32)
    return jnp.where(hit, mean + step, mean), count

  zeros = (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.int32))
  mean, _ = jax.lax.fori_loop(0, workers * k, entry, zeros)
  t = jnp.dot(dt_ref[...], mean, precision=_HIGHEST)
  q_ref[...] = jnp.dot(t, d_ref[...], precision=_HIGHEST)


def _decode8_kernel(order_ref, ok_ref, d_ref, idx_ref, val_ref, q_ref, *, workers, k):
  bt = idx_ref.shape[1]
  cols = jax.lax.broadcasted_iota(jnp.int32, (bt, 8), 1)

  def entry(n, carry):
    mean, count = list(carry[0]), list(carry[1])
    w, e = order_ref[jax.lax.div(n, k)], jax.lax.rem(n, k)
    p = (idx_ref[w, :, e] & 63)[:, None]
    v = val_ref[w, :, e][:, None]
    ok = ok_ref[w] > 0
    row, col = jax.lax.shift_right_logical(p, 3), p & 7
    for i in range(8):
      hit = (row == i) & (cols == col) & ok
      count[i] = count[i] + hit.astype(jnp.int32)
      step = (v - mean[i]) / jnp.maximum(count[i], 1).astype(jnp.float32)
      mean[i] = jnp.where(hit, mean[i] + step, mean[i])
    return tuple(mean), tuple(count)

  zeros = (
    tuple(jnp.zeros((bt, 8), jnp.float32) for _ in range(8)),
    tuple(jnp.zeros((bt, 8), jnp.int32) for _ in range(8)),
  )
  mean, _ = jax.lax.fori_loop(0, workers * k, entry, zeros)
  d = d_ref[...]
  # R[i, b, n] = sum_j Z[i, b, j] D[j, n], then Q[p] = sum_i D[i, p] R[i].
  r = [jnp.sum(z[:, :, None] * d[None, :, :], axis=1) for z in mean]
  for p in range(8):
    acc = d_ref[0, p] * r[0]
    for i in range(1, 8):
      acc = acc + d_ref[i, p] * r[i]
    q_ref[p] = acc


def decode(
  indices: jax.Array,
  values: jax.Array,
  valid_W: jax.Array,
  block_shape: tuple[int, ...],
  *,
  interpret: bool = False,
) -> jax.Array:
  """:func:`distro_jax.cpu_kernels.decode`; ``interpret`` runs it in Pallas's interpret mode."""
  workers, k = indices.shape[0], indices.shape[-1]
  *lead, a, side, b, _ = block_shape
  bands = int(np.prod(lead, dtype=np.int64)) * a
  idx = indices.astype(jnp.int32).reshape(workers, bands, b, k)
  val = values.astype(jnp.float32).reshape(workers, bands, b, k)
  order = codec.worker_order(
    idx.reshape(workers, bands * b, k), val.reshape(workers, bands * b, k), side * side
  )
  # Triton's blocks have power-of-two sides; the padding is never read.
  kp = _pow2(k)
  idx, val = (jnp.pad(x, ((0, 0),) * 3 + ((0, kp - k),)) for x in (idx, val))
  ok = valid_W.astype(jnp.int32)
  bases = [jnp.asarray(x) for x in _bases(side)]
  (order, ok, *bases, idx, val), typing = _together(order, ok, *bases, idx, val)
  bt = _band(side, b)
  kernel = _decode64_kernel if side == 64 else _decode8_kernel
  vec = _whole((workers,))
  messages = pl.BlockSpec((workers, None, bt, kp), lambda r, c: (0, r, c, 0))
  q = pl.pallas_call(
    functools.partial(kernel, workers=workers, k=k),
    out_shape=jax.ShapeDtypeStruct((bands, side, b, side), jnp.float32, **typing),
    grid=(bands, b // (bt or 1)),
    in_specs=[vec, vec, *[_whole((side, side))] * len(bases), messages, messages],
    out_specs=pl.BlockSpec((None, side, bt, side), lambda r, c: (r, 0, c, 0)),
    **_params(interpret),
  )(order, ok, *bases, idx, val)
  return q.reshape(block_shape)
