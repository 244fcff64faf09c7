"""The overlapped exchange's all-gather as a program of its own (dj.gather_pending)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_step import mesh_of

import distro_jax as dj

WORKERS = 4


def _loss(params, x_BxD):
  h_BxH = jnp.tanh(x_BxD @ params["w"])
  return jnp.mean((h_BxH @ params["v"]) ** 2) + jnp.sum(params["b"] ** 2)


def _problem(mesh):
  keys = jax.random.split(jax.random.key(0), 3)
  params = {
    "w": jax.random.normal(keys[0], (32, 64)) * 0.1,
    "v": jax.random.normal(keys[1], (64, 16)) * 0.1,
    "b": jnp.ones((16,)),
  }
  x = jax.random.normal(keys[2], (6, 4 * WORKERS, 32))
  return jax.device_put(params, NamedSharding(mesh, P())), x


def _steps(tx, mesh, *, split: bool):
  """Six steps of ``tx``, the all-gather fused into the step or run as its own program."""
  params, xs = _problem(mesh)
  specs = dj.worker_state_specs(tx, params, mesh)
  state = dj.init_worker_state(tx, params, mesh)
  rows = NamedSharding(mesh, P("data"))

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs,), out_specs=P())
  def exchange(state):
    return dj.gather_pending(state, "data")

  @jax.jit
  @functools.partial(
    jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P()), out_specs=(P(), specs)
  )
  def step(params, state, x, gathered):
    _, grads = dj.local_value_and_grad(_loss)(params, x)
    extra = {"gathered": gathered} if gathered is not None else {}
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state

  for x in xs:
    gathered = exchange(state) if split else None
    params, state = step(params, state, jax.device_put(x, rows), gathered)
  return params, state, exchange


def _fused_and_split(opts):
  mesh = mesh_of(WORKERS)
  tx = dj.demo(3e-2, delayed_apply=True, **opts)
  fused, fused_state, _ = _steps(tx, mesh, split=False)
  split, split_state, exchange = _steps(tx, mesh, split=True)
  return tx, (fused, fused_state), (split, split_state), exchange


@pytest.fixture(scope="module")
def with_defaults():
  """The default message's fused and split runs, and its exchange program."""
  return _fused_and_split({})


@pytest.mark.parametrize(
  "opts",
  [
    pytest.param(None, id="defaults", marks=pytest.mark.xdist_group("overlap_defaults")),
    pytest.param(
      {"compression_topk": 2, "compression_chunk": 8, "quantize_1bit": True},
      id="k2-c8-1bit",
      marks=pytest.mark.slow,
    ),
  ],
)
def test_an_exchange_of_its_own_gives_the_fused_steps_to_the_bit(opts, request):
  runs = request.getfixturevalue("with_defaults") if opts is None else _fused_and_split(opts)
  _, (fused, fused_state), (split, split_state), _ = runs
  params, _ = _problem(mesh_of(WORKERS))
  assert not np.array_equal(np.asarray(fused["w"]), np.asarray(params["w"]))
  for a, b in zip(jax.tree.leaves((fused, fused_state)), jax.tree.leaves((split, split_state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_a_partial_overlap_gathers_only_the_overlapped_message():
  # The synchronous group's exchange ignores `gathered`; the overlapped one uses it.
  mesh = mesh_of(WORKERS)
  tx = dj.demo(3e-2, delayed_apply=True, synchronous={"w": True, "v": False, "b": False})
  fused, fused_state, _ = _steps(tx, mesh, split=False)
  split, split_state, exchange = _steps(tx, mesh, split=True)
  for a, b in zip(jax.tree.leaves((fused, fused_state)), jax.tree.leaves((split, split_state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  params, _ = _problem(mesh)
  overlapped = {"v": params["v"], "b": params["b"]}
  payload = dj.wire_bytes(overlapped).payload
  gathered = exchange(dj.init_worker_state(tx, params, mesh))
  assert gathered.shape == (WORKERS, payload)


@pytest.mark.xdist_group("overlap_defaults")
def test_the_exchange_program_moves_the_message_and_nothing_else(with_defaults):
  mesh = mesh_of(WORKERS)
  tx, _, _, exchange = with_defaults
  params, _ = _problem(mesh)
  state = dj.init_worker_state(tx, params, mesh)
  measured = dj.parse_collective_bytes(exchange.lower(state).compile().as_text())
  assert set(k for k, v in measured.by_kind.items() if v) == {"all-gather"}
  assert measured.total == dj.wire_bytes(params).payload


def test_gathered_of_another_shape_is_refused_by_name():
  mesh = mesh_of(WORKERS)
  tx = dj.demo(3e-2, delayed_apply=True)
  params, xs = _problem(mesh)
  specs = dj.worker_state_specs(tx, params, mesh)
  state = dj.init_worker_state(tx, params, mesh)
  wrong = jnp.zeros((WORKERS, 7), jnp.uint8)

  @functools.partial(
    jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P()), out_specs=(P(), specs)
  )
  def step(params, state, x, gathered):
    _, grads = dj.local_value_and_grad(_loss)(params, x)
    return tx.update(grads, state, params, gathered=gathered)

  with pytest.raises(ValueError, match=r"gathered has shape \(4, 7\).*dj.gather_pending"):
    jax.jit(step)(params, state, jax.device_put(xs[0], NamedSharding(mesh, P("data"))), wrong)


@pytest.mark.parametrize("delayed", [False, True])
def test_gather_pending_needs_exactly_one_overlapped_exchange(delayed):
  params = {"w": jnp.ones((8, 8))}
  if delayed:
    # Two overlapped exchanges side by side: each must gather its own.
    one = dj.demo(0.1, delayed_apply=True, axis_name=None)
    state, count = (one.init(params), one.init(params)), 2
  else:
    state, count = dj.demo(0.1, axis_name=None).init(params), 0
  with pytest.raises(ValueError, match=f"exactly one delayed_apply.*has {count}"):
    dj.gather_pending(state, None)
