"""dj.demo composes with optax the way optax users expect."""

import contextlib

import compiled
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sharded_step import build, mesh_of, place_grads

import distro_jax as dj


def _params(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  return {
    "w": jnp.asarray(rng.normal(size=(32, 48)), dtype),
    "b": jnp.asarray(rng.normal(size=(48,)), dtype),
  }


def _grads(seed, params):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)


def test_chain_with_clipping_runs_outside_shard_map_with_axis_none():
  params = _params()
  tx = optax.chain(optax.clip_by_global_norm(1.0), dj.demo(1e-2, axis_name=None))
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(_grads(1, params), state, params)
  # DeMo moves every entry by exactly lr (sign step), unless Q is exactly 0 there.
  mags = np.abs(np.asarray(updates["w"]))
  assert np.all(np.isclose(mags, 0.01) | (mags == 0)) and np.isclose(mags, 0.01).mean() > 0.5


def test_eval_shape_of_init_allocates_nothing():
  params = jax.eval_shape(
    lambda: {"w": jnp.zeros((4096, 4096)), "v": jnp.zeros((3, 5, 7)), "s": jnp.zeros(())}
  )
  state = jax.eval_shape(dj.demo(1e-3).init, params)
  demo_state = state[0]
  # The momentum has its param's shape (a scalar's gets one axis, for the per-worker layout).
  assert demo_state.momentum["w"].shape == (4096, 4096)
  assert demo_state.momentum["v"].shape == (3, 5, 7)
  assert demo_state.momentum["s"].shape == (1,)


def test_inject_hyperparams_over_numeric_hyperparameters():
  params = _params()
  tx = optax.inject_hyperparams(dj.demo, static_args=("compression_topk", "compression_chunk"))(
    learning_rate=1e-2, compression_decay=0.9, weight_decay=0.0, axis_name=None
  )
  state = tx.init(params)
  update = jax.jit(tx.update)
  u1, state = update(_grads(1, params), state, params)
  assert np.abs(np.asarray(u1["w"])).max() == pytest.approx(1e-2)
  state.hyperparams["learning_rate"] = jnp.asarray(5e-2)
  u2, state = update(_grads(2, params), state, params)
  assert np.abs(np.asarray(u2["w"])).max() == pytest.approx(5e-2)


def test_inject_hyperparams_with_default_sizes_needs_no_static_args():
  params = _params()
  tx = optax.inject_hyperparams(dj.demo)(learning_rate=1e-2, weight_decay=0.0, axis_name=None)
  state = tx.init(params)
  # The default decay stays exact (bfloat16 would round it to 1); set, it is injected.
  assert set(state.hyperparams) == {"learning_rate", "weight_decay"}
  set_decay = optax.inject_hyperparams(dj.demo)(learning_rate=1e-2, compression_decay=0.9)
  assert "compression_decay" in set_decay.init(params).hyperparams
  update = jax.jit(tx.update)
  u1, state = update(_grads(1, params), state, params)
  state.hyperparams["learning_rate"] = jnp.asarray(2e-2)
  u2, state = update(_grads(2, params), state, params)
  assert np.abs(np.asarray(u1["w"])).max() == pytest.approx(1e-2)
  assert np.abs(np.asarray(u2["w"])).max() == pytest.approx(2e-2)


def test_inject_hyperparams_with_a_traced_size_says_what_to_do():
  params = _params()
  tx = optax.inject_hyperparams(dj.demo)(learning_rate=1e-2, compression_topk=8, axis_name=None)
  state = tx.init(params)
  with pytest.raises(TypeError, match="static_args"):
    jax.jit(tx.update)(_grads(1, params), state, params)


def test_signature_defaults_are_the_reference_ones():
  import inspect

  sig = inspect.signature(dj.demo).parameters
  assert sig["compression_topk"].default == 32 and repr(sig["compression_topk"].default) == "32"
  assert sig["compression_chunk"].default == 64
  assert sig["compression_decay"].default == 0.999
  assert repr(sig["compression_decay"].default) == "0.999"
  assert sig["axis_name"].default == "data"


def test_schedule_as_learning_rate():
  params = _params()
  sched = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 10, 1e-3)
  tx = dj.demo(sched, axis_name=None)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for t in range(6):
    u, state = update(_grads(t, params), state, params)
    top = np.abs(np.asarray(u["w"])).max()
    assert top == pytest.approx(float(sched(t)), rel=1e-5, abs=1e-12)


@pytest.mark.slow
def test_multisteps_with_clipping_before_it_on_8_workers():
  params = _params()
  inner = optax.MultiSteps(dj.demo(1e-2), every_k_schedule=2)
  tx = optax.chain(optax.clip_by_global_norm(1.0), inner.gradient_transformation())
  mesh = mesh_of(8)
  step, p, state = build(tx, params, mesh)
  start = jax.tree.map(np.asarray, p)
  rng = np.random.default_rng(3)
  grads_W = jax.tree.map(lambda x: rng.normal(size=(8, *x.shape)).astype(np.float32), params)
  p, state = step(p, state, place_grads(grads_W, mesh))
  np.testing.assert_array_equal(p["w"], start["w"])  # accumulating, no update yet
  p, state = step(p, state, place_grads(grads_W, mesh))
  moved = np.abs(np.asarray(p["w"]) - start["w"])
  assert moved.max() == pytest.approx(1e-2, rel=1e-5)


def test_bf16_params_get_bf16_updates():
  params = _params(jnp.bfloat16)
  for tx in (dj.demo(1e-2, axis_name=None), dj.distro_adamw(1e-2, axis_name=None)):
    state = tx.init(params)
    updates, _ = jax.jit(tx.update)(_grads(1, params), state, params)
    assert all(u.dtype == jnp.bfloat16 for u in jax.tree.leaves(updates))
    assert all(np.isfinite(np.asarray(u, np.float32)).all() for u in jax.tree.leaves(updates))


def test_stateless_mode_keeps_no_momentum_across_steps():
  params = _params()
  tx = compiled.transformation(
    dj.scale_by_demo(1.0, compression_decay=0.0, compression_topk=4096, axis_name=None)
  )
  state = tx.init(params)
  g = _grads(1, params)
  q, state = tx.update(g, state, params)
  # Keeping every coefficient sends the whole gradient and leaves nothing behind.
  np.testing.assert_allclose(q["w"], g["w"], atol=1e-5)
  assert all(np.abs(np.asarray(m)).max() == 0 for m in jax.tree.leaves(state.momentum))


def test_distro_feeds_the_aggregate_to_any_inner_transformation():
  params = _params()
  tx = compiled.transformation(
    dj.distro(optax.identity(), 1.0, compression_decay=0.0, compression_topk=4096, axis_name=None)
  )
  g = _grads(2, params)
  q, _ = tx.update(g, tx.init(params), params)
  np.testing.assert_allclose(q["b"], g["b"], atol=1e-5)


def test_no_dct_ablation_sends_the_largest_raw_entries_of_each_chunk():
  params = {"w": jnp.zeros((16, 16))}
  g = {"w": jnp.asarray(np.random.default_rng(4).normal(size=(16, 16)), jnp.float32)}
  kw = {"compression_decay": 0.0, "compression_topk": 3, "compression_chunk": 8}
  tx = compiled.transformation(dj.scale_by_demo(1.0, use_dct=False, axis_name=None, **kw))
  q, _ = tx.update(g, tx.init(params), params)
  q_blocks = np.asarray(q["w"]).reshape(2, 8, 2, 8).transpose(0, 2, 1, 3).reshape(4, 64)
  g_blocks = np.asarray(g["w"]).reshape(2, 8, 2, 8).transpose(0, 2, 1, 3).reshape(4, 64)
  for qb, gb in zip(q_blocks, g_blocks):
    top3 = np.argsort(-np.abs(gb))[:3]
    assert set(np.flatnonzero(qb)) == set(top3)
    np.testing.assert_array_equal(qb[top3], gb[top3])
  # The DCT's selection decodes to a dense direction, which is the point of it.
  with_dct = compiled.transformation(dj.scale_by_demo(1.0, axis_name=None, **kw))
  q_dct, _ = with_dct.update(g, with_dct.init(params), params)
  assert np.count_nonzero(np.asarray(q_dct["w"])) > 200


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_a_param_sharded_by_columns_stays_sharded_under_plain_jit(axis_type):
  # The case of issue 14: (64, 512) split in 8 column blocks of whole 64x64 chunks.
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  kind = AxisType.Explicit if axis_type == "explicit" else AxisType.Auto
  mesh = jax.make_mesh((8,), ("x",), axis_types=(kind,))
  sharding = NamedSharding(mesh, P(None, "x"))
  rng = np.random.default_rng(0)
  w = rng.normal(size=(64, 512)).astype(np.float32)
  g = rng.normal(size=(64, 512)).astype(np.float32)
  tx = dj.demo(1e-2, axis_name=None)
  reference, _ = jax.jit(tx.update)({"w": g}, tx.init({"w": w}), {"w": w})
  params = {"w": jax.device_put(w, sharding)}
  grads = {"w": jax.device_put(g, sharding)}
  with jax.set_mesh(mesh) if kind == AxisType.Explicit else contextlib.nullcontext():
    state = jax.jit(tx.init)(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    measured = dj.collective_bytes(jax.jit(tx.update), grads, state, params)
  assert updates["w"].sharding.spec == P(None, "x")
  assert state[0].momentum["w"].sharding.spec == P(None, "x")
  assert measured.by_kind["all-gather"] == 0 and measured.total <= 8  # the finite flag only
  # Each device transformed its own chunks: the update is the unsharded one, to the bit.
  np.testing.assert_array_equal(np.asarray(updates["w"]), np.asarray(reference["w"]))


def test_a_sharding_that_cuts_chunks_is_gathered_for_the_transform_and_kept():
  # (2, 8, 4) split 8 ways along an axis of one 8-long chunk: optax's sharding test shape.
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
  tx = dj.demo(1.0, axis_name=None)
  with jax.set_mesh(mesh):
    params = jnp.ones((2, 8, 4), jnp.float16, out_sharding=NamedSharding(mesh, P(None, "x")))
    state0 = tx.init(params)
    _, state1 = jax.jit(tx.update)(params, state0, params)
  assert jax.tree.map(jax.typeof, state0) == jax.tree.map(jax.typeof, state1)


def test_complex_params_are_refused_at_init_with_the_fix():
  with pytest.raises(ValueError, match=r"\['z'\] is complex.*jnp.stack\(\[z.real, z.imag\]\)"):
    dj.distro_adamw(1e-3, axis_name=None).init({"z": jnp.ones((4, 4), jnp.complex64)})


def test_empty_trees_and_nothing_masked():
  for tx in (dj.demo(1e-3, axis_name=None), dj.scale_by_demo(1e-3, axis_name=None)):
    for empty in ({}, ()):
      assert tx.update(empty, tx.init(empty), empty)[0] == empty
    masked = optax.masked(tx, {"w": False})
    params = {"w": jnp.ones((8, 8))}
    updates, _ = masked.update(params, masked.init(params), params)
    np.testing.assert_array_equal(updates["w"], params["w"])


@pytest.mark.parametrize("delayed", [False, True])
def test_one_worker_on_a_mesh_of_one_device(delayed):
  # A single GPU: the data axis is bound but has size 1; the aggregate must
  # still come out typed as identical on every worker.
  params = _params()
  step, p, state = build(dj.demo(1e-2, delayed_apply=delayed), params, mesh_of(1))
  grads = {k: np.asarray(v)[None] for k, v in _grads(1, params).items()}
  for _ in range(2):
    p, state = step(p, state, place_grads(grads, mesh_of(1)))
  # Two sign steps of lr, the first of which delayed_apply spends waiting.
  moved = np.abs(np.asarray(p["w"]) - np.asarray(params["w"])).max()
  assert moved == pytest.approx((1 if delayed else 2) * 1e-2, rel=1e-5)
