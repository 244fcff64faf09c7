"""dj.resize_worker_state: the per-worker state of W workers, rearranged for W'.

Each test builds a real state (a few steps of training on W simulated
workers, so every worker's momentum differs), resizes it, and checks every
field against what it should be, written out field by field for that
optimizer: stayers keep their blocks, leavers' residual is folded or dropped,
joiners start from ``tx.init`` of the shared params, shared leaves are as
they were.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_step import build, mesh_of, place_grads

import distro_jax as dj

PARAMS = {"w": jnp.zeros((16, 8), jnp.float32), "b": jnp.zeros((8,), jnp.float32)}


# One instance each, so that states trained with them are shared between tests (compiling is
# most of these tests' time).
DEMO = dj.demo(0.1, compression_topk=2, compression_chunk=8)
DILOCO = dj.diloco(optax.adam(0.1), sync_every=5)


@functools.cache
def _trained(tx, workers, steps=3, seed=0):
  """``(params, state)`` after ``steps`` steps of random per-worker gradients (cached)."""
  mesh = mesh_of(workers)
  step, params, state = build(tx, PARAMS, mesh)
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    grads = jax.tree.map(lambda p: rng.normal(size=(workers, *p.shape)).astype(np.float32), PARAMS)
    params, state = step(params, state, place_grads(grads, mesh))
  return params, state


def _blocks(x, workers):
  """A per-worker leaf ``(W * d0, ...)`` as NumPy ``(W, d0, ...)``."""
  x = np.asarray(x)
  return x.reshape(workers, x.shape[0] // workers, *x.shape[1:])


def _resize(tx, state, params, workers, **kw):
  mesh = mesh_of(workers)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  return dj.resize_worker_state(tx, state, params, mesh, **kw), params


def _assert_same_tree(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.mark.parametrize("leaving", ["fold", "drop"])
def test_demo_shrink_8_to_6_folds_or_drops_the_leavers_momentum(leaving):
  tx = DEMO
  params, state = _trained(tx, 8)
  new, _ = _resize(tx, state, params, 6, leaving=leaving)
  old_demo, new_demo = state[0], new[0]
  for name in ("w", "b"):
    before = _blocks(old_demo.momentum[name], 8)
    after = _blocks(new_demo.momentum[name], 6)
    expected = before[:6].copy()
    if leaving == "fold":
      expected += before.mean(0) - before[:6].mean(0)
    np.testing.assert_allclose(after, expected, rtol=1e-5, atol=1e-6)
    if leaving == "fold":  # nothing lost from the mean, which the exchange averages
      np.testing.assert_allclose(after.mean(0), before.mean(0), rtol=1e-5, atol=1e-6)
  assert int(new_demo.count) == int(old_demo.count) == 3
  assert int(new_demo.contributors) == int(old_demo.contributors)
  assert new_demo.momentum["w"].sharding.spec == P("data")


def test_demo_grow_6_to_8_joiners_start_from_zero_momentum():
  tx = DEMO
  params, state = _trained(tx, 6)
  new, _ = _resize(tx, state, params, 8)
  before = _blocks(state[0].momentum["w"], 6)
  after = _blocks(new[0].momentum["w"], 8)
  np.testing.assert_array_equal(after[:6], before)
  np.testing.assert_array_equal(after[6:], 0.0)
  assert np.abs(before).max() > 0


def test_keep_chooses_which_workers_stay_and_their_new_order():
  tx = DEMO
  params, state = _trained(tx, 4)
  new, _ = _resize(tx, state, params, 3, keep=[3, 0], leaving="fold")
  before = _blocks(state[0].momentum["w"], 4)
  after = _blocks(new[0].momentum["w"], 3)
  shift = before.mean(0) - (before[3] + before[0]) / 2
  np.testing.assert_allclose(after[0], before[3] + shift, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(after[1], before[0] + shift, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(after[2], 0.0)  # the third is a joiner


def test_same_count_is_the_identity():
  tx = DEMO
  params, state = _trained(tx, 4)
  new, _ = _resize(tx, state, params, 4)
  _assert_same_tree(new, state)


def test_distro_adamw_shared_adam_moments_carry_over_unchanged():
  tx = dj.distro_adamw(0.1, compression_topk=2, compression_chunk=8)
  params, state = _trained(tx, 8)
  new, _ = _resize(tx, state, params, 6)
  # The chain's second part is AdamW on the shared aggregate: the same on every worker.
  _assert_same_tree(new[1], state[1])
  adam = state[1][0]
  assert int(adam.count) == 3 and float(jnp.abs(adam.mu["w"]).max()) > 0
  assert _blocks(new[0].momentum["w"], 6).shape[0] == 6


@pytest.mark.parametrize(
  "drawn", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["topk", "drawn"]
)
def test_delayed_apply_pending_message_stays_with_its_worker_and_joiners_send_nothing(drawn):
  tx = dj.demo(
    0.1, compression_topk=2, compression_chunk=8, delayed_apply=True, random_positions=drawn
  )
  params, state = _trained(tx, 4)
  # Worker 1 leaves; 0 keeps its index, 2 and 3 move to 1 and 2.
  new, _ = _resize(tx, state, params, 6, keep=[0, 2, 3], leaving="fold")
  before = _blocks(state[0].pending, 4)
  after = _blocks(new[0].pending, 6)
  assert before.any()
  np.testing.assert_array_equal(after[0], before[0])
  # A message made under another index is marked invalid (all zeros), since
  # drawn positions are keyed by the sender's index; a joiner's first message
  # is invalid too. Nothing is lost: the momentum still holds what it sent.
  np.testing.assert_array_equal(after[1:], 0)
  # The message of the worker that left is not residual: it is not folded anywhere.
  momentum_before = _blocks(state[0].momentum["w"], 4)
  momentum_after = _blocks(new[0].momentum["w"], 6)
  stayers = momentum_before[[0, 2, 3]]
  shift = momentum_before.mean(0) - stayers.mean(0)
  np.testing.assert_allclose(momentum_after[:3], stayers + shift, rtol=1e-5, atol=1e-6)


def test_diloco_joiners_start_from_the_shared_params_with_fresh_inner_state():
  tx = DILOCO
  params, state = _trained(tx, 4, steps=3)  # mid-round: inner params differ from the outer
  new, placed = _resize(tx, state, params, 6, leaving="fold")
  old_local, new_local = state.local_params["w"], new.local_params["w"]
  before, after = _blocks(old_local, 4), _blocks(new_local, 6)
  np.testing.assert_array_equal(after[:4], before)
  np.testing.assert_array_equal(after[4:], np.broadcast_to(np.asarray(placed["w"]), (2, 16, 8)))
  assert not np.array_equal(before[0], np.asarray(params["w"]))
  mu_before = _blocks(state.inner_state[0].mu["w"], 4)
  mu_after = _blocks(new.inner_state[0].mu["w"], 6)
  np.testing.assert_array_equal(mu_after[:4], mu_before)
  np.testing.assert_array_equal(mu_after[4:], 0.0)
  assert int(new.count) == 3 and int(new.inner_state[0].count) == 3
  _assert_same_tree(new.outer_momentum, state.outer_momentum)


def test_diloco_leaver_inner_params_are_dropped_not_folded():
  tx = DILOCO
  params, state = _trained(tx, 4, steps=3)
  new, _ = _resize(tx, state, params, 2, leaving="fold")
  np.testing.assert_array_equal(
    _blocks(new.local_params["w"], 2), _blocks(state.local_params["w"], 4)[:2]
  )
  np.testing.assert_array_equal(
    _blocks(new.inner_state[0].nu["b"], 2), _blocks(state.inner_state[0].nu["b"], 4)[:2]
  )


@pytest.mark.slow
def test_sparseloco_error_feedback_folds_and_joiners_start_from_shared_params():
  tx = dj.sparseloco(optax.adam(0.1), sync_every=2, compression_topk=2, compression_chunk=8)
  params, state = _trained(tx, 8, steps=3)  # one sync done: error feedback is non-zero
  new, placed = _resize(tx, state, params, 6, leaving="fold")
  before = _blocks(state.error_feedback["w"], 8)
  after = _blocks(new.error_feedback["w"], 6)
  shift = before.mean(0) - before[:6].mean(0)
  np.testing.assert_allclose(after, before[:6] + shift, rtol=1e-5, atol=1e-6)
  assert np.abs(before).max() > 0
  grown, _ = _resize(tx, new, placed, 8)
  np.testing.assert_array_equal(_blocks(grown.error_feedback["w"], 8)[6:], 0.0)
  np.testing.assert_array_equal(
    _blocks(grown.local_params["w"], 8)[6:], np.broadcast_to(np.asarray(placed["w"]), (2, 16, 8))
  )
  assert int(grown.count) == 3


def test_fsdp_sites_resize_by_whole_sites():
  """On a (replica, fsdp) mesh a worker is a site: its block spans all its fsdp shards."""
  params = {"w": jnp.zeros((16, 16), jnp.float32)}
  specs = {"w": P("fsdp", None)}

  def mesh(replicas):
    return jax.make_mesh((replicas, 2), ("replica", "fsdp"), devices=jax.devices()[: 2 * replicas])

  tx = dj.demo(0.1, compression_topk=2, compression_chunk=8, axis_name="replica")
  old_mesh = mesh(4)
  placed = jax.device_put(params, NamedSharding(old_mesh, specs["w"]))
  state = dj.init_worker_state(tx, placed, old_mesh, "replica", param_specs=specs)
  momentum = state[0].momentum["w"]
  assert momentum.sharding.spec == P(("replica", "fsdp"))
  rows = momentum.shape[0] // 8  # per device
  # Device (r, f) holds rows [(2r + f) * rows, ...): give each site r the value r + 1.
  values = np.repeat(np.arange(1, 5, dtype=np.float32), 2 * rows)[:, None]
  filled = jax.device_put(np.broadcast_to(values, momentum.shape), momentum.sharding)
  state = ((state[0]._replace(momentum={"w": filled})), *state[1:])
  new_mesh = mesh(3)
  new_params = jax.device_put(params, NamedSharding(new_mesh, specs["w"]))
  new = dj.resize_worker_state(
    tx, state, new_params, new_mesh, "replica", param_specs=specs, leaving="fold"
  )
  got = np.asarray(new[0].momentum["w"])[:, 0].reshape(3, 2 * rows)
  expected = np.array([[1.0], [2.0], [3.0]]) + 0.5  # the mean, 2 of 1..3, becomes 2.5 of 1..4
  np.testing.assert_allclose(got, np.broadcast_to(expected, got.shape), rtol=1e-6)
  assert new[0].momentum["w"].sharding.spec == P(("replica", "fsdp"))


def test_all_reduce_optimizer_state_is_shared_and_fits_any_count():
  tx = optax.chain(dj.pmean_gradients("data"), optax.adam(0.1))
  params, state = _trained(tx, 4)
  assert dj.worker_count(tx, state, params, mesh_of(4)) is None
  new, _ = _resize(tx, state, params, 2)
  _assert_same_tree(new, state)


def test_worker_count_and_restore_target_from_shapes():
  tx = DEMO
  params, state = _trained(tx, 8)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  assert dj.worker_count(tx, shapes, params, mesh_of(6)) == 8
  target = dj.abstract_state_of_workers(tx, params, mesh_of(6), 8)
  assert jax.tree.map(lambda x: x.shape, target) == jax.tree.map(lambda x: x.shape, shapes)
  assert target[0].momentum["w"].sharding.spec == P()
  assert target[0].momentum["w"].sharding.mesh.shape["data"] == 6


def test_refuses_bad_arguments_with_what_to_do():
  tx = DEMO
  params, state = _trained(tx, 4)
  with pytest.raises(ValueError, match="distinct workers"):
    _resize(tx, state, params, 4, keep=[0, 0])
  with pytest.raises(ValueError, match="room for 2"):
    _resize(tx, state, params, 2, keep=[0, 1, 2])
  with pytest.raises(ValueError, match="leaving="):
    _resize(tx, state, params, 2, leaving="sum")
  with pytest.raises(ValueError, match="leaving='drop'"):
    _resize(tx, state, params, 2, keep=[], leaving="fold")
  # Momentum has its param's shape whatever the chunk; a delayed state holds a message more.
  other = dj.demo(0.1, compression_topk=3, compression_chunk=4, delayed_apply=True)
  with pytest.raises(ValueError, match="another optimizer"):
    _resize(other, state, params, 2)
