"""DeMo and DisTrO as optax transformations.

:func:`scale_by_demo` is the communication step, a pipeline of named stages
(docs/library.md, "The pipeline"): **compress** (:mod:`distro_jax.compress`)
folds the gradient into the decoupled momentum and selects the message;
**exchange** (:mod:`distro_jax.delivery`) all-gathers the messages; **decode**
(:mod:`distro_jax.decode`) averages them into ``Q``, the same on every worker.
The fourth stage, **normalize**, is the transformation chained after it:
:func:`demo`'s ``sign(Q)`` (or a step of :mod:`distro_jax.unit_rms`), or any
optax transformation in :func:`distro`.
"""

import functools
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from distro_jax import (
  compress,
  dct,
  decode,
  delivery,
  dense_step,
  exchange,
  message,
  unit_rms,
  wire,
)
from distro_jax.aggregate_momentum import scale_by_muon_momentum
from distro_jax.compression import Compression, takes_compression
from distro_jax.hyperparams import (
  StaticFloat,
  check_decay,
  check_learning_rate,
  unwrap_static,
)
from distro_jax.shared_estimate import EstimateState, track_shared_estimate

__all__ = [
  "DemoState",
  "demo",
  "distro",
  "distro_adamw",
  "scale_by_demo",
]


class DemoState(NamedTuple):
  """State of :func:`scale_by_demo`; it differs from worker to worker.

  Attributes:
    count: number of updates applied, int32 scalar.
    momentum: per parameter, the decoupled momentum in the chunked DCT basis,
      float32, in the parameter's shape (``(1,)`` for a scalar) with each
      chunk's coefficients in place (docs/design.md, section 1). With
      ``delayed_apply`` it is kept before the pending message's error
      feedback (what the lookahead reads). A worker whose values were not
      finite restarts from zero.
    contributors: how many workers' messages went into the last aggregate
      (with ``delayed_apply``, the previous step's; 0 at step 1).
    pending: with ``delayed_apply``, this worker's message of the previous
      step, ``uint8[message bytes]``, all zeros (invalid) before the first
      step; ``None`` otherwise.
  """

  count: jax.Array
  momentum: Any
  contributors: jax.Array
  pending: jax.Array | None = None


def is_delayed_state(x: Any) -> bool:
  """Whether ``x`` is the :class:`DemoState` of a ``delayed_apply`` exchange (or its specs)."""
  return isinstance(x, DemoState) and x.pending is not None


def delayed_states(opt_state: Any) -> list[DemoState]:
  """Every ``delayed_apply`` :class:`DemoState` in ``opt_state``, in tree order."""
  return [x for x in jax.tree.leaves(opt_state, is_leaf=is_delayed_state) if is_delayed_state(x)]


def _check_trees(updates: Any, params: Any) -> None:
  if params is None:
    return
  u_def, p_def = jax.tree.structure(updates), jax.tree.structure(params)
  if u_def != p_def:
    raise ValueError(
      "The gradient tree does not match the parameter tree. Pass gradients "
      "computed with respect to exactly these params, e.g. "
      "jax.grad(loss)(params).\n"
      f"  gradients: {u_def}\n  params:    {p_def}"
    )
  with_path = jax.tree_util.tree_flatten_with_path(updates)[0]
  for (path, g), p in zip(with_path, jax.tree.leaves(params)):
    if np.shape(g) != np.shape(p):
      raise ValueError(
        f"Gradient {jax.tree_util.keystr(path)} has shape {np.shape(g)} but its parameter has "
        f"shape {np.shape(p)}. Gradients must have the shapes of the params."
      )


def _check_momentum(updates: Any, momenta: list[Any], plans: list[dct.ChunkPlan]) -> None:
  for (path, _), m, plan in zip(jax.tree_util.tree_flatten_with_path(updates)[0], momenta, plans):
    if np.shape(m) != plan.state_shape:
      raise ValueError(
        f"DemoState.momentum{jax.tree_util.keystr(path)} has shape {np.shape(m)}, but its "
        f"parameter needs {plan.state_shape} (the param's own shape, (1,) for a scalar). "
        "The state was built for other params, or by an older distro_jax that kept one row "
        "per chunk; build it again with tx.init(params) (or dj.init_worker_state), or "
        "convert an old momentum m with dj.dct.from_chunks(m, dj.dct.plan_chunks(shape, chunk))."
      )


class _Options(NamedTuple):
  """:func:`scale_by_demo`'s options, checked. Static."""

  compression: Compression
  axis_name: Hashable | None
  delayed_apply: bool
  collective: str


def _options(
  learning_rate: Any,
  compression: Compression,
  axis_name: Hashable | None,
  delayed_apply: bool,
  collective: str,
) -> _Options:
  check_learning_rate("learning_rate", learning_rate)
  collective = exchange.check_collective(collective)
  if delayed_apply and not compression.error_feedback:
    raise ValueError(
      "error_feedback=False is built for the plain exchange; with delayed_apply=True the "
      "message in flight is fed back a step late. Use error_feedback=True there."
    )
  if delayed_apply and unwrap_static(compression.sent_keep):
    raise ValueError(
      f"sent_keep={unwrap_static(compression.sent_keep)} is built for the plain exchange; with "
      "delayed_apply=True the message in flight is fed back whole, a step late. Drop sent_keep."
    )
  return _Options(compression.checked(), axis_name, bool(delayed_apply), collective)


def _without_empty(update: Callable[..., Any], updates, state, params, **extra_args):
  """``update`` on the nonempty tensors; a zero-size one, in no message, gets an empty update."""
  _check_trees(updates, params)
  grads, treedef = jax.tree.flatten(updates)
  carried = wire.CarriedLeaves(grads)
  if carried.all:
    return update(updates, state, params, **extra_args)
  momenta = treedef.flatten_up_to(state.momentum)
  p_leaves = grads if params is None else treedef.flatten_up_to(params)
  sub_params = None if params is None else carried.pick(p_leaves)
  sub_state = state._replace(momentum=carried.pick(momenta))
  q, sub_state = update(carried.pick(grads), sub_state, sub_params, **extra_args)
  empty = lambda gp: jnp.zeros(np.shape(gp[0]), gp[1].dtype)
  q = carried.with_empty(q, list(zip(grads, p_leaves)), empty)
  momenta = carried.merge(sub_state.momentum, momenta)
  return treedef.unflatten(q), sub_state._replace(momentum=treedef.unflatten(momenta))


class _Tensors(NamedTuple):
  """What one update knows of its tensors before it computes anything.

  ``shapes`` holds the updates' shapes with the params' dtypes (the values'
  width on the wire); ``momentum_blocks`` the ``momenta`` in their block views,
  where all param-sized work reads them in place; ``site_axes`` the mesh axes
  besides the workers' that the gradients vary over (FSDP within a site).
  """

  lr: Any
  shapes: list[jax.ShapeDtypeStruct]
  plans: list[dct.ChunkPlan]
  momenta: list[jax.Array]
  momentum_blocks: list[jax.Array]
  site_axes: list[Hashable]


def _tensors(updates, state, params, learning_rate, opts: _Options) -> _Tensors:
  """This update's :class:`_Tensors`, the state's momenta checked against the params."""
  grads, treedef = jax.tree.flatten(updates)
  dtypes_from = jax.tree.leaves(params) if params is not None else grads
  shapes = [jax.ShapeDtypeStruct(np.shape(g), x.dtype) for g, x in zip(grads, dtypes_from)]
  plans = wire.plan_tree(shapes, opts.compression.compression_chunk)
  momenta = treedef.flatten_up_to(state.momentum)
  _check_momentum(updates, momenta, plans)
  varying = frozenset().union(*(exchange.varying_axes(g) for g in grads))
  return _Tensors(
    lr=learning_rate(state.count) if callable(learning_rate) else learning_rate,
    shapes=shapes,
    plans=plans,
    momenta=momenta,
    momentum_blocks=[dct.to_blocks(m, plan) for m, plan in zip(momenta, plans)],
    site_axes=sorted(varying - {opts.axis_name}, key=str),
  )


def _message_format(count, grads, tensors: _Tensors, opts: _Options) -> message.MessageFormat:
  """This step's message format: its bytes, its positions (top-k or drawn) and its basis."""
  c = opts.compression
  layout = c.layout(tensors.shapes)
  ks = tuple(t.k for t in layout.tensors)
  if c.random_positions:
    block_shapes = [plan.block_shape for plan in tensors.plans]
    positions = message.drawn(
      count, opts.axis_name, grads, tensors.site_axes, block_shapes, ks, c.frequency_bias
    )
  else:
    positions = message.TopK(ks)
  return message.MessageFormat(layout, positions, c.basis)


def _verdict(
  selection: message.Selection, site_axes: list[Hashable], contribute: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
  """``(finite, send)``: whether this worker's values are finite, and whether it sends.

  A non-finite gradient spreads over all its chunk's coefficients, so checking
  the selection catches it; such a worker sends an invalid message and restarts
  from zero momentum. ``contribute=False`` (a cold start) also sends an invalid
  message, but keeps the momentum whole.
  """
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in selection.values]))
  if site_axes:
    # The shards of one worker agree on the flag, so a worker is left out
    # whole and the count of contributors is the same on every device.
    finite = jax.lax.pmin(finite.astype(jnp.int32), tuple(site_axes)) > 0
  send = finite if contribute is None else jnp.logical_and(finite, contribute)
  return finite, send


@takes_compression
def scale_by_demo(
  learning_rate: optax.ScalarOrSchedule,
  *,
  axis_name: Hashable | None = "data",
  delayed_apply: bool = False,
  collective: str = "all_gather",
  **compression: Any,
) -> optax.GradientTransformationExtraArgs:
  """Decoupled momentum, compressed and exchanged; yields the aggregate ``Q``.

  Per tensor, on every worker: ``m <- decay * m + lr * g``; take the chunked
  DCT of ``m``; keep the top-k coefficients of every chunk (or the drawn
  positions); remove them from ``m`` (error feedback); all-gather every
  worker's message; average each coefficient over the workers that chose it;
  and return ``Q = IDCT(aggregate)``, identical on every worker. Only the
  message crosses ``axis_name``; a zero-size param gets an empty update.

  Args:
    learning_rate: a float or an optax schedule, folded into the momentum as
      the reference does.
    axis_name: the workers' axis, bound by an enclosing ``jax.shard_map``;
      ``None`` for one worker and no collective.
    delayed_apply: the overlapped exchange: step t all-gathers the message
      that step t-1 compressed (:attr:`DemoState.pending`) and returns its
      aggregate, so the all-gather depends on nothing computed from step t's
      gradient. The first step returns zeros. Static.
    collective: how the messages travel: ``"all_gather"``, or ``"all_to_all"``,
      each message straight to every peer in one hop, for far links (inside a
      ``jax.shard_map`` built with ``check_vma=False``;
      :func:`distro_jax.exchange.all_gather_messages`). Static.
    **compression: the fields of :class:`~distro_jax.Compression` by name.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`DemoState`. Its ``update`` takes two extra keywords:
    ``contribute``, a per-worker bool that, when false, sends this worker's
    message marked invalid while its momentum keeps what it would have sent
    (an elastic cold start); and, with ``delayed_apply``, ``gathered``: the
    messages in flight as :func:`distro_jax.gather_pending` all-gathered them
    in a program of their own (:mod:`distro_jax.overlap`).

  References:
    Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization",
    arXiv:2411.19870, 2024.

  Example:
    >>> import jax.numpy as jnp, distro_jax as dj
    >>> tx = dj.scale_by_demo(0.1, axis_name=None)
    >>> params = {"w": jnp.ones((4, 8))}
    >>> state = tx.init(params)
    >>> q, state = tx.update({"w": jnp.ones((4, 8))}, state, params)
    >>> q["w"].shape
    (4, 8)
  """
  opts = _options(learning_rate, Compression.of(compression), axis_name, delayed_apply, collective)
  return _demo_stage(learning_rate, opts)


def _demo_stage(
  learning_rate: optax.ScalarOrSchedule, opts: _Options
) -> optax.GradientTransformationExtraArgs:
  """:func:`scale_by_demo` with its options checked."""
  axis_name = opts.axis_name
  decay = opts.compression.compression_decay
  feed_back = opts.compression.error_feedback

  def init_fn(params):
    dct.refuse_non_float(params, "DeMo", "DCT, top-k by magnitude and sign step")
    zero = jnp.zeros([], jnp.int32)
    pending = None
    if opts.delayed_apply:
      # All zeros marks the message invalid, so the first step applies nothing.
      pending = jnp.zeros((opts.compression.layout(params).num_bytes,), jnp.uint8)
    momentum = jax.tree.map(dct.in_place_zeros, params)
    return DemoState(count=zero, momentum=momentum, contributors=zero, pending=pending)

  def update_carried(updates, state, params, *, contribute=None, gathered=None, **extra_args):
    del extra_args  # Other transformations' arguments, passed along by optax.chain.
    num_workers = exchange.bound_axis_size(axis_name)
    grads, treedef = jax.tree.flatten(updates)
    if not grads:
      # Nothing to compress (an empty tree, or optax.masked selecting nothing):
      # no message, and no worker failed.
      everyone = jnp.full([], num_workers, jnp.int32)
      return updates, state._replace(count=optax.safe_increment(state.count), contributors=everyone)
    tensors = _tensors(updates, state, params, learning_rate, opts)
    fmt = _message_format(state.count, grads, tensors, opts)
    schedule = delivery.schedule(axis_name, num_workers, opts.delayed_apply, opts.collective)
    momentum_blocks = schedule.feed_back(tensors.momentum_blocks, state, fmt)
    compressed = compress.compress(
      grads,
      momentum_blocks,
      tensors.plans,
      fmt,
      tensors.lr,
      decay,
      feed_back=feed_back,
      keep=opts.compression.sent_keep,
    )
    finite, send = _verdict(compressed.selection, tensors.site_axes, contribute)
    received, pending = schedule.exchange(fmt, compressed.selection, send, state, gathered)
    q_blocks = decode.aggregate(received, compressed.kept, tensors.plans, fmt.basis, axis_name)
    directions = decode.to_params(q_blocks, tensors.plans, tensors.shapes, grads, tensors.site_axes)
    contributors = decode.contributors(received, tensors.site_axes)
    momenta = schedule.next_momentum(
      compressed, tensors.momenta, tensors.plans, finite, send, contributors, contribute
    )
    count = optax.safe_increment(state.count)
    new_state = DemoState(count, treedef.unflatten(momenta), contributors, pending)
    return treedef.unflatten(directions), new_state

  def update_fn(updates, state, params=None, **extra_args):
    dense_step.warn_if_dense(jax.tree.leaves(updates), axis_name)
    return _without_empty(update_carried, updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _skip_when_nothing_received(
  tx: optax.GradientTransformation, *, delayed_apply: bool = False
) -> optax.GradientTransformationExtraArgs:
  """Makes a step whose every message was left out a no-op but for ``contributors``, 0.

  ``tx`` is a chain whose first state is a :class:`DemoState`; the rest of it
  would still act on the empty aggregate (weight decay would shrink the params,
  Adam's moments would decay). With ``delayed_apply`` this step's gradient is
  already in the momentum and the next message, so only the rest is held.
  """
  tx = optax.with_extra_args_support(tx)

  def update_fn(updates, state, params=None, **extra_args):
    new_updates, new_state = tx.update(updates, state, params, **extra_args)
    received = _exchange_state(new_state[0]).contributors > 0
    # Selects on the updates, and on state that the rest of the chain computes
    # elementwise, fuse into what computes or consumes them; DeMo's momentum is
    # param-sized and materialized, so scale_by_demo holds it itself.
    new_updates = jax.tree.map(lambda u: jnp.where(received, u, jnp.zeros_like(u)), new_updates)
    hold = lambda new, old: jax.tree.map(lambda n, o: jnp.where(received, n, o), new, old)
    demo_new, demo_old = new_state[0], state[0]
    if not delayed_apply:
      # contributors stays this step's 0, so a caller sees that every worker
      # was left out (the driver logs W - contributors as excluded).
      exchanged = _exchange_state(demo_new)
      exchanged = exchanged._replace(count=hold(exchanged.count, _exchange_state(demo_old).count))
      if isinstance(demo_new, EstimateState):
        # As DeMo's momentum is: a step with no message changes no state.
        demo_new = EstimateState(exchanged, *hold(tuple(demo_new[1:]), tuple(demo_old[1:])))
      else:
        demo_new = exchanged
    return new_updates, (demo_new, *hold(new_state[1:], state[1:]))

  return optax.GradientTransformationExtraArgs(tx.init, update_fn)


def _exchange_state(state: Any) -> DemoState:
  """The :class:`DemoState` of the first stage, bare or inside an :class:`EstimateState`."""
  return state.exchange if isinstance(state, EstimateState) else state


def _normalization(normalize: Any, axis_name: Hashable | None) -> optax.GradientTransformation:
  """The normalize stage: how ``Q`` becomes a step (``sign``, or :mod:`distro_jax.unit_rms`'s)."""
  unit_rms.check_normalize(normalize)
  if normalize == "sign":
    return optax.scale_by_sign()
  return unit_rms.scale_by_normalize(normalize, axis_name)


def _momentum_stage(name: str, decay: float) -> list[optax.GradientTransformation]:
  """A momentum stage of ``demo``'s inner chain (``name``), if ``decay`` asks for one."""
  momentum = unwrap_static(decay)
  check_decay(
    name,
    momentum,
    one_allowed=False,
    hint=f"Use 0 for no {name}, or e.g. 0.95 (Muon's decay).",
  )
  # An injected (traced) momentum may be anything at run time, so it gets the state.
  if not isinstance(momentum, int | float) or momentum > 0:
    return [scale_by_muon_momentum(momentum)]
  return []


@takes_compression
def demo(
  learning_rate: optax.ScalarOrSchedule,
  *,
  weight_decay: float = 0.0,
  axis_name: Hashable | None = "data",
  delayed_apply: bool = False,
  synchronous: Any = None,
  collective: str = "all_gather",
  normalize: Any = "sign",
  aggregate_momentum: float = StaticFloat(0.0),
  step_momentum: float = StaticFloat(0.0),
  estimate_step: float = StaticFloat(0.0),
  **compression: Any,
) -> optax.GradientTransformationExtraArgs:
  """DeMo: ``p <- p * (1 - lr * wd) - lr * sign(Q)``, with ``Q`` from :func:`scale_by_demo`.

  :func:`distro` of ``optax.chain(normalize, optax.add_decayed_weights,
  optax.scale_by_learning_rate)``. Call its ``update`` inside
  ``jax.shard_map`` over a mesh that binds ``axis_name``, with each worker's
  local gradients; each worker's state is its own
  (:func:`distro_jax.init_worker_state`).

  Args:
    learning_rate: a float or an optax schedule.
    weight_decay: decoupled weight decay, scaled by the learning rate.
    normalize: how ``Q`` becomes a step: ``"sign"`` (DeMo's), ``"rms"`` (each
      tensor at unit root mean square) or ``"orth"`` (each matrix
      orthogonalized as Muon does, :func:`distro_jax.orthogonalize`; other
      tensors at unit RMS); or a tree of these like the params (or a prefix),
      or a function of the params giving one. Static.
    aggregate_momentum: the decay of a Nesterov momentum on the decoded
      aggregate before ``normalize`` (:func:`distro_jax.scale_by_muon_momentum`),
      the same on every worker; 0 keeps none.
    step_momentum: the decay of the same momentum on the step ``normalize``
      made, so each step's orthogonalized (or signed) aggregate is averaged
      over the steps before it; 0 keeps none.
    axis_name: as in :func:`distro`.
    delayed_apply: as in :func:`distro`.
    synchronous: as in :func:`distro`.
    collective: as in :func:`distro`.
    estimate_step: as in :func:`distro`.
    **compression: the fields of :class:`~distro_jax.Compression` by name.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  References:
    Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization",
    arXiv:2411.19870, 2024.

  Example:
    >>> import jax, jax.numpy as jnp, optax, distro_jax as dj
    >>> tx = dj.demo(1e-3, axis_name=None)
    >>> params = {"w": jnp.ones((64, 64))}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones((64, 64))}, state, params)
    >>> params = optax.apply_updates(params, updates)
  """
  inner = optax.chain(
    *_momentum_stage("aggregate_momentum", aggregate_momentum),
    _normalization(normalize, axis_name),
    *_momentum_stage("step_momentum", step_momentum),
    optax.add_decayed_weights(weight_decay),
    optax.scale_by_learning_rate(learning_rate),
  )
  return distro(
    inner,
    learning_rate,
    axis_name=axis_name,
    delayed_apply=delayed_apply,
    synchronous=synchronous,
    collective=collective,
    estimate_step=estimate_step,
    **compression,
  )


@takes_compression
def distro(
  inner: optax.GradientTransformation,
  learning_rate: optax.ScalarOrSchedule,
  *,
  axis_name: Hashable | None = "data",
  delayed_apply: bool = False,
  synchronous: Any = None,
  collective: str = "all_gather",
  estimate_step: float = StaticFloat(0.0),
  **compression: Any,
) -> optax.GradientTransformationExtraArgs:
  """DisTrO: the compressed exchange of :func:`scale_by_demo`, then ``inner``.

  ``inner`` sees the same aggregate ``Q`` on every worker, so its state and
  its updates stay identical across replicas.

  With ``delayed_apply`` and ``synchronous``, a partial overlap: the params
  that ``synchronous`` selects are exchanged without the delay, the others
  one step late. It is ``optax.multi_transform`` over two exchanges, each
  with its own message, all-gather and copy of ``inner`` (so ``inner`` must
  act on each param on its own, as ``sign`` and AdamW do); the lookahead of
  :func:`distro_jax.gradient_point` then moves only the overlapped params.

  Args:
    inner: any optax transformation that turns ``Q`` into updates, for example
      ``optax.adamw(lr)``.
    learning_rate: the rate folded into the momentum (a float or schedule),
      normally the one ``inner`` uses.
    axis_name: the data-parallel axis; ``None`` for one worker, no collective.
    delayed_apply: apply step t-1's aggregate at step t, so that the
      all-gather can overlap the next forward and backward pass
      (:func:`scale_by_demo`). Static.
    synchronous: with ``delayed_apply``, the params exchanged in the step that
      computes them: a tree of bools like the params (or a prefix of it), or a
      function of the params that returns one; ``None`` overlaps every param.
      Static.
    collective: how the messages travel (:func:`scale_by_demo`). Static.
    estimate_step: above 0, the exchange corrects a shared estimate of the
      workers' mean momentum that every worker keeps alike, and ``inner``
      sees that estimate (:func:`distro_jax.track_shared_estimate`). Not with
      ``delayed_apply``. Static.
    **compression: the fields of :class:`~distro_jax.Compression` by name.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import jax.numpy as jnp, optax, distro_jax as dj
    >>> tx = dj.distro(optax.adamw(1e-3), 1e-3, axis_name=None)
    >>> state = tx.init({"w": jnp.ones((8,))})

    A partial overlap: ``w`` exchanged in its own step, ``b`` one step late.

    >>> params = {"w": jnp.ones((64, 64)), "b": jnp.ones((64,))}
    >>> tx = dj.demo(1e-3, axis_name=None, delayed_apply=True, synchronous={"w": True, "b": False})
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state, params)
    >>> float(jnp.abs(updates["w"]).max()) > 0, float(jnp.abs(updates["b"]).max()) > 0
    (True, False)
  """
  c = Compression.of(compression)
  estimate = _estimate(estimate_step, c)
  if estimate is not None and delayed_apply:
    raise ValueError(
      "estimate_step > 0 corrects the estimate with this step's messages; with "
      "delayed_apply=True they arrive a step late. Use delayed_apply=False, or estimate_step=0."
    )
  if synchronous is not None:
    if not delayed_apply:
      raise ValueError(
        "synchronous= picks the params that a delayed_apply=True exchange still sends in "
        "the step that computes them; without delayed_apply every param is synchronous "
        "already. Pass delayed_apply=True, or leave synchronous=None."
      )
    # Two exchanges, one per group, each a whole DisTrO of its own, so a tensor
    # trains as it would in a run with its group's mode.
    group = functools.partial(
      distro, inner, learning_rate, axis_name=axis_name, collective=collective, **compression
    )
    groups = {_SYNCHRONOUS: group(delayed_apply=False), _OVERLAPPED: group(delayed_apply=True)}
    return optax.multi_transform(groups, functools.partial(_overlap_labels, synchronous))
  rate = learning_rate
  if estimate is not None:
    # A stateless exchange at rate 1 corrects the estimate, which keeps the momentum.
    rate, c = 1.0, c._replace(compression_decay=0.0)
  stage = _demo_stage(rate, _options(rate, c, axis_name, delayed_apply, collective))
  if estimate is not None:
    decay, step = estimate
    stage = track_shared_estimate(stage, decay=decay, step=step, axis_name=axis_name)
  return _skip_when_nothing_received(optax.chain(stage, inner), delayed_apply=delayed_apply)


def _estimate(estimate_step: Any, compression: Compression) -> tuple[float, float] | None:
  """``estimate_step`` checked: ``(momentum decay, step)`` for the estimate, or ``None``."""
  step = unwrap_static(estimate_step)
  if not isinstance(step, int | float) or step < 0:
    raise ValueError(
      f"estimate_step={step!r} must be a static number >= 0: 0 for DeMo's exchange, "
      "or e.g. 0.5 to step along a shared estimate of the mean momentum."
    )
  if step == 0:
    return None
  decay = unwrap_static(compression.compression_decay)
  check_decay(
    "compression_decay",
    decay,
    one_allowed=False,
    hint="With estimate_step it is each worker's momentum decay, e.g. 0.95 (Muon's).",
  )
  return decay, float(step)


_SYNCHRONOUS, _OVERLAPPED = "synchronous", "overlapped"


def _overlap_labels(synchronous: Any, params: Any) -> Any:
  """``synchronous``'s mask of ``params`` as :func:`distro`'s group labels."""
  mask = synchronous(params) if callable(synchronous) else synchronous
  try:
    return jax.tree.map(lambda sync, _: _SYNCHRONOUS if sync else _OVERLAPPED, mask, params)
  except ValueError as e:
    raise ValueError(
      "synchronous= must be a tree of bools with the params' structure, or a prefix of "
      f"it (or a function of the params that returns one): {e}"
    ) from None


@takes_compression
def distro_adamw(
  learning_rate: optax.ScalarOrSchedule,
  *,
  b1: float = 0.9,
  b2: float = StaticFloat(0.999),
  eps: float = 1e-8,
  weight_decay: float = 0.0,
  axis_name: Hashable | None = "data",
  delayed_apply: bool = False,
  synchronous: Any = None,
  collective: str = "all_gather",
  **compression: Any,
) -> optax.GradientTransformationExtraArgs:
  """DisTrO-AdamW: the compressed exchange followed by ``optax.adamw``.

  Args:
    learning_rate: a float or an optax schedule, used by both parts.
    b1: Adam's first-moment decay.
    b2: Adam's second-moment decay.
    eps: Adam's epsilon.
    weight_decay: AdamW's decoupled weight decay.
    axis_name: as in :func:`distro`.
    delayed_apply: as in :func:`distro`.
    synchronous: as in :func:`distro`.
    collective: as in :func:`distro`.
    **compression: the fields of :class:`~distro_jax.Compression` by name.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  References:
    Nous Research, "A Preliminary Report on DisTrO", 2024.
  """
  return distro(
    optax.adamw(learning_rate, b1=b1, b2=unwrap_static(b2), eps=eps, weight_decay=weight_decay),
    learning_rate,
    axis_name=axis_name,
    delayed_apply=delayed_apply,
    synchronous=synchronous,
    collective=collective,
    **compression,
  )
