"""DeMo's message format: which coefficients a worker sends, and how they travel.

A message is a choice of ``k`` positions in every chunk and the values there.
Its format is three choices, and this module is where the update asks about
them:

- **Positions.** :class:`TopK`: the ``k`` coefficients of largest magnitude,
  whose indices the message carries. :class:`Drawn`: ``k`` positions drawn
  from a key that every worker can build, so the message carries no indices
  and each receiver draws a sender's positions again.
- **Values.** In the param dtype, or with ``quantize_1bit`` one sign bit each
  (the receiver reads +-1), or as codes of a per-tensor codebook
  (SparseLoCo's quantizer). The bytes are :mod:`distro_jax.codec`'s, laid out
  by its :class:`~distro_jax.codec.WireLayout`.
- **Basis.** The chunked DCT, or the raw entries (an ablation):
  :class:`distro_jax.dct.Basis`.

:class:`MessageFormat` holds the three. ``select`` picks a worker's
:class:`Selection` from its momentum, ``encode`` writes it as bytes,
``decode`` reads every worker's bytes back into a :class:`Received`, and
``as_received`` gives what decoding a lone worker's own message would, without
making the bytes. The exchange (:mod:`distro_jax.delivery`) needs nothing else
of a format; SparseLoCo's messages are formats of this kind too.
"""

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from distro_jax import codec, cpu_kernels, dct, exchange

__all__ = ["Drawn", "Format", "MessageFormat", "Received", "Selection", "TopK", "drawn"]


class Selection(NamedTuple):
  """What one worker's message sends, per tensor in its block view.

  Attributes:
    indices: per tensor, int32 chunk-local positions ``(*lead, A, B, k)``.
    values: per tensor, the float32 coefficients there, full precision.
  """

  indices: list[jax.Array]
  values: list[jax.Array]


class Received(NamedTuple):
  """Every worker's message, read back.

  Attributes:
    tensors: per tensor, ``(indices, values)`` with the workers first:
      int32 positions and float32 values as the receivers decode them.
    valid: ``bool[W]``, whether each worker's message counts.
  """

  tensors: list[tuple[jax.Array, jax.Array]]
  valid: jax.Array


class Format(Protocol):
  """What the exchange asks of a message format (:func:`distro_jax.delivery.deliver`)."""

  @property
  def num_bytes(self) -> int:
    """The length of one worker's message."""

  def encode(self, selection: Any, valid: jax.Array) -> jax.Array:
    """One worker's ``uint8[num_bytes]`` message; ``valid=False`` marks it to be left out."""

  def decode(self, messages: jax.Array) -> Received:
    """Every worker's message, ``uint8[W, num_bytes]``, read back."""

  def as_received(self, selection: Any, valid: jax.Array) -> Received:
    """What :meth:`decode` gives of this worker's own message alone, without the bytes."""


class TopK(NamedTuple):
  """The ``k`` largest-magnitude coefficients of every chunk; the message carries their indices.

  Attributes:
    ks: coefficients kept per chunk, per tensor.
  """

  ks: tuple[int, ...]

  def select(self, blocks: list[jax.Array], tensors: Sequence[int]) -> list[tuple[Any, Any]]:
    """``(indices, values)``: the top-k of each block view, of the tensors numbered ``tensors``."""
    return codec.select_topk_many(blocks, [self.ks[i] for i in tensors])

  def sent(self, senders: tuple[int, ...]) -> None:
    """The positions receivers must draw themselves: none, the message names them."""
    del senders

  def made_at(self, step: jax.Array) -> "TopK":
    """The positions of a message made at ``step``: chosen then, and sent."""
    del step
    return self


class Drawn(NamedTuple):
  """``k`` positions per chunk drawn from a key that every worker can build.

  The draw is :func:`distro_jax.codec.draw_positions` (or
  :func:`distro_jax.cpu_kernels.draw_positions`, the same bits in one pass,
  where it serves the tensor); its key is a
  function of the step, the tensor, the sender's index on the
  workers' axis and, for a tensor sharded within a site (FSDP), the device's
  place along the axes that shard it; a tensor kept whole on a site's
  devices gets the same positions on each of them.

  Attributes:
    step: the step count the positions are drawn for.
    worker: this worker's index on the workers' axis (0 with none).
    shards: per tensor, the device's index along the site axes that shard
      it, or ``None``.
    block_shapes: per tensor, its block view.
    ks: positions per chunk, per tensor.
    bias: the draw's preference for low frequencies (0: uniform).
    native: per tensor, whether the CPU kernel draws its positions.
  """

  step: jax.Array
  worker: jax.Array | int
  shards: tuple[jax.Array | None, ...]
  block_shapes: tuple[tuple[int, ...], ...]
  ks: tuple[int, ...]
  bias: float
  native: tuple[bool, ...]

  def draw(self, tensor: int, worker: jax.Array | int) -> jax.Array:
    """Worker ``worker``'s positions in tensor ``tensor``, ``(*lead, A, B, k)``."""
    key = codec.position_key(self.step, tensor, worker, self.shards[tensor])
    fn = cpu_kernels.draw_positions if self.native[tensor] else codec.draw_positions
    return fn(key, self.block_shapes[tensor], self.ks[tensor], self.bias)

  def select(self, blocks: list[jax.Array], tensors: Sequence[int]) -> list[tuple[Any, Any]]:
    """This worker's drawn positions and the values there, for the tensors numbered ``tensors``."""
    picked = []
    for b, i in zip(blocks, tensors):
      idx = self.draw(i, self.worker)
      picked.append((idx, codec.gather_blocks(b, idx)))
    return picked

  def sent(self, senders: tuple[int, ...]) -> list[jax.Array]:
    """Each tensor's positions as the senders drew them: this worker's for ``()``, else W's."""

    def every_tensor(worker):
      return [self.draw(i, worker) for i in range(len(self.ks))]

    if not senders:
      return every_tensor(self.worker)
    # The all-gather orders the messages by the senders' indices on the axis.
    return jax.vmap(every_tensor)(jnp.arange(senders[0]))

  def made_at(self, step: jax.Array) -> "Drawn":
    """The positions of a message made at ``step``, drawn again from that step's keys."""
    return self._replace(step=step)


def drawn(
  step: jax.Array,
  axis_name: Hashable | None,
  grads: list[jax.Array],
  site_axes: Sequence[Hashable],
  block_shapes: Sequence[tuple[int, ...]],
  ks: Sequence[int],
  bias: float,
) -> Drawn:
  """This worker's :class:`Drawn` positions at ``step``, from where its gradients lie.

  Args:
    step: the step count the positions are drawn for.
    axis_name: the workers' axis; ``None`` for one worker.
    grads: this worker's gradients; those that vary over a site axis are
      sharded over it, and the device's place along it enters the key.
    site_axes: the mesh axes besides ``axis_name`` that gradients vary over.
    block_shapes: per tensor, its block view.
    ks: positions per chunk, per tensor.
    bias: the draw's preference for low frequencies (0: uniform).

  Returns:
    A :class:`Drawn`.

  Example:
    >>> import jax.numpy as jnp
    >>> from distro_jax import message
    >>> grads = [jnp.zeros((8, 8))]
    >>> pos = message.drawn(jnp.asarray(3), None, grads, [], [(1, 8, 1, 8)], [2], 0.0)
    >>> ((idx, values),) = pos.select([jnp.ones((1, 8, 1, 8))], [0])
    >>> idx.shape, bool(idx[0, 0, 0] < 32 <= idx[0, 0, 1])  # one from each half
    ((1, 1, 2), True)
  """
  shards = []
  for g in grads:
    axes = tuple(a for a in site_axes if exchange.varies_over(g, a))
    shards.append(jax.lax.axis_index(axes) if axes else None)
  worker = 0 if axis_name is None else jax.lax.axis_index(axis_name)
  native = tuple(cpu_kernels.serves_draw(s, g) for s, g in zip(block_shapes, grads))
  return Drawn(step, worker, tuple(shards), tuple(block_shapes), tuple(ks), bias, native)


class MessageFormat(NamedTuple):
  """A DeMo message's positions, values and basis. Static but for a drawn step.

  Attributes:
    layout: the bytes (:func:`distro_jax.wire.wire_layout`), which also say
      whether values travel as sign bits and whether positions are drawn.
    positions: :class:`TopK` or :class:`Drawn`.
    basis: :data:`distro_jax.dct.DCT_BASIS` or the identity ablation.
  """

  layout: codec.WireLayout
  positions: TopK | Drawn
  basis: dct.Basis

  @property
  def num_bytes(self) -> int:
    return self.layout.num_bytes

  def select(self, blocks: list[jax.Array], tensors: Sequence[int]) -> list[tuple[Any, Any]]:
    """``(indices, values)`` sent from each block view, of the tensors numbered ``tensors``."""
    return self.positions.select(blocks, tensors)

  def encode(self, selection: Selection, valid: jax.Array) -> jax.Array:
    return codec.encode_message(selection.indices, selection.values, self.layout, valid=valid)

  def decode(self, messages: jax.Array) -> Received:
    """Messages ``uint8[W, N]`` (or this worker's own, ``uint8[N]``) read back, W first."""
    positions = self.positions.sent(messages.shape[:-1])
    tensors, valid = codec.decode_message(messages, self.layout, positions)
    return Received(tensors, valid)

  def as_received(self, selection: Selection, valid: jax.Array) -> Received:
    # The receiver's view of a value: a codebook entry, a sign, or the value in the wire dtype.
    values = []
    for v, t in zip(selection.values, self.layout.tensors):
      if self.layout.codebook_bits:
        values.append(codec.dequantize(*codec.quantize(v, self.layout.codebook_bits)))
      elif self.layout.quantize_1bit:
        values.append(jnp.where(v >= 0, 1.0, -1.0))
      else:
        values.append(v.astype(t.value_dtype).astype(jnp.float32))
    tensors = [(i[None], v[None]) for i, v in zip(selection.indices, values)]
    return Received(tensors, jnp.asarray(valid)[None])

  def made_at(self, step: jax.Array) -> "MessageFormat":
    """The format of the message this worker made at ``step`` (its drawn positions then)."""
    return self._replace(positions=self.positions.made_at(step))
