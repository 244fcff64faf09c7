"""dj.diloco: local steps, then an averaged outer Nesterov step, on simulated workers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sharded_step import (
  assert_identical_on_every_device,
  build,
  mesh_of,
  per_device_copies,
  place_grads,
)

import distro_jax as dj
from experiments.run import checks


def _numpy_diloco(p0, grads_TxW, lr, sync_every, outer_lr, mu, total_steps=None):
  """DiLoCo in float64 NumPy, with plain SGD inside; returns the outer params after each step."""
  outer = p0.astype(np.float64)
  local = [outer.copy() for _ in grads_TxW[0]]
  m = np.zeros_like(outer)
  history = []
  for t, grads_W in enumerate(grads_TxW, start=1):
    local = [x - lr * g for x, g in zip(local, grads_W)]
    if t % sync_every == 0 or t == total_steps:
      # A worker whose round went non-finite is left out; none left, no move.
      finite = [outer - x for x in local if np.all(np.isfinite(x))]
      if finite:
        delta = np.mean(finite, axis=0)
        m = mu * m + delta
        outer = outer - outer_lr * (delta + mu * m)
      local = [outer.copy() for _ in local]
    history.append(outer)
  return history


# Worker 2's second step, mid-round: its NaN must reach no replica.
@pytest.mark.parametrize("nan_at", [None, (1, 2)], ids=["finite", "one-worker-nan"])
def test_matches_numpy_reference_and_replicas_stay_identical(nan_at):
  workers, steps, sync_every = 4, 7, 3
  rng = np.random.default_rng(0)
  p0 = rng.normal(size=(8, 16)).astype(np.float32)
  grads = rng.normal(size=(steps, workers, 8, 16)).astype(np.float32)
  if nan_at is not None:
    grads[(*nan_at, 0, 0)] = np.nan
  mesh = mesh_of(workers)
  tx = dj.diloco(optax.sgd(0.1), sync_every=sync_every, outer_learning_rate=0.7, outer_momentum=0.9)
  step, params, state = build(tx, {"w": jnp.asarray(p0)}, mesh)
  expected = _numpy_diloco(p0, grads, 0.1, sync_every, 0.7, 0.9)
  for t in range(steps):
    params, state = step(params, state, {"w": place_grads(grads[t], mesh)})
    copies = per_device_copies(params["w"])
    assert_identical_on_every_device(params["w"], copies=workers, context=f"step {t}")
    assert np.all(np.isfinite(copies[0])), f"step {t}"
    np.testing.assert_allclose(copies[0], expected[t], atol=1e-5)
    # The state counts the workers that went into the step's outer step.
    left_out = nan_at is not None and t + 1 == sync_every
    assert int(state.contributors) == workers - left_out, f"step {t}"
  # Between synchronizations the shared params do not move.
  np.testing.assert_array_equal(expected[3], expected[4])
  if nan_at is not None:
    # The first synchronization averaged three workers, not four.
    counted = _numpy_diloco(p0, np.nan_to_num(grads, nan=0.0), 0.1, sync_every, 0.7, 0.9)
    assert not np.allclose(expected[2], counted[2], atol=1e-3)


def test_a_failed_worker_restarts_with_a_fresh_inner_state():
  """AdamW's moments would keep the NaN, and the worker would fail every round after."""
  workers, sync_every = 4, 2
  rng = np.random.default_rng(2)
  params = {"w": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)}
  mesh = mesh_of(workers)
  tx = dj.diloco(optax.adamw(1e-2), sync_every=sync_every)
  step, params, state = build(tx, params, mesh)
  for t in range(3 * sync_every):
    grads = rng.normal(size=(workers, 8, 16)).astype(np.float32)
    if t == 0:
      grads[1, 3, 3] = np.inf
    params, state = step(params, state, {"w": place_grads(grads, mesh)})
    if (t + 1) % sync_every == 0:
      for leaf in jax.tree.leaves(state):
        assert np.all(np.isfinite(np.asarray(leaf))), f"step {t + 1}"
  assert np.all(np.isfinite(np.asarray(params["w"])))


def test_a_round_in_which_every_worker_failed_moves_nothing():
  tx = dj.diloco(optax.sgd(0.1), sync_every=2, axis_name=None)
  params = {"w": jnp.ones((4, 4))}
  state = tx.init(params)
  moved, state = tx.update({"w": jnp.ones((4, 4))}, state, params)
  moved, state = tx.update({"w": jnp.ones((4, 4))}, state, params)
  params = optax.apply_updates(params, moved)
  before = state.outer_momentum["w"]
  nan = {"w": jnp.full((4, 4), jnp.nan)}
  updates, state = tx.update(nan, state, params)
  updates, state = tx.update(nan, state, params)
  np.testing.assert_array_equal(updates["w"], np.zeros((4, 4)))
  np.testing.assert_array_equal(state.outer_momentum["w"], before)
  np.testing.assert_array_equal(state.local_params["w"], params["w"])
  # The next round trains on from the shared params.
  updates, state = tx.update({"w": jnp.ones((4, 4))}, state, params)
  updates, state = tx.update({"w": jnp.ones((4, 4))}, state, params)
  assert np.all(np.isfinite(updates["w"])) and np.any(updates["w"] != 0)


def test_only_collective_is_one_fp32_all_reduce_of_the_params():
  mesh = mesh_of(8)
  params = {"w": jnp.zeros((64, 32), jnp.bfloat16), "b": jnp.zeros((32,), jnp.float32)}
  tx = dj.diloco(optax.adamw(1e-3), sync_every=50)
  step, params, state = build(tx, params, mesh)
  grads = jax.tree.map(lambda p: jnp.zeros((8, *p.shape), p.dtype), params)
  measured = dj.collective_bytes(step, params, state, place_grads(grads, mesh))
  assert [k for k, v in measured.by_kind.items() if v] == ["all-reduce"]
  # The pseudo-gradient is averaged in float32, whatever the param dtype, and
  # the count of finite workers rides in the same all-reduce.
  assert len(measured.ops) == 1
  assert measured.total == (64 * 32 + 32) * 4 + 4


def test_inner_params_is_where_the_gradient_is_taken():
  params = {"w": jnp.ones(3)}
  tx = optax.chain(optax.clip_by_global_norm(1.0), dj.diloco(optax.sgd(1.0), axis_name=None))
  state = tx.init(params)
  _, state = tx.update({"w": jnp.full(3, 0.1)}, state, params)
  np.testing.assert_allclose(dj.inner_params(state, params)["w"], 0.9)
  # Every other optimizer computes its gradient at the shared params.
  assert dj.inner_params(optax.adamw(1e-3).init(params), params) is params


def test_the_last_partial_round_reaches_the_outer_params():
  workers, steps, sync_every = 2, 7, 3
  rng = np.random.default_rng(1)
  p0 = rng.normal(size=(4, 8)).astype(np.float32)
  grads = rng.normal(size=(steps, workers, 4, 8)).astype(np.float32)
  mesh = mesh_of(workers)
  tx = dj.diloco(optax.sgd(0.1), sync_every=sync_every, total_steps=steps)
  step, params, state = build(tx, {"w": jnp.asarray(p0)}, mesh)
  expected = _numpy_diloco(p0, grads, 0.1, sync_every, 0.7, 0.9, total_steps=steps)
  for t in range(steps):
    params, state = step(params, state, {"w": place_grads(grads[t], mesh)})
  np.testing.assert_allclose(per_device_copies(params["w"])[0], expected[-1], atol=1e-5)
  # Without it, steps 7 of a 7-step run would be thrown away: the params of step 6 stay.
  thrown_away = _numpy_diloco(p0, grads, 0.1, sync_every, 0.7, 0.9)
  np.testing.assert_array_equal(thrown_away[-1], thrown_away[-2])
  assert not np.allclose(expected[-1], expected[-2])


# A wrong type is a TypeError, as for dj.sparseloco's and dj.demo's sizes.
_BAD_INTS = [(0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)]


@pytest.mark.parametrize(("bad", "error"), _BAD_INTS)
def test_total_steps_must_be_a_positive_int_or_none(bad, error):
  with pytest.raises(error, match=r"total_steps must be a positive int.*e\.g\. total_steps="):
    dj.diloco(optax.sgd(1.0), total_steps=bad)


def test_the_registry_counts_the_final_exchange():
  from experiments.run import methods
  from experiments.run.config import TrainConfig

  diloco, demo = methods.get("diloco"), methods.get("demo")
  cfg = checks.resolve(TrainConfig(optimizer="diloco", steps=120, diloco_sync_every=50))
  assert [diloco.exchanges(cfg, n) for n in (49, 50, 100, 119, 120)] == [0, 1, 2, 2, 3]
  payload = methods.Payload(message=1000.0, per_step=20.0, sent=20.0)
  assert diloco.sent_over(cfg, payload, 120) == 3000.0
  plain = checks.resolve(TrainConfig(steps=120))
  assert demo.sent_over(plain, methods.Payload(10.0, 10.0, 10.0), 120) == 1200.0


@pytest.mark.parametrize(("bad", "error"), _BAD_INTS)
def test_sync_every_must_be_a_positive_int(bad, error):
  with pytest.raises(error, match=r"sync_every must be a positive int.*e\.g\. sync_every="):
    dj.diloco(optax.sgd(1.0), sync_every=bad)


def test_numpy_ints_are_ints():
  # They used to be refused: "sync_every must be a positive int ..., got np.int64(2)".
  params = {"w": jnp.ones((4, 4))}
  grads = {"w": jnp.full((4, 4), 0.5)}
  runs = []
  for sync_every, total_steps in ((2, 3), (np.int64(2), np.int32(3))):
    tx = dj.diloco(optax.sgd(1.0), sync_every=sync_every, total_steps=total_steps, axis_name=None)
    state, moved = tx.init(params), []
    for _ in range(3):
      updates, state = tx.update(grads, state, params)
      moved.append(float(jnp.abs(updates["w"]).max()))
    runs.append(moved)
  assert runs[0] == runs[1]
  assert runs[0][0] == 0.0 and runs[0][1] > 0.0 and runs[0][2] > 0.0  # syncs at 2 and at 3


def test_init_is_shape_only():
  tx = dj.diloco(optax.adamw(1e-3))
  shapes = jax.eval_shape(tx.init, {"w": jax.ShapeDtypeStruct((4, 4), jnp.bfloat16)})
  assert shapes.local_params["w"].dtype == jnp.bfloat16
  assert shapes.outer_momentum["w"].dtype == jnp.float32


def test_inject_hyperparams_leaves_the_synchronization_schedule_static():
  params = {"w": jnp.ones((4, 4))}
  tx = optax.inject_hyperparams(dj.diloco)(inner=optax.sgd(0.1), axis_name=None)
  state = tx.init(params)
  assert sorted(state.hyperparams) == ["outer_learning_rate", "outer_momentum"]
  jax.jit(tx.update)({"w": jnp.ones((4, 4))}, state, params)
  with pytest.raises(TypeError, match=r"static_args=\('sync_every',\)"):
    optax.inject_hyperparams(dj.diloco)(inner=optax.sgd(0.1), sync_every=2).init(params)
  tx = optax.inject_hyperparams(dj.diloco, static_args=("sync_every",))(
    inner=optax.sgd(0.1), sync_every=2, axis_name=None
  )
  tx.update({"w": jnp.ones((4, 4))}, tx.init(params), params)
