"""delayed_apply: step t applies step t-1's aggregate, and its all-gather waits on no gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxpr_gathers import gathers_fed_by
from sharded_step import mesh_of, random_problem, trajectory

import distro_jax as dj

SHAPES = {"a": (64, 128), "b": (96,), "c": ()}


# Drawn positions: the message in flight must be decoded, and fed back, at
# the positions drawn at the step that made it.
DRAWN = dict(compression_topk=2, compression_chunk=8, quantize_1bit=True, random_positions=True)


@pytest.mark.slow
@pytest.mark.parametrize(
  "make_tx, opts",
  [(dj.demo, {}), (dj.distro_adamw, {}), (dj.demo, DRAWN)],
  ids=["demo", "distro_adamw", "demo-drawn-1bit"],
)
def test_delayed_is_the_same_steps_one_step_later(make_tx, opts):
  # Gradients that do not depend on the params make the two runs' messages
  # identical, so the delayed run must be the plain one shifted by one step.
  workers, steps = 4, 6
  init, grads = random_problem(SHAPES, workers, steps + 1, seed=0)
  mesh = mesh_of(workers)
  plain, _ = trajectory(make_tx(1e-2, **opts), init, grads[:steps], mesh)
  delayed, state = trajectory(make_tx(1e-2, delayed_apply=True, **opts), init, grads, mesh)
  for k in SHAPES:
    np.testing.assert_array_equal(np.asarray(delayed[1][k]), np.asarray(init[k]))
    for t in range(steps + 1):
      np.testing.assert_array_equal(np.asarray(delayed[t + 1][k]), np.asarray(plain[t][k]))
  assert not np.array_equal(np.asarray(plain[-1]["a"]), np.asarray(init["a"]))
  # The last message is still pending, one per worker, and valid.
  pending = np.asarray(state[0].pending).reshape(workers, -1)
  # The defaults' wire options, with the run's own over them.
  wire_opts = {**dict(compression_topk=32, compression_chunk=64, quantize_1bit=False), **opts}
  layout = dj.wire.wire_layout(init, **wire_opts)
  assert pending.shape[1] == layout.num_bytes
  assert np.asarray(dj.codec.message_valid(jnp.asarray(pending), layout)).all()


def _loss(params, x_BxD):
  return jnp.mean(jnp.tanh(x_BxD @ params["w"]) ** 2)


@pytest.mark.parametrize("delayed", [False, True])
def test_the_all_gather_waits_on_the_gradient_only_without_delay(delayed):
  mesh = mesh_of(4)
  params = {"w": jnp.ones((32, 64), jnp.float32) * 0.1}
  tx = dj.demo(1e-3, delayed_apply=delayed)
  specs = dj.worker_state_specs(tx, params, mesh)
  state = dj.init_worker_state(tx, params, mesh)

  @functools.partial(
    jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)
  )
  def step(params, state, x):
    _, grads = dj.local_value_and_grad(_loss)(params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = jax.device_put(params, NamedSharding(mesh, P()))
  x = jax.device_put(jnp.ones((16, 32), jnp.float32), NamedSharding(mesh, P("data")))
  closed = jax.make_jaxpr(step)(params, state, x)
  batch = closed.jaxpr.invars[-1]
  fed = gathers_fed_by(closed.jaxpr, {batch})
  assert len(fed) == 1
  # Delayed, the payload in flight comes from the state alone, so it can
  # overlap this step's forward and backward pass.
  assert fed == [not delayed]


def test_delayed_state_from_a_plain_transformation_is_refused():
  params = {"w": jnp.ones((8, 8))}
  plain_state = dj.demo(1e-3, axis_name=None).init(params)
  with pytest.raises(ValueError, match="delayed_apply=True needs the state"):
    dj.demo(1e-3, axis_name=None, delayed_apply=True).update(params, plain_state, params)
