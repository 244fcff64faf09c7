"""Property tests of the chunked DCT and the codec on random shapes, chunks and k."""

import functools

import compiled
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import distro_jax as dj
from distro_jax import dct, wire

SIZES = st.sampled_from([1, 2, 3, 5, 6, 7, 8, 12, 13, 16, 31, 36, 64, 97])
SHAPES = st.lists(SIZES, min_size=0, max_size=4).map(tuple).filter(lambda s: np.prod(s) <= 20_000)
SETTINGS = settings(max_examples=15, deadline=None)
# Each example has shapes of its own, so each compiles anew: run op by op, an
# example compiled every operation on its own (about 5 s); jitted, it compiles
# one program. Both sides of every bit-for-bit comparison run jitted.


def _selection(x, chunk, k):
  plan = dct.plan_chunks(x.shape, chunk)
  coeffs = dct.DCT_BASIS.forward(dct.to_blocks(x, plan), plan)
  idx, val = dj.codec.select_topk_blocks(coeffs, min(k, plan.chunk_size))
  return plan, idx, val


@functools.partial(jax.jit, static_argnums=1)
def _round_trip(x, chunk):
  plan, idx, val = _selection(x, chunk, 10**6)
  layout = wire.wire_layout(x, compression_topk=10**6, compression_chunk=chunk, quantize_1bit=False)
  message = dj.codec.encode_message([idx], [val], layout)
  (tensors, valid) = dj.codec.decode_message(message[None], layout)
  ((dense, _),) = dj.codec.aggregate_blocks(tensors, [plan.block_shape], valid)
  return dct.from_blocks(dct.DCT_BASIS.inverse(dense, plan), plan)


@pytest.mark.slow
@SETTINGS
@given(shape=SHAPES, chunk=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_keeping_every_coefficient_reconstructs_the_tensor(shape, chunk, seed):
  x = jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)
  np.testing.assert_allclose(_round_trip(x, chunk), x, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@SETTINGS
@given(
  shape=SHAPES,
  chunk=st.integers(1, 70),
  k=st.integers(1, 40),
  q1=st.booleans(),
  dtype=st.sampled_from(["float32", "bfloat16"]),
)
def test_byte_accounting_is_the_message_length(shape, chunk, k, q1, dtype):
  x = jnp.zeros(shape, dtype)
  layout = wire.wire_layout(x, compression_topk=k, compression_chunk=chunk, quantize_1bit=q1)

  @jax.jit
  def encode(x):
    _, idx, val = _selection(x, chunk, k)
    return dj.codec.encode_message([idx], [val], layout)

  message = encode(x)
  assert message.dtype == jnp.uint8
  assert (
    message.size
    == layout.num_bytes
    == dj.wire_bytes(x, compression_topk=k, compression_chunk=chunk, quantize_1bit=q1).payload
  )


@pytest.mark.slow
@SETTINGS
@given(
  workers=st.integers(2, 9),
  rows=st.integers(1, 6),
  chunk=st.integers(1, 40),
  k=st.integers(1, 40),
  seed=st.integers(0, 2**16),
  data=st.data(),
)
def test_worker_order_changes_the_aggregate_by_not_one_bit(workers, rows, chunk, k, seed, data):
  k = min(k, chunk)
  rng = np.random.default_rng(seed)
  idx = np.stack(
    [np.stack([rng.choice(chunk, k, replace=False) for _ in range(rows)]) for _ in range(workers)]
  )
  # Coarse values make shared coefficients and exact ties common.
  val = rng.integers(-3, 4, size=(workers, rows, k)).astype(np.float32) * rng.choice([1, 0.1])
  perm = np.asarray(data.draw(st.permutations(range(workers))))
  # One program for both orders.
  aggregate = compiled.aggregate_rows
  a, na = aggregate(jnp.asarray(idx), jnp.asarray(val), chunk)
  b, nb = aggregate(jnp.asarray(idx[perm]), jnp.asarray(val[perm]), chunk)
  np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
  np.testing.assert_array_equal(na, nb)


@pytest.mark.slow
@SETTINGS
@given(
  workers=st.integers(1, 9),
  shape=SHAPES,
  chunk=st.integers(1, 70),
  k=st.integers(1, 40),
  seed=st.integers(0, 2**16),
)
def test_identical_payloads_aggregate_to_that_payload(workers, shape, chunk, k, seed):
  x = jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)
  one, many, count = _one_and_many(x, chunk, k, workers)
  np.testing.assert_array_equal(many, one)
  assert set(np.unique(np.asarray(count))) <= {0, workers}


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _one_and_many(x, chunk, k, workers):
  """The aggregate of one worker's selection, and of ``workers`` copies of it."""
  plan, idx, val = _selection(x, chunk, k)
  ((one, _),) = dj.codec.aggregate_blocks([(idx[None], val[None])], [plan.block_shape])
  copies = (jnp.repeat(idx[None], workers, 0), jnp.repeat(val[None], workers, 0))
  ((many, count),) = dj.codec.aggregate_blocks([copies], [plan.block_shape])
  return one, many, count
