"""Codec and wire format: per-chunk top-k, the byte message, and aggregation.

One worker's message for a whole parameter tree is a single ``uint8`` vector,
so one collective carries it. It is laid out as:

1. **Indices**, one bit stream for every tensor in tree order: each tensor's
   ``rows * k`` chunk-local indices (row-major over chunks, then in top-k
   order within a chunk), each written with ``ceil(log2(chunk size))`` bits,
   least significant bit first (12 bits for a 4096-coefficient chunk, 6 for
   64). With ``quantize_1bit`` the stream goes on with the sign bits (set: +1,
   clear: -1), tensor after tensor, and half of them travel in the order of
   the indices instead (below). The stream is packed 8 bits to a
   byte with no padding between tensors, and padded with zeros to a whole
   byte at its end (:mod:`distro_jax.bitpack`).
2. **Values**, without ``quantize_1bit``: per tensor, ``rows * k`` values in
   the parameter dtype, in the same order as the indices.

**Signs in the order of the indices.** The k indices of a chunk are a set,
so the order they are sent in is free to carry information (up to
``log2(k!)`` bits). With ``quantize_1bit`` each pair of consecutive positions
``(2j, 2j+1)`` of a chunk carries one sign that way: the pair goes out in
ascending order when its smaller index has a positive value, descending when
negative, and only the sign of its larger index is written as a bit; an odd
k's last value keeps its own bit. So a chunk sends ``ceil(k / 2)`` sign bits
instead of k (at top-k 8 of a 64x64 chunk, 8 x 12 + 4 = 100 bits instead of
104). The receiver reads each pair's order back into both signs.

**Drawn positions.** With ``WireLayout.drawn_positions`` the positions are
not chosen by magnitude but drawn at random from a key that every worker can
build (:func:`draw_positions`), so the message has no indices: after its flag
byte, one sign bit per value with ``quantize_1bit``, else the values alone.

A message whose sender's values were not finite is all zeros, and receivers
leave it out of the aggregate. A valid message can never look like that, since
the first chunk of the first tensor that keeps two or more coefficients names
two different positions. When no tensor keeps more than one coefficient per
chunk there is no such chunk, and the message starts with one flag byte
instead (1: valid, 0: left out).

The indices come back exactly as sent (with ``quantize_1bit``, the same set
in each chunk, each pair possibly swapped), with their values, so decoding is
exact and identical on every worker, and the aggregate does not depend on the
format.
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
  "draw_positions",
  "draw_tables",
  "encode_message",
  "gather_blocks",
  "index_bits",
  "message_valid",
  "position_key",
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
    value_dtype: dtype name of the values on the wire (the parameter dtype).
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
    """Sign bits written with ``quantize_1bit``: each pair's other sign is in its order."""
    return self.rows * (self.k - self.k // 2)


class WireLayout(NamedTuple):
  """Layout of a whole tree's message. Static.

  Attributes:
    tensors: one :class:`TensorWire` per leaf, in tree order.
    quantize_1bit: whether values travel as sign bits in the bit stream.
    drawn_positions: the positions are drawn from a seed every worker knows
      (:func:`draw_positions`), so the message carries no indices, and with
      ``quantize_1bit`` one sign bit per value.
  """

  tensors: tuple[TensorWire, ...]
  quantize_1bit: bool
  drawn_positions: bool = False

  @property
  def marker(self) -> int | None:
    """The tensor whose first chunk marks validity (two distinct indices), or ``None``."""
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
    """Bits of the bit stream: the indices, then the signs with ``quantize_1bit``."""
    signs = sum(self.tensor_sign_bits(t) for t in self.tensors) if self.quantize_1bit else 0
    return self.index_bits + signs

  @property
  def stream_bytes(self) -> int:
    return math.ceil(self.stream_bits / 8)

  @property
  def value_bytes(self) -> int:
    """Bytes of full-precision values (0 with ``quantize_1bit``)."""
    if self.quantize_1bit:
      return 0
    return sum(t.entries * np.dtype(t.value_dtype).itemsize for t in self.tensors)

  @property
  def num_bytes(self) -> int:
    """Bytes one worker sends per step: the length of its message."""
    return self.header_bytes + self.stream_bytes + self.value_bytes


def _batching(nb: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Batching dims of a block view ``(*lead, A, c1, B, c2)`` and of its ``(*lead, A, B, k)``."""
  return (*range(nb), nb, nb + 2), (*range(nb), nb, nb + 1)


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
  """Entries of a block view at chunk-local indices.

  Args:
    x_blocks: ``(*lead, A, c1, B, c2)``.
    idx: int ``(*lead, A, B, k)``, each in ``[0, c1 * c2)``.

  Returns:
    ``(*lead, A, B, k)``: ``x_blocks[..., a, i, b, j]`` for each ``i * c2 + j``.
  """
  if not dct.placed_on_mesh(x_blocks):
    # One flat index per entry is the cheapest gather there is. On a mesh the
    # batched form below tells the compiler which axes the indices run along,
    # so the sharding of the chunk axes carries through.
    flat = _flat_positions(idx, x_blocks.shape)
    return x_blocks.reshape(-1).at[flat].get(mode="promise_in_bounds", unique_indices=True)
  nb = x_blocks.ndim - 4
  operand_batch, index_batch = _batching(nb)
  dn = jax.lax.GatherDimensionNumbers(
    offset_dims=(),
    collapsed_slice_dims=(nb + 1, nb + 3),
    start_index_map=(nb + 1, nb + 3),
    operand_batching_dims=operand_batch,
    start_indices_batching_dims=index_batch,
  )
  return jax.lax.gather(
    x_blocks,
    _coords(idx, x_blocks.shape[-1]),
    dn,
    (1,) * x_blocks.ndim,
    mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
  )


def scatter_blocks(x_blocks: jax.Array, idx: jax.Array, updates: jax.Array) -> jax.Array:
  """Writes ``updates`` into a block view at chunk-local indices (distinct per chunk).

  Args:
    x_blocks: ``(*lead, A, c1, B, c2)``.
    idx: int ``(*lead, A, B, k)``, distinct within each chunk.
    updates: ``(*lead, A, B, k)``, or a scalar.

  Returns:
    ``x_blocks`` with those entries replaced. Each location is written at most
    once, so no backend needs atomics.
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
    # Each row is ranked on its own, so stacking rows changes no result, and
    # one call costs less than many on every backend.
    _, idx = jax.lax.top_k(jnp.concatenate([rows[i] for i in members]), k)
    # XLA turns top-k into its fast kernel only when it sees whole rows taken
    # from a sort; splitting here would merge into those slices and undo it.
    idx = jax.lax.optimization_barrier(idx)
    bounds = np.cumsum([rows[i].shape[0] for i in members])[:-1]
    for i, part in zip(members, jnp.split(idx, bounds)):
      out[i] = part
  return out


def select_topk_many(blocks: list[jax.Array], ks: list[int]) -> list[tuple[jax.Array, jax.Array]]:
  """:func:`select_topk_blocks` for many tensors, with one top-k call per kind of row.

  Args:
    blocks: block views ``(*lead, A, c1, B, c2)``, one per tensor.
    ks: how many to keep per chunk, one per tensor.

  Returns:
    Per tensor, what :func:`select_topk_blocks` returns, to the bit.
  """
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
  """The chunks of a block view as rows ``(*lead, A, B, c1 * c2)`` (a transposed copy)."""
  *lead, a, c1, b, c2 = x_blocks.shape
  nb = len(lead)
  perm = (*range(nb), nb, nb + 2, nb + 1, nb + 3)
  return x_blocks.transpose(perm).reshape(*lead, a, b, c1 * c2)


def _group_maxima(x_blocks: jax.Array) -> jax.Array:
  """Max magnitude of every run of 8 along each chunk row: ``(*lead, A, B, c1 * c2 / 8)``.

  Read where the data lies; only these maxima (an eighth) are rearranged.
  """
  *lead, a, c1, b, c2 = x_blocks.shape
  nb = len(lead)
  runs = x_blocks.reshape(*lead, a, c1, b, c2 // _GROUP, _GROUP)
  # A max over eight strided reads is one vectorized loop; a reduce over a
  # minor axis of 8 runs about three times slower on CPU. Same values.
  maxima = jnp.abs(runs[..., 0])
  for e in range(1, _GROUP):
    maxima = jnp.maximum(maxima, jnp.abs(runs[..., e]))
  perm = (*range(nb), nb, nb + 2, nb + 1, nb + 3)
  return maxima.transpose(perm).reshape(*lead, a, b, c1 * c2 // _GROUP)


def _candidates(x_blocks: jax.Array, groups: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The 8 entries of each chosen group, in index order: ``(*lead, A, B, 8k)``, and the groups."""
  *lead, a, c1, b, c2 = x_blocks.shape
  k = groups.shape[-1]
  per_row = c2 // _GROUP
  # Groups run along chunk rows (c2 is a multiple of 8): group g holds
  # chunk-local indices 8g to 8g + 7, one contiguous run of the block view.
  if not dct.placed_on_mesh(x_blocks):
    runs = _flat_positions(groups * _GROUP, x_blocks.shape) // _GROUP
    found = x_blocks.reshape(-1, _GROUP).at[runs].get(mode="promise_in_bounds")
    return found.reshape(*lead, a, b, k * _GROUP), groups
  nb = len(lead)
  operand_batch, index_batch = _batching(nb)
  dn = jax.lax.GatherDimensionNumbers(
    offset_dims=(nb + 3,),
    collapsed_slice_dims=(nb + 1, nb + 3),
    start_index_map=(nb + 1, nb + 3),
    operand_batching_dims=operand_batch,
    start_indices_batching_dims=index_batch,
  )
  coords = jnp.stack([groups // per_row, groups % per_row], axis=-1)
  found = jax.lax.gather(
    x_blocks.reshape(*lead, a, c1, b, per_row, _GROUP),
    coords,
    dn,
    (1,) * (nb + 4) + (_GROUP,),
    mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
  )
  return found.reshape(*lead, a, b, k * _GROUP), groups


def _top_k(x: jax.Array, k: int) -> jax.Array:
  """Indices of the ``k`` largest entries of each last-axis row, largest first, ties low.

  XLA partitions its top-k kernel by gathering the rows onto every device, so
  on a mesh this is a stable sort, which it partitions along the other axes.
  Both give the same indices in the same order.
  """
  if not dct.placed_on_mesh(x):
    return jax.lax.top_k(x, k)[1]
  return jnp.argsort(-x, axis=-1, stable=True)[..., :k]


def select_topk_blocks(x_blocks: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Keeps the ``k`` largest-magnitude entries of every chunk of a block view.

  Ties go to the lower chunk-local index, as ``jax.lax.top_k`` documents, so
  the choice is the same on every backend. Wide chunks whose rows split into
  groups of 8 are searched in two stages, which pick exactly the same
  indices in the same order: the k groups of 8 with the largest maxima hold
  every one of the top k (each element of the top k lifts its own group's
  maximum to at least the k-th value, and at most k groups can reach it), so
  a second top-k over those 8k candidates, kept in index order, finds them.
  The first stage reads the chunks where they lie, so only the group maxima
  (an eighth of the data) are rearranged.

  Args:
    x_blocks: float ``(*lead, A, c1, B, c2)`` (see :func:`distro_jax.dct.to_blocks`).
    k: how many to keep, ``1 <= k <= c1 * c2``.

  Returns:
    ``(indices, values)``, both ``(*lead, A, B, k)``: int32 chunk-local
    positions ``i * c2 + j`` in descending magnitude, and the entries there.
  """
  if not _two_stage(x_blocks.shape, k):
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
  """``x`` replicated, when its type shards it over explicit mesh axes.

  A message is one byte vector, so a selection sharded with its param (one
  worker under ``jax.jit`` on an explicit mesh) is gathered first: the
  selection, a sliver of the param, never the param itself.
  """
  sharding = dct.explicit_sharding(x)
  if sharding is None:
    return x
  return jax.sharding.reshard(
    x, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  )


def _signs_into_order(idx_RxK: jax.Array, positive_RxK: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Each pair of a chunk's indices ordered by its smaller index's sign; the bits left to write.

  Returns ``(indices (rows, k), bits (rows, ceil(k / 2)))``: per pair, the
  sign of its larger index, then an odd k's last sign.
  """
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
  """Inverse of :func:`_signs_into_order`: the sign (True: +) of every index, ``(..., rows, k)``."""
  k = idx.shape[-1]
  pairs = k // 2
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
  """Serializes one worker's top-k selections into its wire message.

  Args:
    indices: per tensor, int chunk-local positions, ``rows * k`` of them in any
      shape whose C-order flattening is row-major over chunks (``(rows, k)``,
      or ``(*lead, A, B, k)`` from :func:`select_topk_blocks`).
    values: per tensor, float coefficients (full precision), shaped as the indices.
    layout: the :class:`WireLayout` of the tree.
    valid: False marks the message as one to leave out (the sender's values
      were not finite): it goes out as all zeros (after a 0 flag byte when the
      layout has one).

  Returns:
    ``uint8[layout.num_bytes]``.
  """
  indices = [unsharded(x) for x in indices]
  values = [unsharded(x) for x in values]
  signs = []
  if layout.drawn_positions:
    # Every receiver draws the positions itself; only the values travel.
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
  if not layout.quantize_1bit:
    parts += [bitpack.to_bytes(v.astype(t.value_dtype)) for t, v in zip(layout.tensors, values)]
  message = jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.uint8)
  # Zeros mark a message to leave out; the message is tiny, so this costs nothing.
  return jnp.where(jnp.asarray(valid, bool), message, jnp.zeros_like(message))


def decode_message(
  message: jax.Array, layout: WireLayout, positions: list[jax.Array] | None = None
) -> tuple[list[tuple[jax.Array, jax.Array]], jax.Array]:
  """Parses messages back into (int32 indices, float32 values) per tensor.

  Args:
    message: ``uint8[..., layout.num_bytes]``; leading axes (the workers) are kept.
    layout: the :class:`WireLayout` of the tree.
    positions: with ``layout.drawn_positions`` (and only then), the positions
      each sender drew (:func:`draw_positions`), per tensor ``rows * k`` of
      them for every message, with the message's leading axes first.

  Returns:
    ``(tensors, valid)``: per tensor, ``(indices, values)`` of shape
    ``(..., rows, k)``, exactly as sent; and the bool validity flag of each
    message, ``(...)``.
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
    if layout.quantize_1bit:
      n = layout.tensor_sign_bits(t)
      bits = stream[..., start : start + n].reshape(*lead, t.rows, -1).astype(bool)
      # Drawn positions carry no order, so every sign is a bit of its own.
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
  """The validity flag of each message, without decoding its values.

  Args:
    message: ``uint8[..., layout.num_bytes]``; leading axes are kept.
    layout: the :class:`WireLayout` of the tree.

  Returns:
    ``bool[...]``: whether each message was sent valid.
  """
  if layout.marker is None:
    return message[..., 0] == 1
  # The flag is the marker tensor's first two indices: equal means invalid.
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
  """The key of one sender's drawn positions for one tensor at one step.

  Built from what every worker knows, so that a receiver can draw a sender's
  positions itself (:func:`draw_positions`).

  Args:
    step: the transformation's step count.
    tensor: the tensor's index in the flattened tree.
    worker: the sender's index on the workers' axis.
    shard: for a tensor sharded within a site (FSDP), the device's index
      along the axes that shard it; ``None`` otherwise.

  Returns:
    A ``jax.random`` key.
  """
  # Threefry whatever jax_default_prng_impl says: a process configured with
  # another generator would draw other positions and decode its peers wrong.
  root = jax.random.key(_POSITIONS_SEED, impl="threefry2x32")
  key = jax.random.fold_in(jax.random.fold_in(root, step), tensor)
  if shard is not None:
    key = jax.random.fold_in(key, shard)
  return jax.random.fold_in(key, worker)


def draw_positions(
  key: jax.Array, block_shape: tuple[int, ...], k: int, frequency_bias: float = 0.0
) -> jax.Array:
  """``k`` distinct chunk-local positions for every chunk of a block view, drawn at random.

  The ``n = c1 * c2`` positions of a chunk are cut into ``k`` runs of
  (nearly) equal length, ``[floor(j n / k), floor((j + 1) n / k))``, and one
  position is drawn from each, so the k are distinct by construction and
  spread over the chunk's frequencies. Within a run, position ``i * c2 + j``
  (frequency ``i`` along the chunk's first axis, ``j`` along its second) is
  drawn with probability proportional to ``((1 + i) (1 + j)) ** -frequency_bias``:
  uniformly at 0, more often at low frequencies above it. The draw is in
  integers (the weights are rounded to integers that sum to about 2**24, each
  at least 1), so it is the same on every backend; any worker that knows the
  key (:func:`position_key`) draws the same positions, and the message need
  not carry them. Each draw is elementwise, so a sharded block view gets its
  positions where its chunks lie.

  Args:
    key: a ``jax.random`` key.
    block_shape: the block view ``(*lead, A, c1, B, c2)``.
    k: positions per chunk, ``1 <= k <= c1 * c2``.
    frequency_bias: the exponent of the preference for low frequencies, 0 or more.

  Returns:
    int32 ``(*lead, A, B, k)``, each in ``[0, c1 * c2)``, in ascending order
    within a chunk.
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
  """The tables of :func:`draw_positions`: each run's tickets, and where each position's end.

  Args:
    c1: the chunk's length along its first axis.
    c2: its length along the second.
    k: positions per chunk.
    frequency_bias: as for :func:`draw_positions`.

  Returns:
    ``(lo, hi, ends)``: int32 ``(k,)`` bounds ``[lo, hi)`` of the tickets
    drawn for each run, and int32 ``(c1 * c2,)`` ends of each position's
    tickets (position ``p`` owns ``[ends[p - 1], ends[p])``), or ``None`` for
    a uniform draw, whose ticket is the position itself.
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
  # Position p owns the tickets [ends[p - 1], ends[p]); a ticket drawn within
  # a run's tickets names one of the run's positions.
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
  """Two 32-bit content hashes per worker; they fix a canonical worker order.

  Each key is a wrapping sum over the worker's entries of a scrambled (flat
  position, value bits) pair, so it reads the set of entries a worker sent and
  not their order: a wire format that reorders a chunk's entries (the 1-bit
  signs-in-order format) leaves the order, and every mean, as they were.
  Integer sums wrap identically in any order, so the keys are also the same
  whichever way the workers were numbered.
  """
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
  """The canonical order in which :func:`aggregate_blocks` folds the workers in.

  Args:
    indices_WxRxK: int32 chunk-local indices, ``(W, rows, k)``.
    values_WxRxK: float32 values, same shape.
    chunk_size: coefficients per chunk.

  Returns:
    int32 ``(W,)``, a permutation of the workers sorted by a hash of what each
    sent, the same whichever way the workers are numbered.
  """
  key_a, key_b = _worker_keys(indices_WxRxK, values_WxRxK, chunk_size)
  return jnp.lexsort((key_b, key_a)).astype(jnp.int32)


def aggregate_blocks(
  selections: list[tuple[jax.Array, jax.Array]],
  block_shapes: list[tuple[int, ...]],
  valid_W: jax.Array | None = None,
) -> list[tuple[jax.Array, jax.Array]]:
  """Mean over contributors, coefficient by coefficient, straight into block views.

  A coefficient that several workers chose gets the mean of their values; one
  that nobody chose is 0. Workers are folded in one at a time with a running
  mean, ``mu <- mu + (v - mu) / n``, which returns ``v`` exactly when all
  contributions equal ``v``. Each tensor takes them in its own canonical order
  (:func:`worker_order`, a hash of that tensor's part of the messages), so the
  result does not depend on how the workers are numbered, to the bit. Every
  scatter writes each location at most once (one worker names an index at
  most once per chunk), so no backend needs atomics. One loop over the
  workers folds every tensor.

  Args:
    selections: per tensor, ``(indices, values)`` of shape ``(W, *lead, A, B,
      k)`` (or any shape with W first and ``rows * k`` entries per worker, in
      chunk-major order).
    block_shapes: per tensor, its block view ``(*lead, A, c1, B, c2)``.
    valid_W: optional bool per worker; a worker marked False is left out.

  Returns:
    Per tensor, ``(mean, count)`` in its block view: float32 means over
    contributors and int32 contributor counts.
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
  # The count only ever reaches W; a narrow type keeps this dense buffer small.
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
    # Zeros of the same shape would be merged into one buffer, which the loop
    # then copies into each tensor's slot; a zero XLA cannot prove (an index
    # is never negative) keeps one fresh buffer per tensor.
    zero = jnp.minimum(idx_W.reshape(-1)[0], 0).astype(dtype)
    return jnp.broadcast_to(zero, shape)

  init = [
    (zeros(idx, s, jnp.float32), zeros(idx, s, count_dtype))
    for (idx, _), s in zip(prepared, block_shapes)
  ]
  # The loop carry must be typed as varying over every mesh axis its inputs
  # vary over (e.g. "fsdp" when each device aggregates its own shard).
  axes = frozenset(varying_axes(valid_W))
  for idx, val in prepared:
    axes |= varying_axes(idx) | varying_axes(val)

  init = jax.tree.map(lambda x: as_varying(x, axes), init)
  result = jax.lax.fori_loop(0, num_workers, fold, init)
  return [(mean, count.astype(jnp.int32)) for mean, count in result]
