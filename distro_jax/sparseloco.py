"""SparseLoCo: local steps, then a top-k, 2-bit, error-feedback pseudo-gradient exchange.

Each worker takes ``sync_every`` (H) steps of its own inner optimizer from the
shared params ``theta``. Then it folds its pseudo-gradient ``d = theta -
theta_w`` into a decayed error-feedback buffer ``e <- decay * e + d``, keeps the
top-k entries of every chunk of ``e``, quantizes them, and removes what it
sent, as quantized, from ``e``. The workers all-gather these messages and
average them, optionally clipping each worker's contribution to the median
norm first, and every worker takes the outer step ``theta <- theta - outer_lr
* mean`` and restarts from it. The inner optimizer's state carries on.

As with :func:`distro_jax.diloco`, the params that the train step holds are
the shared outer params, bit-identical on every worker at every step; each
worker's inner params live in its state, and :func:`distro_jax.inner_params`
finds them.

**The 2-bit quantizer.** This is the one Templar runs SparseLoCo with in
production (``quantization_bins=4``, ``quantization_range=6`` in
``hparams/hparams.json`` of github.com/one-covenant/templar, applied by
``TopKCompressor._quantize_values`` in ``src/tplr/compress.py``). It acts on
all the kept values ``v`` of one tensor at once, on each worker:

* ``mu = mean(v)``, ``c = v - mu``, ``sigma = ||c|| / sqrt(n - 1)``;
* bin width ``s = 6 * sigma / 4`` (1 if that is 0 or not finite);
* code ``q = clip(round(c / s + 2), 0, 3)``, rounding half to even. The bins
  are therefore ``c < -2.25 sigma``, ``[-2.25, -0.75) sigma``,
  ``[-0.75, 0.75) sigma`` and ``>= 0.75 sigma``: asymmetric, as in Templar;
* the receiver reconstructs ``mu + (mean of the c that fell in bin q)``. This
  codebook of 4 float32 values (``mu`` folded in) is the side information, 16
  bytes per tensor; an empty bin's entry is ``mu``.

With ``value_bits=1`` the same codebook scheme splits at the mean instead
(``q = c >= 0``, two entries): Templar's formula with two bins would put the
only threshold at ``-1.5 sigma``. This 1-bit form is this library's choice.
With ``value_bits=None`` the values travel in the parameter dtype.

**Wire.** One ``uint8`` message per worker; per tensor, in tree order: the
chunk-local indices packed at ``ceil(log2 chunk size)`` bits each (12 for a
64x64 chunk), the codes packed at ``value_bits`` bits each, then the float32
codebook (or, without quantization, the values in the parameter dtype).
:func:`sparseloco_bytes` counts it; it is the operand of the one all-gather.

**Aggregation.** ``mean = (1 / W) * sum_w decoded_w``, the paper's average over
all W workers (Templar's own code instead averages each coefficient over the
workers that chose it). The sum runs over the gathered messages in worker
order, so every worker computes it bit for bit alike. With median clipping,
each worker's decoded values of a tensor are scaled by ``min(1, med / (norm +
1e-8))``, where ``norm`` is their L2 norm and ``med`` the lower median of the W
norms of that tensor (``torch.median``'s convention, as Templar uses); every
worker computes it from the gathered messages, so no other collective runs.

**A worker whose values are not finite** (a NaN or inf anywhere in its
pseudo-gradient) sends its message with every codebook entry (or value) NaN,
which no finite message has, and keeps its error feedback as it was before the
round. Receivers leave such messages out: the mean and the median are over the
valid workers only, and a round with none moves nothing. That worker restarts
from the shared params with a fresh inner optimizer state, since its own may
hold the NaN. So one worker's NaN reaches no replica, at no cost in bytes.
"""

import math
from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from distro_jax import bitpack, codec, dct, delivery, exchange, message, wire
from distro_jax.hyperparams import (
  StaticFloat,
  StaticInt,
  check_decay,
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
# What the median clip adds to a norm before dividing by it (as Templar does).
_CLIP_EPS = 1e-8
_CODEBOOK_DTYPE = np.dtype(np.float32)


class SparseLocoState(NamedTuple):
  """State of :func:`sparseloco`; all but ``count`` and ``contributors`` differ by worker.

  Attributes:
    count: inner steps taken, int32 scalar, the same on every worker.
    local_params: this worker's inner params; equal to the outer params right
      after each synchronization. :func:`distro_jax.inner_params` returns them.
    inner_state: this worker's inner optimizer state; it carries on across
      synchronizations.
    error_feedback: per parameter, the decayed error-feedback buffer ``e``,
      float32, in the param's own shape (``(1,)`` for a scalar): each chunk's
      entries (its DCT coefficients with ``use_dct``) in that chunk's own
      place, as DeMo keeps its momentum, so any sharding of the param that
      does not cut a chunk places it too (``optax.tree_map_params`` gives it
      the param's spec).
    contributors: how many workers' messages went into this step's outer
      step; those that were not finite are left out (so ``W - contributors``
      were excluded). On a step that does not synchronize no worker is left
      out, and it is ``W``. int32 scalar, the same on every worker; 0 before
      the first step.
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

  See the module docstring for the definition (``bits=2`` is Templar's
  production quantizer). Deterministic: the same values give the same codes
  and codebook on every backend run of the same program.

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


def _lower_median(x_W: jax.Array, valid_W: jax.Array) -> jax.Array:
  """The lower median of the n valid entries, ``sorted(x)[(n - 1) // 2]``, as ``torch.median``."""
  n = jnp.sum(valid_W.astype(jnp.int32))
  # The invalid sort last, so the first n are the valid ones in order.
  ordered = jnp.sort(jnp.where(valid_W, x_W, jnp.inf))
  return ordered[jnp.maximum(n - 1, 0) // 2]


def _all_finite_per_worker(values_W: list[jax.Array]) -> jax.Array:
  """``bool[W]``: whether each worker's decoded values are finite in every tensor."""
  # No reshape: values sharded with their param (under jax.jit) stay so.
  per_tensor = [jnp.all(jnp.isfinite(v), axis=tuple(range(1, v.ndim))) for v in values_W]
  return jnp.all(jnp.stack(per_tensor), axis=0)


def _per_worker(
  w: jax.Array, x_W: jax.Array, otherwise: jax.Array | float | None = None
) -> jax.Array:
  """``w[W]`` broadcast over each worker's entries of ``x_W``: a factor, or a mask with a fill."""
  w = w.reshape(w.shape + (1,) * (x_W.ndim - 1))
  return w if otherwise is None else jnp.where(w, x_W, otherwise)


def _norm_per_worker(x_W: jax.Array) -> jax.Array:
  """``float[W]``: the L2 norm of each worker's entries of ``x_W``."""
  return jnp.sqrt(jnp.sum(jnp.square(x_W), axis=tuple(range(1, x_W.ndim))))


def _invalid_unless(finite: jax.Array, x: jax.Array) -> jax.Array:
  """``x``, or NaN everywhere (the mark of an invalid message) when not ``finite``."""
  return jnp.where(finite, x, jnp.nan).astype(x.dtype)


def _sum_in_worker_order(
  zeros_blocks: jax.Array, idx_WxRxK: jax.Array, val_WxRxK: jax.Array
) -> jax.Array:
  """Every worker's sparse message summed into a block view, worker 0 first.

  A fixed order of float additions makes the sum bit-identical on every
  worker. Within one worker an index occurs at most once per chunk, so each
  scatter writes a location once and needs no atomics. ``zeros_blocks``
  carries the param's sharding, so a sharded param's sum stays sharded.
  """
  lead = zeros_blocks.shape[:-4]
  a, b = zeros_blocks.shape[-4], zeros_blocks.shape[-2]
  num_workers, k = idx_WxRxK.shape[0], idx_WxRxK.shape[-1]
  want = (num_workers, *lead, a, b, k)
  idx_W = idx_WxRxK if idx_WxRxK.shape == want else idx_WxRxK.reshape(want)
  val_W = val_WxRxK if val_WxRxK.shape == want else val_WxRxK.reshape(want)

  def add(w, dense):
    here = codec.gather_blocks(dense, idx_W[w])
    return codec.scatter_blocks(dense, idx_W[w], here + val_W[w])

  return jax.lax.fori_loop(0, num_workers, add, zeros_blocks)


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
  """SparseLoCo's message format, as the exchange (:func:`distro_jax.delivery.deliver`) asks.

  A message is marked invalid by NaN where a valid one is finite: in every
  codebook entry or, without quantization, in every value. So a receiver
  reads each worker's validity from its values.
  """

  layout: SparseLocoLayout

  @property
  def num_bytes(self) -> int:
    return self.layout.num_bytes

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
  outer_learning_rate: Any
  error_decay: float
  topk: int
  chunk: int
  bits: int | None
  basis: dct.Basis
  clip: bool
  axis_name: Hashable | None


class _Round(NamedTuple):
  """What one synchronization knows of the params before it computes anything. Static.

  Attributes:
    treedef: the params' tree structure.
    carried: which leaves the message carries (not the zero-size ones).
    all_leaves: every param leaf.
    leaves: the carried ones.
    layout: the message's layout.
    plans: per carried leaf, its :class:`~distro_jax.dct.ChunkPlan`.
  """

  treedef: Any
  carried: wire.CarriedLeaves
  all_leaves: list[jax.Array]
  leaves: list[jax.Array]
  layout: SparseLocoLayout
  plans: list[dct.ChunkPlan]


def _compress(
  pseudo_grads: list[jax.Array], errors: list[jax.Array], rnd: _Round, cfg: _Config
) -> tuple[_Selection, list[jax.Array]]:
  """Error feedback, top-k and quantization of one worker's pseudo-gradient.

  Returns what the message sends and, per tensor in its param's shape, the
  buffer with what was sent (as the receivers decode it) taken out.
  """
  indices, codes, books, sents, kept = [], [], [], [], []
  for d, e, plan, t in zip(pseudo_grads, errors, rnd.plans, rnd.layout.tensors):
    # Everything param-sized stays in its block view, sharded as the param is.
    coeffs = cfg.basis.forward(dct.to_blocks(d, plan), plan)
    e_blocks = cfg.error_decay * dct.to_blocks(e, plan) + coeffs
    idx, val = codec.select_topk_blocks(e_blocks, t.k)
    if cfg.bits is None:
      code, book = val.astype(t.value_dtype), None
      sent = code.astype(jnp.float32)
    else:
      code, book = quantize(val, cfg.bits)
      sent = dequantize(code, book)
    # What was sent, as the receivers decode it, leaves the buffer.
    e_blocks = codec.scatter_blocks(e_blocks, idx, val - sent)
    kept.append(dct.from_blocks(e_blocks, plan, plan.state_shape, like=e))
    indices.append(idx)
    codes.append(code)
    books.append(book)
    sents.append(sent)
  return _Selection(indices, codes, books, sents), kept


def _aggregate(
  received: message.Received, rnd: _Round, clip: bool
) -> tuple[list[jax.Array], jax.Array]:
  """The mean of the valid workers' messages, per tensor in its block view, and their count.

  Each worker's values are clipped first, with ``clip``, to the lower median
  of the valid workers' norms of that tensor. The sum runs over the workers
  in their order, so every worker computes it bit for bit alike.
  """
  valid_W = received.valid
  tensors = [(idx, _per_worker(valid_W, val, 0.0)) for idx, val in received.tensors]
  if clip:
    tensors = [
      (idx, val * _per_worker(_clip_factors(_norm_per_worker(val), valid_W), val))
      for idx, val in tensors
    ]
  contributors = jnp.sum(valid_W.astype(jnp.int32))
  means = []
  for (idx, val), plan, x in zip(tensors, rnd.plans, rnd.leaves):
    zeros = dct.to_blocks(jnp.zeros_like(x, dtype=jnp.float32), plan)
    # A round with no valid message sums to zero and moves nothing.
    means.append(_sum_in_worker_order(zeros, idx, val) / jnp.maximum(contributors, 1))
  return means, contributors


def _clip_factors(norms_W: jax.Array, valid_W: jax.Array) -> jax.Array:
  """Each worker's scale for one tensor: at most the lower median of the valid norms."""
  return jnp.minimum(1.0, _lower_median(norms_W, valid_W) / (norms_W + _CLIP_EPS))


def _outer_step(means: list[jax.Array], rnd: _Round, cfg: _Config) -> Any:
  """``-outer_lr * mean``, back out of the basis, in the params' shapes and dtypes."""
  outer = []
  for mean, plan, x in zip(means, rnd.plans, rnd.leaves):
    step = dct.from_blocks(cfg.basis.inverse(mean, plan), plan, like=x)
    outer.append((-cfg.outer_learning_rate * step).astype(x.dtype))
  return rnd.treedef.unflatten(rnd.carried.with_empty(outer, rnd.all_leaves, jnp.zeros_like))


def _restart(
  params: Any, outer: Any, inner_state: Any, finite: jax.Array, cfg: _Config
) -> tuple[Any, Any]:
  """Every worker's inner params at the new outer params; a failed worker's inner state afresh.

  Its own inner state may hold the NaN. Leaves shared by every worker (a
  step count) took in no gradient, so they carry on.
  """
  restart = exchange.worker_local(optax.apply_updates(params, outer), cfg.axis_name)
  inner_state = jax.tree.map(
    lambda s, f: s if exchange.is_shared(s, cfg.axis_name) else jnp.where(finite, s, f),
    inner_state,
    cfg.inner.init(restart),
  )
  return restart, inner_state


def _synchronize(cfg: _Config, rnd: _Round, params: Any, local: Any, errors: Any, inner_state: Any):
  """A synchronization: compress, exchange, aggregate, outer step, restart."""
  local_leaves = rnd.carried.pick(rnd.treedef.flatten_up_to(local))
  pseudo = [p.astype(jnp.float32) - q.astype(jnp.float32) for p, q in zip(rnd.leaves, local_leaves)]
  all_errors = rnd.treedef.flatten_up_to(errors)
  old_errors = rnd.carried.pick(all_errors)
  selection, new_errors = _compress(pseudo, old_errors, rnd, cfg)
  finite = exchange.all_finite([*pseudo, *selection.sent])
  # A worker that is not finite keeps its buffer of before the round.
  kept = [jnp.where(finite, e, old) for e, old in zip(new_errors, old_errors)]
  errors = rnd.treedef.unflatten(rnd.carried.merge(kept, all_errors))
  received = delivery.deliver(_Format(rnd.layout), selection, finite, cfg.axis_name)
  means, contributors = _aggregate(received, rnd, cfg.clip)
  outer = _outer_step(means, rnd, cfg)
  restart, inner_state = _restart(params, outer, inner_state, finite, cfg)
  return outer, restart, errors, inner_state, contributors


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
) -> _Config:
  """:func:`sparseloco`'s arguments checked, each refused with the fix when wrong."""
  sync_every = static_positive_int("sync_every", sync_every, example=30)
  topk = static_positive_int("compression_topk", compression_topk, example=64)
  chunk = static_positive_int("compression_chunk", compression_chunk, example=64)
  bits = _check_value_bits(value_bits)
  error_decay = unwrap_static(error_decay)
  check_decay(
    "error_decay", error_decay, one_allowed=True, hint="SparseLoCo's production value is 0.95."
  )
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
      f"inner must be an optax.GradientTransformation such as optax.adamw(1e-3), got "
      f"{type(inner).__name__}."
    )
  basis = dct.basis(bool(use_dct))
  clip = bool(clip_to_median_norm)
  return _Config(
    inner, sync_every, outer_learning_rate, error_decay, topk, chunk, bits, basis, clip, axis_name
  )


def _round(params: Any, state: SparseLocoState, cfg: _Config) -> _Round:
  """This update's :class:`_Round`; a zero-size param has nothing to send (an empty step)."""
  all_leaves, treedef = jax.tree.flatten(params)
  carried = wire.CarriedLeaves(all_leaves)
  leaves = carried.pick(all_leaves)
  layout = sparseloco_layout(
    leaves, compression_topk=cfg.topk, compression_chunk=cfg.chunk, value_bits=cfg.bits
  )
  plans = [_plan(x, cfg.chunk) for x in leaves]
  if leaves:
    _check_errors(carried.pick(treedef.flatten_up_to(state.error_feedback)), plans)
  return _Round(treedef, carried, all_leaves, leaves, layout, plans)


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
) -> optax.GradientTransformation:
  """SparseLoCo: H local steps of ``inner``, then a compressed, error-fed outer step.

  On every step, the worker's gradient (taken at
  :func:`distro_jax.inner_params`) moves its own inner params by ``inner``.
  Every ``sync_every``-th step each worker computes ``d = outer - inner``,
  updates ``e <- error_decay * e + chunks(d)``, keeps the ``compression_topk``
  largest-magnitude entries of each chunk of ``e``, quantizes them to
  ``value_bits`` bits, subtracts the quantized values from ``e``, and
  all-gathers the message (see the module docstring for the quantizer and the
  wire). Every worker then decodes all W messages, optionally clips each to the
  median norm, averages them over W, and sets ``outer <- outer - outer_lr *
  mean``; it restarts its inner params there. Between synchronizations the
  update of the outer params is zero, so replicas stay identical.

  Args:
    inner: the inner optimizer, e.g. ``optax.adamw(lr)``; its state is per
      worker and carries on across synchronizations.
    sync_every: inner steps between synchronizations (H). Static.
    outer_learning_rate: the outer step size (1.0 in the paper).
    error_decay: the error-feedback decay in ``[0, 1]`` (0.95 in the paper).
    compression_topk: entries kept per chunk, clamped to the chunk size. Static.
    compression_chunk: chunk length target per axis; 64 gives 64x64 chunks of
      4,096 entries for large matrices. Static.
    value_bits: 2 (the paper's), 1, or ``None`` to send the values in the
      parameter dtype. Static.
    use_dct: select entries in the chunked DCT domain (as DeMo does) instead of
      the raw chunks (the paper's production form). Static.
    clip_to_median_norm: scale each worker's contribution, per tensor, to at
      most the median norm across workers, as Templar's production does.
      Static.
    axis_name: the data-parallel axis bound by an enclosing ``jax.shard_map``;
      ``None`` for one worker and no collective.

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
  cfg = _config(
    inner,
    sync_every,
    outer_learning_rate,
    error_decay,
    compression_topk,
    compression_chunk,
    value_bits,
    use_dct,
    clip_to_median_norm,
    axis_name,
  )

  def init_fn(params):
    dct.refuse_non_float(params, "SparseLoCo", "top-k by magnitude and quantizer")
    return SparseLocoState(
      count=jnp.zeros([], jnp.int32),
      local_params=jax.tree.map(jnp.asarray, params),
      inner_state=inner.init(params),
      error_feedback=jax.tree.map(dct.in_place_zeros, params),
      contributors=jnp.zeros([], jnp.int32),
    )

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(
        "dj.sparseloco needs the outer params: call tx.update(grads, state, params)."
      )
    everyone = jnp.full([], exchange.bound_axis_size(axis_name), jnp.int32)
    steps, inner_state = inner.update(updates, state.inner_state, state.local_params)
    local = optax.apply_updates(state.local_params, steps)
    count = optax.safe_increment(state.count)
    rnd = _round(params, state, cfg)
    if not rnd.leaves:
      # Nothing to exchange (an empty tree, or optax.masked selecting nothing).
      return updates, SparseLocoState(count, local, inner_state, state.error_feedback, everyone)

    def synchronize(local, errors, inner_state):
      return _synchronize(cfg, rnd, params, local, errors, inner_state)

    def keep_going(local, errors, inner_state):
      return jax.tree.map(jnp.zeros_like, params), local, errors, inner_state, everyone

    # A cond, not a select: the all-gather must run only on synchronizing steps.
    # Both branches must return the buffer typed alike, and the synchronizing
    # one makes it differ by worker, so it enters as such (else tracing it from
    # a shared buffer, as dj.worker_state_specs does first, fails).
    errors = exchange.worker_local(state.error_feedback, axis_name)
    outer_updates, local, errors, inner_state, contributors = jax.lax.cond(
      count % cfg.sync_every == 0, synchronize, keep_going, local, errors, inner_state
    )
    return outer_updates, SparseLocoState(count, local, inner_state, errors, contributors)

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
  """
  bits = _check_value_bits(value_bits)
  sync_every = static_positive_int("sync_every", sync_every, example=30)
  layout = sparseloco_layout(
    params,
    compression_topk=static_positive_int("compression_topk", compression_topk, example=64),
    compression_chunk=static_positive_int("compression_chunk", compression_chunk, example=64),
    value_bits=bits,
  )
  leaves = jax.tree.leaves(params)
  numel = sum(math.prod(np.shape(x)) for x in leaves)
  grad = sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in leaves)
  return SparseLocoBytes(
    payload=layout.num_bytes,
    per_step=layout.num_bytes / sync_every,
    grad_bf16=2 * numel,
    grad_fp32=4 * numel,
    grad=grad,
    ring_allreduce=2 * (num_workers - 1) / num_workers * grad,
    num_workers=num_workers,
    sync_every=sync_every,
  )
