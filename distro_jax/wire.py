"""Byte accounting: what one worker sends per step, to the byte, against the baselines."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from distro_jax import codec, dct
from distro_jax.hyperparams import static_positive_int

__all__ = ["WireBytes", "plan_tree", "ring_allreduce_factor", "wire_bytes", "wire_layout"]


def carried(x: Any) -> bool:
  """Whether the message carries a leaf: a tensor with no entries has nothing to send."""
  return bool(np.size(x))


class CarriedLeaves:
  """Which of a flat list of leaves the message carries (see :func:`carried`)."""

  def __init__(self, leaves: list[Any]):
    self.mask = [carried(x) for x in leaves]

  @property
  def all(self) -> bool:
    """Whether every leaf is carried, so that nothing needs to be taken out."""
    return all(self.mask)

  def pick(self, xs: list[Any]) -> list[Any]:
    """The entries of ``xs`` (one per leaf) at the carried leaves."""
    return [x for x, k in zip(xs, self.mask, strict=True) if k]

  def merge(self, picked: list[Any], others: list[Any]) -> list[Any]:
    """One entry per leaf: ``picked``'s in order at the carried leaves, ``others``' elsewhere."""
    return self.with_empty(picked, others, lambda o: o)

  def with_empty(
    self, picked: list[Any], leaves: list[Any], empty: Callable[[Any], Any]
  ) -> list[Any]:
    """One entry per leaf: ``picked``'s at the carried leaves, ``empty(leaf)`` (only) elsewhere."""
    it = iter(picked)
    return [next(it) if k else empty(x) for x, k in zip(leaves, self.mask, strict=True)]


def plan_tree(params: Any, compression_chunk: int) -> list[dct.ChunkPlan]:
  """A :class:`~distro_jax.dct.ChunkPlan` for every leaf, in tree order."""
  return [dct.plan_chunks(tuple(np.shape(x)), compression_chunk) for x in jax.tree.leaves(params)]


def wire_layout(
  params: Any,
  *,
  compression_topk: int,
  compression_chunk: int,
  quantize_1bit: bool,
  random_positions: bool = False,
  codebook_bits: int | None = None,
) -> codec.WireLayout:
  """The message layout of a params tree: its carried leaves, in order (SparseLoCo's too)."""
  tensors = []
  leaves = [x for x in jax.tree.leaves(params) if carried(x)]
  for x, plan in zip(leaves, plan_tree(leaves, compression_chunk)):
    k = min(compression_topk, plan.chunk_size)
    tensors.append(codec.TensorWire(plan.rows, k, plan.chunk_size, np.dtype(x.dtype).name))
  return codec.WireLayout(
    tuple(tensors), bool(quantize_1bit), bool(random_positions), codebook_bits
  )


def ring_allreduce_factor(num_workers: int) -> float:
  """Operands a ring all-reduce moves up each worker's link: ``2 (W - 1) / W``."""
  return 2 * (num_workers - 1) / num_workers


class WireBytes(NamedTuple):
  """Bytes per worker per step, and what they are compared with.

  Attributes:
    payload: the message one worker sends (layout: :mod:`distro_jax.codec`).
    grad_bf16: the full gradient in bf16, the DisTrO report's baseline.
    grad_fp32: the full gradient in fp32.
    grad: the full gradient in the parameters' own dtypes.
    ring_allreduce: what a ring all-reduce of ``grad`` moves per worker.
    num_workers: the W used for ``ring_allreduce``.
  """

  payload: int
  grad_bf16: int
  grad_fp32: int
  grad: int
  ring_allreduce: float
  num_workers: int

  @property
  def ratio_vs_bf16(self) -> float:
    """The DisTrO report's ratio: bf16 gradient bytes over payload bytes."""
    return self.grad_bf16 / self.payload

  @property
  def ratio_vs_ring(self) -> float:
    """Ring all-reduce bytes (parameter dtype) over payload bytes."""
    return self.ring_allreduce / self.payload


def wire_bytes(
  params: Any,
  *,
  compression_topk: int = 32,
  compression_chunk: int = 64,
  quantize_1bit: bool = False,
  num_workers: int = 8,
  random_positions: bool = False,
) -> WireBytes:
  """Payload bytes per worker per step for ``params``, with the baselines.

  Args:
    params: a tree of arrays or ``jax.ShapeDtypeStruct`` (``jax.eval_shape``'s).
    compression_topk: coefficients kept per chunk (clamped to the chunk size).
    compression_chunk: chunk target length per axis.
    quantize_1bit: whether values travel as sign bits.
    num_workers: W, for the ring all-reduce baseline.
    random_positions: whether the positions are drawn instead of sent.

  Returns:
    A :class:`WireBytes`.

  Raises:
    TypeError: a size that is not an int (``compression_topk=2.5``).
    ValueError: a size of zero or less.

  Example:
    >>> import jax.numpy as jnp, distro_jax as dj
    >>> params = {"w": jnp.zeros((4096, 4096))}
    >>> b = dj.wire_bytes(params, num_workers=8)
    >>> b.payload == 4096 * 32 * (12 + 32) // 8  # 12-bit indices, then fp32 values
    True
    >>> psyche = dj.wire_bytes(params, compression_topk=8, quantize_1bit=True)
    >>> psyche.payload  # per 64x64 chunk 8 x 12 index bits + 4 sign bits (4 more in the order)
    51200
    >>> drawn = dj.wire_bytes(params, compression_topk=1, compression_chunk=8,
    ...                       quantize_1bit=True, random_positions=True)
    >>> drawn.payload  # a flag byte, then one sign bit per 8x8 chunk
    32769
  """
  num_workers = static_positive_int("num_workers", num_workers, example=8)
  layout = wire_layout(
    params,
    compression_topk=static_positive_int("compression_topk", compression_topk, example=32),
    compression_chunk=static_positive_int("compression_chunk", compression_chunk, example=64),
    quantize_1bit=quantize_1bit,
    random_positions=random_positions,
  )
  leaves = jax.tree.leaves(params)
  numel = sum(int(np.prod(np.shape(x))) for x in leaves)
  grad = sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in leaves)
  ring = ring_allreduce_factor(num_workers) * grad
  return WireBytes(layout.num_bytes, 2 * numel, 4 * numel, grad, ring, num_workers)
