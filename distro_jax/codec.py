"""Codec and wire format: per-chunk top-k, one worker's byte message, the aggregate.

A worker's message for a whole tree is one ``uint8`` vector (docs/design.md,
"The wire format and its bytes"). Its exact layout, after a flag byte where
:attr:`WireLayout.header_bytes` says so:

1. One bit stream, least significant bit first, packed 8 bits to a byte and
   padded with zeros at its end only: every tensor's ``rows * k`` chunk-local
   indices in tree order (chunk after chunk, top-k order within one), each of
   :func:`index_bits` bits (none with drawn positions); then, with
   ``quantize_1bit``, every tensor's sign bits (set: +1): ``ceil(k / 2)`` a
   chunk, the other signs carried by the order of each index pair (``k`` a
   chunk with drawn positions); or, with ``codebook_bits``, every tensor's
   codes (:func:`quantize`).
2. With ``codebook_bits``, every tensor's float32 codebook; without it or
   ``quantize_1bit``, every tensor's ``rows * k`` values in its dtype.

A message whose sender's values were not finite is all zeros, and is left out.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from distro_jax import bitpack, dct
from distro_jax.exchange import as_varying, varying_axes

__all__ = [
  "TensorWire",
  "WireLayout",
  "aggregate_blocks",
  "decode_message",
  "dequantize",
  "draw_positions",
  "draw_tables",
  "encode_message",
  "gather_blocks",
  "index_bits",
  "message_valid",
  "position_key",
  "quantize",
  "scatter_blocks",
  "select_topk_blocks",
  "select_topk_many",
  "unsharded",
  "worker_order",
  "zero_selected_blocks",
]


def index_bits(chunk_size: int) -> int:
  """Bits per index on the wire: ``ceil(log2(chunk_size))``, at least 1."""
  return bitpack.bits_for(chunk_size)


class TensorWire(NamedTuple):
  """What one tensor contributes to the message. Static.

  Attributes:
    rows: number of chunks.
    k: coefficients kept per chunk.
    chunk_size: coefficients per chunk.
    value_dtype: dtype name of the values on the wire (the param's).
  """

  rows: int
  k: int
  chunk_size: int
  value_dtype: str

  @property
  def index_bits(self) -> int:
    return index_bits(self.chunk_size)

  @property
  def entries(self) -> int:
    return self.rows * self.k

  @property
  def sign_bits(self) -> int:
    """Sign bits written with ``quantize_1bit``, ``ceil(k / 2)`` per chunk."""
    return self.rows * (self.k - self.k // 2)


class WireLayout(NamedTuple):
  """Layout of a whole tree's message. Static.

  Attributes:
    tensors: one :class:`TensorWire` per leaf, in tree order.
    quantize_1bit: whether values travel as sign bits in the bit stream.
    drawn_positions: positions drawn from a shared key (:func:`draw_positions`), not sent.
    codebook_bits: values travel as codes of this many bits and a codebook
      per tensor (:func:`quantize`, SparseLoCo's), or ``None``.
  """

  tensors: tuple[TensorWire, ...]
  quantize_1bit: bool
  drawn_positions: bool = False
  codebook_bits: int | None = None

  @property
  def marker(self) -> int | None:
    """The tensor whose first chunk's two distinct indices mark validity, or ``None``."""
    if self.drawn_positions:
      return None
    return next((i for i, t in enumerate(self.tensors) if t.k >= 2), None)

  @property
  def header_bytes(self) -> int:
    """1 (a flag byte) when no tensor keeps two coefficients per chunk, else 0."""
    return 1 if self.marker is None else 0

  @property
  def index_bits(self) -> int:
    """Bits of all the indices (none when the positions are drawn)."""
    if self.drawn_positions:
      return 0
    return sum(t.entries * t.index_bits for t in self.tensors)

  def tensor_sign_bits(self, t: TensorWire) -> int:
    """Sign bits one tensor writes with ``quantize_1bit``."""
    # Drawn positions are not sent, so no order can carry a sign.
    return t.entries if self.drawn_positions else t.sign_bits

  @property
  def stream_bits(self) -> int:
    """Bits of the bit stream: the indices, then the signs or the codes."""
    signs = sum(self.tensor_sign_bits(t) for t in self.tensors) if self.quantize_1bit else 0
    codes = sum(t.entries * (self.codebook_bits or 0) for t in self.tensors)
    return self.index_bits + signs + codes

  @property
  def stream_bytes(self) -> int:
    return math.ceil(self.stream_bits / 8)

  @property
  def value_bytes(self) -> int:
    """Bytes after the stream: the codebooks, or full-precision values (none as signs)."""
    if self.quantize_1bit:
      return 0
    if self.codebook_bits:
      return len(self.tensors) * (1 << self.codebook_bits) * _CODEBOOK_DTYPE.itemsize
    return sum(t.entries * np.dtype(t.value_dtype).itemsize for t in self.tensors)

  @property
  def num_bytes(self) -> int:
    """Bytes one worker sends per step: the length of its message."""
    return self.header_bytes + self.stream_bytes + self.value_bytes


def _batching(nb: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Batching dims of a block view ``(*lead, A, c1, B, c2)`` and of its ``(*lead, A, B, k)``."""
  return (*range(nb), nb, nb + 2), (*range(nb), nb, nb + 1)


def _gather_numbers(nb: int, offset_dims: tuple[int, ...]) -> jax.lax.GatherDimensionNumbers:
  """A gather from a block view at ``(i, j)`` pairs ``(*lead, A, B, k, 2)``."""
  operand_batch, index_batch = _batching(nb)
  return jax.lax.GatherDimensionNumbers(
    offset_dims=offset_dims,
    collapsed_slice_dims=(nb + 1, nb + 3),
    start_index_map=(nb + 1, nb + 3),
    operand_batching_dims=operand_batch,
    start_indices_batching_dims=index_batch,
  )


def _coords(idx: jax.Array, c2: int) -> jax.Array:
  """Chunk-local indices ``i * c2 + j`` as ``(i, j)`` pairs on a new last axis."""
  idx = idx.astype(jnp.int32)
  return jnp.stack([idx // c2, idx % c2], axis=-1)


def _flat_positions(idx: jax.Array, block_shape: tuple[int, ...]) -> jax.Array:
  """Positions in the flattened block view of chunk-local indices ``(*lead, A, B, k)``."""
  *lead, a, c1, b, c2 = block_shape
  bands = jnp.arange(math.prod(lead) * a, dtype=jnp.int32).reshape(*lead, a, 1, 1)
  cols = jnp.arange(b, dtype=jnp.int32).reshape(b, 1)
  idx = idx.astype(jnp.int32)
  return (bands * c1 + idx // c2) * (b * c2) + cols * c2 + idx % c2


def gather_blocks(x_blocks: jax.Array, idx: jax.Array) -> jax.Array:
  """The entries ``(*lead, A, B, k)`` of a block view at chunk-local indices ``i * c2 + j``.

  Args:
    x_blocks: ``(*lead, A, c1, B, c2)``.
    idx: int ``(*lead, A, B, k)``, each in ``[0, c1 * c2)``.
  """
  if not dct.placed_on_mesh(x_blocks):
    # A flat gather is cheapest; on a mesh the batched form below lets the
    # sharding of the chunk axes carry through.
    flat = _flat_positions(idx, x_blocks.shape)
    return x_blocks.reshape(-1).at[flat].get(mode="promise_in_bounds", unique_indices=True)
  return jax.lax.gather(
    x_blocks,
    _coords(idx, x_blocks.shape[-1]),
    _gather_numbers(x_blocks.ndim - 4, ()),
    (1,) * x_blocks.ndim,
    mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
  )


def scatter_blocks(x_blocks: jax.Array, idx: jax.Array, updates: jax.Array) -> jax.Array:
  """``x_blocks`` with ``updates`` written at chunk-local indices.

  Args:
    x_blocks: ``(*lead, A, c1, B, c2)``.
    idx: int ``(*lead, A, B, k)``, distinct within each chunk.
    updates: ``(*lead, A, B, k)``, or a scalar.
  """
  updates = jnp.broadcast_to(jnp.asarray(updates, x_blocks.dtype), idx.shape)
  if not dct.placed_on_mesh(x_blocks):
    flat = _flat_positions(idx, x_blocks.shape)
    out = x_blocks.reshape(-1).at[flat].set(updates, unique_indices=True, mode="promise_in_bounds")
    return out.reshape(x_blocks.shape)
  nb = x_blocks.ndim - 4
  operand_batch, index_batch = _batching(nb)
  dn = jax.lax.ScatterDimensionNumbers(
    update_window_dims=(),
    inserted_window_dims=(nb + 1, nb + 3),
    scatter_dims_to_operand_dims=(nb + 1, nb + 3),
    operand_batching_dims=operand_batch,
    scatter_indices_batching_dims=index_batch,
  )
  return jax.lax.scatter(
    x_blocks,
    _coords(idx, x_blocks.shape[-1]),
    updates,
    dn,
    indices_are_sorted=False,
    unique_indices=True,
    mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
  )


def _top_k_rows(rows: list[jax.Array], k: int) -> list[jax.Array]:
  """``jax.lax.top_k(r, k)[1]`` for each 2-D ``r``; rows of equal width share one call."""
  out: list[jax.Array | None] = [None] * len(rows)
  by_width: dict[int, list[int]] = {}
  for i, r in enumerate(rows):
    by_width.setdefault(r.shape[-1], []).append(i)
  for members in by_width.values():
    if len(members) == 1:
      out[members[0]] = jax.lax.top_k(rows[members[0]], k)[1]
      continue
    # Rows are ranked each on its own, so one stacked call gives the same result.
    _, idx = jax.lax.top_k(jnp.concatenate([rows[i] for i in members]), k)
    # Keeps the split out of the top-k, or XLA loses its fast top-k kernel.
    idx = jax.lax.optimization_barrier(idx)
    bounds = np.cumsum([rows[i].shape[0] for i in members])[:-1]
    for i, part in zip(members, jnp.split(idx, bounds)):
      out[i] = part
  return out


def select_topk_many(blocks: list[jax.Array], ks: list[int]) -> list[tuple[jax.Array, jax.Array]]:
  """:func:`select_topk_blocks` of each of ``blocks`` with its ``k``, in fewer top-k calls."""
  if any(dct.placed_on_mesh(x) for x in blocks):
    # Stacking tensors would merge their shardings; keep each on its own.
    return [select_topk_blocks(x, k) for x, k in zip(blocks, ks)]
  out: list[tuple[jax.Array, jax.Array] | None] = [None] * len(blocks)

  def flat(x: jax.Array) -> jax.Array:
    return x.reshape(-1, x.shape[-1])

  for k in sorted(set(ks)):
    members = [i for i, kk in enumerate(ks) if kk == k]
    two = [i for i in members if _two_stage(blocks[i].shape, k)]
    one = [i for i in members if i not in two]
    full_rows = [_rows(blocks[i]) for i in one]
    found = _top_k_rows([flat(jnp.abs(r)) for r in full_rows], k)
    for i, rows, idx in zip(one, full_rows, found):
      idx = idx.reshape(*rows.shape[:-1], k)
      out[i] = idx, jnp.take_along_axis(rows, idx, axis=-1)
    maxima = [_group_maxima(blocks[i]) for i in two]
    picked = _top_k_rows([flat(m) for m in maxima], k)
    cands = [
      _candidates(blocks[i], jnp.sort(g, axis=-1).reshape(*m.shape[:-1], k))
      for i, g, m in zip(two, picked, maxima)
    ]
    found = _top_k_rows([flat(jnp.abs(c)) for c, _ in cands], k)
    for i, (c, groups), pos in zip(two, cands, found):
      pos = pos.reshape(*c.shape[:-1], k)
      idx = jnp.take_along_axis(groups, pos // _GROUP, axis=-1) * _GROUP + pos % _GROUP
      out[i] = idx, jnp.take_along_axis(c, pos, axis=-1)
  return out


_GROUP = 8


def _two_stage(block_shape: tuple[int, ...], k: int) -> bool:
  *_, c1, _, c2 = block_shape
  return c2 % _GROUP == 0 and c1 * c2 >= 32 * k


def _rows(x_blocks: jax.Array) -> jax.Array:
  """The chunks of a block view as rows ``(*lead, A, B, c1 * c2)``."""
  *lead, a, c1, b, c2 = x_blocks.shape
  nb = len(lead)
  perm = (*range(nb), nb, nb + 2, nb + 1, nb + 3)
  return x_blocks.transpose(perm).reshape(*lead, a, b, c1 * c2)


def _group_maxima(x_blocks: jax.Array) -> jax.Array:
  """Max magnitude of every run of 8 of each chunk, as rows ``(*lead, A, B, c1 * c2 / 8)``."""
  *lead, a, c1, b, c2 = x_blocks.shape
  runs = x_blocks.reshape(*lead, a, c1, b, c2 // _GROUP, _GROUP)
  # Eight strided maxima vectorize; a reduce over a minor axis of 8 is slower on CPU.
  maxima = jnp.abs(runs[..., 0])
  for e in range(1, _GROUP):
    maxima = jnp.maximum(maxima, jnp.abs(runs[..., e]))
  return _rows(maxima)


def _candidates(x_blocks: jax.Array, groups: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The 8 entries of each chosen group, ``(*lead, A, B, 8k)``, and the groups."""
  *lead, a, c1, b, c2 = x_blocks.shape
  k = groups.shape[-1]
  per_row = c2 // _GROUP
  # Group g is chunk-local indices 8g to 8g + 7, contiguous in the block view.
  if not dct.placed_on_mesh(x_blocks):
    runs = _flat_positions(groups * _GROUP, x_blocks.shape) // _GROUP
    found = x_blocks.reshape(-1, _GROUP).at[runs].get(mode="promise_in_bounds")
    return found.reshape(*lead, a, b, k * _GROUP), groups
  nb = len(lead)
  coords = jnp.stack([groups // per_row, groups % per_row], axis=-1)
  found = jax.lax.gather(
    x_blocks.reshape(*lead, a, c1, b, per_row, _GROUP),
    coords,
    _gather_numbers(nb, (nb + 3,)),
    (1,) * (nb + 4) + (_GROUP,),
    mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
  )
  return found.reshape(*lead, a, b, k * _GROUP), groups


def _top_k(x: jax.Array, k: int) -> jax.Array:
  """``jax.lax.top_k``'s indices; on a mesh a stable sort, which XLA shards without a gather."""
  if not dct.placed_on_mesh(x):
    return jax.lax.top_k(x, k)[1]
  return jnp.argsort(-x, axis=-1, stable=True)[..., :k]


def select_topk_blocks(x_blocks: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The ``k`` largest-magnitude entries of every chunk, ties to the lower index.

  Args:
    x_blocks: a float block view ``(*lead, A, c1, B, c2)`` (:func:`distro_jax.dct.to_blocks`).
    k: how many to keep, ``1 <= k <= c1 * c2``.

  Returns:
    int32 chunk-local indices ``(*lead, A, B, k)``, largest first, and the entries there.
  """
  if not _two_stage(x_blocks.shape, k):  # docs/performance.md, "The top-k in two stages"
    rows = _rows(x_blocks)
    idx = _top_k(jnp.abs(rows), k)
    return idx, jnp.take_along_axis(rows, idx, axis=-1)
  groups = _top_k(_group_maxima(x_blocks), k)
  candidates, groups = _candidates(x_blocks, jnp.sort(groups, axis=-1))
  pos = _top_k(jnp.abs(candidates), k)
  idx = jnp.take_along_axis(groups, pos // _GROUP, axis=-1) * _GROUP + pos % _GROUP
  return idx, jnp.take_along_axis(candidates, pos, axis=-1)


def zero_selected_blocks(x_blocks: jax.Array, idx: jax.Array) -> jax.Array:
  """Error feedback in place: what was sent leaves the buffer."""
  return scatter_blocks(x_blocks, idx, 0.0)


def unsharded(x: jax.Array) -> jax.Array:
  """``x`` replicated when its type shards it over explicit mesh axes, else ``x`` itself."""
  sharding = dct.explicit_sharding(x)
  if sharding is None:
    return x
  return jax.sharding.reshard(
    x, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  )


# Templar's production quantizer: 4 bins spanning 6 standard deviations.
_RANGE_IN_SIGMAS = 6.0
_CODEBOOK_DTYPE = np.dtype(np.float32)


def quantize(values: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
  """Quantizes one tensor's kept values to ``bits``-bit codes and a float32 codebook.

  SparseLoCo's quantizer, docs/design.md section 6 (``bits=2`` is Templar's).

  Args:
    values: float array of the values kept from one tensor, any shape.
    bits: 1 or 2. Static.

  Returns:
    ``(codes, codebook)``: uint32 codes of the shape of ``values``, each below
    ``2**bits``, and float32 ``codebook[2**bits]``; ``codebook[codes]``
    reconstructs the values.
  """
  v = values.astype(jnp.float32)
  n = v.size
  bins = 1 << bits
  mu = jnp.mean(v)
  c = v - mu
  if bits == 1:
    codes = (c >= 0).astype(jnp.uint32)
  else:
    sigma = jnp.sqrt(jnp.sum(jnp.square(c)) / max(n - 1, 1))
    width = _RANGE_IN_SIGMAS * sigma / bins
    width = jnp.where((width > 0) & jnp.isfinite(width), width, 1.0)
    codes = jnp.clip(jnp.round(c / width + bins // 2), 0, bins - 1).astype(jnp.uint32)
  # No reshape: values sharded with their param (under jax.jit) stay so.
  members = codes[..., None] == jnp.arange(bins, dtype=jnp.uint32)
  every = tuple(range(codes.ndim))
  sums = jnp.sum(jnp.where(members, c[..., None], 0.0), axis=every)
  counts = jnp.sum(members, axis=every)
  codebook = mu + jnp.where(counts > 0, sums / jnp.maximum(counts, 1), 0.0)
  return codes, codebook


def dequantize(codes: jax.Array, codebook: jax.Array) -> jax.Array:
  """``codebook[codes]`` in float32; leading axes of ``codebook`` batch over workers.

  Args:
    codes: integer codes whose leading axes are those of ``codebook`` but its last.
    codebook: float ``(..., 2**bits)``.

  Returns:
    float32 values of the shape of ``codes``.
  """
  book = codebook.astype(jnp.float32)
  lead = book.shape[:-1]
  if not lead:
    # A select per entry of the codebook, not a gather: elementwise, so codes
    # sharded with their param (under jax.jit) stay so.
    out = jnp.broadcast_to(book[0], codes.shape)
    for q in range(1, book.shape[0]):
      out = jnp.where(codes == q, book[q], out)
    return out
  flat = codes.reshape(*lead, -1).astype(jnp.int32)
  return jnp.take_along_axis(book, flat, axis=-1).reshape(codes.shape)


def _signs_into_order(idx_RxK: jax.Array, positive_RxK: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Pairs ascending iff the smaller index is positive; bits: the larger's signs, odd k's last."""
  pairs = idx_RxK.shape[-1] // 2
  a, b = idx_RxK[:, 0 : 2 * pairs : 2], idx_RxK[:, 1 : 2 * pairs : 2]
  sa, sb = positive_RxK[:, 0 : 2 * pairs : 2], positive_RxK[:, 1 : 2 * pairs : 2]
  a_low = a < b
  low, high = jnp.minimum(a, b), jnp.maximum(a, b)
  low_positive = jnp.where(a_low, sa, sb)
  high_positive = jnp.where(a_low, sb, sa)
  first = jnp.where(low_positive, low, high)
  second = jnp.where(low_positive, high, low)
  pairs_out = jnp.stack([first, second], axis=-1).reshape(idx_RxK.shape[0], 2 * pairs)
  tail = idx_RxK[:, 2 * pairs :]
  bits = jnp.concatenate([high_positive, positive_RxK[:, 2 * pairs :]], axis=-1)
  return jnp.concatenate([pairs_out, tail], axis=-1), bits


def _signs_from_order(idx: jax.Array, bits: jax.Array) -> jax.Array:
  """Inverse of :func:`_signs_into_order`: whether each index's value is positive."""
  pairs = idx.shape[-1] // 2
  x, y = idx[..., 0 : 2 * pairs : 2], idx[..., 1 : 2 * pairs : 2]
  high_positive = bits[..., :pairs]
  ascending = x < y  # the smaller index (first) is positive
  sign_x = jnp.where(ascending, True, high_positive)
  sign_y = jnp.where(ascending, high_positive, False)
  both = jnp.stack([sign_x, sign_y], axis=-1).reshape(*idx.shape[:-1], 2 * pairs)
  return jnp.concatenate([both, bits[..., pairs:]], axis=-1)


def encode_message(
  indices: list[jax.Array],
  values: list[jax.Array],
  layout: WireLayout,
  valid: jax.Array | bool = True,
) -> jax.Array:
  """One worker's wire message, ``uint8[layout.num_bytes]``.

  Args:
    indices: per tensor, ``rows * k`` int chunk-local positions, chunk-major in C order.
    values: per tensor, float values shaped as the indices.
    layout: the :class:`WireLayout` of the tree.
    valid: False sends the message as all zeros, one to leave out.
  """
  bits = layout.codebook_bits
  # Quantized where they lie, so a sharded selection's codebook is the sender's own.
  quantized = [quantize(v, bits) for v in values] if bits else []
  indices = [unsharded(x) for x in indices]
  values = [unsharded(x) for x in values]
  # The stream after the indices: the codes, or (below) the signs.
  signs = [bitpack.to_bit_stream(unsharded(code), bits) for code, _ in quantized]
  if layout.drawn_positions:
    if layout.quantize_1bit:
      signs = [(v >= 0).reshape(-1).astype(jnp.uint8) for v in values]
    indices = []
  elif layout.quantize_1bit:
    ordered = [
      _signs_into_order(idx.reshape(t.rows, t.k), (v >= 0).reshape(t.rows, t.k))
      for t, idx, v in zip(layout.tensors, indices, values)
    ]
    indices = [idx for idx, _ in ordered]
    signs = [bits.reshape(-1).astype(jnp.uint8) for _, bits in ordered]
  stream = [bitpack.to_bit_stream(i, t.index_bits) for t, i in zip(layout.tensors, indices)]
  stream += signs
  parts = []
  if layout.header_bytes:
    parts.append(jnp.ones((1,), jnp.uint8))
  if stream:
    parts.append(jnp.packbits(jnp.concatenate(stream), bitorder="little"))
  if quantized:
    parts += [bitpack.to_bytes(unsharded(book).astype(_CODEBOOK_DTYPE)) for _, book in quantized]
  elif not layout.quantize_1bit:
    parts += [bitpack.to_bytes(v.astype(t.value_dtype)) for t, v in zip(layout.tensors, values)]
  message = jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.uint8)
  return jnp.where(jnp.asarray(valid, bool), message, jnp.zeros_like(message))


def decode_message(
  message: jax.Array, layout: WireLayout, positions: list[jax.Array] | None = None
) -> tuple[list[tuple[jax.Array, jax.Array]], jax.Array]:
  """Parses messages back into int32 indices and float32 values per tensor.

  Args:
    message: ``uint8[..., layout.num_bytes]``; leading axes (the workers) are kept.
    layout: the :class:`WireLayout` of the tree.
    positions: per tensor, each sender's drawn positions; given iff ``layout.drawn_positions``.

  Returns:
    ``(tensors, valid)``: per tensor ``(indices, values)``, ``(..., rows, k)``, as
    sent (with ``quantize_1bit`` a pair's order may differ); and ``bool[...]``.
  """
  lead = message.shape[:-1]
  offset = layout.header_bytes
  stream = jnp.unpackbits(
    message[..., offset : offset + layout.stream_bytes],
    axis=-1,
    count=layout.stream_bits,
    bitorder="little",
  )
  offset += layout.stream_bytes
  if (positions is not None) != layout.drawn_positions:
    raise ValueError(
      "decode_message needs the drawn positions exactly when the layout says they are "
      f"drawn (drawn_positions={layout.drawn_positions}); got positions="
      f"{'a list' if positions is not None else None}."
    )
  out_idx, start = [], 0
  for i, t in enumerate(layout.tensors):
    if positions is not None:
      out_idx.append(positions[i].astype(jnp.int32).reshape(*lead, t.rows, t.k))
      continue
    n = t.entries * t.index_bits
    idx = bitpack.from_bit_stream(stream[..., start : start + n], t.index_bits, t.entries)
    out_idx.append(idx.astype(jnp.int32).reshape(*lead, t.rows, t.k))
    start += n
  out_val = []
  for t in layout.tensors:
    if layout.codebook_bits:
      n = t.entries * layout.codebook_bits
      codes = bitpack.from_bit_stream(
        stream[..., start : start + n], layout.codebook_bits, t.entries
      )
      start += n
      entries = 1 << layout.codebook_bits
      size = entries * _CODEBOOK_DTYPE.itemsize
      book = bitpack.from_bytes(message[..., offset : offset + size], _CODEBOOK_DTYPE, (entries,))
      out_val.append(dequantize(codes, book).reshape(*lead, t.rows, t.k))
      offset += size
    elif layout.quantize_1bit:
      n = layout.tensor_sign_bits(t)
      bits = stream[..., start : start + n].reshape(*lead, t.rows, -1).astype(bool)
      drawn = layout.drawn_positions
      positive = bits if drawn else _signs_from_order(out_idx[len(out_val)], bits)
      out_val.append(jnp.where(positive, 1.0, -1.0).astype(jnp.float32))
      start += n
    else:
      dt = np.dtype(t.value_dtype)
      n = t.entries * dt.itemsize
      raw = message[..., offset : offset + n]
      out_val.append(bitpack.from_bytes(raw, dt, (t.rows, t.k)).astype(jnp.float32))
      offset += n
  if layout.marker is None:
    valid = message_valid(message, layout)
  else:
    first = out_idx[layout.marker]
    valid = first[..., 0, 0] != first[..., 0, 1]
  return list(zip(out_idx, out_val)), valid


def message_valid(message: jax.Array, layout: WireLayout) -> jax.Array:
  """``bool[...]``: whether each message ``uint8[..., layout.num_bytes]`` was sent valid."""
  if layout.marker is None:
    return message[..., 0] == 1
  _, valid = decode_message(message, layout)
  return valid


# Any fixed value works: every worker folds the same one.
_POSITIONS_SEED = 0x5EED


def position_key(
  step: jax.Array | int,
  tensor: int,
  worker: jax.Array | int,
  shard: jax.Array | int | None = None,
) -> jax.Array:
  """The ``jax.random`` key of a sender's drawn positions, which any worker can build.

  Args:
    step: the transformation's step count.
    tensor: the tensor's index in the flattened tree.
    worker: the sender's index on the workers' axis.
    shard: within an FSDP site, the device's index along the axes that shard the tensor.
  """
  # Threefry whatever jax_default_prng_impl says, so every process draws alike.
  root = jax.random.key(_POSITIONS_SEED, impl="threefry2x32")
  key = jax.random.fold_in(jax.random.fold_in(root, step), tensor)
  if shard is not None:
    key = jax.random.fold_in(key, shard)
  return jax.random.fold_in(key, worker)


def draw_positions(
  key: jax.Array, block_shape: tuple[int, ...], k: int, frequency_bias: float = 0.0
) -> jax.Array:
  """``k`` distinct chunk-local positions for every chunk of a block view, drawn at random.

  One position from each of ``k`` equal runs of the chunk; within a run,
  position ``i * c2 + j`` is drawn with weight ``((1 + i) (1 + j)) ** -frequency_bias``,
  in integer arithmetic, so every backend draws the same.

  Args:
    key: a ``jax.random`` key (:func:`position_key`).
    block_shape: the block view ``(*lead, A, c1, B, c2)``.
    k: positions per chunk, ``1 <= k <= c1 * c2``.
    frequency_bias: the exponent of the preference for low frequencies, 0 or more.

  Returns:
    int32 ``(*lead, A, B, k)``, ascending within a chunk.
  """
  *lead, a, c1, b, c2 = block_shape
  lo, hi, ends = draw_tables(c1, c2, k, frequency_bias)
  ticket = jax.random.randint(key, (*lead, a, b, k), lo, hi, dtype=jnp.int32)
  if ends is None:
    return ticket
  return jnp.searchsorted(jnp.asarray(ends), ticket, side="right").astype(jnp.int32)


def draw_tables(
  c1: int, c2: int, k: int, frequency_bias: float = 0.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
  """:func:`draw_positions`'s tables for a ``c1 x c2`` chunk.

  Returns:
    ``(lo, hi, ends)``: int32 ``(k,)`` ticket bounds ``[lo, hi)`` of each run, and
    int32 ``(c1 * c2,)`` ends of each position's tickets, or ``None`` for a uniform draw.
  """
  n = c1 * c2
  if not 1 <= k <= n:
    raise ValueError(f"k={k} positions do not fit a chunk of {n}; use 1 <= k <= {n}.")
  bounds = (np.arange(k + 1) * n) // k
  if not frequency_bias:
    return bounds[:-1].astype(np.int32), bounds[1:].astype(np.int32), None
  freq = (1.0 + np.arange(c1)[:, None]) * (1.0 + np.arange(c2)[None, :])
  weight = freq.reshape(-1) ** -float(frequency_bias)
  counts = np.maximum(np.round(weight / weight.sum() * 2**24), 1).astype(np.int64)
  # Position p owns the tickets [ends[p - 1], ends[p]).
  ends = np.cumsum(counts)
  starts = np.concatenate([[0], ends])
  lo, hi = starts[bounds[:-1]], ends[bounds[1:] - 1]
  return lo.astype(np.int32), hi.astype(np.int32), ends.astype(np.int32)


def _mix32(h: jax.Array) -> jax.Array:
  """A bijective scramble of uint32 words (xor-shifts and odd multipliers)."""
  h = h ^ (h >> 16)
  h = h * np.uint32(0x7FEB352D)
  h = h ^ (h >> 15)
  h = h * np.uint32(0x846CA68B)
  return h ^ (h >> 16)


def _worker_keys(
  indices_WxRxK: jax.Array, values_WxRxK: jax.Array, chunk_size: int
) -> tuple[jax.Array, jax.Array]:
  """Two 32-bit hashes per worker of the set of (position, value) entries it sent."""
  num_workers, rows = indices_WxRxK.shape[:2]
  bits = jax.lax.bitcast_convert_type(values_WxRxK.astype(jnp.float32), jnp.uint32)
  row = jnp.arange(rows, dtype=jnp.uint32).reshape(1, rows, 1)
  pos = row * np.uint32(chunk_size) + indices_WxRxK.astype(jnp.uint32)
  keys = []
  for salt in (0x27D4EB2F, 0x165667B1):
    h = _mix32(_mix32(pos ^ np.uint32(salt)) ^ bits)
    keys.append(jnp.sum(h.reshape(num_workers, -1), axis=1, dtype=jnp.uint32))
  return keys[0], keys[1]


def worker_order(indices_WxRxK: jax.Array, values_WxRxK: jax.Array, chunk_size: int) -> jax.Array:
  """The int32 permutation ``(W,)`` of the workers that :func:`aggregate_blocks` folds in.

  Args:
    indices_WxRxK: int32 chunk-local indices, ``(W, rows, k)``.
    values_WxRxK: float32 values, same shape.
    chunk_size: coefficients per chunk.
  """
  key_a, key_b = _worker_keys(indices_WxRxK, values_WxRxK, chunk_size)
  return jnp.lexsort((key_b, key_a)).astype(jnp.int32)


def aggregate_blocks(
  selections: list[tuple[jax.Array, jax.Array]],
  block_shapes: list[tuple[int, ...]],
  valid_W: jax.Array | None = None,
) -> list[tuple[jax.Array, jax.Array]]:
  """Each coefficient's mean over the workers that chose it (0 if none), in block views.

  A running mean over the workers in :func:`worker_order` (docs/design.md, "The aggregate").

  Args:
    selections: per tensor, ``(indices, values)``, ``(W, *lead, A, B, k)`` or W then chunk-major.
    block_shapes: per tensor, its block view ``(*lead, A, c1, B, c2)``.
    valid_W: optional bool per worker; a worker marked False is left out.

  Returns:
    Per tensor, float32 ``mean`` and int32 contributor ``count`` in its block view.
  """
  if not selections:
    return []
  num_workers = selections[0][0].shape[0]
  if valid_W is None:
    valid_W = jnp.ones((num_workers,), bool)
  prepared, orders = [], []
  for (idx, val), shape in zip(selections, block_shapes):
    *lead, a, c1, b, c2 = shape
    rows = math.prod(lead) * a * b
    idx = idx.astype(jnp.int32).reshape(num_workers, rows, -1)
    val = val.astype(jnp.float32).reshape(num_workers, rows, -1)
    orders.append(worker_order(idx, val, c1 * c2))
    k = idx.shape[-1]
    prepared.append(
      (idx.reshape(num_workers, *lead, a, b, k), val.reshape(num_workers, *lead, a, b, k))
    )
  # The count only reaches W; a narrow type keeps this dense buffer small.
  count_dtype = jnp.uint8 if num_workers < 255 else jnp.int32

  def fold(i, carry):
    out = []
    for (mean, count), (idx_W, val_W), order in zip(carry, prepared, orders):
      w = order[i]
      ok = valid_W[w]
      idx, val = idx_W[w], val_W[w]
      n = gather_blocks(count, idx) + ok.astype(count_dtype)
      mu = gather_blocks(mean, idx)
      step = (val - mu) / jnp.maximum(n, 1).astype(jnp.float32)
      mu = jnp.where(ok, mu + step, mu)
      out.append((scatter_blocks(mean, idx, mu), scatter_blocks(count, idx, n)))
    return out

  def zeros(idx_W: jax.Array, shape: tuple[int, ...], dtype: np.dtype) -> jax.Array:
    # A zero XLA cannot prove keeps equal-shaped buffers from being merged into one.
    zero = jnp.minimum(idx_W.reshape(-1)[0], 0).astype(dtype)
    return jnp.broadcast_to(zero, shape)

  init = [
    (zeros(idx, s, jnp.float32), zeros(idx, s, count_dtype))
    for (idx, _), s in zip(prepared, block_shapes)
  ]
  # The carry must vary over every mesh axis its inputs vary over (e.g. "fsdp").
  axes = frozenset(varying_axes(valid_W))
  for idx, val in prepared:
    axes |= varying_axes(idx) | varying_axes(val)
  init = jax.tree.map(lambda x: as_varying(x, axes), init)
  result = jax.lax.fori_loop(0, num_workers, fold, init)
  return [(mean, count.astype(jnp.int32)) for mean, count in result]
