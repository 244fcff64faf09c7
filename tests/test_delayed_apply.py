"""delayed_apply: step t applies step t-1's aggregate, and its all-gather waits on no gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jex_core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_step import build, mesh_of, place_grads

import distro_jax as dj

SHAPES = {"a": (64, 128), "b": (96,), "c": ()}


@pytest.mark.slow
@pytest.mark.parametrize("make_tx", [dj.demo, dj.distro_adamw], ids=["demo", "distro_adamw"])
def test_delayed_is_the_same_steps_one_step_later(make_tx):
  # Gradients that do not depend on the params make the two runs' messages
  # identical, so the delayed run must be the plain one shifted by one step.
  workers, steps = 4, 6
  rng = np.random.default_rng(0)
  init = {k: jnp.asarray(rng.normal(size=s) * 0.1, jnp.float32) for k, s in SHAPES.items()}
  grads = [
    {k: rng.normal(size=(workers, *s)).astype(np.float32) for k, s in SHAPES.items()}
    for _ in range(steps + 1)
  ]
  mesh = mesh_of(workers)

  def trajectory(delayed, n):
    step, params, state = build(make_tx(1e-2, delayed_apply=delayed), init, mesh)
    out = [params]
    for g in grads[:n]:
      params, state = step(params, state, place_grads(g, mesh))
      out.append(params)
    return out, state

  plain, _ = trajectory(False, steps)
  delayed, state = trajectory(True, steps + 1)
  for k in SHAPES:
    np.testing.assert_array_equal(np.asarray(delayed[1][k]), np.asarray(init[k]))
    for t in range(steps + 1):
      np.testing.assert_array_equal(np.asarray(delayed[t + 1][k]), np.asarray(plain[t][k]))
  assert not np.array_equal(np.asarray(plain[-1]["a"]), np.asarray(init["a"]))
  # The last message is still pending, one per worker, and valid.
  pending = np.asarray(state[0].pending).reshape(workers, -1)
  layout = dj.wire.wire_layout(init, compression_topk=32, compression_chunk=64, quantize_1bit=False)
  assert pending.shape[1] == layout.num_bytes
  _, valid = dj.codec.decode_message(jnp.asarray(pending), layout)
  assert np.asarray(valid).all()


def _gathers_fed_by(jaxpr, tainted):
  """For each all-gather in ``jaxpr``, whether its operand depends on a ``tainted`` var."""
  found = []
  for eqn in jaxpr.eqns:
    hit = any(isinstance(v, jex_core.Var) and v in tainted for v in eqn.invars)
    if eqn.primitive.name.startswith("all_gather"):
      found.append(hit)
    for sub in eqn.params.values():
      inner = sub.jaxpr if isinstance(sub, jex_core.ClosedJaxpr) else sub
      if not isinstance(inner, jex_core.Jaxpr):
        continue
      if len(inner.invars) == len(eqn.invars):
        inner_tainted = {
          iv
          for iv, v in zip(inner.invars, eqn.invars)
          if isinstance(v, jex_core.Var) and v in tainted
        }
      else:
        inner_tainted = set(inner.invars) if hit else set()
      found += _gathers_fed_by(inner, inner_tainted)
    if hit:
      tainted.update(eqn.outvars)
  return found


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
  fed = _gathers_fed_by(closed.jaxpr, {batch})
  assert len(fed) == 1
  # Delayed, the payload in flight comes from the state alone, so it can
  # overlap this step's forward and backward pass.
  assert fed == [not delayed]


def test_delayed_state_from_a_plain_transformation_is_refused():
  params = {"w": jnp.ones((8, 8))}
  plain_state = dj.demo(1e-3, axis_name=None).init(params)
  with pytest.raises(ValueError, match="delayed_apply=True needs the state"):
    dj.demo(1e-3, axis_name=None, delayed_apply=True).update(params, plain_state, params)
