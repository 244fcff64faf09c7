"""A partial overlap: ``delayed_apply`` with ``synchronous``, some params sent in their own step."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxpr_gathers import gather_operand_bytes, gathers_fed_by, trainer_step_jaxpr
from sharded_step import mesh_of, random_problem, trajectory

import distro_jax as dj
from experiments.run import checks

SHAPES = {"a": (64, 128), "b": (96,), "c": (32, 128)}
SYNC = {"a": True, "b": False, "c": False}


@pytest.mark.slow
@pytest.mark.parametrize("make_tx", [dj.demo, dj.distro_adamw], ids=["demo", "distro_adamw"])
def test_each_group_trains_as_its_own_mode(make_tx):
  # With gradients that do not depend on the params, every tensor's messages
  # are its own: a synchronous tensor must follow the plain run bit for bit,
  # an overlapped one the plain run one step late.
  workers, steps = 4, 5
  init, grads = random_problem(SHAPES, workers, steps + 1, seed=0)
  mesh = mesh_of(workers)
  # The two runs are different programs, and XLA may fuse a multiply-add in
  # one and not the other: at lr 1e-2 and decay 0.1, one whole-suite run left
  # 3 of 8,192 entries one unit in the last place apart (7.5e-9). Powers of
  # two make the products exact, and the tolerance covers what is left; an
  # update of a wrong mode or step would be off by about lr = 7.8e-3.
  make = functools.partial(make_tx, 2**-7, weight_decay=2**-3, compression_topk=8)
  plain, _ = trajectory(make(), init, grads, mesh)
  partial, _ = trajectory(make(delayed_apply=True, synchronous=SYNC), init, grads, mesh)
  same = functools.partial(np.testing.assert_allclose, rtol=0, atol=1e-7)
  for t in range(steps + 1):
    same(np.asarray(partial[t]["a"]), np.asarray(plain[t]["a"]))
    for k in ("b", "c"):
      want = init[k] if t == 0 else plain[t - 1][k]
      same(np.asarray(partial[t][k]), np.asarray(want))
  assert not np.array_equal(np.asarray(plain[-1]["c"]), np.asarray(init["c"]))


@pytest.mark.slow
def test_every_param_synchronous_or_none_is_the_plain_or_the_delayed_exchange():
  workers, steps = 4, 3
  init, grads = random_problem(SHAPES, workers, steps, seed=1)
  mesh = mesh_of(workers)
  make = functools.partial(dj.demo, 1e-2, compression_topk=8)
  for synchronous, reference in ((True, make()), (False, make(delayed_apply=True))):
    mask = jax.tree.map(lambda _, s=synchronous: s, init)
    got, _ = trajectory(make(delayed_apply=True, synchronous=mask), init, grads, mesh)
    want, _ = trajectory(reference, init, grads, mesh)
    for g, w in zip(got, want):
      for k in SHAPES:
        np.testing.assert_array_equal(np.asarray(g[k]), np.asarray(w[k]))


def _loss(params, x_BxD):
  h = jnp.tanh(x_BxD @ params["a"])
  return jnp.mean(h @ params["c"].T) + jnp.mean(params["b"] ** 2)


def _step(tx, lr, opts):
  def step(params, state, x):
    at = dj.worker_local(dj.gradient_point(state, params, lr, **opts))
    _, grads = dj.local_value_and_grad(_loss)(at, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, at

  return step


def test_only_the_overlapped_gather_waits_on_no_gradient():
  mesh = mesh_of(4)
  params = {k: jnp.full(s, 0.1, jnp.float32) for k, s in SHAPES.items()}
  tx = dj.demo(1e-3, delayed_apply=True, synchronous=SYNC)
  specs = dj.worker_state_specs(tx, params, mesh)
  state = dj.init_worker_state(tx, params, mesh)
  step = jax.shard_map(
    _step(tx, 1e-3, {}),
    mesh=mesh,
    in_specs=(P(), specs, P("data")),
    out_specs=(P(), specs, P("data")),
  )
  params = jax.device_put(params, NamedSharding(mesh, P()))
  x = jax.device_put(jnp.ones((16, 64), jnp.float32), NamedSharding(mesh, P("data")))
  closed = jax.make_jaxpr(step)(params, state, x)
  fed = gathers_fed_by(closed.jaxpr, {closed.jaxpr.invars[-1]})
  sizes = gather_operand_bytes(closed.jaxpr)
  sync = dj.wire_bytes([params[k] for k in SHAPES if SYNC[k]]).payload
  overlapped = dj.wire_bytes([params[k] for k in SHAPES if not SYNC[k]]).payload
  assert sync != overlapped  # so the sizes tell the two gathers apart
  # Only the synchronous message waits on this step's batch.
  assert sorted(zip(sizes, fed)) == sorted([(sync, True), (overlapped, False)])
  # The two all-gathers move the two messages and nothing else.
  measured = dj.collective_bytes(jax.jit(step), params, state, x)
  assert [k for k, v in measured.by_kind.items() if v] == ["all-gather"]
  assert measured.total == sync + overlapped


def test_the_lookahead_moves_only_the_overlapped_params():
  # The overlapped group's point is the lookahead of a delayed exchange of
  # that group alone; the synchronous group is looked at where it is.
  rng = np.random.default_rng(2)
  params = {k: jnp.asarray(rng.normal(size=s) * 0.1, jnp.float32) for k, s in SHAPES.items()}
  x = jnp.asarray(rng.normal(size=(8, 64)), jnp.float32)
  opts = dict(compression_topk=8, weight_decay=0.1)
  partial = dj.demo(1e-2, axis_name=None, delayed_apply=True, synchronous=SYNC, **opts)
  alone = dj.demo(1e-2, axis_name=None, delayed_apply=True, **opts)
  overlapped = {k: params[k] for k in SHAPES if not SYNC[k]}
  point = jax.jit(functools.partial(dj.gradient_point, learning_rate=1e-2, **opts))

  @jax.jit
  def both(state, alone_state):
    grads = jax.grad(_loss)(dj.gradient_point(state, params, 1e-2, **opts), x)
    _, state = partial.update(grads, state, params)
    _, alone_state = alone.update({k: grads[k] for k in overlapped}, alone_state, overlapped)
    return state, alone_state

  state, alone_state = partial.init(params), alone.init(overlapped)
  for _ in range(3):
    state, alone_state = both(state, alone_state)
  at = point(state, params)
  want = point(alone_state, overlapped)
  np.testing.assert_array_equal(np.asarray(at["a"]), np.asarray(params["a"]))
  for k in overlapped:
    np.testing.assert_array_equal(np.asarray(at[k]), np.asarray(want[k]))
    assert not np.array_equal(np.asarray(at[k]), np.asarray(params[k]))


def test_a_mask_function_and_a_mask_tree_agree():
  params = {k: jnp.ones(s, jnp.float32) for k, s in SHAPES.items()}
  by_tree = dj.demo(1e-2, axis_name=None, delayed_apply=True, synchronous=SYNC)
  by_fn = dj.demo(
    1e-2, axis_name=None, delayed_apply=True, synchronous=lambda p: {k: k == "a" for k in p}
  )
  shapes = lambda tx: jax.tree.map(jnp.shape, jax.eval_shape(tx.init, params))
  assert shapes(by_tree) == shapes(by_fn)
  # A prefix: one bool for a whole subtree.
  nested = {"ab": {"a": params["a"], "b": params["b"]}, "c": params["c"]}
  tx = dj.demo(1e-2, axis_name=None, delayed_apply=True, synchronous={"ab": True, "c": False})
  updates, _ = jax.jit(tx.update)(nested, tx.init(nested), nested)
  moved = jax.tree.map(lambda u: bool(jnp.any(u != 0)), updates)
  assert moved == {"ab": {"a": True, "b": True}, "c": False}  # "c" waits a step


def test_synchronous_without_delay_or_with_a_wrong_mask_is_refused():
  params = {k: jnp.ones(s, jnp.float32) for k, s in SHAPES.items()}
  with pytest.raises(ValueError, match="Pass delayed_apply=True, or leave synchronous=None"):
    dj.demo(1e-2, axis_name=None, synchronous=SYNC)
  tx = dj.demo(1e-2, axis_name=None, delayed_apply=True, synchronous={"a": True})
  with pytest.raises(ValueError, match="tree of bools with the params' structure, or a prefix"):
    tx.init(params)


@pytest.mark.parametrize(
  "flags, message",
  [
    (dict(synchronous_params="'attn'"), "without --delayed_apply every param is"),
    (dict(synchronous_params="(attn", delayed_apply=True), "is not a regular expression"),
    (dict(synchronous_params="'attention'", delayed_apply=True), "matches no param"),
  ],
  ids=["no-delay", "bad-regex", "no-match"],
)
def test_the_driver_refuses_a_synchronous_pattern_it_cannot_use(flags, message):
  from experiments.run import config

  with pytest.raises(config.ConfigError, match=message):
    checks.resolve(config.TrainConfig(preset="tiny", workers=4, **flags))


def test_the_method_option_partial_names_the_measured_group():
  from experiments.run import methods, model, presets

  method, overrides = methods.parse("demo-k8-delayed-partial")
  assert method.name == "demo"
  assert overrides["synchronous_params"] == methods.PARTIAL_OVERLAP
  paths = model.param_paths(presets.get_preset("small"))
  picked = [p for p in paths if re.search(methods.PARTIAL_OVERLAP, p)]
  # Every attention weight, the embedding and the head; no norm, no MLP.
  assert len(picked) == 4 * 4 + 2
  assert not any("norm" in p or "mlp" in p for p in picked)


@pytest.mark.slow
def test_the_trainers_partial_step_gathers_one_message_before_the_batch_and_one_after():
  from experiments.run import methods

  cfg, program, closed = trainer_step_jaxpr(
    compression_topk=8, delayed_apply=True, synchronous_params=methods.PARTIAL_OVERLAP
  )
  fed = gathers_fed_by(closed.jaxpr, set(closed.jaxpr.invars[-2:]))
  sizes = gather_operand_bytes(closed.jaxpr)
  leaves = jax.tree_util.tree_flatten_with_path(program.abstract)[0]
  pick = lambda sync: [
    x
    for path, x in leaves
    if (re.search(methods.PARTIAL_OVERLAP, jax.tree_util.keystr(path)) is not None) == sync
  ]
  payload = lambda xs: dj.wire_bytes(xs, compression_topk=8).payload
  messages = [(payload(pick(True)), True), (payload(pick(False)), False)]
  # Of the all-gathers of a message's size, the synchronous one reads the
  # batch and the overlapped one does not.
  got = [(size, hit) for size, hit in zip(sizes, fed) if size in {b for b, _ in messages}]
  assert sorted(got) == sorted(messages)
  # The driver's byte accounting is the two messages'.
  assert methods.get("demo").message_bytes(cfg, program.abstract) == sum(b for b, _ in messages)


def test_the_time_model_sees_the_overlapped_share_of_the_message():
  from experiments.run import config, methods, model, presets

  params = model.abstract_params(presets.get_preset("small"))
  share = lambda **flags: methods.overlapped_share(
    config.TrainConfig(**{"preset": "small", "optimizer": "demo", **flags})
  )
  assert share() == 0.0
  assert share(delayed_apply=True) == 1.0
  partial = share(delayed_apply=True, synchronous_params=methods.PARTIAL_OVERLAP)
  paths = model.param_paths(presets.get_preset("small"))
  overlapped = [
    x for p, x in zip(paths, jax.tree.leaves(params)) if not re.search(methods.PARTIAL_OVERLAP, p)
  ]
  assert partial == dj.wire_bytes(overlapped).payload / dj.wire_bytes(params).payload
  assert 0.6 < partial < 0.7  # a third of the message stays synchronous
  assert share(optimizer="adamw") == 0.0


# A failed worker left out of each exchange in turn, in a partially overlapped
# run: tests/test_threaded_step.py, whose fused and threaded runs both check it.
