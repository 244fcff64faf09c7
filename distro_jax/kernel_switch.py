"""What the CPU's and the GPU's fused kernels share: their off switch, and which tensors they take.

:mod:`distro_jax.cpu_kernels` and :mod:`distro_jax.pallas_kernels` each take a
tensor only in float32 block views of square chunks they have kernels for, not
placed on a mesh by the compiler (:func:`fits`); docs/library.md, "The pipeline".
"""

import contextlib
import os
import threading
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from distro_jax import dct

__all__ = ["Switch", "fits"]


class Switch:
  """A set of kernels' off switch: ``ENV=0``, or a :meth:`disabled` block in this thread."""

  def __init__(self, env: str):
    self.env = env
    self._local = threading.local()

  def off(self) -> bool:
    """Whether the kernels are off for what this thread traces now."""
    return getattr(self._local, "off", False) or os.environ.get(self.env, "1") == "0"

  @contextlib.contextmanager
  def disabled(self) -> Iterator[None]:
    """Turns the kernels off for what this thread traces within the block."""
    before = getattr(self._local, "off", False)
    self._local.off = True
    try:
      yield
    finally:
      self._local.off = before


def fits(
  plan: dct.ChunkPlan,
  arrays: tuple[jax.Array, ...],
  *,
  k: int | None,
  drawn: bool,
  sides: tuple[int, ...],
  top_k_side: int,
  max_k: int,
) -> bool:
  """Whether a set of kernels can take a tensor of ``plan`` given as block views ``arrays``.

  Args:
    plan: the tensor's chunk plan.
    arrays: its block views the kernel would read.
    k: the top-k per chunk a compress would select; ``None`` asks about the decode.
    drawn: whether the compress would take drawn positions.
    sides: the square chunk sides the kernels take for drawn positions and the decode.
    top_k_side: the one chunk side their top-k takes.
    max_k: the largest top-k they select.
  """
  side = plan.c1 if plan.c1 == plan.c2 else None
  if side not in sides:
    return False
  if k is not None and not drawn and (side != top_k_side or not 1 <= k <= max_k):
    return False
  return not any(x.dtype != jnp.float32 or dct.placed_on_mesh(x) for x in arrays)
