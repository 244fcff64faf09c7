"""Dense bit packing: exact round trips at every width, and the byte count it promises."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distro_jax import bitpack


@pytest.mark.parametrize(
  ("n", "bits"), [(1, 1), (2, 1), (3, 2), (40, 6), (64, 6), (4096, 12), (65536, 16), (65537, 17)]
)
def test_bits_for_is_ceil_log2(n, bits):
  assert bitpack.bits_for(n) == bits


def _pack(values: jax.Array, bits: int) -> jax.Array:
  """The codec's packing: the bit stream, eight bits to a byte, least significant first."""
  return jnp.packbits(bitpack.to_bit_stream(values, bits), bitorder="little")


def _unpack(packed: jax.Array, bits: int, count: int) -> jax.Array:
  stream = jnp.unpackbits(packed, axis=-1, count=count * bits, bitorder="little")
  return bitpack.from_bit_stream(stream, bits, count)


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(bits=st.integers(1, 32), count=st.integers(0, 300), seed=st.integers(0, 2**16))
def test_round_trip_is_exact_and_tight(bits, count, seed):
  rng = np.random.default_rng(seed)
  values = rng.integers(0, 2**bits, size=count, dtype=np.uint64).astype(np.uint32)
  # Jitted: one program per example, where eager calls compile one per operation.
  packed = jax.jit(_pack, static_argnums=1)(jnp.asarray(values), bits)
  assert packed.dtype == jnp.uint8
  assert packed.shape == (-(-count * bits // 8),)
  unpacked = jax.jit(_unpack, static_argnums=(1, 2))(packed, bits, count)
  np.testing.assert_array_equal(np.asarray(unpacked), values)


def test_unpack_keeps_leading_axes_and_jits():
  values = np.arange(3 * 7).reshape(3, 7).astype(np.uint32) * 97 % 4096
  packed = jnp.stack([_pack(jnp.asarray(v), 12) for v in values])
  out = jax.jit(_unpack, static_argnums=(1, 2))(packed, 12, 7)
  np.testing.assert_array_equal(np.asarray(out), values)


def test_stream_order_is_least_significant_bit_first():
  # 0b101 then 0b011 at 3 bits: stream 1,0,1,1,1,0 -> byte 0b00011101.
  assert _pack(jnp.array([5, 3]), 3).tolist() == [0b00011101]


def test_bad_width_is_refused():
  with pytest.raises(ValueError, match="bits must be in"):
    bitpack.to_bit_stream(jnp.array([1]), 0)
  with pytest.raises(ValueError, match="bits must be in"):
    bitpack.from_bit_stream(jnp.zeros((33,), jnp.uint8), 33, 1)


@pytest.mark.parametrize(
  "dtype",
  [np.dtype("float32"), jnp.float32, np.float32, "float32", jnp.bfloat16, "bfloat16", np.uint8],
  ids=["np.dtype", "jnp.float32", "np.float32", "str", "jnp.bfloat16", "str-bf16", "np.uint8"],
)
def test_from_bytes_takes_any_dtype_like(dtype):
  # Only an np.dtype instance used to work: jnp.float32 has no .itemsize.
  x = jnp.arange(2 * 3 * 4).reshape(2, 3, 4).astype(dtype)
  b = jnp.stack([bitpack.to_bytes(row) for row in x])  # a leading batch axis
  out = bitpack.from_bytes(b, dtype, (3, 4))
  assert out.dtype == np.dtype(dtype)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
