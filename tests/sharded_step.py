"""A data-parallel optimizer step for tests: each worker brings its own gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import distro_jax as dj


def mesh_of(workers):
  return jax.make_mesh((workers,), ("data",), devices=jax.devices()[:workers])


def build(tx, params, mesh):
  """Returns (step, params, opt_state); step(params, state, grads_W) -> (params, state).

  ``grads_W`` has a leading worker axis; worker w applies ``grads_W[w]``.
  """
  specs = dj.worker_state_specs(tx, params, mesh)
  state = dj.init_worker_state(tx, params, mesh)
  params = jax.device_put(params, NamedSharding(mesh, P()))

  def local(p, s, g):
    g = jax.tree.map(lambda x: x[0], g)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(
    jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
  )
  return step, params, state


def random_problem(shapes, workers, steps, seed):
  """Params (normal, x0.1) and ``steps`` gradient trees, each with a leading worker axis.

  The gradients do not depend on the params, so two modes of one exchange
  can be compared message for message.
  """
  rng = np.random.default_rng(seed)
  init = {k: jnp.asarray(rng.normal(size=s) * 0.1, jnp.float32) for k, s in shapes.items()}
  grads = [
    {k: rng.normal(size=(workers, *s)).astype(np.float32) for k, s in shapes.items()}
    for _ in range(steps)
  ]
  return init, grads


def trajectory(tx, init, grads, mesh):
  """``(params before each step and after the last, final state)`` of :func:`build`'s step."""
  step, params, state = build(tx, init, mesh)
  out = [params]
  for g in grads:
    params, state = step(params, state, place_grads(g, mesh))
    out.append(params)
  return out, state


def place_grads(grads_W, mesh):
  return jax.tree.map(
    lambda g: jax.device_put(jnp.asarray(g), NamedSharding(mesh, P("data"))), grads_W
  )


def per_device_copies(x):
  """Every device's own buffer of a replicated array, as NumPy."""
  return [np.asarray(s.data) for s in x.addressable_shards]
