"""dj.gradient_point: the lookahead of the overlapped exchange, and where local steps look from."""

import dataclasses
import functools

import compiled
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxpr_gathers import gathers_fed_by, outputs_fed_by, trainer_step_jaxpr
from sharded_step import mesh_of

import distro_jax as dj
from distro_jax import dct, wire
from experiments.run import checks

SHAPES = {"a": (64, 128), "b": (96,)}
# One drawn position of each 8x8 chunk, one sign bit each.
DRAWN = dict(compression_topk=1, compression_chunk=8, quantize_1bit=True, random_positions=True)


def _loss(params, x_BxD):
  # Gradients depend on the params, so a wrong lookahead changes the trajectory.
  h = jnp.tanh(x_BxD @ params["a"])
  return jnp.mean((h - 0.5) ** 2) + jnp.mean(params["b"] ** 2 * x_BxD[:, :96].mean())


def _runner(tx, params, mesh, opts, lookahead):
  specs = dj.worker_state_specs(tx, params, mesh)

  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(P(), specs, P("data")),
    out_specs=(P(), specs, P("data")),
  )
  def step(params, state, x):
    # The point is per worker; the out spec stacks the workers' along axis 0.
    at = dj.gradient_point(state, params, sched, **opts) if lookahead else params
    at = dj.worker_local(at)
    _, grads = dj.local_value_and_grad(_loss)(at, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, at

  state = dj.init_worker_state(tx, params, mesh)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  return jax.jit(step), params, state


def sched(count):
  return 1e-2 * (1.0 + 0.1 * count)


@pytest.mark.slow
@pytest.mark.parametrize("quantize_1bit", [False, True], ids=["fp32", "1bit"])
def test_when_workers_agree_the_lookahead_is_exact_and_delayed_is_plain(quantize_1bit):
  # Every worker sees the same batch, so the aggregate in flight is exactly
  # the worker's own message (a mean of equal values is that value): looking
  # from it must reproduce the plain run, whose params the delayed run's
  # gradient points are, step for step.
  workers, steps = 4, 6
  rng = np.random.default_rng(0)
  init = {k: jnp.asarray(rng.normal(size=s) * 0.1, jnp.float32) for k, s in SHAPES.items()}
  x = np.tile(rng.normal(size=(1, 4, 64)).astype(np.float32), (workers, 1, 1)).reshape(-1, 64)
  mesh = mesh_of(workers)
  x = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("data")))
  opts = dict(compression_topk=8, quantize_1bit=quantize_1bit, weight_decay=0.1)
  make = functools.partial(dj.demo, sched, **opts)
  look = dict(opts, guess="message")

  plain_step, p, s = _runner(make(), init, mesh, look, lookahead=False)
  plain = []
  for _ in range(steps):
    plain.append(p)
    p, s, _ = plain_step(p, s, x)
  delayed_step, p, s = _runner(make(delayed_apply=True), init, mesh, look, lookahead=True)
  for t in range(steps):
    p, s, at = delayed_step(p, s, x)
    for k, shape in SHAPES.items():
      for w in range(workers):
        seen = np.asarray(at[k]).reshape(workers, *shape)[w]
        np.testing.assert_allclose(seen, np.asarray(plain[t][k]), atol=1e-7)
  assert not np.allclose(np.asarray(plain[-1]["a"]), np.asarray(init["a"]))


@pytest.mark.parametrize(
  "quantize_1bit", [pytest.param(False, marks=pytest.mark.slow), True], ids=["fp32", "1bit"]
)
def test_psyche_guess_is_the_momentum_before_error_feedback(quantize_1bit):
  opts = dict(compression_topk=4, quantize_1bit=quantize_1bit)
  params = {"w": jnp.zeros((16, 16))}
  tx = compiled.transformation(
    dj.demo(0.1, compression_decay=0.9, delayed_apply=True, axis_name=None, **opts)
  )
  point = compiled.gradient_point(0.1, **opts)
  state = tx.init(params)
  rng = np.random.default_rng(1)
  g1, g2 = ({"w": jnp.asarray(rng.normal(size=(16, 16)), jnp.float32)} for _ in range(2))
  # Before any message, the point is the params themselves.
  np.testing.assert_array_equal(point(state, params)["w"], 0.0)
  _, state = tx.update(g1, state, params)
  at = point(state, params)
  # m = lr * g before error feedback; the guess is its sign in the param domain.
  np.testing.assert_allclose(np.asarray(at["w"]), -0.1 * np.sign(np.asarray(g1["w"])), atol=1e-7)
  # One step on: the first message's coefficients left the momentum before the
  # decay, whatever width its values travelled at.
  _, state = tx.update(g2, state, params)
  plan = wire.plan_tree([params["w"]], 64)[0]
  m1 = np.array(compiled.dct_rows(0.1 * g1["w"], plan))
  sent = np.argsort(-np.abs(m1), axis=-1, kind="stable")[:, :4]
  np.put_along_axis(m1, sent, 0.0, axis=-1)
  expected = 0.9 * m1 + np.asarray(compiled.dct_rows(0.1 * g2["w"], plan))
  (demo_state,) = [s for s in state if isinstance(s, dj.DemoState)]
  got = np.asarray(dct.to_chunks(demo_state.momentum["w"], plan))
  np.testing.assert_allclose(got, expected, atol=1e-6)


def test_drawn_positions_leave_the_momentum_at_the_step_after_they_were_drawn():
  params = {"w": jnp.zeros((16, 16))}
  tx = compiled.transformation(
    dj.demo(0.1, compression_decay=0.9, delayed_apply=True, axis_name=None, **DRAWN)
  )
  state = tx.init(params)
  rng = np.random.default_rng(2)
  g1, g2 = ({"w": jnp.asarray(rng.normal(size=(16, 16)), jnp.float32)} for _ in range(2))
  _, state = tx.update(g1, state, params)
  at = compiled.gradient_point(0.1, **DRAWN)(state, params)
  np.testing.assert_allclose(np.asarray(at["w"]), -0.1 * np.sign(np.asarray(g1["w"])), atol=1e-7)
  _, state = tx.update(g2, state, params)
  # The first message went out at the positions drawn for step 0 (worker 0,
  # tensor 0), and only those left the momentum.
  plan = wire.plan_tree([params["w"]], DRAWN["compression_chunk"])[0]
  key = dj.codec.position_key(0, 0, 0)
  k = DRAWN["compression_topk"]
  sent = np.asarray(dj.codec.draw_positions(key, plan.block_shape, k)).reshape(plan.rows, k)
  m1 = np.array(compiled.dct_rows(0.1 * g1["w"], plan))
  np.put_along_axis(m1, sent, 0.0, axis=-1)
  expected = 0.9 * m1 + np.asarray(compiled.dct_rows(0.1 * g2["w"], plan))
  (demo_state,) = [s for s in state if isinstance(s, dj.DemoState)]
  got = np.asarray(dct.to_chunks(demo_state.momentum["w"], plan))
  np.testing.assert_allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize(
  "opts",
  [{}, DRAWN],
  ids=["topk", "drawn-1bit"],
)
def test_the_all_gather_still_waits_on_no_gradient(opts):
  mesh = mesh_of(4)
  params = {"w": jnp.ones((32, 64), jnp.float32) * 0.1}
  tx = dj.demo(1e-3, delayed_apply=True, **opts)
  specs = dj.worker_state_specs(tx, params, mesh)
  state = dj.init_worker_state(tx, params, mesh)

  @functools.partial(
    jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)
  )
  def step(params, state, x):
    at = dj.gradient_point(state, params, 1e-3, **opts)
    _, grads = dj.local_value_and_grad(lambda p, x: jnp.mean(jnp.tanh(x @ p["w"]) ** 2))(at, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = jax.device_put(params, NamedSharding(mesh, P()))
  x = jax.device_put(jnp.ones((16, 32), jnp.float32), NamedSharding(mesh, P("data")))
  closed = jax.make_jaxpr(step)(params, state, x)
  assert gathers_fed_by(closed.jaxpr, {closed.jaxpr.invars[-1]}) == [False]
  # The one all-gather moves the message and nothing else.
  measured = dj.collective_bytes(jax.jit(step), params, state, x)
  assert [k for k, v in measured.by_kind.items() if v] == ["all-gather"]
  assert measured.total == dj.wire_bytes(params, **opts).payload


def test_other_optimizers_look_from_their_own_point():
  params = {"w": jnp.ones((8, 8))}
  assert dj.gradient_point(dj.demo(1e-3, axis_name=None).init(params), params, 1e-3) is params
  assert dj.gradient_point(optax.adamw(1e-3).init(params), params) is params
  tx = dj.diloco(optax.sgd(1.0), axis_name=None)
  state = tx.init(params)
  _, state = tx.update({"w": jnp.full((8, 8), 0.5)}, state, params)
  np.testing.assert_array_equal(dj.gradient_point(state, params)["w"], 0.5)


@pytest.mark.parametrize("guess", ["momentum", "message"])
def test_a_zero_size_param_changes_no_other_guess(guess):
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(64, 64)), jnp.float32)}
  with_empty = {**params, "e": jnp.zeros((0, 8))}
  points = []
  point = compiled.gradient_point(1e-2, compression_topk=8, guess=guess)
  for p in (params, with_empty):
    tx = compiled.transformation(
      dj.demo(1e-2, compression_topk=8, delayed_apply=True, axis_name=None)
    )
    state = tx.init(p)
    for t in range(3):
      at = point(state, p)
      g = {
        k: jnp.asarray(np.random.default_rng(t).normal(size=x.shape), x.dtype)
        for k, x in at.items()
      }
      _, state = tx.update(g, state, p)
    points.append(at)
  np.testing.assert_array_equal(points[1]["w"], points[0]["w"])
  assert not np.array_equal(points[0]["w"], params["w"])
  assert points[1]["e"].shape == (0, 8)


def test_options_that_do_not_match_the_state_are_refused():
  params = {"w": jnp.ones((64, 64))}
  state = dj.demo(1e-3, compression_topk=8, delayed_apply=True, axis_name=None).init(params)
  with pytest.raises(ValueError, match="compression options of the dj.demo"):
    dj.gradient_point(state, params, 1e-3, compression_topk=32)


@pytest.mark.slow
@pytest.mark.parametrize(
  "quantize_1bit, drawn",
  [(False, False), (True, False), (True, True)],
  ids=["fp32", "1bit", "drawn"],
)
def test_the_trainers_overlapped_step_looks_ahead_and_gathers_before_the_gradient(
  quantize_1bit, drawn
):
  from experiments.run import methods

  cfg, _, closed = trainer_step_jaxpr(
    compression_topk=1 if drawn else 8,
    compression_chunk=8 if drawn else 64,
    quantize_1bit=quantize_1bit,
    random_positions=drawn,
    delayed_apply=True,
  )
  point = methods.get("demo").gradient_point(cfg)
  assert point.func is dj.gradient_point
  assert point.keywords["quantize_1bit"] is quantize_1bit
  assert point.keywords["random_positions"] is drawn
  bare = checks.resolve(dataclasses.replace(cfg, lookahead=False))
  assert methods.get("demo").gradient_point(bare) is dj.inner_params
  fed = gathers_fed_by(closed.jaxpr, set(closed.jaxpr.invars[-2:]))
  # The message all-gather (and any other) starts before the batch is read.
  assert fed and not any(fed)


# Each traces the tiny model's whole train step (about 6 CPU-s).
@pytest.mark.slow
@pytest.mark.parametrize(
  "lookahead, optimizer",
  [(True, "demo"), (True, "distro_adamw"), (False, "demo"), (False, "distro_adamw")],
  ids=["True-demo", "True-distro_adamw", "False-demo", "False-distro_adamw"],
)
def test_the_trainers_step_takes_its_gradient_at_the_lookahead(lookahead, optimizer):
  # The step's loss is the value of the forward pass its gradient comes from.
  # At the lookahead (where the update in flight lands) that pass reads the
  # message in flight, the state's pending; at the bare params it does not.
  _, program, closed = trainer_step_jaxpr(
    optimizer=optimizer, delayed_apply=True, lookahead=lookahead
  )
  jaxpr = closed.jaxpr
  num_params = len(jax.tree.leaves(program.abstract))
  state = jax.tree.flatten_with_path(program.abstract_state()["opt_state"])[0]
  pending = {
    jaxpr.invars[num_params + i]
    for i, (path, _) in enumerate(state)
    if jax.tree_util.keystr(path).endswith(".pending")
  }
  assert len(pending) == 1
  # The outputs: params, state, then the metrics {"excluded", "loss"}.
  *_, excluded, loss = jaxpr.outvars
  assert (excluded.aval.dtype, loss.aval.dtype) == (jnp.int32, jnp.float32)
  fed = outputs_fed_by(jaxpr, pending)
  assert fed[-1] is lookahead, f"the loss reads the message in flight: {fed[-1]}"
  # Either way the message in flight is applied to every param.
  assert all(fed[:num_params])


def test_the_lookahead_normalize_flag_reaches_the_guess_and_is_refused_without_a_lookahead():
  from experiments.run import methods
  from experiments.run.config import ConfigError, TrainConfig

  base = dict(preset="tiny", steps=4, workers=1, optimizer="demo", normalize="orth")
  cfg = checks.resolve(TrainConfig(**base, delayed_apply=True, lookahead_normalize="rms"))
  assert methods.get("demo").gradient_point(cfg).keywords["normalize"] == "rms"
  as_step = checks.resolve(TrainConfig(**base, delayed_apply=True))
  assert methods.get("demo").gradient_point(as_step).keywords["normalize"] != "rms"
  for wrong in (dict(lookahead_normalize="rms"), dict(delayed_apply=True, lookahead_normalize="x")):
    with pytest.raises(ConfigError, match="--lookahead_normalize"):
      checks.resolve(TrainConfig(**base, **wrong))
  # The rms guess moves a matrix along its own momentum; the orthogonalized one does not.
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)}
  tx = dj.demo(1e-2, compression_topk=4, compression_chunk=8, delayed_apply=True, axis_name=None)
  state = tx.init(params)
  _, state = tx.update({"w": jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)}, state, params)
  opts = dict(compression_topk=4, compression_chunk=8)
  moves = {
    n: dj.gradient_point(state, params, 1e-2, normalize=n, **opts)["w"] - params["w"]
    for n in ("rms", "orth")
  }
  for n, move in moves.items():
    np.testing.assert_allclose(np.sqrt(np.mean(np.square(move))), 1e-2, rtol=1e-3, err_msg=n)
  assert not np.allclose(moves["rms"], moves["orth"], atol=1e-4)
