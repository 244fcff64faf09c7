"""SparseLoCo: local steps, then a top-k, 2-bit, error-fed pseudo-gradient exchange.

Each worker takes ``sync_every`` (H) steps of its own inner optimizer, then
sends the top-k of its error-fed pseudo-gradient, quantized, and every worker
takes the same outer step from the mean (docs/design.md, section 6: the
quantizer, the wire, the median clip and the drawn message). As with
:func:`distro_jax.diloco`, the params the train step holds are the shared
outer params; each worker's inner params are in its state
(:func:`distro_jax.inner_params`), and the local rounds are
:mod:`distro_jax.local_rounds`'.

One 1-bit coefficient of each 8x8 DCT chunk, no indices, each matrix's mean
orthogonalized:

>>> import jax.numpy as jnp, optax, distro_jax as dj
>>> tx = dj.sparseloco(optax.adamw(1e-2), sync_every=2, compression_topk=1,
...     compression_chunk=8, value_bits=1, use_dct=True, random_positions=True,
...     frequency_bias=1.0, normalize="orth", outer_learning_rate=2e-2, axis_name=None)
>>> params, g = {"w": jnp.ones((64, 64))}, {"w": jnp.ones((64, 64))}
>>> state = tx.init(params)
>>> for _ in range(2):
...   updates, state = tx.update(g, state, params)
>>> round(float(jnp.sqrt(jnp.mean(updates["w"] ** 2))), 4)  # unit RMS times the rate
0.02
"""

import functools
from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from distro_jax import (
  bitpack,
  codec,
  compress,
  dct,
  decode,
  delivery,
  exchange,
  local_rounds,
  message,
  unit_rms,
  wire,
)
from distro_jax.hyperparams import (
  StaticFloat,
  StaticInt,
  check_decay,
  check_learning_rate,
  static_nonnegative_float,
  static_positive_int,
  unwrap_static,
)

__all__ = [
  "SparseLocoBytes",
  "SparseLocoLayout",
  "SparseLocoState",
  "SparseLocoTensor",
  "dequantize",
  "quantize",
  "sparseloco",
  "sparseloco_bytes",
  "sparseloco_layout",
]

# Templar's production quantizer: 4 bins spanning 6 standard deviations.
_RANGE_IN_SIGMAS = 6.0
_CODEBOOK_DTYPE = np.dtype(np.float32)


class SparseLocoState(NamedTuple):
  """State of :func:`sparseloco`; all but ``count`` and ``contributors`` differ by worker.

  Attributes:
    count: inner steps taken, int32 scalar, the same on every worker.
    local_params: this worker's inner params; equal to the outer params right
      after each synchronization. :func:`distro_jax.inner_params` returns them.
    inner_state: this worker's inner optimizer state; it carries on across
      synchronizations.
    error_feedback: per parameter, the error-feedback buffer ``e``, float32,
      in the param's shape (``(1,)`` for a scalar), each chunk in place as
      DeMo keeps its momentum.
    contributors: how many workers' messages went into this step's outer
      step (``W`` on a step that does not synchronize, 0 before the first);
      int32, the same on every worker.
  """

  count: jax.Array
  local_params: Any
  inner_state: Any
  error_feedback: Any
  contributors: jax.Array


class SparseLocoTensor(NamedTuple):
  """What one tensor contributes to the message. Static.

  Attributes:
    rows: number of chunks.
    k: entries kept per chunk.
    chunk_size: entries per chunk.
    value_bits: bits per quantized value, or ``None`` for the param dtype.
    value_dtype: the parameter dtype's name (the values' wire dtype without
      quantization).
  """

  rows: int
  k: int
  chunk_size: int
  value_bits: int | None
  value_dtype: str

  @property
  def entries(self) -> int:
    return self.rows * self.k

  @property
  def index_bits(self) -> int:
    return bitpack.bits_for(self.chunk_size)

  @property
  def index_bytes(self) -> int:
    return bitpack.packed_bytes(self.entries, self.index_bits)

  @property
  def value_bytes(self) -> int:
    if self.value_bits is None:
      return self.entries * np.dtype(self.value_dtype).itemsize
    return bitpack.packed_bytes(self.entries, self.value_bits)

  @property
  def codebook_bytes(self) -> int:
    if self.value_bits is None:
      return 0
    return (1 << self.value_bits) * _CODEBOOK_DTYPE.itemsize

  @property
  def num_bytes(self) -> int:
    return self.index_bytes + self.value_bytes + self.codebook_bytes


class SparseLocoLayout(NamedTuple):
  """Layout of a whole tree's SparseLoCo message. Static.

  Attributes:
    tensors: one :class:`SparseLocoTensor` per leaf, in tree order.
  """

  tensors: tuple[SparseLocoTensor, ...]

  @property
  def num_bytes(self) -> int:
    """Bytes one worker sends per synchronization: the length of its message."""
    return sum(t.num_bytes for t in self.tensors)


def _plan(x: Any, chunk: int) -> dct.ChunkPlan:
  return dct.plan_chunks(tuple(np.shape(x)), chunk)


def sparseloco_layout(
  params: Any, *, compression_topk: int, compression_chunk: int, value_bits: int | None
) -> SparseLocoLayout:
  """The message layout for a params tree (arrays or ``jax.ShapeDtypeStruct``).

  A zero-size leaf has no part in it (see :func:`distro_jax.wire.carried`).
  """
  tensors = []
  for x in filter(wire.carried, jax.tree.leaves(params)):
    plan = _plan(x, compression_chunk)
    k = min(compression_topk, plan.chunk_size)
    tensors.append(
      SparseLocoTensor(plan.rows, k, plan.chunk_size, value_bits, np.dtype(x.dtype).name)
    )
  return SparseLocoLayout(tuple(tensors))


def quantize(values: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
  """Quantizes one tensor's kept values to ``bits``-bit codes and a float32 codebook.

  The quantizer is docs/design.md's, section 6 (``bits=2`` is Templar's).

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


def _encode(
  indices: list[jax.Array],
  codes: list[jax.Array],
  codebooks: list[jax.Array | None],
  layout: SparseLocoLayout,
) -> jax.Array:
  """One worker's message: per tensor, packed indices, packed codes (or values), codebook."""
  parts = []
  for t, idx, code, book in zip(layout.tensors, indices, codes, codebooks):
    parts.append(bitpack.pack_bits(idx, t.index_bits))
    if t.value_bits is None:
      parts.append(bitpack.to_bytes(code.astype(t.value_dtype)))
    else:
      parts.append(bitpack.pack_bits(code, t.value_bits))
      parts.append(bitpack.to_bytes(book.astype(_CODEBOOK_DTYPE)))
  message = jnp.concatenate(parts)
  assert message.shape == (layout.num_bytes,), (message.shape, layout.num_bytes)
  return message


def _decode(messages: jax.Array, layout: SparseLocoLayout) -> list[tuple[jax.Array, jax.Array]]:
  """Per tensor, int32 indices and float32 values ``(W, rows, k)`` from ``uint8[W, N]``."""
  out, offset = [], 0
  num_workers = messages.shape[0]

  def take(n):
    nonlocal offset
    piece = messages[:, offset : offset + n]
    offset += n
    return piece

  for t in layout.tensors:
    idx = bitpack.unpack_bits(take(t.index_bytes), t.index_bits, t.entries).astype(jnp.int32)
    if t.value_bits is None:
      val = bitpack.from_bytes(take(t.value_bytes), np.dtype(t.value_dtype), (t.entries,))
    else:
      code = bitpack.unpack_bits(take(t.value_bytes), t.value_bits, t.entries)
      book = bitpack.from_bytes(take(t.codebook_bytes), _CODEBOOK_DTYPE, (1 << t.value_bits,))
      val = dequantize(code, book)
    shape = (num_workers, t.rows, t.k)
    out.append((idx.reshape(shape), val.astype(jnp.float32).reshape(shape)))
  return out


def _all_finite_per_worker(values_W: list[jax.Array]) -> jax.Array:
  """``bool[W]``: whether each worker's decoded values are finite in every tensor."""
  # No reshape: values sharded with their param (under jax.jit) stay so.
  per_tensor = [jnp.all(jnp.isfinite(v), axis=tuple(range(1, v.ndim))) for v in values_W]
  return jnp.all(jnp.stack(per_tensor), axis=0)


def _invalid_unless(finite: jax.Array, x: jax.Array) -> jax.Array:
  """``x``, or NaN everywhere (the mark of an invalid message) when not ``finite``."""
  return jnp.where(finite, x, jnp.nan).astype(x.dtype)


def _check_errors(errors: list[Any], plans: list[dct.ChunkPlan]) -> None:
  for i, (e, plan) in enumerate(zip(errors, plans)):
    if np.shape(e) != plan.state_shape:
      raise ValueError(
        f"SparseLocoState.error_feedback leaf {i} has shape {np.shape(e)}, but its parameter "
        f"needs {plan.state_shape} (the param's own shape, (1,) for a scalar). The state was "
        "built for other params, or by an older distro_jax that kept one row per chunk; build "
        "it again with tx.init(params) (or dj.init_worker_state), or convert an old buffer e "
        "with dj.dct.from_chunks(e, dj.dct.plan_chunks(shape, chunk))."
      )


def _check_value_bits(value_bits: Any) -> int | None:
  if value_bits is None:
    return None
  bits = value_bits.value if isinstance(value_bits, StaticInt) else value_bits
  if isinstance(bits, jax.core.Tracer):
    static_positive_int("value_bits", bits, example=2)  # Raises, with the static_args hint.
  if isinstance(bits, bool) or bits not in (1, 2):
    raise ValueError(
      f"value_bits must be 1, 2 or None (values in the parameter dtype), got {bits}; "
      "SparseLoCo's production value is 2."
    )
  return int(bits)


class _Selection(NamedTuple):
  """One worker's SparseLoCo message before it is written, per tensor.

  Attributes:
    indices: chunk-local positions in the block view, ``(*lead, A, B, k)``.
    codes: the quantized codes (or, without quantization, the values in the
      param dtype), shaped as the indices.
    codebooks: per tensor a float32 codebook, or ``None`` without quantization.
    sent: the values as receivers decode them, float32.
  """

  indices: list[jax.Array]
  codes: list[jax.Array]
  codebooks: list[jax.Array | None]
  sent: list[jax.Array]


class _Format(NamedTuple):
  """SparseLoCo's top-k message, as DeMo's stages ask of a format.

  :func:`distro_jax.compress.compress` selects with it (DeMo's top-k) and
  :func:`distro_jax.delivery.deliver` writes and reads it. A message is
  marked invalid by NaN where a valid one is finite: in every codebook entry
  or, without quantization, in every value. So a receiver reads each
  worker's validity from its values.
  """

  layout: SparseLocoLayout
  basis: dct.Basis

  @property
  def num_bytes(self) -> int:
    return self.layout.num_bytes

  def select(self, blocks: list[jax.Array], tensors: list[int]) -> list[tuple[Any, Any]]:
    """DeMo's top-k (:class:`distro_jax.message.TopK`) of the tensors numbered ``tensors``."""
    ks = tuple(t.k for t in self.layout.tensors)
    return message.TopK(ks).select(blocks, tensors)

  def encode(self, selection: _Selection, valid: jax.Array) -> jax.Array:
    quantized = [t.value_bits is not None for t in self.layout.tensors]
    codes = [c if q else _invalid_unless(valid, c) for c, q in zip(selection.codes, quantized)]
    books = [b if b is None else _invalid_unless(valid, b) for b in selection.codebooks]
    # The message is one byte vector: a selection sharded with its param is
    # gathered onto every device first, never the param.
    rows_k = [(t.rows, t.k) for t in self.layout.tensors]
    return _encode(
      [codec.unsharded(i).reshape(s) for i, s in zip(selection.indices, rows_k)],
      [codec.unsharded(c).reshape(s) for c, s in zip(codes, rows_k)],
      books,
      self.layout,
    )

  def decode(self, messages: jax.Array) -> message.Received:
    tensors = _decode(messages, self.layout)
    return message.Received(tensors, _all_finite_per_worker([val for _, val in tensors]))

  def as_received(self, selection: _Selection, valid: jax.Array) -> message.Received:
    tensors = [
      (idx[None], _invalid_unless(valid, sent)[None])
      for idx, sent in zip(selection.indices, selection.sent)
    ]
    return message.Received(tensors, _all_finite_per_worker([val for _, val in tensors]))


class _Config(NamedTuple):
  """:func:`sparseloco`'s options, checked. Static."""

  inner: optax.GradientTransformation
  sync_every: int
  total_steps: int | None
  outer_learning_rate: Any
  error_decay: float
  topk: int
  chunk: int
  bits: int | None
  basis: dct.Basis
  clip: bool
  axis_name: Hashable | None
  drawn: bool
  bias: float
  normalize: Any


class _Round(NamedTuple):
  """What one synchronization knows of the params before it computes anything. Static.

  Attributes:
    treedef: the params' tree structure.
    carried: which leaves the message carries (not the zero-size ones).
    all_leaves: every param leaf.
    leaves: the carried ones.
    layout: the message's layout: :class:`SparseLocoLayout` for the top-k,
      DeMo's :class:`~distro_jax.codec.WireLayout` for drawn positions.
    plans: per carried leaf, its :class:`~distro_jax.dct.ChunkPlan`.
    modes: per carried leaf, how its mean becomes a step
      (:func:`distro_jax.unit_rms.normalized_step`), or ``None`` for the mean
      itself.
  """

  treedef: Any
  carried: wire.CarriedLeaves
  all_leaves: list[jax.Array]
  leaves: list[jax.Array]
  layout: SparseLocoLayout | codec.WireLayout
  plans: list[dct.ChunkPlan]
  modes: list[Any]


def _quantized(
  out: compress.Compressed, layout: SparseLocoLayout
) -> tuple[_Selection, list[jax.Array]]:
  """The top-k values quantized, and the buffer with what receivers decode taken out.

  What the quantizer loses stays in the buffer, so a later round sends it.
  """
  codes, books, sents, kept = [], [], [], []
  picked = zip(layout.tensors, out.momentum, out.selection.indices, out.selection.values)
  for t, m, idx, val in picked:
    if t.value_bits is None:
      code, book = val.astype(t.value_dtype), None
      sent = code.astype(jnp.float32)
    else:
      code, book = quantize(val, t.value_bits)
      sent = dequantize(code, book)
    kept.append(codec.scatter_blocks(m, idx, val - sent))
    codes.append(code)
    books.append(book)
    sents.append(sent)
  return _Selection(out.selection.indices, codes, books, sents), kept


def _outer_step(means: list[jax.Array], rnd: _Round, cfg: _Config, count: jax.Array) -> Any:
  """``-outer_lr * normalize(mean)``, in the params' shapes and dtypes.

  ``means`` are in their block views, out of the basis. Every worker computes
  the same bits from the same gathered messages.
  """
  rate = cfg.outer_learning_rate
  # A schedule is read at this update's own step, as the inner optimizer read its rate.
  rate = rate(count - 1) if callable(rate) else rate
  outer = []
  for mean, plan, x, mode in zip(means, rnd.plans, rnd.leaves, rnd.modes):
    step = dct.from_blocks(mean, plan, like=x)
    if mode is not None:
      step = unit_rms.normalized_step(step, mode)
    outer.append((-rate * step).astype(x.dtype))
  return rnd.treedef.unflatten(rnd.carried.with_empty(outer, rnd.all_leaves, jnp.zeros_like))


def _format(
  pseudo: list[jax.Array], rnd: _Round, cfg: _Config, count: jax.Array
) -> _Format | message.MessageFormat:
  """The round's message format: SparseLoCo's top-k, or DeMo's drawn one."""
  if not cfg.drawn:
    return _Format(rnd.layout, cfg.basis)
  block_shapes = [plan.block_shape for plan in rnd.plans]
  ks = tuple(t.k for t in rnd.layout.tensors)
  positions = message.drawn(count, cfg.axis_name, pseudo, [], block_shapes, ks, cfg.bias)
  return message.MessageFormat(rnd.layout, positions, cfg.basis)


def _exchange(
  pseudo: list[jax.Array], errors: list[jax.Array], rnd: _Round, cfg: _Config, count: jax.Array
) -> tuple[list[jax.Array], jax.Array, list[jax.Array], jax.Array]:
  """One worker's round through DeMo's stages: compress, deliver, decode.

  DeMo's compress stage takes the pseudo-gradient as the gradient and the
  error decay as the momentum's (``e <- decay * e + basis(d)``). The top-k
  message quantizes what it selected and decodes to the clipped mean over
  every valid worker; the drawn one is DeMo's message (no indices; 1-bit
  signs or param-dtype values), whose values leave the buffer at full
  precision, decoded as DeMo does (each coefficient's mean over the workers
  that drew it).

  Returns:
    ``(means, contributors, errors, finite)``: per tensor, the mean in its
    block view, out of the basis (the same on every worker); how many
    workers' messages went into it; per tensor, this worker's buffer after
    the round, in its param's shape; and whether this worker's
    pseudo-gradient and message were finite.
  """
  fmt = _format(pseudo, rnd, cfg, count)
  blocks = [dct.to_blocks(e, plan) for e, plan in zip(errors, rnd.plans)]
  # SparseLoCo's top-k keeps XLA's path, and with it its bits: a fused
  # kernel's DCT rounds differently.
  out = compress.compress(
    pseudo, blocks, rnd.plans, fmt, lr=1.0, decay=cfg.error_decay, kernels=cfg.drawn
  )
  if cfg.drawn:
    selection, kept, sent = out.selection, out.kept, out.selection.values
  else:
    selection, kept = _quantized(out, rnd.layout)
    sent = selection.sent
  finite = exchange.all_finite([*pseudo, *sent])
  received = delivery.deliver(fmt, selection, finite, cfg.axis_name)
  if cfg.drawn:
    means = decode.aggregate(received, out.kept, rnd.plans, cfg.basis, cfg.axis_name)
  else:
    zeros = [
      dct.to_blocks(jnp.zeros_like(x, jnp.float32), p) for x, p in zip(rnd.leaves, rnd.plans)
    ]
    means = decode.clipped_mean(received, zeros, rnd.plans, cfg.basis, cfg.clip)
  contributors = jnp.sum(received.valid.astype(jnp.int32))
  errors = [
    dct.from_blocks(k, plan, plan.state_shape, like=e)
    for k, plan, e in zip(kept, rnd.plans, errors)
  ]
  return means, contributors, errors, finite


def _synchronize(
  cfg: _Config,
  rnd: _Round,
  count: jax.Array,
  params: Any,
  local: Any,
  errors: Any,
  inner_state: Any,
):
  """A synchronization: compress, exchange, aggregate, outer step, restart."""
  local_leaves = rnd.carried.pick(rnd.treedef.flatten_up_to(local))
  pseudo = [p.astype(jnp.float32) - q.astype(jnp.float32) for p, q in zip(rnd.leaves, local_leaves)]
  all_errors = rnd.treedef.flatten_up_to(errors)
  old_errors = rnd.carried.pick(all_errors)
  means, contributors, new_errors, finite = _exchange(pseudo, old_errors, rnd, cfg, count)
  # A worker that is not finite keeps its buffer of before the round.
  kept = [jnp.where(finite, e, old) for e, old in zip(new_errors, old_errors)]
  errors = rnd.treedef.unflatten(rnd.carried.merge(kept, all_errors))
  outer = _outer_step(means, rnd, cfg, count)
  local, inner_state = local_rounds.restart(
    cfg.inner, params, outer, inner_state, finite, cfg.axis_name
  )
  return outer, local, errors, inner_state, contributors


def _config(
  inner: Any,
  sync_every: Any,
  outer_learning_rate: Any,
  error_decay: Any,
  compression_topk: Any,
  compression_chunk: Any,
  value_bits: Any,
  use_dct: bool,
  clip_to_median_norm: bool,
  axis_name: Hashable | None,
  random_positions: bool = False,
  frequency_bias: Any = None,
  normalize: Any = None,
  total_steps: Any = None,
) -> _Config:
  """:func:`sparseloco`'s arguments checked, each refused with the fix when wrong."""
  sync_every = static_positive_int("sync_every", sync_every, example=30)
  if total_steps is not None:
    total_steps = static_positive_int("total_steps", total_steps, example=1000)
  topk = static_positive_int("compression_topk", compression_topk, example=64)
  chunk = static_positive_int("compression_chunk", compression_chunk, example=64)
  bits = _check_value_bits(value_bits)
  drawn, bias = _check_positions(random_positions, frequency_bias, bits)
  check_learning_rate("outer_learning_rate", outer_learning_rate)
  if normalize is not None:
    unit_rms.check_normalize(normalize)
  error_decay = unwrap_static(error_decay)
  check_decay(
    "error_decay", error_decay, one_allowed=True, hint="SparseLoCo's production value is 0.95."
  )
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
      f"inner must be an optax.GradientTransformation such as optax.adamw(1e-3), got "
      f"{type(inner).__name__}."
    )
  return _Config(
    inner,
    sync_every,
    total_steps,
    outer_learning_rate,
    error_decay,
    topk,
    chunk,
    bits,
    dct.basis(bool(use_dct)),
    bool(clip_to_median_norm),
    axis_name,
    drawn,
    bias,
    normalize,
  )


def _check_positions(random_positions: Any, frequency_bias: Any, bits: int | None):
  """``(drawn, bias)``: whether positions are drawn, and the draw's bias (0 for uniform)."""
  drawn = bool(random_positions)
  if drawn and bits == 2:
    raise ValueError(
      "random_positions=True sends DeMo's drawn message, whose values travel as 1-bit "
      "signs or in the parameter dtype; use value_bits=1 (or None), not value_bits=2."
    )
  if frequency_bias is None:
    return drawn, 0.0
  bias = static_nonnegative_float("frequency_bias", frequency_bias, example=1.0)
  if not drawn:
    raise ValueError(
      f"frequency_bias={frequency_bias} shapes the draw of random_positions=True; pass "
      "random_positions=True, or leave frequency_bias=None."
    )
  return drawn, bias


def _layout(
  leaves: list[Any], topk: int, chunk: int, bits: int | None, drawn: bool
) -> SparseLocoLayout | codec.WireLayout:
  """The message's layout: SparseLoCo's top-k one, or DeMo's drawn one (no indices)."""
  if drawn:
    return wire.wire_layout(
      leaves,
      compression_topk=topk,
      compression_chunk=chunk,
      quantize_1bit=bits == 1,
      random_positions=True,
    )
  return sparseloco_layout(leaves, compression_topk=topk, compression_chunk=chunk, value_bits=bits)


def _round(params: Any, state: SparseLocoState, cfg: _Config) -> _Round:
  """This update's :class:`_Round`; a zero-size param has nothing to send (an empty step)."""
  all_leaves, treedef = jax.tree.flatten(params)
  carried = wire.CarriedLeaves(all_leaves)
  leaves = carried.pick(all_leaves)
  layout = _layout(leaves, cfg.topk, cfg.chunk, cfg.bits, cfg.drawn)
  plans = [_plan(x, cfg.chunk) for x in leaves]
  if leaves:
    _check_errors(carried.pick(treedef.flatten_up_to(state.error_feedback)), plans)
  if cfg.normalize is None:
    modes = [None] * len(leaves)
  else:
    modes = carried.pick(unit_rms.normalize_modes(cfg.normalize, params))
  return _Round(treedef, carried, all_leaves, leaves, layout, plans, modes)


def _update(
  cfg: _Config, updates: Any, state: SparseLocoState, params: Any
) -> tuple[Any, SparseLocoState]:
  """:func:`sparseloco`'s update: the inner step, then the round's exchange when it is due."""
  count, local, inner_state = local_rounds.inner_step(
    cfg.inner, updates, state, params, cfg.axis_name, "dj.sparseloco"
  )
  rnd = _round(params, state, cfg)
  if not rnd.leaves:
    # Nothing to exchange (an empty tree, or optax.masked selecting nothing).
    everyone = jnp.full([], exchange.bound_axis_size(cfg.axis_name), jnp.int32)
    return updates, SparseLocoState(count, local, inner_state, state.error_feedback, everyone)

  synchronize = functools.partial(_synchronize, cfg, rnd, count, params)
  # The synchronizing branch makes the buffer differ by worker, and both
  # must return it typed alike, so it enters as such (else tracing it from
  # a shared buffer, as dj.worker_state_specs does first, fails).
  errors = exchange.worker_local(state.error_feedback, cfg.axis_name)
  outer_updates, local, errors, inner_state, contributors = local_rounds.synchronize_when_due(
    synchronize,
    count,
    params,
    errors,
    local,
    inner_state,
    sync_every=cfg.sync_every,
    total_steps=cfg.total_steps,
    axis_name=cfg.axis_name,
  )
  return outer_updates, SparseLocoState(count, local, inner_state, errors, contributors)


def sparseloco(
  inner: optax.GradientTransformation,
  *,
  sync_every: int = StaticInt(30),
  outer_learning_rate: float = 1.0,
  error_decay: float = StaticFloat(0.95),
  compression_topk: int = StaticInt(64),
  compression_chunk: int = StaticInt(64),
  value_bits: int | None = StaticInt(2),
  use_dct: bool = False,
  clip_to_median_norm: bool = True,
  axis_name: Hashable | None = "data",
  random_positions: bool = False,
  frequency_bias: float | None = None,
  normalize: Any = None,
  total_steps: int | None = None,
) -> optax.GradientTransformation:
  """SparseLoCo: H local steps of ``inner``, then a compressed, error-fed outer step.

  Every step moves the worker's inner params by ``inner`` (take the gradient
  at :func:`distro_jax.inner_params`). Every ``sync_every``-th step each
  worker folds ``d = outer - inner`` into its error feedback, sends the
  quantized top-k of each chunk, and every worker steps the outer params by
  ``outer_lr`` times the mean and restarts there (docs/design.md, section 6).
  Between synchronizations the update is zero.

  Args:
    inner: the inner optimizer, e.g. ``optax.adamw(lr)``; its state is per
      worker and carries on across synchronizations.
    sync_every: inner steps between synchronizations (H). Static.
    outer_learning_rate: the outer step size (1.0 in the paper), or a
      schedule read at the synchronizing step; with ``normalize``, the size
      per entry.
    error_decay: the error-feedback decay in ``[0, 1]`` (0.95 in the paper).
    compression_topk: entries kept per chunk, clamped to the chunk size. Static.
    compression_chunk: chunk length target per axis. Static.
    value_bits: 2 (the paper's), 1, or ``None`` to send the values in the
      parameter dtype. Static.
    use_dct: select in the chunked DCT domain, as DeMo does, instead of the
      raw chunks (the paper's form). Static.
    clip_to_median_norm: scale each worker's contribution, per tensor, to at
      most the workers' median norm, as Templar does. Static.
    axis_name: the data-parallel axis; ``None`` for one worker, no collective.
    random_positions: send DeMo's drawn message instead of the top-k and its
      indices; needs ``value_bits`` 1 or ``None``. Static.
    frequency_bias: with ``random_positions``, the draw's preference for a
      chunk's low frequencies (:func:`distro_jax.codec.draw_positions`);
      ``None`` draws uniformly. Static.
    normalize: how the mean becomes the outer step: ``None`` (the mean
      itself), or as :func:`distro_jax.demo` takes it. Static.
    total_steps: the run's length, which synchronizes too, so a last shorter
      round is not lost; ``None``: only multiples of ``sync_every`` do. Static.

  Returns:
    An ``optax.GradientTransformation`` whose state is a :class:`SparseLocoState`.

  References:
    Sarfi, Thérien, Lidin, Belilovsky, "Communication Efficient LLM
    Pre-training with SparseLoCo", arXiv:2508.15706, 2025.

  Example:
    >>> import jax.numpy as jnp, optax, distro_jax as dj
    >>> tx = dj.sparseloco(optax.adamw(1e-2), sync_every=2, axis_name=None)
    >>> params = {"w": jnp.ones((64, 64))}
    >>> state = tx.init(params)
    >>> g = {"w": jnp.ones((64, 64))}  # in training: the gradient at dj.inner_params(state, params)
    >>> updates, state = tx.update(g, state, params)  # no sync yet: the update is zero
    >>> float(jnp.abs(updates["w"]).max())
    0.0
    >>> updates, state = tx.update(g, state, params)  # sync: the compressed outer step
    >>> int((updates["w"] != 0).sum())  # top-64 of each 64x64 chunk
    64
  """
  # Every argument, checked before any is used.
  cfg = _config(**locals())

  def init_fn(params):
    dct.refuse_non_float(params, "SparseLoCo", "top-k by magnitude and quantizer")
    count, local, inner_state, contributors = local_rounds.init(inner, params)
    errors = jax.tree.map(dct.in_place_zeros, params)
    return SparseLocoState(count, local, inner_state, errors, contributors)

  def update_fn(updates, state, params=None):
    return _update(cfg, updates, state, params)

  return optax.GradientTransformation(init_fn, update_fn)


class SparseLocoBytes(NamedTuple):
  """Bytes one SparseLoCo worker sends, against the baselines.

  Attributes:
    payload: the message of one synchronization, the all-gather's operand.
    per_step: ``payload / sync_every``, amortized over the round's H steps.
    grad_bf16: the full gradient in bf16, the DisTrO report's baseline (per step).
    grad_fp32: the full gradient in fp32.
    grad: the full gradient in the parameters' own dtypes.
    ring_allreduce: what a ring all-reduce of that gradient moves per worker
      per step, ``2 (W - 1) / W * grad``.
    num_workers: the W used for ``ring_allreduce``.
    sync_every: H.
  """

  payload: int
  per_step: float
  grad_bf16: int
  grad_fp32: int
  grad: int
  ring_allreduce: float
  num_workers: int
  sync_every: int

  @property
  def ratio_vs_bf16(self) -> float:
    """A bf16 gradient per step over SparseLoCo's bytes per step."""
    return self.grad_bf16 / self.per_step

  @property
  def ratio_vs_ring(self) -> float:
    """A ring all-reduce's bytes per step over SparseLoCo's bytes per step."""
    return self.ring_allreduce / self.per_step


def sparseloco_bytes(
  params: Any,
  *,
  sync_every: int = 30,
  compression_topk: int = 64,
  compression_chunk: int = 64,
  value_bits: int | None = 2,
  num_workers: int = 8,
  random_positions: bool = False,
) -> SparseLocoBytes:
  """Bytes per worker per synchronization and per step of :func:`sparseloco`.

  Args:
    params: a tree of arrays or ``jax.ShapeDtypeStruct`` (``jax.eval_shape``
      output works, so large models need no memory).
    sync_every: H, the steps each message covers.
    compression_topk: entries kept per chunk (clamped to the chunk size).
    compression_chunk: chunk target length per axis.
    value_bits: 1, 2, or ``None`` for the parameter dtype.
    num_workers: W, for the ring all-reduce baseline.
    random_positions: the message is DeMo's drawn one (no indices).

  Returns:
    A :class:`SparseLocoBytes`.

  Example:
    >>> import jax.numpy as jnp, distro_jax as dj
    >>> b = dj.sparseloco_bytes({"w": jnp.zeros((4096, 4096))})
    >>> chunks = 64 * 64  # of 4,096 entries each; 64 kept per chunk
    >>> b.payload == chunks * 64 * (12 + 2) // 8 + 16  # 12-bit indices, 2-bit codes, codebook
    True
    >>> round(b.ratio_vs_bf16)
    2194
    >>> drawn = dj.sparseloco_bytes({"w": jnp.zeros((4096, 4096))}, sync_every=2,
    ...     compression_topk=1, compression_chunk=8, value_bits=1, random_positions=True)
    >>> drawn.payload == 1 + 512 * 512 // 8  # a flag byte, one sign bit per 8x8 chunk
    True
    >>> round(drawn.ratio_vs_bf16)
    2048
  """
  bits = _check_value_bits(value_bits)
  drawn, _ = _check_positions(random_positions, None, bits)
  sync_every = static_positive_int("sync_every", sync_every, example=30)
  layout = _layout(
    [x for x in jax.tree.leaves(params) if wire.carried(x)],
    static_positive_int("compression_topk", compression_topk, example=64),
    static_positive_int("compression_chunk", compression_chunk, example=64),
    bits,
    drawn,
  )
  # The baselines (the full gradient, a ring all-reduce of it) are DeMo's.
  base = wire.wire_bytes(params, num_workers=num_workers)._asdict()
  mine = dict(payload=layout.num_bytes, per_step=layout.num_bytes / sync_every)
  return SparseLocoBytes(**base | mine, sync_every=sync_every)
