"""Which fused kernels run a stage of DeMo's update here, if any.

A kernel is another implementation of a stage, with the stage's inputs and
outputs: :func:`distro_jax.cpu_kernels.compress` and
:func:`distro_jax.pallas_kernels.compress` for compress (momentum, DCT and
selection), their ``decode`` for decode (the workers' mean and the inverse
DCT). The CPU's are taken on a CPU backend, the Pallas ones on a GPU, each
where it serves the tensor; ``None`` means XLA's path. The switches
``DISTRO_JAX_CPU_KERNELS=0`` and ``DISTRO_JAX_PALLAS=0`` turn either off.
"""

from types import ModuleType

import jax

from distro_jax import cpu_kernels, dct, pallas_kernels

__all__ = ["for_compress", "for_decode"]


def for_compress(
  plan: dct.ChunkPlan, g: jax.Array, m: jax.Array, *, k: int, drawn: bool
) -> ModuleType | None:
  """The kernels whose ``compress`` takes this tensor's block views, or ``None``."""
  for kernels in (cpu_kernels, pallas_kernels):
    if kernels.serves(plan, g, m, k=k, drawn=drawn):
      return kernels
  return None


def for_decode(plan: dct.ChunkPlan, m: jax.Array) -> ModuleType | None:
  """The kernels whose ``decode`` takes this tensor (``m`` in its block view), or ``None``."""
  for kernels in (cpu_kernels, pallas_kernels):
    if kernels.serves(plan, m):
      return kernels
  return None
