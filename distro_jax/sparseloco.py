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

__all__ = ["SparseLocoBytes", "SparseLocoState", "sparseloco", "sparseloco_bytes"]


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
    layout: the message's :class:`~distro_jax.codec.WireLayout`.
    plans: per carried leaf, its :class:`~distro_jax.dct.ChunkPlan`.
    modes: per carried leaf, how its mean becomes a step
      (:func:`distro_jax.unit_rms.normalized_step`), or ``None`` for the mean
      itself.
  """

  treedef: Any
  carried: wire.CarriedLeaves
  all_leaves: list[jax.Array]
  leaves: list[jax.Array]
  layout: codec.WireLayout
  plans: list[dct.ChunkPlan]
  modes: list[Any]


def _quantized(
  out: compress.Compressed, fmt: message.MessageFormat
) -> tuple[list[jax.Array], list[jax.Array]]:
  """The values as receivers decode them, and the buffer with those taken out.

  What the quantizer loses stays in the buffer, so a later round sends it.
  The encoder quantizes the same values by the same operations, which the
  step's program computes once.
  """
  received = fmt.as_received(out.selection, jnp.asarray(True))
  sent = [values[0] for _, values in received.tensors]
  picked = zip(out.momentum, out.selection.indices, out.selection.values, sent)
  return sent, [codec.scatter_blocks(m, idx, val - s) for m, idx, val, s in picked]


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
) -> message.MessageFormat:
  """The round's message format: the top-k and its indices, or positions drawn from a key."""
  ks = tuple(t.k for t in rnd.layout.tensors)
  if not cfg.drawn:
    return message.MessageFormat(rnd.layout, message.TopK(ks), cfg.basis)
  block_shapes = [plan.block_shape for plan in rnd.plans]
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
    sent, kept = out.selection.values, out.kept
  else:
    sent, kept = _quantized(out, fmt)
  finite = exchange.all_finite([*pseudo, *sent])
  received = delivery.deliver(fmt, out.selection, finite, cfg.axis_name)
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
) -> codec.WireLayout:
  """The message's layout: the top-k with its indices and codes, or DeMo's drawn one."""
  return wire.wire_layout(
    leaves,
    compression_topk=topk,
    compression_chunk=chunk,
    quantize_1bit=drawn and bits == 1,
    random_positions=drawn,
    codebook_bits=None if drawn else bits,
  )


def _round(params: Any, state: SparseLocoState, cfg: _Config) -> _Round:
  """This update's :class:`_Round`; a zero-size param has nothing to send (an empty step)."""
  all_leaves, treedef = jax.tree.flatten(params)
  carried = wire.CarriedLeaves(all_leaves)
  leaves = carried.pick(all_leaves)
  layout = _layout(leaves, cfg.topk, cfg.chunk, cfg.bits, cfg.drawn)
  plans = wire.plan_tree(leaves, cfg.chunk)
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
