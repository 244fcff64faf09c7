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


def build(tx, params, mesh, check_vma=True):
  """Returns (step, params, opt_state); step(params, state, grads_W) -> (params, state).

  ``grads_W`` has a leading worker axis; worker w applies ``grads_W[w]``.
  After every call the step asserts that each device holds the same params, to
  the bit (see :func:`assert_identical_on_every_device`); it keeps the jitted
  step's attributes, such as ``lower``.
  """
  specs = dj.worker_state_specs(tx, params, mesh)
  state = dj.init_worker_state(tx, params, mesh)
  params = jax.device_put(params, NamedSharding(mesh, P()))

  def local(p, s, g):
    g = jax.tree.map(lambda x: x[0], g)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(
    jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(P(), specs, P("data")),
      out_specs=(P(), specs),
      check_vma=check_vma,
    )
  )
  return _CheckedStep(step, mesh.devices.size), params, state


class _CheckedStep:
  """A jitted step that checks, after each call, that the params are bit-identical on every device.

  Reading ``np.asarray(params)`` sees one device's copy only, so without this a
  step that let the replicas drift apart would pass every test that reads it.
  """

  def __init__(self, jitted, num_devices):
    self._jitted = jitted
    self._num_devices = num_devices
    self._calls = 0

  def __call__(self, *args, **kwargs):
    params, state = self._jitted(*args, **kwargs)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)):
      return params, state  # traced (make_jaxpr, an outer jit): no buffers to read
    self._calls += 1
    assert_identical_on_every_device(
      params, copies=self._num_devices, context=f"after step {self._calls}"
    )
    return params, state

  def __getattr__(self, name):
    return getattr(self._jitted, name)


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


def bits(x):
  """``x``'s bits as unsigned ints of its width, so -0.0 != 0.0 and NaNs compare by payload."""
  x = np.asarray(x)
  return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def assert_identical_on_every_device(tree, copies=None, context=""):
  """Every device's buffer of each replicated leaf of ``tree`` is the same, to the bit.

  ``copies``, if given, is how many devices must hold each leaf.
  """
  for path, leaf in jax.tree.flatten_with_path(tree)[0]:
    name = f"{jax.tree_util.keystr(path)} {context}".strip()
    found = [bits(c) for c in per_device_copies(leaf)]
    if copies is not None:
      assert len(found) == copies, f"{name}: {len(found)} copies, not {copies}"
    for i, c in enumerate(found[1:], 1):
      np.testing.assert_array_equal(c, found[0], err_msg=f"{name}: device {i} differs from 0")
