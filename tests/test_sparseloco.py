"""dj.sparseloco: against its float64 NumPy reference, on the wire, and in the HLO."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxpr_gathers import gather_branch_paths
from sharded_step import (
  assert_identical_on_every_device,
  build,
  mesh_of,
  per_device_copies,
  place_grads,
)
from sparseloco_reference import ReferenceSparseLoCo
from sparseloco_reference import quantize as np_quantize

import distro_jax as dj
from distro_jax.codec import dequantize, quantize

# A 64x128 matrix (two 64x64 chunks of 4,096), a 96-vector (two chunks of 48),
# a small matrix whose axes are shorter than the chunk target, and a 5-vector
# (per-worker state cannot hold scalar leaves; see worker_state).
SHAPES = {"a": (64, 128), "b": (96,), "c": (8, 24), "d": (5,)}


def _grads(rng, local, workers):
  # Gradients depend on each worker's inner params, so trajectories are coupled.
  return [
    {k: 0.5 * np.asarray(local[w][k]) + rng.normal(size=np.shape(local[w][k])) for k in SHAPES}
    for w in range(workers)
  ]


@pytest.mark.slow
@pytest.mark.parametrize(
  "value_bits, use_dct, clip",
  [(2, False, True), (2, True, False), (None, False, False), (None, True, True), (1, False, True)],
  ids=["2bit-clip", "2bit-dct-noclip", "fp32-noclip", "fp32-dct-clip", "1bit-clip"],
)
def test_matches_numpy_reference_and_replicas_stay_identical(value_bits, use_dct, clip):
  workers, steps, h, lr = 4, 6, 2, 0.05
  rng = np.random.default_rng(0)
  init = {k: (rng.normal(size=s) * 0.1).astype(np.float32) for k, s in SHAPES.items()}
  options = dict(
    sync_every=h,
    outer_learning_rate=0.9,
    error_decay=0.95,
    compression_topk=16,
    compression_chunk=64,
    value_bits=value_bits,
    use_dct=use_dct,
    clip_to_median_norm=clip,
  )
  ref = ReferenceSparseLoCo(
    init,
    workers,
    lr=lr,
    sync_every=h,
    outer_lr=0.9,
    decay=0.95,
    topk=16,
    chunk=64,
    bits=value_bits,
    use_dct=use_dct,
    clip=clip,
  )
  mesh = mesh_of(workers)
  step, params, state = build(dj.sparseloco(optax.sgd(lr), **options), init, mesh)
  start = {k: np.asarray(v) for k, v in init.items()}
  for t in range(1, steps + 1):
    grads = _grads(rng, ref.local, workers)
    expected = ref.step(grads)
    grads_W = {k: np.stack([g[k] for g in grads]).astype(np.float32) for k in SHAPES}
    params, state = step(params, state, place_grads(grads_W, mesh))
    for k in SHAPES:
      copies = per_device_copies(params[k])
      assert_identical_on_every_device(params[k], copies=workers, context=f"{k}, step {t}")
      np.testing.assert_allclose(copies[0], expected[k], atol=2e-5, err_msg=f"{k}, step {t}")
    if t % h:
      # Between synchronizations the shared params do not move.
      continue
    assert not np.array_equal(np.asarray(params["a"]), start["a"])
    start = {k: np.asarray(v) for k, v in params.items()}
  # The error feedback is per worker and carries what was not sent.
  errors = np.asarray(state.error_feedback["a"]).reshape(workers, -1)
  assert np.abs(errors).max() > 0
  assert not np.array_equal(errors[0], errors[1])


@functools.cache
def _draw(block_shape, k, bias):
  """``dj.codec.draw_positions`` at a position key, jitted once per block view."""

  def draw(step, tensor, worker):
    return dj.codec.draw_positions(
      dj.codec.position_key(step, tensor, worker), block_shape, k, bias
    )

  return jax.jit(draw)


def _drawn(name, worker, step, k, chunk, bias):
  """The positions sparseloco(random_positions=True) draws, from DeMo's documented key."""
  plan = dj.dct.plan_chunks(SHAPES[name], chunk)
  draw = _draw(plan.block_shape, k, bias)
  return draw(np.int32(step), np.int32(sorted(SHAPES).index(name)), np.int32(worker))


@pytest.mark.slow
def test_drawn_orthogonalized_form_matches_numpy_reference():
  """Drawn 1-bit message, error feedback before the orthogonalization, a scheduled outer rate."""
  workers, steps, h, lr, chunk, k, bias = 4, 4, 2, 0.05, 8, 2, 1.0
  rng = np.random.default_rng(3)
  init = {k_: (rng.normal(size=s) * 0.1).astype(np.float32) for k_, s in SHAPES.items()}
  outer_lr = lambda count: 0.02 * (1.0 + count) / 4.0  # read at the synchronizing step
  ref = ReferenceSparseLoCo(
    init,
    workers,
    lr=lr,
    sync_every=h,
    outer_lr=outer_lr,
    decay=0.95,
    topk=k,
    chunk=chunk,
    bits=1,
    use_dct=True,
    clip=False,
    positions=functools.partial(_drawn, chunk=chunk, bias=bias),
    normalize="orth",
  )
  tx = dj.sparseloco(
    optax.sgd(lr),
    sync_every=h,
    outer_learning_rate=outer_lr,
    error_decay=0.95,
    compression_topk=k,
    compression_chunk=chunk,
    value_bits=1,
    use_dct=True,
    random_positions=True,
    frequency_bias=bias,
    normalize="orth",
  )
  mesh = mesh_of(workers)
  step, params, state = build(tx, init, mesh)
  for t in range(1, steps + 1):
    grads = _grads(rng, ref.local, workers)
    expected = ref.step(grads)
    grads_W = {k_: np.stack([g[k_] for g in grads]).astype(np.float32) for k_ in SHAPES}
    params, state = step(params, state, place_grads(grads_W, mesh))
    for name in SHAPES:
      copies = per_device_copies(params[name])
      assert_identical_on_every_device(params[name], copies=workers, context=f"{name}, {t}")
      np.testing.assert_allclose(copies[0], expected[name], atol=2e-6, err_msg=f"{name}, {t}")
  # Each tensor moved by its two outer steps (unit RMS at rates 0.005 and 0.01),
  # far above the tolerance, and each worker's buffer kept what it did not send.
  for name in SHAPES:
    moved = np.sqrt(np.mean((np.asarray(params[name]) - init[name]) ** 2))
    assert moved > 5e-3, (name, moved)
  errors = np.asarray(state.error_feedback["a"]).reshape(workers, -1)
  assert np.abs(errors).max() > 0 and not np.array_equal(errors[0], errors[1])


def test_quantizer_is_templars_two_bit_rule():
  rng = np.random.default_rng(1)
  v = rng.normal(size=(50, 16)).astype(np.float32)
  # Jitted: one program, where an eager call compiles one per operation.
  codes, book = jax.jit(quantize, static_argnums=1)(jnp.asarray(v), 2)
  ref_codes, ref_book = np_quantize(v, 2)
  np.testing.assert_array_equal(np.asarray(codes), ref_codes)
  np.testing.assert_allclose(np.asarray(book), ref_book, rtol=1e-5)
  # The bins sit at -2.25, -0.75 and +0.75 standard deviations around the mean.
  c = v - v.mean()
  sigma = np.sqrt(np.sum(c**2) / (v.size - 1))
  np.testing.assert_array_equal(
    np.asarray(codes), np.searchsorted(np.array([-2.25, -0.75, 0.75]) * sigma, c, side="right")
  )
  # Each codebook entry is the mean of the values that fell in its bin.
  for j in range(4):
    np.testing.assert_allclose(book[j], v[np.asarray(codes) == j].mean(), rtol=1e-5)
  # Equal values (zero spread) all land in one bin and come back exactly.
  codes, book = quantize(jnp.full((3, 4), 0.25), 2)
  np.testing.assert_array_equal(np.asarray(dequantize(codes, book)), 0.25)


def _step_parts(params, options):
  mesh = mesh_of(8)
  tx = dj.sparseloco(optax.adamw(1e-3), **options)
  step, params, state = build(tx, params, mesh)
  grads = place_grads(jax.tree.map(lambda p: jnp.zeros((8, *p.shape), p.dtype), params), mesh)
  return step, params, state, grads


# The message counted by hand for a (128, 192) bf16 and a (40,) f32 param.
# 64x64 chunks, top-64: 2x3 chunks of 64x64 (12-bit indices) and one of 40
# entries (6-bit). 8x8 chunks, top-1: 16x24 chunks (6-bit) and 5 of 8 entries
# (3-bit), and a flag byte, since no chunk keeps two indices to mark validity.
# One bit stream holds every index, then every code; quantized values add a
# float32 codebook per tensor, 16 bytes at 2 bits and 8 at 1.
_IDX_64 = 6 * 64 * 12 + 40 * 6
_IDX_8 = 16 * 24 * 6 + 5 * 3
_HAND_COUNTED = {
  "chunk64-2bit": (dict(value_bits=2), (_IDX_64 + (6 * 64 + 40) * 2 + 7) // 8 + 2 * 16),
  "chunk64-1bit": (dict(value_bits=1), (_IDX_64 + 6 * 64 + 40 + 7) // 8 + 2 * 8),
  "chunk64-float": (dict(value_bits=None), (_IDX_64 + 7) // 8 + 6 * 64 * 2 + 40 * 4),
  "chunk8-2bit": (
    dict(value_bits=2, compression_topk=1, compression_chunk=8),
    1 + (_IDX_8 + (16 * 24 + 5) * 2 + 7) // 8 + 2 * 16,
  ),
  # DeMo's drawn message: no indices, no codebook; a flag byte, then one sign
  # bit per 8x8 chunk (16x24) and per chunk of 8 (5), packed together.
  "drawn-1bit": (
    dict(value_bits=1, compression_topk=1, compression_chunk=8, random_positions=True),
    1 + (16 * 24 + 5 + 7) // 8,
  ),
}
# What changes the step but not the bytes: the drawn form's bias, basis and
# orthogonalized outer step (whose Newton-Schulz runs on every worker alone).
_BUILD_ONLY = {"drawn-1bit": dict(frequency_bias=1.0, use_dct=True, normalize="orth")}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(_HAND_COUNTED))
def test_the_hlo_all_gathers_exactly_the_payload_once(case):
  params = {"w": jnp.zeros((128, 192), jnp.bfloat16), "b": jnp.zeros((40,), jnp.float32)}
  options, by_hand = _HAND_COUNTED[case]
  options = dict(sync_every=30, **options)
  step, params, state, grads = _step_parts(params, {**options, **_BUILD_ONLY.get(case, {})})
  measured = dj.collective_bytes(step, params, state, grads)
  computed = dj.sparseloco_bytes(params, **options)
  assert [k for k, v in measured.by_kind.items() if v] == ["all-gather"]
  assert len(measured.ops) == 1
  assert measured.total == computed.payload
  assert computed.payload == by_hand
  assert computed.per_step == computed.payload / 30


def _conditional_branches(hlo: str) -> list[list[str]]:
  return [
    [b.strip().lstrip("%") for b in m.group(1).split(",")]
    for m in re.finditer(r"conditional\(.*branch_computations=\{([^}]*)\}", hlo)
  ]


def _computation_of(hlo: str, opcode: str) -> list[str]:
  found, current = [], None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head and not line.startswith(" "):
      current = head.group(1)
    elif re.search(rf"\s{opcode}(-start)?\(", line):
      found.append(current)
  return found


def _callees(hlo: str) -> dict[str, set[str]]:
  calls, current = {}, None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head and not line.startswith(" "):
      current = head.group(1)
      calls[current] = set()
    elif current:
      for attr in re.findall(
        r"(?:to_apply|calls|body|condition|branch_computations)=\{?([%\w.\-, ]+)\}?", line
      ):
        calls[current] |= {c.strip().lstrip("%") for c in attr.split(",") if c.strip()}
  return calls


def _reaches(calls, start, target):
  seen, todo = set(), [start]
  while todo:
    c = todo.pop()
    if c == target:
      return True
    if c not in seen:
      seen.add(c)
      todo += sorted(calls.get(c, ()))
  return False


def test_the_all_gather_runs_only_in_the_synchronizing_branch():
  params = {"w": jnp.zeros((64, 64), jnp.float32)}
  step, params, state, grads = _step_parts(params, dict(sync_every=5))
  hlo = step.lower(params, state, grads).compile().as_text()
  (home,) = _computation_of(hlo, "all-gather")
  calls = _callees(hlo)
  branches = _conditional_branches(hlo)
  # lax.cond's branch 0 is the false branch (keep going), branch 1 the sync.
  assert any(_reaches(calls, b[1], home) and not _reaches(calls, b[0], home) for b in branches)
  # And in the jaxpr: exactly one all_gather, inside the true branch of a cond.
  closed = jax.make_jaxpr(step)(params, state, grads)

  found = gather_branch_paths(closed.jaxpr)
  assert len(found) == 1 and found[0][-1] == "cond[1]", found


def test_inner_params_is_where_the_gradient_is_taken():
  params = {"w": jnp.ones((4, 4))}
  tx = dj.sparseloco(optax.sgd(1.0), sync_every=3, axis_name=None)
  state = tx.init(params)
  _, state = tx.update({"w": jnp.full((4, 4), 0.1)}, state, params)
  np.testing.assert_allclose(dj.inner_params(state, params)["w"], 0.9)
  for _ in range(2):
    updates, state = tx.update({"w": jnp.full((4, 4), 0.1)}, state, params)
  # After the sync, every worker restarts from the new shared params.
  new = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(dj.inner_params(state, params)["w"], new["w"])


def test_state_persists_across_rounds_and_error_feedback_keeps_the_rest():
  params = {"w": jnp.zeros((8, 8))}
  tx = dj.sparseloco(
    optax.adam(0.1),
    sync_every=1,
    compression_topk=1,
    value_bits=None,
    error_decay=1.0,
    clip_to_median_norm=False,
    axis_name=None,
  )
  state = tx.init(params)
  g = {"w": jnp.arange(64.0).reshape(8, 8) - 31.5}
  updates, state = tx.update(g, state, params)
  # One entry of the single 8x8 chunk was sent; the other 63 wait in the buffer.
  assert int((updates["w"] != 0).sum()) == 1
  assert int((state.error_feedback["w"] != 0).sum()) == 63
  assert int(state.inner_state[0].count) == 1
  _, state = tx.update(g, state, params)
  assert int(state.inner_state[0].count) == 2


# Each case compiles two steps (in the whole suite; the quick loop has the
# round in which no worker is finite, below).
@pytest.mark.slow
@pytest.mark.parametrize(
  "value_bits, clip",
  [
    pytest.param(2, True, id="2bit-clip"),
    pytest.param(None, False, id="fp32", marks=pytest.mark.slow),
    pytest.param(1, True, id="1bit-clip", marks=pytest.mark.slow),
  ],
)
def test_a_worker_that_is_not_finite_is_left_out_and_restarts(value_bits, clip):
  # Worker 1's gradient holds one NaN. The shared params must move exactly as
  # a mesh of the three other workers moves them, stay finite on every
  # replica, and worker 1 must train again in the next round.
  rng = np.random.default_rng(5)
  init = {k: (rng.normal(size=s) * 0.1).astype(np.float32) for k, s in SHAPES.items()}
  grads = [
    {k: rng.normal(size=(4, *s)).astype(np.float32) for k, s in SHAPES.items()} for _ in range(2)
  ]
  grads[0]["a"][1, 3, 5] = np.nan
  options = dict(sync_every=1, compression_topk=16, value_bits=value_bits)
  tx = lambda: dj.sparseloco(optax.adam(0.05), clip_to_median_norm=clip, **options)
  step4, params4, state4 = build(tx(), init, mesh_of(4))
  step3, params3, state3 = build(tx(), init, mesh_of(3))
  params4, state4 = step4(params4, state4, place_grads(grads[0], mesh_of(4)))
  assert int(state4.contributors) == 3
  others = {k: g[[0, 2, 3]] for k, g in grads[0].items()}
  params3, _ = step3(params3, state3, place_grads(others, mesh_of(3)))
  for k in SHAPES:
    copies = per_device_copies(params4[k])
    assert np.isfinite(copies[0]).all(), k
    assert all(np.array_equal(c.view(np.uint32), copies[0].view(np.uint32)) for c in copies), k
    np.testing.assert_array_equal(copies[0], np.asarray(params3[k]), err_msg=k)
  assert not np.array_equal(np.asarray(params4["a"]), init["a"])
  # Worker 1 kept its (empty) buffer and restarted its inner Adam afresh.
  errors = np.asarray(state4.error_feedback["a"]).reshape(4, *SHAPES["a"])
  assert not errors[1].any() and errors[0].any()
  mu = np.asarray(state4.inner_state[0].mu["a"]).reshape(4, *SHAPES["a"])
  assert not mu[1].any() and np.isfinite(mu).all()
  params4, state4 = step4(params4, state4, place_grads(grads[1], mesh_of(4)))
  assert int(state4.contributors) == 4
  assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves((params4, state4)))
  errors = np.asarray(state4.error_feedback["a"]).reshape(4, *SHAPES["a"])
  assert errors[1].any()


def test_a_round_with_no_finite_worker_moves_nothing():
  tx = dj.sparseloco(optax.sgd(0.1), sync_every=1, compression_topk=4, axis_name=None)
  params = {"w": jnp.ones((8, 8))}
  state = tx.init(params)
  updates, state = tx.update({"w": jnp.full((8, 8), jnp.nan)}, state, params)
  assert not np.asarray(updates["w"]).any()
  assert np.isfinite(np.asarray(state.local_params["w"])).all()
  updates, _ = tx.update({"w": jnp.ones((8, 8))}, state, params)
  assert np.asarray(updates["w"]).any() and np.isfinite(np.asarray(updates["w"])).all()


def test_total_steps_synchronizes_the_last_step_of_the_run():
  params = {"w": jnp.ones((8, 8))}
  g = {"w": jnp.arange(64.0).reshape(8, 8)}
  for total_steps, moved in ((None, False), (4, True)):
    tx = dj.sparseloco(optax.sgd(0.1), sync_every=3, total_steps=total_steps, axis_name=None)
    state = tx.init(params)
    for _ in range(4):
      updates, state = tx.update(g, state, params)
    # Step 4 is no multiple of 3: only the run's last step makes it synchronize.
    assert bool(np.asarray(updates["w"]).any()) == moved
    if moved:
      new = optax.apply_updates(params, updates)["w"]
      np.testing.assert_array_equal(dj.inner_params(state, params)["w"], new)


def test_compress_without_kernels_keeps_xlas_bits_on_dct_chunks():
  # 64x64 DCT chunks are a fused kernel's on a CPU; SparseLoCo's top-k keeps XLA's.
  from distro_jax import compress, cpu_kernels, dct, wire

  g = [jnp.asarray(np.random.default_rng(0).normal(size=(64, 128)), jnp.float32)]
  plans = wire.plan_tree(g, 64)
  layout = wire.wire_layout(g, compression_topk=8, compression_chunk=64, quantize_1bit=False)
  fmt = dj.message.MessageFormat(layout, dj.message.TopK((8,)), dct.DCT_BASIS)
  m = [jnp.ones(plans[0].block_shape)]
  got = compress.compress(g, m, plans, fmt, lr=1.0, decay=0.9, kernels=False)
  with cpu_kernels.disabled():
    want = compress.compress(g, m, plans, fmt, lr=1.0, decay=0.9)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)


def test_clipped_mean_is_over_every_valid_worker_after_the_median_clip():
  plan = dj.dct.plan_chunks((4,), 4)
  idx = jnp.array([[[[0, 1]]], [[[0, 3]]], [[[2, 3]]]])  # (W, A, B, k)
  val = jnp.array([[[[3.0, 4.0]]], [[[0.6, 0.8]]], [[[9.0, 9.0]]]])  # norms 5, 1, 12.7
  valid = jnp.array([True, True, False])
  got = dj.message.Received([(idx, val)], valid)
  zeros = [jnp.zeros(plan.block_shape)]
  (plain,) = dj.decode.clipped_mean(got, zeros, [plan], dj.dct.IDENTITY_BASIS, clip=False)
  np.testing.assert_allclose(plain.reshape(-1), [1.8, 2.0, 0.0, 0.4], rtol=1e-6)
  # The lower median of the valid norms (5, 1) is 1: the first worker is scaled by 1/5.
  (clipped,) = dj.decode.clipped_mean(got, zeros, [plan], dj.dct.IDENTITY_BASIS, clip=True)
  np.testing.assert_allclose(clipped.reshape(-1), [0.6, 0.4, 0.0, 0.4], rtol=1e-6)


def test_init_is_shape_only():
  tx = dj.sparseloco(optax.adamw(1e-3), use_dct=True)
  shapes = jax.eval_shape(tx.init, {"w": jax.ShapeDtypeStruct((128, 96), jnp.bfloat16)})
  assert shapes.local_params["w"].dtype == jnp.bfloat16
  # In the param's own shape (its 2x2 chunks of 64x48 in place), so the
  # param's sharding places it.
  assert shapes.error_feedback["w"].shape == (128, 96)
  assert shapes.error_feedback["w"].dtype == jnp.float32


def test_a_state_in_the_old_row_layout_is_refused_with_the_fix():
  tx = dj.sparseloco(optax.sgd(0.1), sync_every=1, axis_name=None)
  params = {"w": jnp.zeros((128, 96))}
  # Before the buffer took the param's shape it held one row per 64x48 chunk.
  old = tx.init(params)._replace(error_feedback={"w": jnp.zeros((4, 64 * 48))})
  with pytest.raises(ValueError, match=r"\(128, 96\).*one row per chunk.*from_chunks"):
    tx.update(params, old, params)


def test_numeric_options_work_under_inject_hyperparams():
  tx = optax.inject_hyperparams(dj.sparseloco, static_args=("sync_every",))(
    optax.sgd(0.5), outer_learning_rate=0.5, error_decay=0.9, sync_every=1, axis_name=None
  )
  params = {"w": jnp.ones((4, 8))}
  state = tx.init(params)
  assert set(state.hyperparams) >= {"outer_learning_rate", "error_decay"}
  updates, state = jax.jit(tx.update)({"w": jnp.ones((4, 8))}, state, params)
  assert jnp.all(jnp.isfinite(updates["w"]))
  assert float(jnp.abs(updates["w"]).max()) > 0


def test_production_payload_is_about_2200x_below_a_bf16_gradient():
  b = dj.sparseloco_bytes({"w": jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)})
  assert b.payload == 4096 * 64 * 14 // 8 + 16
  assert 2150 < b.ratio_vs_bf16 < 2250


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(sync_every=0), ValueError, "sync_every must be a positive int"),
    # A wrong type is a TypeError, as for dj.demo's sizes.
    (dict(sync_every=2.5), TypeError, "sync_every must be a positive int"),
    (dict(compression_topk=-1), ValueError, "compression_topk must be a positive int"),
    (dict(compression_chunk=True), TypeError, "compression_chunk must be a positive int"),
    (dict(value_bits=True), ValueError, "value_bits must be 1, 2 or None"),
    (dict(value_bits=3), ValueError, "value_bits must be 1, 2 or None"),
    (dict(value_bits=0), ValueError, "value_bits must be 1, 2 or None"),
    (dict(error_decay=1.5), ValueError, "error_decay must be in"),
    (dict(total_steps=0), ValueError, "total_steps must be a positive int"),
  ],
)
def test_bad_options_are_refused_with_the_fix(kwargs, error, match):
  with pytest.raises(error, match=match):
    dj.sparseloco(optax.sgd(1.0), **kwargs)


def test_inner_must_be_an_optax_transformation():
  with pytest.raises(TypeError, match="inner must be an optax.GradientTransformation"):
    dj.sparseloco(1e-3)


def test_update_needs_the_params_and_a_bound_axis():
  params = {"w": jnp.ones((4, 4))}
  tx = dj.sparseloco(optax.sgd(1.0), axis_name=None)
  with pytest.raises(ValueError, match="needs the outer params"):
    tx.update(params, tx.init(params))
  tx = dj.sparseloco(optax.sgd(1.0))
  with pytest.raises(ValueError, match="is not bound here"):
    tx.update(params, tx.init(params), params)


def test_update_traces_from_a_shared_state():
  """A state passed as shared still traces, so dj.worker_state_specs takes its fast path.

  Before the error buffer entered the synchronizing cond typed per worker, this
  raised a TypeError, and worker_state_specs fell back to tracing once per
  state leaf: over two minutes for the small preset.
  """
  from jax.sharding import PartitionSpec as P

  mesh = mesh_of(2)
  params = {"w": jnp.zeros((64, 64)), "b": jnp.zeros((64,))}
  tx = dj.sparseloco(optax.sgd(0.1), sync_every=2)
  state = tx.init(params)
  on_workers = jax.sharding.NamedSharding(mesh, P("data"))
  grads_W = jax.tree.map(lambda x: jax.device_put(jnp.ones((2, *x.shape)), on_workers), params)

  def body(p, s, g):
    _, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
    return s.count

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P())
  assert jax.eval_shape(fn, params, state, grads_W).shape == ()
