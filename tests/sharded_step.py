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


def place_grads(grads_W, mesh):
  return jax.tree.map(
    lambda g: jax.device_put(jnp.asarray(g), NamedSharding(mesh, P("data"))), grads_W
  )


def per_device_copies(x):
  """Every device's own buffer of a replicated array, as NumPy."""
  return [np.asarray(s.data) for s in x.addressable_shards]
