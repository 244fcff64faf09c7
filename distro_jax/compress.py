"""DeMo's compress stage: one worker's gradient into its message and what stays behind.

Per tensor, in its block view: fold the gradient into the momentum in the
format's basis (``m <- decay * m + lr * basis(g)``), select the message's
positions and values from it (:meth:`distro_jax.message.MessageFormat.select`),
and zero what was selected (error feedback, so what is sent leaves the
momentum at full precision).

A fused kernel is another implementation of this stage: :func:`_fused`
is where the stage asks whether one serves a tensor (the ``serves`` of
:mod:`distro_jax.cpu_kernels`, then of :mod:`distro_jax.pallas_kernels`:
the CPU's on a CPU, the Pallas ones on a GPU, each folding, transforming and
taking the top-k or the drawn positions in one pass), and every tensor none
serves takes XLA's path.
"""

from typing import Any, NamedTuple

import jax

from distro_jax import codec, cpu_kernels, dct, pallas_kernels
from distro_jax.message import Drawn, MessageFormat, Selection

__all__ = ["Compressed", "compress", "fold_in"]


class Compressed(NamedTuple):
  """One worker's side of a step, per tensor in its block view.

  Attributes:
    momentum: the momentum with this gradient folded in, before error feedback.
    selection: what the message sends from it.
    kept: the momentum with the selection zeroed (error feedback).
  """

  momentum: list[jax.Array]
  selection: Selection
  kept: list[jax.Array]


def fold_in(
  g_blocks: jax.Array,
  m_blocks: jax.Array,
  plan: dct.ChunkPlan,
  basis: dct.Basis,
  lr: Any,
  decay: float,
) -> jax.Array:
  """``decay * m + lr * basis(g)``: the decoupled momentum, in the basis the message is cut from."""
  return decay * m_blocks + lr * basis.forward(g_blocks, plan)


def _fused(
  fmt: MessageFormat,
  tensor: int,
  g_blocks: jax.Array,
  m_blocks: jax.Array,
  plan: dct.ChunkPlan,
  lr: Any,
  decay: float,
) -> tuple[jax.Array, jax.Array, jax.Array] | None:
  """``(momentum, indices, values)`` from a fused kernel; ``None`` where none serves."""
  k = fmt.layout.tensors[tensor].k
  drawn = isinstance(fmt.positions, Drawn)
  if fmt.basis is not dct.DCT_BASIS:
    return None
  for fused in (cpu_kernels, pallas_kernels):
    if fused.serves(plan, g_blocks, m_blocks, k=k, drawn=drawn):
      at = fmt.positions.draw(tensor, fmt.positions.worker) if drawn else None
      return fused.compress(g_blocks, m_blocks, decay, lr, k, positions=at)
  return None


def compress(
  grads: list[jax.Array],
  momentum_blocks: list[jax.Array],
  plans: list[dct.ChunkPlan],
  fmt: MessageFormat,
  lr: Any,
  decay: float,
  kernels: bool = True,
  feed_back: bool = True,
  keep: float = 0.0,
) -> Compressed:
  """Folds each gradient into its momentum, selects the message from it, and feeds back.

  Args:
    grads: this worker's gradients, in their params' shapes.
    momentum_blocks: its momenta in their block views (after the feedback of
      any message still in flight).
    plans: each tensor's :class:`~distro_jax.dct.ChunkPlan`.
    fmt: the message's format.
    lr: the learning rate folded into the momentum.
    decay: the momentum's decay.
    kernels: whether a fused kernel may serve a tensor; ``False`` keeps every
      tensor on XLA's path, whose DCT rounds differently.
    feed_back: zero what was selected in the momentum (error feedback).
    keep: with ``feed_back``, the share of each selected value left in the
      momentum (0 zeroes it).

  Returns:
    A :class:`Compressed`.

  Example:
    >>> import jax.numpy as jnp
    >>> from distro_jax import compress, dct, message, wire
    >>> grads = [jnp.arange(64.0).reshape(8, 8)]
    >>> layout = wire.wire_layout(
    ...     grads, compression_topk=2, compression_chunk=8, quantize_1bit=False)
    >>> fmt = message.MessageFormat(layout, message.TopK((2,)), dct.DCT_BASIS)
    >>> plans = wire.plan_tree(grads, 8)
    >>> momentum = [jnp.zeros(plans[0].block_shape)]
    >>> out = compress.compress(grads, momentum, plans, fmt, lr=1.0, decay=0.9)
    >>> out.selection.indices[0].shape  # (chunks down, chunks across, k)
    (1, 1, 2)
    >>> int((out.momentum[0] != 0).sum() - (out.kept[0] != 0).sum())  # fed back
    2
  """
  g_blocks = [dct.to_blocks(g, plan) for g, plan in zip(grads, plans)]
  fused = [
    _fused(fmt, i, g, m, plan, lr, decay) if kernels else None
    for i, (g, m, plan) in enumerate(zip(g_blocks, momentum_blocks, plans))
  ]
  momentum = [
    f[0] if f is not None else fold_in(g, m, plan, fmt.basis, lr, decay)
    for f, g, m, plan in zip(fused, g_blocks, momentum_blocks, plans)
  ]
  # Every tensor the kernels left goes through one selection, which batches
  # the top-k of tensors alike.
  rest = [i for i, f in enumerate(fused) if f is None]
  chosen = dict(zip(rest, fmt.select([momentum[i] for i in rest], rest)))
  picks = [chosen[i] if f is None else f[1:] for i, f in enumerate(fused)]
  selection = Selection([idx for idx, _ in picks], [val for _, val in picks])
  if not feed_back:
    return Compressed(momentum, selection, momentum)
  if keep:
    kept = [
      codec.scatter_blocks(m, idx, keep * codec.gather_blocks(m, idx))
      for m, idx in zip(momentum, selection.indices)
    ]
    return Compressed(momentum, selection, kept)
  kept = [codec.zero_selected_blocks(m, idx) for m, idx in zip(momentum, selection.indices)]
  return Compressed(momentum, selection, kept)
