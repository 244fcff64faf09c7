"""Codec and wire format: per-chunk top-k, the byte message, and aggregation.

One worker's message for a whole parameter tree is a single ``uint8`` vector,
so one collective carries it. Its first byte says whether the sender's values
are finite (1) or not (0); receivers leave a message marked 0 out of the
aggregate. Then, for each tensor, in tree order, it holds the
chunk-local indices (``rows * k`` entries in the narrowest unsigned type that
holds the chunk size) and then the values (``rows * k`` entries in the
parameter dtype). With 1-bit values the value blocks are left out and the
signs of every tensor are packed together, 8 per byte, at the end of the
message. The receiver maps a set bit to +1 and a clear bit to -1.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from distro_jax.exchange import varying_axes

__all__ = [
  "TensorWire",
  "WireLayout",
  "aggregate",
  "decode_message",
  "encode_message",
  "index_dtype",
  "select_topk",
  "zero_selected",
]


HEADER_BYTES = 1  # the validity flag


def index_dtype(chunk_size: int) -> np.dtype:
  """The narrowest unsigned integer dtype that indexes a chunk of this size."""
  if chunk_size <= 1 << 8:
    return np.dtype(np.uint8)
  if chunk_size <= 1 << 16:
    return np.dtype(np.uint16)
  return np.dtype(np.uint32)


class TensorWire(NamedTuple):
  """What one tensor contributes to the message. Static.

  Attributes:
    rows: number of chunks.
    k: coefficients kept per chunk.
    chunk_size: coefficients per chunk.
    value_dtype: dtype name of the values on the wire (the parameter dtype).
  """

  rows: int
  k: int
  chunk_size: int
  value_dtype: str

  @property
  def index_dtype(self) -> np.dtype:
    return index_dtype(self.chunk_size)

  @property
  def entries(self) -> int:
    return self.rows * self.k


class WireLayout(NamedTuple):
  """Layout of a whole tree's message. Static.

  Attributes:
    tensors: one :class:`TensorWire` per leaf, in tree order.
    quantize_1bit: whether values travel as packed sign bits.
  """

  tensors: tuple[TensorWire, ...]
  quantize_1bit: bool

  @property
  def index_bytes(self) -> int:
    return sum(t.entries * t.index_dtype.itemsize for t in self.tensors)

  @property
  def value_bytes(self) -> int:
    if self.quantize_1bit:
      return math.ceil(sum(t.entries for t in self.tensors) / 8)
    return sum(t.entries * np.dtype(t.value_dtype).itemsize for t in self.tensors)

  @property
  def num_bytes(self) -> int:
    """Bytes one worker sends per step: the length of its message."""
    return HEADER_BYTES + self.index_bytes + self.value_bytes


def select_topk(coeffs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Keeps the ``k`` largest-magnitude coefficients of every row.

  Ties go to the lower index, as ``jax.lax.top_k`` documents, so the choice is
  the same on every backend. Wide rows are searched in two stages, which pick
  exactly the same set: the k groups of 8 with the largest maxima hold every
  one of the top k (each element of the top k lifts its own group's maximum to
  at least the k-th value, and at most k groups can reach it), so a second
  top-k over those 8k candidates, kept in index order, finds them.

  Args:
    coeffs: float array ``(rows, chunk_size)``.
    k: how many to keep, ``1 <= k <= chunk_size``.

  Returns:
    ``(indices, values)``, both ``(rows, k)``: int32 positions within the chunk,
    and the coefficients found there.
  """
  rows, width = coeffs.shape
  mag = jnp.abs(coeffs)
  group = 8
  if width % group or width < 32 * k:
    _, idx = jax.lax.top_k(mag, k)
  else:
    mag_RxGxS = mag.reshape(rows, width // group, group)
    _, groups = jax.lax.top_k(mag_RxGxS.max(axis=-1), k)
    groups = jnp.sort(groups, axis=-1)
    candidates = jnp.take_along_axis(mag_RxGxS, groups[..., None], axis=1).reshape(rows, k * group)
    _, pos = jax.lax.top_k(candidates, k)
    idx = jnp.take_along_axis(groups, pos // group, axis=1) * group + pos % group
  return idx, jnp.take_along_axis(coeffs, idx, axis=-1)


def zero_selected(coeffs: jax.Array, idx: jax.Array) -> jax.Array:
  """Error feedback in the coefficient domain: what was sent leaves the buffer."""
  rows = jnp.arange(coeffs.shape[0])[:, None]
  return coeffs.at[rows, idx].set(0.0, unique_indices=True)


def _to_bytes(x: jax.Array) -> jax.Array:
  """Flattens ``x`` to its raw bytes (uint8) in native order."""
  return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(b: jax.Array, dtype: np.dtype, shape: tuple[int, ...]) -> jax.Array:
  """Inverse of :func:`_to_bytes` for one tensor; ``b`` has leading batch axes."""
  lead = b.shape[:-1]
  if dtype.itemsize == 1:
    return jax.lax.bitcast_convert_type(b, dtype).reshape(*lead, *shape)
  b = b.reshape(*lead, *shape, dtype.itemsize)
  return jax.lax.bitcast_convert_type(b, dtype)


def encode_message(
  indices: list[jax.Array],
  values: list[jax.Array],
  layout: WireLayout,
  valid: jax.Array | bool = True,
) -> jax.Array:
  """Serializes one worker's top-k selections into its wire message.

  Args:
    indices: per tensor, int ``(rows, k)`` chunk-local positions.
    values: per tensor, float ``(rows, k)`` coefficients (full precision).
    layout: the :class:`WireLayout` of the tree.
    valid: False marks the message as one to leave out (the sender's values
      were not finite).

  Returns:
    ``uint8[layout.num_bytes]``.
  """
  parts = [jnp.asarray(valid, jnp.uint8).reshape(1)]
  for t, idx in zip(layout.tensors, indices):
    parts.append(_to_bytes(idx.astype(t.index_dtype)))
  if layout.quantize_1bit:
    signs = jnp.concatenate([(v >= 0).reshape(-1) for v in values])
    parts.append(jnp.packbits(signs))
  else:
    for t, v in zip(layout.tensors, values):
      parts.append(_to_bytes(v.astype(t.value_dtype)))
  return jnp.concatenate(parts)


def decode_message(
  message: jax.Array, layout: WireLayout
) -> tuple[list[tuple[jax.Array, jax.Array]], jax.Array]:
  """Parses messages back into (int32 indices, float32 values) per tensor.

  Args:
    message: ``uint8[..., layout.num_bytes]``; leading axes (the workers) are kept.
    layout: the :class:`WireLayout` of the tree.

  Returns:
    ``(tensors, valid)``: per tensor, ``(indices, values)`` of shape
    ``(..., rows, k)``; and the bool validity flag of each message, ``(...)``.
  """
  valid = message[..., 0] == 1
  out_idx, offset = [], HEADER_BYTES
  for t in layout.tensors:
    n = t.entries * t.index_dtype.itemsize
    raw = message[..., offset : offset + n]
    out_idx.append(_from_bytes(raw, t.index_dtype, (t.rows, t.k)).astype(jnp.int32))
    offset += n
  out_val = []
  if layout.quantize_1bit:
    total = sum(t.entries for t in layout.tensors)
    bits = jnp.unpackbits(message[..., offset:], axis=-1, count=total)
    signs = jnp.where(bits.astype(bool), 1.0, -1.0).astype(jnp.float32)
    start = 0
    for t in layout.tensors:
      chunk = signs[..., start : start + t.entries]
      out_val.append(chunk.reshape(*chunk.shape[:-1], t.rows, t.k))
      start += t.entries
  else:
    for t in layout.tensors:
      dt = np.dtype(t.value_dtype)
      n = t.entries * dt.itemsize
      raw = message[..., offset : offset + n]
      out_val.append(_from_bytes(raw, dt, (t.rows, t.k)).astype(jnp.float32))
      offset += n
  return list(zip(out_idx, out_val)), valid


def _worker_keys(indices_WxRxK: jax.Array, values_WxRxK: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Two 32-bit content hashes per worker; they fix a canonical worker order.

  Integer sums wrap identically in any order, so the keys, and the order they
  give, are the same whichever way the workers were numbered.
  """
  num_workers = indices_WxRxK.shape[0]
  bits = jax.lax.bitcast_convert_type(values_WxRxK.astype(jnp.float32), jnp.uint32)
  x = (bits ^ (indices_WxRxK.astype(jnp.uint32) * np.uint32(0x9E3779B1))).reshape(num_workers, -1)
  pos = jnp.arange(x.shape[1], dtype=jnp.uint32)
  keys = []
  for mul, salt in ((0x85EBCA6B, 0x27D4EB2F), (0xC2B2AE35, 0x165667B1)):
    h = (x ^ np.uint32(salt)) * np.uint32(mul)
    h = h ^ (h >> 15)
    keys.append(jnp.sum(h * (pos * np.uint32(2) + np.uint32(1)), axis=1, dtype=jnp.uint32))
  return keys[0], keys[1]


def aggregate(
  indices_WxRxK: jax.Array,
  values_WxRxK: jax.Array,
  chunk_size: int,
  valid_W: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Mean over contributors, coefficient by coefficient, into dense chunks.

  A coefficient that several workers chose gets the mean of their values; one
  that nobody chose is 0. Workers are folded in one at a time with a running
  mean, ``mu <- mu + (v - mu) / n``, which returns ``v`` exactly when all
  contributions equal ``v``. They are taken in a canonical order given by a
  hash of their contents, so the result does not depend on how the workers are
  numbered, to the bit. Every scatter writes each location at most once (one
  worker names an index at most once per chunk), so no backend needs atomics.

  Args:
    indices_WxRxK: int chunk-local indices from each of W workers.
    values_WxRxK: float values from each worker.
    chunk_size: coefficients per chunk.
    valid_W: optional bool per worker; a worker marked False is left out, as
      if it had chosen nothing.

  Returns:
    ``(dense, contributors)``: float32 ``(rows, chunk_size)`` aggregate, and
    int32 ``(rows, chunk_size)`` count of workers behind each coefficient.
  """
  num_workers, rows, _ = indices_WxRxK.shape
  indices_WxRxK = indices_WxRxK.astype(jnp.int32)
  values_WxRxK = values_WxRxK.astype(jnp.float32)
  if valid_W is None:
    valid_W = jnp.ones((num_workers,), bool)
  key_a, key_b = _worker_keys(indices_WxRxK, values_WxRxK)
  order = jnp.lexsort((key_b, key_a))
  row_ids = jnp.arange(rows)[:, None]
  # The count only ever reaches W; a narrow type keeps this dense buffer small.
  count_dtype = jnp.uint8 if num_workers < 255 else jnp.int32

  def fold(i, carry):
    mean, count = carry
    w = order[i]
    idx, val = indices_WxRxK[w], values_WxRxK[w]
    n = count[row_ids, idx] + valid_W[w].astype(count_dtype)
    mu = mean[row_ids, idx]
    step = (val - mu) / jnp.maximum(n, 1).astype(jnp.float32)
    mu = jnp.where(valid_W[w], mu + step, mu)
    mean = mean.at[row_ids, idx].set(mu, unique_indices=True)
    count = count.at[row_ids, idx].set(n, unique_indices=True)
    return mean, count

  init = (jnp.zeros((rows, chunk_size), jnp.float32), jnp.zeros((rows, chunk_size), count_dtype))
  # The loop carry must be typed as varying over every mesh axis its inputs
  # vary over (e.g. "fsdp" when each device aggregates its own shard).
  axes = varying_axes(indices_WxRxK) | varying_axes(values_WxRxK) | varying_axes(valid_W)
  if axes:
    init = jax.lax.pcast(init, tuple(sorted(axes, key=str)), to="varying")
  mean, count = jax.lax.fori_loop(0, num_workers, fold, init)
  return mean, count.astype(jnp.int32)
