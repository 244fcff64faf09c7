"""DeMo and DisTrO as optax transformations.

:func:`scale_by_demo` is the whole communication step: decoupled momentum,
chunked DCT, top-k, error feedback, one all-gather of the compressed message,
and the decoded aggregate ``Q``. :func:`demo` follows it with ``sign`` as the
reference does; :func:`distro` follows it with any optax transformation.
"""

import functools
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from distro_jax import codec, cpu_kernels, dct, exchange, kernels, unit_rms, wire
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
    momentum: per parameter, the decoupled momentum in the chunked DCT domain,
      float32, with the parameter's shape (``(1,)`` for a scalar): each chunk's
      coefficients sit in that chunk's own place (the in-place layout of
      :mod:`distro_jax.dct`; ``dj.dct.to_chunks(m, plan)`` gives one row per
      chunk). So ``optax.tree_map_params`` and a param's ``PartitionSpec``
      place it, and a sharding that keeps chunks whole keeps it local. The DCT
      is orthonormal, so this is the reference's buffer ``m`` in another basis,
      and error feedback is exactly "zero the coefficients that were sent".
      With ``delayed_apply`` it is kept *before* the error feedback of the
      pending message (the next update removes the coefficients that message
      sends), so it is the buffer Psyche's lookahead reads
      (:func:`distro_jax.gradient_point`).
      A worker whose values were not finite restarts from zero; without
      ``delayed_apply``, a step in which every worker's message was left out
      for non-finite values leaves every momentum as it was (one held back
      with ``contribute=False`` still takes in its gradient).
    contributors: how many workers' messages went into the last aggregate;
      those whose values were not finite are left out (so ``W - contributors``
      were excluded). int32 scalar, the same on every worker. With
      ``delayed_apply`` it counts the previous step's messages, and step 1,
      which has none, counts 0.
    pending: with ``delayed_apply``, this worker's message of the previous
      step, ``uint8[message bytes]``, to be all-gathered at the next step;
      ``None`` otherwise. Before the first step it is all zeros, which marks it
      invalid, so the first step applies nothing.
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
  for path_u, g, p in zip(
    jax.tree_util.tree_flatten_with_path(updates)[0],
    jax.tree.leaves(updates),
    jax.tree.leaves(params),
  ):
    if np.shape(g) != np.shape(p):
      name = jax.tree_util.keystr(path_u[0])
      raise ValueError(
        f"Gradient {name} has shape {np.shape(g)} but its parameter has shape "
        f"{np.shape(p)}. Gradients must have the shapes of the params."
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


def _feed_back_pending(
  momentum_blocks: list[jax.Array],
  pending: jax.Array | None,
  layout: codec.WireLayout,
  positions: list[jax.Array] | None = None,
) -> list[jax.Array]:
  """Error feedback of the message in flight: what it sends leaves the momentum.

  With ``delayed_apply`` the state keeps the momentum as it was before the
  message was cut from it, and this step removes the sent coefficients, read
  back from the worker's own pending message (whose drawn ``positions`` are
  passed when the layout draws them). A message marked invalid (the first
  step, a worker that failed) sent nothing, so nothing is removed.
  """
  if pending is None or pending.shape != (layout.num_bytes,):
    return momentum_blocks  # update_fn refuses this state with a clear message
  tensors, valid = codec.decode_message(pending, layout, positions)
  out = []
  for m, (idx, _) in zip(momentum_blocks, tensors):
    idx = idx.reshape(*m.shape[:-3], m.shape[-2], idx.shape[-1])
    # Zero where the message was valid, else write back what is there.
    values = jnp.where(valid, 0.0, codec.gather_blocks(m, idx))
    out.append(codec.scatter_blocks(m, idx, values))
  return out


def _check_gathered(gathered: Any, num_workers: int, num_bytes: int) -> None:
  want = (num_workers, num_bytes)
  if np.shape(gathered) != want or jnp.asarray(gathered).dtype != jnp.uint8:
    raise ValueError(
      f"gathered has shape {np.shape(gathered)} and dtype {jnp.asarray(gathered).dtype}, but "
      f"this exchange's messages in flight are uint8{list(want)} ({num_workers} workers x "
      f"{num_bytes} bytes). Pass what dj.gather_pending(opt_state, axis_name) returns for "
      "this very opt_state, or leave gathered out and the update all-gathers them itself."
    )


def _position_drawer(
  count: jax.Array,
  grads: list[jax.Array],
  site_axes: list[Hashable],
  blocks: list[jax.Array],
  ks: list[int],
  frequency_bias: float,
) -> Callable[[jax.Array | int], list[jax.Array]]:
  """Worker index -> that worker's drawn positions for every tensor, this step.

  A tensor sharded within a site (FSDP) is a message per shard, so the
  device's place along the axes that shard it enters the key; a tensor kept
  whole on a site's devices gets the same positions on each of them.
  """
  shards = []
  for g in grads:
    axes = tuple(a for a in site_axes if exchange.varies_over(g, a))
    shards.append(jax.lax.axis_index(axes) if axes else None)

  fns = [
    cpu_kernels.draw_positions if cpu_kernels.serves_draw(b) else codec.draw_positions
    for b in blocks
  ]

  def draw(worker: jax.Array | int) -> list[jax.Array]:
    return [
      fn(codec.position_key(count, i, worker, shard), b.shape, k, frequency_bias)
      for i, (fn, shard, b, k) in enumerate(zip(fns, shards, blocks, ks))
    ]

  return draw


def _replace_rarely(pred: jax.Array, tree: Any, replacement: Callable[[], Any]) -> Any:
  """``replacement()`` where ``pred`` holds, else ``tree``, with no pass over ``tree``.

  A ``jnp.where`` or a ``lax.cond`` reads and writes every byte of ``tree``
  even when ``pred`` is false, which for param-sized buffers costs as much as
  the step's arithmetic. A while loop whose body runs only when ``pred`` holds
  hands the buffers through untouched otherwise, and ``pred`` (a worker that
  failed) is rare.
  """
  # Traced only for its types (unused, so compiled away): inside shard_map the
  # loop carry must be typed as varying over the axes either side varies over.
  probe = replacement()
  pred_axes = exchange.varying_axes(pred)

  def axes(x: Any, r: Any) -> tuple[Hashable, ...]:
    union = exchange.varying_axes(x) | exchange.varying_axes(r) | pred_axes
    return tuple(sorted(union, key=str))

  targets = jax.tree.map(axes, tree, probe)

  def typed(x: Any, want: tuple[Hashable, ...], dtype: Any) -> jax.Array:
    return exchange.as_varying(jnp.asarray(x, dtype), want)

  tree = jax.tree.map(lambda x, want: typed(x, want, x.dtype), tree, targets)
  dtypes = jax.tree.map(lambda x: x.dtype, tree)

  def body(carry):
    new = jax.tree.map(typed, replacement(), targets, dtypes)
    return jnp.zeros_like(carry[0]), new

  _, out = jax.lax.while_loop(lambda c: c[0], body, (pred, tree))
  return out


def _compress(
  grads: list[jax.Array],
  momentum_blocks: list[jax.Array],
  plans: list[dct.ChunkPlan],
  layout: codec.WireLayout,
  lr: Any,
  *,
  decay: float,
  use_dct: bool,
  drawn: Callable[[], list[jax.Array]] | None,
) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array], list[jax.Array]]:
  """One worker's side of the step, in each tensor's block view.

  Returns the momentum with this gradient folded in, the positions and values
  selected from it (the top-k, or the positions ``drawn()`` gives), and the
  momentum with them zeroed (error feedback).
  """
  n = len(grads)
  blocks: list[jax.Array] = []
  sel_idx: list[jax.Array | None] = [None] * n
  sel_val: list[jax.Array | None] = [None] * n
  at = drawn() if drawn is not None else [None] * n
  for i, (g, m, plan, t) in enumerate(zip(grads, momentum_blocks, plans, layout.tensors)):
    g = dct.to_blocks(g, plan)
    fused = use_dct and kernels.for_compress(plan, g, m, k=t.k, drawn=drawn is not None)
    if fused:
      # Transform, momentum and selection in one pass (distro_jax.kernels).
      b, sel_idx[i], sel_val[i] = fused.compress(g, m, decay, lr, t.k, positions=at[i])
      blocks.append(b)
      continue
    coeffs = dct.forward_blocks(g, plan) if use_dct else g.astype(jnp.float32)
    blocks.append(decay * m + lr * coeffs)
  if drawn is not None:
    for i in range(n):
      if sel_idx[i] is None:
        sel_idx[i], sel_val[i] = at[i], codec.gather_blocks(blocks[i], at[i])
  else:
    rest = [i for i in range(n) if sel_idx[i] is None]
    ks = [layout.tensors[i].k for i in rest]
    selections = codec.select_topk_many([blocks[i] for i in rest], ks)
    for i, (idx, val) in zip(rest, selections):
      sel_idx[i], sel_val[i] = idx, val
  kept = [codec.zero_selected_blocks(m, idx) for m, idx in zip(blocks, sel_idx)]
  return blocks, sel_idx, sel_val, kept


def _own_selection(
  sel_idx: list[jax.Array],
  sel_val: list[jax.Array],
  kept: list[jax.Array],
  layout: codec.WireLayout,
  send: jax.Array,
  quantize_1bit: bool,
) -> list[jax.Array]:
  """A lone worker's aggregate: its selection as the wire would carry it.

  The mean of one value is that value, so the bytes are skipped.
  """
  dense = []
  for idx, val, m, t in zip(sel_idx, sel_val, kept, layout.tensors):
    if quantize_1bit:
      val = jnp.where(val >= 0, 1.0, -1.0)
    else:
      val = val.astype(t.value_dtype).astype(jnp.float32)
    val = jnp.where(send, val, 0.0)
    dense.append(codec.scatter_blocks(jnp.zeros_like(m), idx, val))
  return dense


def _check_pending(pending: jax.Array | None, message: jax.Array) -> None:
  if pending is None:
    raise ValueError(
      "delayed_apply=True needs the state of a delayed_apply=True transformation "
      "(DemoState.pending holding the previous message); build the state with the "
      "same arguments, e.g. tx.init(params) or dj.init_worker_state(tx, params, mesh)."
    )
  if pending.shape != message.shape:
    raise ValueError(
      f"DemoState.pending holds {pending.size} bytes, but this update's message is "
      f"{message.size}: the params' shapes or dtypes, or the compression options, differ "
      "from those the state was built with (with params=None the gradients' dtypes set "
      "the values' width; pass params to tx.update). Update with the params and options "
      "of tx.init(params), or build the state again for these."
    )


def _exchange(
  message: jax.Array,
  gathered: jax.Array | None,
  layout: codec.WireLayout,
  plans: list[dct.ChunkPlan],
  kept: list[jax.Array],
  sel_idx: list[jax.Array],
  *,
  axis_name: Hashable | None,
  num_workers: int,
  draw_sent: Callable[[jax.Array], list[jax.Array]] | None,
  use_dct: bool,
) -> tuple[list[jax.Array], list[bool], jax.Array]:
  """All-gathers ``message`` (unless ``gathered`` holds it) and averages what arrived.

  Returns each tensor's aggregate in its block view, whether each is already
  through the inverse DCT (the CPU kernels do both at once), and the count of
  valid messages. With no ``axis_name`` the one message is its own aggregate,
  scattered into zeros shaped like ``kept`` at indices shaped like ``sel_idx``.
  """
  if gathered is None:
    gathered = exchange.all_gather_messages(message, axis_name)
  else:
    _check_gathered(gathered, num_workers, layout.num_bytes)
  assert gathered.shape == (num_workers, layout.num_bytes)
  positions = None
  if draw_sent is not None:
    # Each sender's positions, drawn again here: the all-gather orders the
    # messages by the senders' indices on axis_name.
    positions = jax.vmap(draw_sent)(jnp.arange(num_workers))
  tensors, valid_W = codec.decode_message(gathered, layout, positions)
  native = [False] * len(plans)
  if axis_name is None:
    # One message and no collective (delayed_apply with one worker): its mean
    # is itself. (With an axis bound, even of size 1, the all-gather types the
    # aggregate as identical on every worker; keep that path.)
    dense = [
      codec.scatter_blocks(
        jnp.zeros_like(m),
        i[0].reshape(s.shape),
        jnp.where(valid_W[0], v[0], 0.0).reshape(s.shape),
      )
      for (i, v), m, s in zip(tensors, kept, sel_idx)
    ]
  else:
    fused = [use_dct and kernels.for_decode(p, m) for p, m in zip(plans, kept)]
    native = [bool(f) for f in fused]
    rest = [i for i, is_native in enumerate(native) if not is_native]
    aggregates = codec.aggregate_blocks(
      [tensors[i] for i in rest], [plans[i].block_shape for i in rest], valid_W
    )
    dense = [None] * len(plans)
    for i, (mean, _) in zip(rest, aggregates):
      dense[i] = mean
    for i, plan in enumerate(plans):
      if native[i]:
        # Mean and inverse DCT in one pass (distro_jax.kernels), the
        # workers folded in in the order aggregate_blocks takes.
        idx, val = tensors[i]
        dense[i] = fused[i].decode(idx, val, valid_W, plan.block_shape)
  return dense, native, jnp.sum(valid_W, dtype=jnp.int32)


def _directions(
  dense: list[jax.Array],
  decoded: list[bool],
  plans: list[dct.ChunkPlan],
  wire_dtypes: list[jax.ShapeDtypeStruct],
  grads: list[jax.Array],
  site_axes: list[Hashable],
  use_dct: bool,
) -> list[jax.Array]:
  """The aggregates decoded: each tensor's ``Q`` in its param's shape and dtype."""
  directions = []
  for d, done, plan, x, g in zip(dense, decoded, plans, wire_dtypes, grads):
    q = dct.inverse_blocks(d, plan) if use_dct and not done else d
    direction = dct.from_blocks(q, plan, like=g).astype(x.dtype)
    whole = tuple(a for a in site_axes if not exchange.varies_over(g, a))
    if whole:
      # A param kept whole on every device of a site is decoded identically
      # on each, but from a message typed as differing; a max over equal
      # values (on the site's fast links) restores the type, not the value.
      direction = jax.lax.pmax(direction, whole)
    directions.append(direction)
  return directions


def _plain_next_momentum(
  kept: list[jax.Array],
  blocks: list[jax.Array],
  momenta: list[jax.Array],
  plans: list[dct.ChunkPlan],
  finite: jax.Array,
  send: jax.Array,
  contributors: jax.Array,
  contribute: jax.Array | None,
) -> list[jax.Array]:
  """The momentum after a plain (not delayed) exchange, in each param's shape.

  A worker that failed restarts from zero; a step in which every worker
  failed changes nothing, so each keeps the momentum it came with. The old
  momentum must outlive this step's, so this select is a pass over it, the
  one the plain exchange pays for that guarantee.
  """
  received = contributors > 0
  kept = [dct.from_blocks(k, p, p.state_shape, like=m) for k, p, m in zip(kept, plans, momenta)]
  # In the momentum's own shape, so XLA writes the result over it in place.
  kept = [jnp.where(finite, k, jnp.where(received, 0.0, m)) for k, m in zip(kept, momenta)]
  if contribute is not None:
    # What a held-back message would have sent stays in the momentum.
    unsent = [
      dct.from_blocks(b, p, p.state_shape, like=m) for b, p, m in zip(blocks, plans, momenta)
    ]
    kept = [jnp.where(send | ~finite, k, w) for k, w in zip(kept, unsent)]
  return kept


def scale_by_demo(
  learning_rate: optax.ScalarOrSchedule,
  *,
  compression_decay: float = StaticFloat(0.999),
  compression_topk: int = StaticInt(32),
  compression_chunk: int = StaticInt(64),
  quantize_1bit: bool = False,
  use_dct: bool = True,
  axis_name: Hashable | None = "data",
  delayed_apply: bool = False,
  random_positions: bool = False,
  frequency_bias: float | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Decoupled momentum, compressed and exchanged; yields the aggregate ``Q``.

  Per tensor, on every worker: ``m <- decay * m + lr * g``; take the chunked
  DCT of ``m``; keep the top-k coefficients of every chunk; remove them from
  ``m`` (error feedback); all-gather the compressed messages of all workers;
  average each coefficient over the workers that chose it; and return
  ``Q = IDCT(aggregate)``, identical on every worker. Only the message crosses
  ``axis_name``. A param with no entries (a zero-size tensor) has no part in
  the message and gets an empty update.

  Args:
    learning_rate: a float or an optax schedule. It is folded into the
      momentum, as in the reference, so a schedule weights old and new
      gradients the same way.
    compression_decay: momentum decay in ``[0, 1)``; 0 is the stateless mode.
    compression_topk: coefficients kept per chunk; clamped to the chunk size.
      Static.
    compression_chunk: chunk length target per axis. Static.
    quantize_1bit: send only the signs of the values (1 bit each). The error
      feedback still removes the unquantized values. Static.
    use_dct: ``False`` is an ablation: the same chunks, top-k and error
      feedback, on the raw momentum entries instead of DCT coefficients. It
      shows what the transform buys. Static.
    axis_name: the mapped axis of the data-parallel workers, bound by an
      enclosing ``jax.shard_map``; ``None`` for a single worker with no
      collective.
    delayed_apply: overlapped exchange. Step t all-gathers the message that
      step t-1 compressed (kept in :attr:`DemoState.pending`) and returns its
      aggregate, while step t's own message waits in the state for step t+1.
      The all-gather then depends on nothing computed from step t's gradient,
      so XLA may run it alongside the forward and backward pass. The first
      step returns zeros. Static.
    random_positions: instead of the ``compression_topk`` largest
      coefficients of a chunk, send the values at ``compression_topk``
      positions drawn at random, different for every worker and step. The
      draw is a function of the step count and the worker's index on
      ``axis_name`` (and, under FSDP, of the device's index within its site),
      so every receiver draws each sender's positions itself and the message
      carries only the values: with ``quantize_1bit``, one bit per value. The
      error feedback removes what was sent, as with the top-k. With
      ``delayed_apply`` the message in flight is decoded with the positions
      drawn at the step that made it. Static.
    frequency_bias: with ``random_positions``, how much the draw prefers a
      chunk's low frequencies: DCT coefficient ``(i, j)`` is drawn with
      probability proportional to ``((1 + i) (1 + j)) ** -frequency_bias``
      (see :func:`distro_jax.codec.draw_positions`). ``None`` (or 0) draws
      uniformly. Static.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`DemoState`. Its ``update`` takes one extra keyword,
    ``contribute``: a bool scalar (per worker, inside ``jax.shard_map``) that,
    when false, sends this worker's message marked invalid, so the others
    leave it out, while its momentum keeps what the message would have sent
    (the cold start of a worker that joins an elastic run). With
    ``delayed_apply`` it takes a second, ``gathered``: the messages in flight
    as :func:`distro_jax.gather_pending` all-gathered them in a program of
    their own, so that the update decodes those instead of all-gathering
    itself (see :mod:`distro_jax.overlap`). ``optax.chain`` passes both
    through; a transformation without ``delayed_apply`` ignores
    ``gathered``, as its message is made in this update.

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
  check_learning_rate("learning_rate", learning_rate)
  compression_decay = unwrap_static(compression_decay)
  topk = static_positive_int("compression_topk", compression_topk, example=32)
  chunk = static_positive_int("compression_chunk", compression_chunk, example=64)
  check_decay(
    "compression_decay",
    compression_decay,
    one_allowed=False,
    hint="Use 0 for the stateless mode, or e.g. 0.999 (the reference default).",
  )
  quantize_1bit = bool(quantize_1bit)
  delayed_apply = bool(delayed_apply)
  random_positions = bool(random_positions)
  bias = 0.0
  if frequency_bias is not None:
    bias = static_nonnegative_float("frequency_bias", frequency_bias, example=1.0)
    if not random_positions:
      raise ValueError(
        f"frequency_bias={frequency_bias} shapes the draw of random_positions=True; pass "
        "random_positions=True, or leave frequency_bias=None."
      )
  to_chunks, from_chunks = (dct.encode, dct.decode) if use_dct else (dct.to_chunks, dct.from_chunks)

  def init_fn(params):
    dct.refuse_non_float(params, "DeMo", "DCT, top-k by magnitude and sign step")
    momentum = jax.tree.map(dct.in_place_zeros, params)
    zero = jnp.zeros([], jnp.int32)
    pending = None
    if delayed_apply:
      layout = wire.wire_layout(
        params,
        compression_topk=topk,
        compression_chunk=chunk,
        quantize_1bit=quantize_1bit,
        random_positions=random_positions,
      )
      pending = jnp.zeros((layout.num_bytes,), jnp.uint8)
    return DemoState(count=zero, momentum=momentum, contributors=zero, pending=pending)

  def update_fn(updates, state, params=None, **extra_args):
    _check_trees(updates, params)
    grads, treedef = jax.tree.flatten(updates)
    carried = wire.CarriedLeaves(grads)
    if carried.all:
      return update_carried(updates, state, params, **extra_args)
    # A zero-size tensor has nothing to send: the message and the exchange
    # leave it out, and its update is as empty as it is.
    momenta = treedef.flatten_up_to(state.momentum)
    p_leaves = grads if params is None else treedef.flatten_up_to(params)
    sub_params = None if params is None else carried.pick(p_leaves)
    sub_state = state._replace(momentum=carried.pick(momenta))
    q, sub_state = update_carried(carried.pick(grads), sub_state, sub_params, **extra_args)
    empty = lambda gp: jnp.zeros(np.shape(gp[0]), gp[1].dtype)
    q = carried.with_empty(q, list(zip(grads, p_leaves)), empty)
    momenta = carried.merge(sub_state.momentum, momenta)
    return treedef.unflatten(q), sub_state._replace(momentum=treedef.unflatten(momenta))

  def update_carried(updates, state, params, *, contribute=None, gathered=None, **extra_args):
    del extra_args  # Other transformations' arguments, passed along by optax.chain.
    if not delayed_apply:
      gathered = None  # Meant for a delayed_apply exchange in the same chain.
    num_workers = exchange.bound_axis_size(axis_name)
    grads, treedef = jax.tree.flatten(updates)
    if not grads:
      # Nothing to compress (an empty tree, or optax.masked selecting nothing):
      # no message, and no worker failed.
      return updates, state._replace(
        count=optax.safe_increment(state.count),
        contributors=jnp.full([], num_workers, jnp.int32),
      )
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    momenta = treedef.flatten_up_to(state.momentum)
    dtypes_from = jax.tree.leaves(params) if params is not None else grads
    wire_dtypes = [jax.ShapeDtypeStruct(np.shape(g), x.dtype) for g, x in zip(grads, dtypes_from)]
    layout = wire.wire_layout(
      wire_dtypes,
      compression_topk=topk,
      compression_chunk=chunk,
      quantize_1bit=quantize_1bit,
      random_positions=random_positions,
    )
    plans = wire.plan_tree(wire_dtypes, chunk)
    _check_momentum(updates, momenta, plans)

    # Everything param-sized stays in each tensor's block view, where both DCT
    # stages, top-k's first stage and the scatters read the data in place.
    momentum_blocks = [dct.to_blocks(m, plan) for m, plan in zip(momenta, plans)]
    # Gradients that also vary over axes other than axis_name are sharded
    # within a worker (FSDP over a site's devices).
    site_axes = sorted(
      frozenset().union(*(exchange.varying_axes(g) for g in grads)) - {axis_name}, key=str
    )
    if random_positions:
      own = 0 if axis_name is None else jax.lax.axis_index(axis_name)
      ks = [t.k for t in layout.tensors]
      draw = _position_drawer(state.count, grads, site_axes, momentum_blocks, ks, bias)
      # The message in flight was drawn at the step that made it: with
      # delayed_apply every update replaces it and counts one, so at count-1.
      draw_sent = draw
      if delayed_apply:
        made_at = jnp.maximum(state.count - 1, 0)
        draw_sent = _position_drawer(made_at, grads, site_axes, momentum_blocks, ks, bias)
    if delayed_apply:
      own_sent = draw_sent(own) if random_positions else None
      momentum_blocks = _feed_back_pending(momentum_blocks, state.pending, layout, own_sent)
    blocks, sel_idx, sel_val, kept = _compress(
      grads,
      momentum_blocks,
      plans,
      layout,
      lr,
      decay=compression_decay,
      use_dct=use_dct,
      drawn=(lambda: draw(own)) if random_positions else None,
    )

    # A non-finite gradient anywhere in a chunk spreads over all its
    # coefficients, so checking what was selected catches it. Such a worker
    # sends a message marked invalid and restarts from zero momentum.
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in sel_val]))
    # The shards of one worker agree on the flag, so a worker is left out
    # whole and the count of contributors is the same on every device.
    if site_axes:
      finite = jax.lax.pmin(finite.astype(jnp.int32), tuple(site_axes)) > 0
    # A worker that holds its message back (contribute=False, a cold start)
    # sends it marked invalid, like a failed one, but keeps its momentum whole.
    send = finite if contribute is None else jnp.logical_and(finite, contribute)

    if axis_name is None and not delayed_apply:
      dense = _own_selection(sel_idx, sel_val, kept, layout, send, quantize_1bit)
      decoded = [False] * len(dense)
      contributors, pending = send.astype(jnp.int32), None
    else:
      message = codec.encode_message(sel_idx, sel_val, layout, valid=send)
      pending = None
      if delayed_apply:
        _check_pending(state.pending, message)
        message, pending = state.pending, message
      dense, decoded, contributors = _exchange(
        message,
        gathered,
        layout,
        plans,
        kept,
        sel_idx,
        axis_name=axis_name,
        num_workers=num_workers,
        draw_sent=draw_sent if random_positions else None,
        use_dct=use_dct,
      )
    directions = _directions(dense, decoded, plans, wire_dtypes, grads, site_axes, use_dct)

    if site_axes:
      # Equal on every device of a site already; this only types it so.
      contributors = jax.lax.pmax(contributors, tuple(site_axes))
    if delayed_apply:
      # The momentum is kept before error feedback (the next step removes what
      # this message sends), so the lookahead reads Psyche's guess from the
      # state. The message in flight is not this step's, so a worker that
      # failed restarts from zero whatever the others sent.
      reset = lambda: jax.tree.map(jnp.zeros_like, blocks)
      kept = _replace_rarely(jnp.logical_not(finite), blocks, reset)
    else:
      kept = _plain_next_momentum(
        kept, blocks, momenta, plans, finite, send, contributors, contribute
      )
    new_state = DemoState(
      count=optax.safe_increment(state.count),
      momentum=treedef.unflatten(
        [dct.from_blocks(k, p, p.state_shape, like=m) for k, p, m in zip(kept, plans, momenta)]
      ),
      contributors=contributors,
      pending=pending,
    )
    return treedef.unflatten(directions), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _skip_when_nothing_received(
  tx: optax.GradientTransformation, *, delayed_apply: bool = False
) -> optax.GradientTransformationExtraArgs:
  """Makes a step whose every message was left out a no-op: no update, state as before.

  All but :attr:`DemoState.contributors`, which says 0 for that step.

  ``tx`` is a chain whose first state is a :class:`DemoState`. Without this,
  the rest of the chain would still act on the empty aggregate (weight decay
  would shrink the params, Adam's moments would decay). With
  ``delayed_apply`` the messages left out are the previous step's, while this
  step's gradient has already gone into the momentum and the next message, so
  the :class:`DemoState` moves on and only the rest of the chain is held.
  """
  tx = optax.with_extra_args_support(tx)

  def update_fn(updates, state, params=None, **extra_args):
    new_updates, new_state = tx.update(updates, state, params, **extra_args)
    received = new_state[0].contributors > 0
    # The select on the updates fuses into what consumes them; the state is
    # param-sized and materialized, so it is held back only when it must be.
    new_updates = jax.tree.map(lambda u: jnp.where(received, u, jnp.zeros_like(u)), new_updates)
    hold = lambda new, old: jax.tree.map(lambda n, o: jnp.where(received, n, o), new, old)
    # Selects on state that the rest of the chain computes elementwise fuse
    # into that computation. DeMo's momentum is held by scale_by_demo itself,
    # and with delayed_apply its state moves on (the messages left out were
    # the previous step's, this step's gradient is already in the momentum).
    demo_new, demo_old = new_state[0], state[0]
    if not delayed_apply:
      # contributors stays this step's 0, so a caller sees that every worker
      # was left out (the driver logs W - contributors as excluded).
      demo_new = demo_new._replace(count=hold(demo_new.count, demo_old.count))
    return new_updates, (demo_new, *hold(new_state[1:], state[1:]))

  return optax.GradientTransformationExtraArgs(tx.init, update_fn)


def demo(
  learning_rate: optax.ScalarOrSchedule,
  *,
  compression_decay: float = StaticFloat(0.999),
  compression_topk: int = StaticInt(32),
  compression_chunk: int = StaticInt(64),
  weight_decay: float = 0.0,
  quantize_1bit: bool = False,
  use_dct: bool = True,
  axis_name: Hashable | None = "data",
  delayed_apply: bool = False,
  synchronous: Any = None,
  random_positions: bool = False,
  frequency_bias: float | None = None,
  normalize: Any = "sign",
) -> optax.GradientTransformationExtraArgs:
  """DeMo: ``p <- p * (1 - lr * wd) - lr * sign(Q)``, with ``Q`` from :func:`scale_by_demo`.

  A short ``optax.chain`` of :func:`scale_by_demo`, ``optax.scale_by_sign``
  (or :func:`scale_to_unit_rms` with ``normalize="rms"``, or the
  orthogonalized step with ``normalize="orth"``),
  ``optax.add_decayed_weights`` and ``optax.scale_by_learning_rate`` (built
  with :func:`distro`, so a step in which every worker's message was left out
  for non-finite values changes nothing). Call its
  ``update`` inside ``jax.shard_map`` over a mesh that binds ``axis_name``,
  with each worker's local gradients; each worker's state is its own (see
  :func:`distro_jax.init_worker_state`).

  Args:
    learning_rate: a float or an optax schedule.
    compression_decay: momentum decay in ``[0, 1)``; 0 is the stateless mode.
    compression_topk: coefficients kept per chunk. Static.
    compression_chunk: chunk length target per axis. Static.
    weight_decay: decoupled weight decay, scaled by the learning rate.
    quantize_1bit: send 1-bit signs instead of values. Static.
    use_dct: ``False`` selects raw entries instead of DCT coefficients (an
      ablation). Static.
    axis_name: the data-parallel axis; ``None`` for one worker, no collective.
    delayed_apply: apply the aggregate of step t-1 at step t, so that the
      all-gather can overlap the next forward and backward pass (see
      :func:`scale_by_demo`). Static.
    synchronous: with ``delayed_apply``, the params whose messages are still
      exchanged in the step that computes them, as without the delay (a
      partial overlap): a tree of bools like the params (or a prefix of it,
      one bool for a subtree), or a function of the params that returns one. ``None`` (the
      default) overlaps every param. See :func:`distro`. Static.
    random_positions: send the values at positions drawn from a seed every
      worker knows, instead of the largest and their indices (see
      :func:`scale_by_demo`). Static.
    frequency_bias: with ``random_positions``, the draw's preference for low
      frequencies (see :func:`scale_by_demo`); ``None`` draws uniformly. Static.
    normalize: how ``Q`` becomes a step: ``"sign"`` (DeMo's: every entry
      moves by the learning rate), ``"rms"`` (each tensor's ``Q`` scaled to
      a root mean square of one, so entries keep their relative sizes) or
      ``"orth"`` (each matrix's ``Q`` orthogonalized as Muon does, see
      :func:`distro_jax.orthogonalize`, then at unit RMS; other tensors at
      unit RMS). Or a tree of these like the params (or a prefix of it), or
      a function of the params that returns one, e.g. to keep an embedding
      at ``"rms"``. With drawn positions ``"rms"`` trained better than the
      sign at some seeds and as well at the others, and ``"orth"`` on the
      hidden matrices better than ``"rms"``; with the top-k ``"rms"`` trained
      worse (docs/results.md). Static.

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
  unit_rms.check_normalize(normalize)
  if normalize == "sign":
    step = optax.scale_by_sign()
  else:
    step = unit_rms.scale_by_normalize(normalize, axis_name)
  return distro(
    optax.chain(
      step,
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate),
    ),
    learning_rate,
    compression_decay=compression_decay,
    compression_topk=compression_topk,
    compression_chunk=compression_chunk,
    quantize_1bit=quantize_1bit,
    use_dct=use_dct,
    axis_name=axis_name,
    delayed_apply=delayed_apply,
    synchronous=synchronous,
    random_positions=random_positions,
    frequency_bias=frequency_bias,
  )


def distro(
  inner: optax.GradientTransformation,
  learning_rate: optax.ScalarOrSchedule,
  *,
  compression_decay: float = StaticFloat(0.999),
  compression_topk: int = StaticInt(32),
  compression_chunk: int = StaticInt(64),
  quantize_1bit: bool = False,
  use_dct: bool = True,
  axis_name: Hashable | None = "data",
  delayed_apply: bool = False,
  synchronous: Any = None,
  random_positions: bool = False,
  frequency_bias: float | None = None,
) -> optax.GradientTransformationExtraArgs:
  """DisTrO: the compressed exchange of :func:`scale_by_demo`, then ``inner``.

  ``inner`` sees the same aggregate ``Q`` on every worker, so its state and its
  updates stay identical across replicas. ``dj.demo`` is
  ``distro(chain(scale_by_sign(), add_decayed_weights(wd), scale_by_learning_rate(lr)), lr)``.

  With ``delayed_apply`` and ``synchronous``, a partial overlap: the params
  that ``synchronous`` selects are exchanged as without the delay (their
  all-gather waits for this step's gradient), the others one step late. It
  is ``optax.multi_transform`` over two exchanges, each with its own message,
  all-gather and copy of ``inner`` (so ``inner`` must act on each param on its
  own, as ``sign`` and AdamW do); the bytes are the two messages'. The
  lookahead of :func:`distro_jax.gradient_point` then moves only the
  overlapped params. What it buys: a gradient taken at the exact params for
  the synchronous group, which at top-k 32 closes most of the overlapped
  exchange's gap (docs/overlapped.md).

  Args:
    inner: any optax transformation that turns ``Q`` into updates, for example
      ``optax.adamw(lr)``.
    learning_rate: the rate folded into the momentum (a float or schedule),
      normally the one ``inner`` uses.
    compression_decay: momentum decay in ``[0, 1)``.
    compression_topk: coefficients kept per chunk. Static.
    compression_chunk: chunk length target per axis. Static.
    quantize_1bit: send 1-bit signs instead of values. Static.
    use_dct: ``False`` selects raw entries instead of DCT coefficients (an
      ablation). Static.
    axis_name: the data-parallel axis; ``None`` for one worker, no collective.
    delayed_apply: apply the aggregate of step t-1 at step t, so that the
      all-gather can overlap the next forward and backward pass (see
      :func:`scale_by_demo`). Static.
    synchronous: with ``delayed_apply``, the params whose messages are still
      exchanged in the step that computes them, as without the delay (a
      partial overlap): a tree of bools like the params (or a prefix of it,
      one bool for a subtree), or a function of the params that returns one. ``None`` (the
      default) overlaps every param. See :func:`distro`. Static.
    random_positions: send the values at positions drawn from a seed every
      worker knows, instead of the largest and their indices (see
      :func:`scale_by_demo`). Static.
    frequency_bias: with ``random_positions``, the draw's preference for low
      frequencies (see :func:`scale_by_demo`); ``None`` draws uniformly. Static.

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
  options = dict(
    compression_decay=compression_decay,
    compression_topk=compression_topk,
    compression_chunk=compression_chunk,
    quantize_1bit=quantize_1bit,
    use_dct=use_dct,
    axis_name=axis_name,
    random_positions=random_positions,
    frequency_bias=frequency_bias,
  )
  if synchronous is None:
    return _skip_when_nothing_received(
      optax.chain(scale_by_demo(learning_rate, delayed_apply=delayed_apply, **options), inner),
      delayed_apply=delayed_apply,
    )
  if not delayed_apply:
    raise ValueError(
      "synchronous= picks the params that a delayed_apply=True exchange still sends in "
      "the step that computes them; without delayed_apply every param is synchronous "
      "already. Pass delayed_apply=True, or leave synchronous=None."
    )
  # Two exchanges, one per group, each a whole DisTrO of its own: the
  # synchronous one all-gathers this step's message, the overlapped one the
  # message of the step before. Every tensor's compression and aggregate are
  # its own, so a tensor trains as it would in a run with its group's mode.
  groups = {
    _SYNCHRONOUS: distro(inner, learning_rate, delayed_apply=False, **options),
    _OVERLAPPED: distro(inner, learning_rate, delayed_apply=True, **options),
  }
  return optax.multi_transform(groups, functools.partial(_overlap_labels, synchronous))


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


def distro_adamw(
  learning_rate: optax.ScalarOrSchedule,
  *,
  b1: float = 0.9,
  b2: float = StaticFloat(0.999),
  eps: float = 1e-8,
  weight_decay: float = 0.0,
  compression_decay: float = StaticFloat(0.999),
  compression_topk: int = StaticInt(32),
  compression_chunk: int = StaticInt(64),
  quantize_1bit: bool = False,
  use_dct: bool = True,
  axis_name: Hashable | None = "data",
  delayed_apply: bool = False,
  synchronous: Any = None,
  random_positions: bool = False,
  frequency_bias: float | None = None,
) -> optax.GradientTransformationExtraArgs:
  """DisTrO-AdamW: the compressed exchange followed by ``optax.adamw``.

  Args:
    learning_rate: a float or an optax schedule, used by both parts.
    b1: Adam's first-moment decay.
    b2: Adam's second-moment decay.
    eps: Adam's epsilon.
    weight_decay: AdamW's decoupled weight decay.
    compression_decay: momentum decay in ``[0, 1)``.
    compression_topk: coefficients kept per chunk. Static.
    compression_chunk: chunk length target per axis. Static.
    quantize_1bit: send 1-bit signs instead of values. Static.
    use_dct: ``False`` selects raw entries instead of DCT coefficients (an
      ablation). Static.
    axis_name: the data-parallel axis; ``None`` for one worker, no collective.
    delayed_apply: apply the aggregate of step t-1 at step t, so that the
      all-gather can overlap the next forward and backward pass (see
      :func:`scale_by_demo`). Static.
    synchronous: with ``delayed_apply``, the params whose messages are still
      exchanged in the step that computes them, as without the delay (a
      partial overlap): a tree of bools like the params (or a prefix of it,
      one bool for a subtree), or a function of the params that returns one. ``None`` (the
      default) overlaps every param. See :func:`distro`. Static.
    random_positions: send the values at positions drawn from a seed every
      worker knows, instead of the largest and their indices (see
      :func:`scale_by_demo`). Static.
    frequency_bias: with ``random_positions``, the draw's preference for low
      frequencies (see :func:`scale_by_demo`); ``None`` draws uniformly. Static.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  References:
    Nous Research, "A Preliminary Report on DisTrO", 2024.
  """
  return distro(
    optax.adamw(learning_rate, b1=b1, b2=unwrap_static(b2), eps=eps, weight_decay=weight_decay),
    learning_rate,
    compression_decay=compression_decay,
    compression_topk=compression_topk,
    compression_chunk=compression_chunk,
    quantize_1bit=quantize_1bit,
    use_dct=use_dct,
    axis_name=axis_name,
    delayed_apply=delayed_apply,
    synchronous=synchronous,
    random_positions=random_positions,
    frequency_bias=frequency_bias,
  )
