"""Top-k, the byte message, and mean-over-contributors aggregation."""

import compiled
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distro_jax as dj
from distro_jax import codec

# One program per call where JAX would compile one per operation (tests/compiled.py).
encode_message = jax.jit(codec.encode_message, static_argnames="layout")
decode_message = jax.jit(codec.decode_message, static_argnames="layout")
aggregate = compiled.aggregate_rows


@pytest.mark.parametrize(
  "chunk_size, bits", [(1, 1), (2, 1), (7, 3), (64, 6), (300, 9), (1600, 11), (4096, 12)]
)
def test_indices_travel_at_ceil_log2_of_the_chunk_size(chunk_size, bits):
  assert codec.index_bits(chunk_size) == bits
  layout = dj.codec.WireLayout((dj.codec.TensorWire(5, 3, chunk_size, "float32"),), True)
  # Three values per chunk: one pair carries a sign in its order, so two sign bits are written.
  assert layout.stream_bits == 5 * (3 * bits + 2)


def test_topk_keeps_largest_magnitudes_of_each_chunk_and_error_feedback_zeroes_them():
  # Two chunks of 2x2, side by side: chunk-local index i * 2 + j.
  y = jnp.asarray([[0.1, -5.0, 1.0, 1.0], [3.0, 0.2, -1.0, 0.0]])
  blocks = y.reshape(1, 2, 2, 2)
  idx, val = dj.codec.select_topk_blocks(blocks, 2)
  np.testing.assert_array_equal(idx, [[[1, 2], [0, 1]]])  # ties: lower index first
  np.testing.assert_array_equal(val, [[[-5.0, 3.0], [1.0, 1.0]]])
  expected = np.asarray([[0.1, 0, 0, 0], [0, 0.2, -1.0, 0]], np.float32)
  kept = codec.zero_selected_blocks(blocks, idx)
  np.testing.assert_array_equal(kept.reshape(2, 4), expected)


def _layout(quantize_1bit, value_dtype="float32"):
  return codec.WireLayout(
    (dj.codec.TensorWire(3, 2, 300, value_dtype), dj.codec.TensorWire(2, 5, 7, value_dtype)),
    quantize_1bit,
  )


def _distinct(rng, n, rows, k):
  """Chunk-local indices as top-k makes them: distinct within each row."""
  return jnp.asarray(np.stack([rng.choice(n, k, replace=False) for _ in range(rows)]))


def _selection(rng):
  idx = [_distinct(rng, 300, 3, 2), _distinct(rng, 7, 2, 5)]
  val = [
    jnp.asarray(rng.normal(size=(3, 2)), jnp.float32),
    jnp.asarray(rng.normal(size=(2, 5)), jnp.float32),
  ]
  return idx, val


def test_message_round_trip_full_precision():
  idx, val = _selection(np.random.default_rng(0))
  layout = _layout(False)
  msg = encode_message(idx, val, layout)
  assert msg.dtype == jnp.uint8 and msg.shape == (layout.num_bytes,)
  # 9-bit and 3-bit indices in one 84-bit stream (11 bytes), then the fp32 values.
  assert layout.num_bytes == 11 + 3 * 2 * 4 + 2 * 5 * 4
  tensors, valid = decode_message(msg, layout)
  assert bool(valid)
  for (i, v), i0, v0 in zip(tensors, idx, val):
    np.testing.assert_array_equal(i, i0)
    np.testing.assert_array_equal(v, v0)


def test_message_round_trip_bf16_values():
  idx, val = _selection(np.random.default_rng(1))
  layout = _layout(False, "bfloat16")
  msg = encode_message(idx, val, layout)
  assert layout.num_bytes == 11 + 3 * 2 * 2 + 2 * 5 * 2
  for (_, v), v0 in zip(decode_message(msg, layout)[0], val):
    np.testing.assert_array_equal(v, v0.astype(jnp.bfloat16).astype(jnp.float32))


def test_one_bit_values_are_packed_signs():
  idx, val = _selection(np.random.default_rng(2))
  layout = _layout(True)
  msg = encode_message(idx, val, layout)
  # 9 sign bits follow the 84 index bits in the same stream (3 x 1 + 2 x 3: each pair of a
  # chunk carries one sign in its order, k=5's last value its own bit): 93 bits, 12 bytes.
  assert layout.num_bytes == 12 == msg.shape[0]
  for (i, v), i0, v0 in zip(decode_message(msg, layout)[0], idx, val):
    signs = np.where(np.asarray(v0) >= 0, 1.0, -1.0)
    for row in range(i.shape[0]):
      # The same (index, sign) set in each chunk; within a pair the order may swap.
      sent = sorted(zip(np.asarray(i0)[row].tolist(), signs[row].tolist()))
      got = sorted(zip(np.asarray(i)[row].tolist(), np.asarray(v)[row].tolist()))
      assert got == sent
    np.testing.assert_array_equal(np.asarray(i)[:, 4:], np.asarray(i0)[:, 4:])  # an odd tail stays


@pytest.mark.parametrize("k", [2, 3, 8, 9])
def test_every_sign_pattern_survives_the_pair_order(k):
  # All four sign combinations of a pair, with its smaller index first and second.
  rng = np.random.default_rng(k)
  layout = dj.codec.WireLayout((dj.codec.TensorWire(64, k, 4096, "float32"),), True)
  idx = _distinct(rng, 4096, 64, k)
  val = jnp.asarray(rng.choice([-1.0, 1.0], size=(64, k)), jnp.float32)
  (((i, v),), valid) = decode_message(encode_message([idx], [val], layout), layout)
  assert bool(valid)
  for row in range(64):
    sent = dict(zip(np.asarray(idx)[row].tolist(), np.asarray(val)[row].tolist()))
    assert dict(zip(np.asarray(i)[row].tolist(), np.asarray(v)[row].tolist())) == sent


def test_decode_message_keeps_leading_worker_axis():
  rng = np.random.default_rng(3)
  layout = _layout(False)
  msgs = []
  sels = []
  for _ in range(4):
    idx, val = _selection(rng)
    sels.append((idx, val))
    msgs.append(encode_message(idx, val, layout, valid=len(msgs) != 2))
  decoded, valid = decode_message(jnp.stack(msgs), layout)
  np.testing.assert_array_equal(valid, [True, True, False, True])
  assert not np.any(np.asarray(msgs[2]))  # a message left out goes out as zeros
  for t, (i_w, v_w) in enumerate(decoded):
    assert i_w.shape[0] == 4
    for w in (0, 1, 3):
      np.testing.assert_array_equal(i_w[w], sels[w][0][t])
      np.testing.assert_array_equal(v_w[w], sels[w][1][t])


def test_one_coefficient_per_chunk_carries_a_flag_byte():
  # With k = 1 everywhere no chunk can name two positions, so validity needs a byte.
  layout = dj.codec.WireLayout((dj.codec.TensorWire(4, 1, 64, "float32"),), True)
  assert layout.header_bytes == 1 and layout.num_bytes == 1 + 4  # 4 x (6 + 1) bits: no pairs
  idx, val = jnp.zeros((4, 1), jnp.int32), jnp.ones((4, 1))
  msgs = jnp.stack([encode_message([idx], [val], layout, valid=v) for v in (True, False)])
  (tensors, valid) = decode_message(msgs, layout)
  np.testing.assert_array_equal(valid, [True, False])
  np.testing.assert_array_equal(tensors[0][0][0], idx)


@pytest.mark.parametrize("bits", [1, 2])
def test_codebook_values_travel_as_codes_after_the_indices_then_a_codebook_per_tensor(bits):
  # SparseLoCo's values: each tensor quantized on its own (codec.quantize).
  idx, val = _selection(np.random.default_rng(5))
  layout = _layout(False)._replace(codebook_bits=bits)
  # 84 index bits, then 16 codes of `bits` bits in one stream; a float32 codebook per tensor.
  assert layout.num_bytes == -(-(84 + 16 * bits) // 8) + 2 * (1 << bits) * 4
  msgs = jnp.stack([encode_message(idx, val, layout, valid=v) for v in (True, False)])
  assert msgs.shape == (2, layout.num_bytes) and not np.any(np.asarray(msgs[1]))
  decoded, valid = decode_message(msgs, layout)
  np.testing.assert_array_equal(valid, [True, False])
  for (i, v), i0, v0 in zip(decoded, idx, val):
    np.testing.assert_array_equal(i[0], i0)
    # The encoder's program rounds the codebook's means as it fuses them: to the ulp.
    np.testing.assert_allclose(v[0], codec.dequantize(*codec.quantize(v0, bits)), rtol=1e-6)
    assert len(np.unique(np.asarray(v[0]))) <= 1 << bits


@pytest.mark.parametrize("quantize_1bit", [True, False], ids=["1bit", "fp32"])
def test_drawn_positions_travel_as_values_alone(quantize_1bit):
  rng = np.random.default_rng(5)
  layout = codec.WireLayout(
    (dj.codec.TensorWire(3, 2, 300, "float32"), dj.codec.TensorWire(2, 5, 7, "float32")),
    quantize_1bit,
    drawn_positions=True,
  )
  # A flag byte, then 16 sign bits (no pair carries a sign in its order: the
  # positions are not sent), or the 16 fp32 values.
  assert layout.index_bits == 0 and layout.header_bytes == 1
  assert layout.num_bytes == 1 + (2 if quantize_1bit else 16 * 4)
  idx, val = _selection(rng)
  msgs = []
  for valid in (True, False):
    msgs.append(encode_message(idx, val, layout, valid=valid))
  assert msgs[0].shape == (layout.num_bytes,)
  positions = [jnp.stack([i, i]) for i in idx]
  tensors, valid = decode_message(jnp.stack(msgs), layout, positions)
  np.testing.assert_array_equal(valid, [True, False])
  for (i, v), i0, v0 in zip(tensors, idx, val):
    np.testing.assert_array_equal(i[0], i0)
    want = np.where(np.asarray(v0) >= 0, 1.0, -1.0) if quantize_1bit else v0
    np.testing.assert_array_equal(v[0], want)
  with pytest.raises(ValueError, match="drawn positions"):
    decode_message(msgs[0], layout)


def _expected_share(k, bias):
  """Each of an 8x8 chunk's 64 positions' share of the draws, from the documented rule."""
  i, j = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
  weight = (((1.0 + i) * (1.0 + j)) ** -bias).reshape(-1)
  share = np.zeros(64)
  for run in range(k):
    sl = slice(run * 64 // k, (run + 1) * 64 // k)
    share[sl] = weight[sl] / weight[sl].sum() / k
  return share


@pytest.mark.parametrize("k, bias", [(1, 0.0), (4, 0.0), (1, 1.0), (4, 1.0)])
def test_drawn_positions_follow_the_rule_and_are_a_function_of_the_key(k, bias):
  shape = (2, 8, 3, 8)  # a block view: 2 x 3 chunks of 8x8
  draws = np.stack(
    [
      np.asarray(dj.codec.draw_positions(dj.codec.position_key(step, 0, 1), shape, k, bias))
      for step in range(600)
    ]
  )
  assert draws.shape == (600, 2, 3, k) and draws.dtype == np.int32
  assert draws.min() >= 0 and draws.max() < 64
  # One from each run of 64 / k positions: distinct within every chunk.
  np.testing.assert_array_equal(draws // (64 // k), np.broadcast_to(np.arange(k), draws.shape))
  counts = np.bincount(draws.reshape(-1), minlength=64)
  expected = _expected_share(k, bias) * draws.size
  # A chi-square of 63 degrees of freedom stays far below 130 unless the
  # draws favour other positions than the rule says (at bias 1 the lowest
  # frequency is drawn 64 times as often as the highest).
  assert ((counts - expected) ** 2 / expected).sum() < 130
  again = dj.codec.draw_positions(dj.codec.position_key(599, 0, 1), shape, k, bias)
  np.testing.assert_array_equal(again, draws[-1])
  # Another worker, step or tensor draws other positions.
  for key in (
    dj.codec.position_key(599, 0, 2),
    dj.codec.position_key(598, 0, 1),
    dj.codec.position_key(599, 1, 1),
  ):
    assert not np.array_equal(dj.codec.draw_positions(key, shape, k, bias), draws[-1])


def test_drawn_positions_ignore_the_default_prng_impl():
  # Every receiver must draw a sender's positions exactly, so a process set to
  # another generator (jax_default_prng_impl) still draws threefry's.
  shape = (2, 8, 3, 8)
  want = np.asarray(dj.codec.draw_positions(dj.codec.position_key(7, 1, 2), shape, 4, 1.0))
  before = jax.config.jax_default_prng_impl
  try:
    for impl in ("rbg", "unsafe_rbg"):
      jax.config.update("jax_default_prng_impl", impl)
      got = dj.codec.draw_positions(dj.codec.position_key(7, 1, 2), shape, 4, 1.0)
      np.testing.assert_array_equal(np.asarray(got), want, err_msg=impl)
  finally:
    jax.config.update("jax_default_prng_impl", before)


def test_psyche_message_is_12_and_a_half_bytes_per_64x64_chunk():
  # Top-k 8 of 4096 with 1-bit values: 8 x 12 index bits and 4 sign bits (the other 4
  # signs in the pairs' order), down from 8 x (16 + 1).
  rng = np.random.default_rng(8)
  layout = dj.codec.WireLayout((dj.codec.TensorWire(10, 8, 4096, "float32"),), True)
  assert layout.num_bytes == 10 * 100 // 8
  idx = _distinct(rng, 4096, 10, 8)
  val = jnp.asarray(rng.normal(size=(10, 8)), jnp.float32)
  (((i, v),), valid) = decode_message(encode_message([idx], [val], layout), layout)
  assert bool(valid)
  signs = np.where(np.asarray(val) >= 0, 1.0, -1.0)
  for row in range(10):
    sent = dict(zip(np.asarray(idx)[row].tolist(), signs[row].tolist()))
    assert dict(zip(np.asarray(i)[row].tolist(), np.asarray(v)[row].tolist())) == sent


def test_aggregate_is_mean_over_contributors_only():
  idx = jnp.asarray([[[0, 1]], [[1, 2]], [[1, 3]]])  # 3 workers, 1 chunk, k=2
  val = jnp.asarray([[[1.0, 2.0]], [[4.0, 8.0]], [[6.0, -3.0]]])
  dense, count = aggregate(idx, val, 5)
  np.testing.assert_allclose(dense, [[1.0, 4.0, 8.0, -3.0, 0.0]], rtol=1e-6)
  np.testing.assert_array_equal(count, [[1, 3, 1, 1, 0]])


def test_aggregate_leaves_out_invalid_workers():
  idx = jnp.asarray([[[0, 1]], [[1, 2]]])
  val = jnp.asarray([[[1.0, 2.0]], [[4.0, 8.0]]])
  dense, count = aggregate(idx, val, 3, valid_W=jnp.asarray([True, False]))
  np.testing.assert_array_equal(dense, [[1.0, 2.0, 0.0]])
  np.testing.assert_array_equal(count, [[1, 1, 0]])


def _random_payloads(rng, workers, rows, chunk, k):
  idx = np.stack(
    [np.stack([rng.choice(chunk, k, replace=False) for _ in range(rows)]) for _ in range(workers)]
  )
  return jnp.asarray(idx), jnp.asarray(rng.normal(size=(workers, rows, k)), jnp.float32)


def test_aggregate_is_bit_identical_under_worker_shuffles():
  rng = np.random.default_rng(4)
  idx, val = _random_payloads(rng, 8, 16, 12, 6)
  ref, _ = aggregate(idx, val, 12)
  for _ in range(5):
    perm = rng.permutation(8)
    out, _ = aggregate(idx[perm], val[perm], 12)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint32), np.asarray(ref).view(np.uint32))


def test_identical_payloads_aggregate_to_that_payload_exactly():
  rng = np.random.default_rng(5)
  idx, val = _random_payloads(rng, 1, 16, 12, 6)
  one, _ = aggregate(idx, val, 12)
  for workers in (3, 7):
    many, _ = aggregate(jnp.repeat(idx, workers, 0), jnp.repeat(val, workers, 0), 12)
    np.testing.assert_array_equal(many, one)


def test_aggregate_matches_brute_force_mean():
  rng = np.random.default_rng(6)
  idx, val = _random_payloads(rng, 5, 9, 10, 4)
  total = np.zeros((9, 10))
  count = np.zeros((9, 10))
  for w in range(5):
    for r in range(9):
      for j, v in zip(np.asarray(idx[w, r]), np.asarray(val[w, r])):
        total[r, j] += v
        count[r, j] += 1
  expected = np.where(count > 0, total / np.maximum(count, 1), 0)
  dense, n = aggregate(idx, val, 10)
  np.testing.assert_allclose(dense, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(n, count)


@pytest.mark.slow
def test_two_stage_topk_picks_exactly_what_a_full_top_k_picks():
  rng = np.random.default_rng(7)
  rows = [
    rng.normal(size=4096),
    np.zeros(4096),  # all ties
    np.where(rng.random(4096) < 0.002, rng.normal(size=4096), 0.0),  # fewer nonzeros than k
    np.round(rng.normal(size=4096)),  # many exact ties
    np.repeat(rng.normal(size=512), 8),  # ties inside groups
  ]
  y = jnp.asarray(np.stack(rows), jnp.float32)
  select = jax.jit(compiled.topk_rows, static_argnums=1)
  for k in (1, 8, 32, 128):
    idx, val = select(y, k)
    _, ref = jax.lax.top_k(jnp.abs(y), k)
    np.testing.assert_array_equal(np.sort(idx, axis=1), np.sort(ref, axis=1))
    np.testing.assert_array_equal(val, np.take_along_axis(np.asarray(y), np.asarray(idx), 1))


def _bits(x):
  return np.asarray(x).view(np.uint32)


def test_aggregate_ignores_the_order_of_entries_within_a_chunk():
  # +-1 values shared by many workers: a running mean of three or more of them
  # rounds differently in different worker orders, so this fails whenever the
  # canonical order reads the entries' order.
  rng = np.random.default_rng(11)
  workers, rows, chunk, k = 8, 64, 16, 6
  idx = np.stack(
    [np.stack([rng.choice(chunk, k, replace=False) for _ in range(rows)]) for _ in range(workers)]
  )
  val = rng.choice([-1.0, 1.0], size=(workers, rows, k)).astype(np.float32)
  ref, ref_n = aggregate(jnp.asarray(idx), jnp.asarray(val), chunk)
  for _ in range(4):
    perm = np.argsort(rng.random((workers, rows, k)), axis=-1)
    out, n = aggregate(
      jnp.asarray(np.take_along_axis(idx, perm, -1)),
      jnp.asarray(np.take_along_axis(val, perm, -1)),
      chunk,
    )
    np.testing.assert_array_equal(_bits(out), _bits(ref))
    np.testing.assert_array_equal(n, ref_n)


def test_one_bit_aggregate_is_the_same_to_the_bit_through_the_wire():
  # The 1-bit format swaps index pairs to carry signs; the aggregate of what
  # the receivers decode equals the aggregate of the selections as chosen.
  rng = np.random.default_rng(12)
  workers, rows, chunk = 8, 32, 4096
  # In every chunk the same 10 positions stand out for all workers, with signs
  # and sizes of their own: the workers share most choices and disagree in sign.
  hot = np.stack([rng.choice(chunk, 10, replace=False) for _ in range(rows)])
  rows_x = rng.normal(size=(workers, rows, chunk)) * 0.01
  big = rng.uniform(1, 2, size=(workers, rows, 10)) * rng.choice([-1, 1], size=(workers, rows, 10))
  np.put_along_axis(rows_x, np.broadcast_to(hot, (workers, rows, 10)), big, -1)
  # A (64, 2048) param has 32 chunks of 64 x 64: 4096 coefficients each.
  layout = dj.wire.wire_layout(
    jax.ShapeDtypeStruct((64, 2048), jnp.float32),
    compression_topk=8,
    compression_chunk=64,
    quantize_1bit=True,
  )

  @jax.jit
  def send(r):
    i, v = compiled.topk_rows(r, 8)
    return i, jnp.where(v >= 0, 1.0, -1.0), encode_message([i], [v], layout)

  @jax.jit
  def receive(idx, signs, messages):
    (tensors, valid) = decode_message(messages, layout)
    ((got_idx, got_val),) = tensors
    want, _ = aggregate(idx, signs, chunk)
    got, _ = aggregate(got_idx, got_val, chunk, valid)
    return got_idx, got, want

  idx, signs, messages = (jnp.stack(x) for x in zip(*(send(r.astype(np.float32)) for r in rows_x)))
  got_idx, got, want = receive(idx, signs, messages)
  assert not np.array_equal(got_idx, idx)  # some pairs did travel swapped
  np.testing.assert_array_equal(_bits(got), _bits(want))
