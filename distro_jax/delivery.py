"""The exchange stage: how a message reaches the other workers, and when it is applied.

- :func:`deliver`: this step's message, all-gathered and read back (or, with
  no workers' axis, a lone worker's own message as the receivers would read
  it, with no bytes made). DeMo's plain exchange and SparseLoCo's.
- :class:`Synchronous`: DeMo with :func:`deliver`: the momentum keeps what the
  message did not send.
- :class:`Delayed`: DeMo's ``delayed_apply``. Step t all-gathers the message
  made at step t-1 (``DemoState.pending``) while its own waits for step t+1,
  so the collective depends on nothing computed from step t's gradient.
  Error feedback waits with the message: the momentum is kept whole until the
  next step removes what its message sent (so the lookahead can read it).

A schedule is an object with three calls, made at fixed points of
:func:`distro_jax.scale_by_demo`'s update: ``feed_back`` (before the
compress stage), ``exchange`` and ``next_momentum``. Another schedule (a
message two steps late, say) is another such object.
"""

from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from distro_jax import codec, dct, exchange
from distro_jax.compress import Compressed
from distro_jax.message import Format, MessageFormat, Received

__all__ = ["Delayed", "Synchronous", "deliver", "schedule"]


def deliver(
  fmt: Format,
  selection: Any,
  valid: jax.Array,
  axis_name: Hashable | None,
  collective: str = "all_gather",
) -> Received:
  """This step's message from every worker on ``axis_name``, read back.

  Args:
    fmt: the message format (:class:`~distro_jax.message.MessageFormat`,
      DeMo's and SparseLoCo's alike).
    selection: what this worker sends, in the format's terms.
    valid: False marks this worker's message to be left out.
    axis_name: the workers' axis; ``None`` for one worker, whose message is
      then its own aggregate, so no bytes are made (and, for params sharded
      under ``jax.jit``, nothing of the selection is gathered).
    collective: ``"all_gather"`` or ``"all_to_all"``
      (:func:`distro_jax.exchange.all_gather_messages`).

  Returns:
    Every worker's message as a :class:`~distro_jax.message.Received`.

  Example:
    >>> import jax.numpy as jnp
    >>> from distro_jax import dct, delivery, message, wire
    >>> params = [jnp.zeros((8, 8))]
    >>> layout = wire.wire_layout(
    ...     params, compression_topk=2, compression_chunk=8, quantize_1bit=True)
    >>> fmt = message.MessageFormat(layout, message.TopK((2,)), dct.DCT_BASIS)
    >>> sent = message.Selection([jnp.array([[[5, 9]]])], [jnp.array([[[0.3, -2.0]]])])
    >>> got = delivery.deliver(fmt, sent, jnp.asarray(True), axis_name=None)
    >>> ((idx, values),) = got.tensors
    >>> values.tolist()  # one worker's; 1-bit values arrive as signs
    [[[[1.0, -1.0]]]]
  """
  if axis_name is None:
    return fmt.as_received(selection, valid)
  gathered = exchange.all_gather_messages(fmt.encode(selection, valid), axis_name, collective)
  assert gathered.shape == (exchange.bound_axis_size(axis_name), fmt.num_bytes)
  return fmt.decode(gathered)


class Synchronous(NamedTuple):
  """Each step's message all-gathered and applied in that step.

  Attributes:
    axis_name: the workers' axis, or ``None`` for one worker.
    collective: how the messages travel (:func:`deliver`).
  """

  axis_name: Hashable | None
  collective: str = "all_gather"

  def feed_back(self, momentum_blocks: list[jax.Array], state: Any, fmt: MessageFormat) -> list:
    """Nothing is in flight, so nothing leaves the momentum before this step's message."""
    del state, fmt
    return momentum_blocks

  def exchange(
    self, fmt: MessageFormat, selection: Any, send: jax.Array, state: Any, gathered: Any
  ) -> tuple[Received, None]:
    """This step's messages, and no message left pending (``gathered`` is a delayed exchange's)."""
    del state, gathered
    return deliver(fmt, selection, send, self.axis_name, self.collective), None

  def next_momentum(
    self,
    compressed: Compressed,
    momenta: list[jax.Array],
    plans: list[dct.ChunkPlan],
    finite: jax.Array,
    send: jax.Array,
    contributors: jax.Array,
    contribute: jax.Array | None,
  ) -> list[jax.Array]:
    """The momentum after error feedback, in each param's shape.

    A worker that failed restarts from zero; a step in which every worker
    failed changes nothing, so each keeps the momentum it came with. The old
    momentum must outlive this step's, so this select is a pass over it, the
    one the plain exchange pays for that guarantee. A message held back
    (``contribute=False``) leaves what it would have sent in the momentum.
    """
    received = contributors > 0

    def shaped(blocks):
      zipped = zip(blocks, plans, momenta)
      return [dct.from_blocks(b, p, p.state_shape, like=m) for b, p, m in zipped]

    # In the momentum's own shape, so XLA writes the result over it in place.
    kept = shaped(compressed.kept)
    kept = [jnp.where(finite, k, jnp.where(received, 0.0, m)) for k, m in zip(kept, momenta)]
    if contribute is not None:
      unsent = shaped(compressed.momentum)
      kept = [jnp.where(send | ~finite, k, w) for k, w in zip(kept, unsent)]
    return kept


class Delayed(NamedTuple):
  """Each step's message all-gathered and applied one step later (``delayed_apply``).

  Attributes:
    axis_name: the workers' axis, or ``None`` for one worker.
    num_workers: the size of that axis (1 for ``None``).
    collective: how the messages travel (:func:`deliver`).
  """

  axis_name: Hashable | None
  num_workers: int
  collective: str = "all_gather"

  def in_flight(self, fmt: MessageFormat, state: Any) -> MessageFormat:
    """The format of the message in flight: every update replaces it and counts one."""
    return fmt.made_at(jnp.maximum(state.count - 1, 0))

  def feed_back(self, momentum_blocks: list[jax.Array], state: Any, fmt: MessageFormat) -> list:
    """Error feedback of the message in flight: what it sends leaves the momentum now.

    The coefficients it sent are read back from this worker's own pending
    message. One marked invalid (the first step, a worker that failed) sent
    nothing, so nothing is removed.
    """
    if state.pending is None or state.pending.shape != (fmt.num_bytes,):
      return momentum_blocks  # exchange refuses this state with a clear message
    own = self.in_flight(fmt, state).decode(state.pending)
    out = []
    for m, (idx, _) in zip(momentum_blocks, own.tensors):
      idx = idx.reshape(*m.shape[:-3], m.shape[-2], idx.shape[-1])
      # Zero where the message was valid, else write back what is there.
      values = jnp.where(own.valid, 0.0, codec.gather_blocks(m, idx))
      out.append(codec.scatter_blocks(m, idx, values))
    return out

  def exchange(
    self, fmt: MessageFormat, selection: Any, send: jax.Array, state: Any, gathered: Any
  ) -> tuple[Received, jax.Array]:
    """The messages of the step before, and this step's own message, to wait in the state.

    ``gathered``, when given, holds the messages in flight as
    :func:`distro_jax.gather_pending` all-gathered them in a program of their own.
    """
    message = fmt.encode(selection, send)
    _check_pending(state.pending, message)
    if gathered is None:
      gathered = exchange.all_gather_messages(state.pending, self.axis_name, self.collective)
    else:
      _check_gathered(gathered, self.num_workers, fmt.num_bytes)
    assert gathered.shape == (self.num_workers, fmt.num_bytes)
    return self.in_flight(fmt, state).decode(gathered), message

  def next_momentum(
    self,
    compressed: Compressed,
    momenta: list[jax.Array],
    plans: list[dct.ChunkPlan],
    finite: jax.Array,
    send: jax.Array,
    contributors: jax.Array,
    contribute: jax.Array | None,
  ) -> list[jax.Array]:
    """The momentum before error feedback (the next step removes what this message sends).

    So the lookahead reads Psyche's guess from the state. The message applied
    is not this step's, so a worker that failed restarts from zero whatever
    the others sent.
    """
    del send, contributors, contribute
    reset = lambda: jax.tree.map(jnp.zeros_like, compressed.momentum)
    kept = _replace_rarely(jnp.logical_not(finite), compressed.momentum, reset)
    return [dct.from_blocks(k, p, p.state_shape, like=m) for k, p, m in zip(kept, plans, momenta)]


def schedule(
  axis_name: Hashable | None, num_workers: int, delayed_apply: bool, collective: str = "all_gather"
) -> Synchronous | Delayed:
  """:class:`Delayed` with ``delayed_apply``, else :class:`Synchronous`."""
  if delayed_apply:
    return Delayed(axis_name, num_workers, collective)
  return Synchronous(axis_name, collective)


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


def _check_gathered(gathered: Any, num_workers: int, num_bytes: int) -> None:
  want = (num_workers, num_bytes)
  if np.shape(gathered) != want or jnp.asarray(gathered).dtype != jnp.uint8:
    raise ValueError(
      f"gathered has shape {np.shape(gathered)} and dtype {jnp.asarray(gathered).dtype}, but "
      f"this exchange's messages in flight are uint8{list(want)} ({num_workers} workers x "
      f"{num_bytes} bytes). Pass what dj.gather_pending(opt_state, axis_name) returns for "
      "this very opt_state, or leave gathered out and the update all-gathers them itself."
    )


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
