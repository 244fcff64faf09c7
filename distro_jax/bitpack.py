"""Unsigned integers at any bit width as one bit stream, and arrays as raw bytes.

Values of ``bits`` bits go end to end, least significant bit first: bit ``j``
of value ``i`` is stream bit ``i * bits + j``, which ``jnp.packbits(...,
bitorder="little")`` puts at bit ``s % 8`` of byte ``s // 8`` (the codec's wire).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

__all__ = [
  "bits_for",
  "from_bit_stream",
  "from_bytes",
  "to_bit_stream",
  "to_bytes",
]


def bits_for(num_values: int) -> int:
  """Bits that index ``num_values`` distinct values: ``ceil(log2 n)``, at least 1."""
  if num_values < 1:
    raise ValueError(f"bits_for needs at least one value, got {num_values}.")
  return max(1, (num_values - 1).bit_length())


def _check_bits(bits: int) -> None:
  if not 1 <= bits <= 32:
    raise ValueError(f"bits must be in [1, 32], got {bits}.")


def to_bit_stream(values: jax.Array, bits: int) -> jax.Array:
  """The bits of ``values``, ``uint8[values.size * bits]``, to concatenate and ``jnp.packbits``.

  Args:
    values: non-negative integers below ``2**bits``, any shape (flattened in C order).
    bits: width of each value, 1 to 32. Static.

  Example:
    >>> import jax.numpy as jnp
    >>> from distro_jax import bitpack
    >>> stream = bitpack.to_bit_stream(jnp.array([5, 4095, 0]), 12)
    >>> packed = jnp.packbits(stream, bitorder="little")  # 36 bits in 5 bytes
    >>> packed.shape
    (5,)
    >>> back = jnp.unpackbits(packed, count=36, bitorder="little")
    >>> bitpack.from_bit_stream(back, 12, 3).tolist()
    [5, 4095, 0]
  """
  _check_bits(bits)
  flat = jnp.ravel(values).astype(jnp.uint32)
  shifts = jnp.arange(bits, dtype=jnp.uint32)
  return ((flat[:, None] >> shifts) & np.uint32(1)).astype(jnp.uint8).reshape(-1)


def from_bit_stream(stream: jax.Array, bits: int, count: int) -> jax.Array:
  """Inverse of :func:`to_bit_stream`: ``uint32[..., count]``, leading batch axes kept.

  Args:
    stream: ``uint8[..., count * bits]`` of zeros and ones.
    bits: width of each value. Static.
    count: how many values. Static.
  """
  _check_bits(bits)
  lead = stream.shape[:-1]
  grouped = stream.reshape(*lead, count, bits).astype(jnp.uint32)
  weights = np.uint32(1) << jnp.arange(bits, dtype=jnp.uint32)
  return jnp.sum(grouped * weights, axis=-1, dtype=jnp.uint32)


def to_bytes(x: jax.Array) -> jax.Array:
  """Flattens ``x`` to its raw bytes (``uint8``), in native byte order."""
  return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def from_bytes(b: jax.Array, dtype: DTypeLike, shape: tuple[int, ...]) -> jax.Array:
  """Inverse of :func:`to_bytes` for an array of ``shape`` and ``dtype``; leading axes kept."""
  dtype = np.dtype(dtype)
  lead = b.shape[:-1]
  if dtype.itemsize == 1:
    return jax.lax.bitcast_convert_type(b, dtype).reshape(*lead, *shape)
  return jax.lax.bitcast_convert_type(b.reshape(*lead, *shape, dtype.itemsize), dtype)
