"""No silent dense step: dj.DenseStepWarning fires in exactly the uses that all-reduce the gradient.

The trap of issue 55: ``dj.demo(axis_name=None)`` in a ``jax.jit`` step over a
sharded batch runs without a word while XLA all-reduces the whole gradient.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import distro_jax as dj

PARAMS = {"w": jnp.full((16, 8), 0.1), "b": jnp.zeros((8,))}


def _loss(params, batch):
  x, y = batch
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _batch():
  rng = np.random.default_rng(0)
  return rng.normal(size=(16, 16)).astype(np.float32), rng.normal(size=(16, 8)).astype(np.float32)


def _jit_step(tx):
  def step(params, state, batch):
    grads = jax.grad(_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step)


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.asarray(jax.devices()), ("data",))


def _compile(fn, *args):
  """Compiles ``fn`` for ``args``: the checks of a jitted step run at compile time."""
  return fn.lower(*args).compile()


def _no_warning(fn, *args):
  with warnings.catch_warnings():
    warnings.simplefilter("error", dj.DenseStepWarning)
    _compile(fn, *args)


def test_axis_name_none_over_a_sharded_batch_warns_and_names_the_fix(mesh):
  tx = dj.demo(0.1, compression_chunk=8, axis_name=None)
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  batch = jax.device_put(_batch(), NamedSharding(mesh, P("data")))
  with pytest.warns(dj.DenseStepWarning, match="over 8 devices") as caught:
    _compile(_jit_step(tx), params, tx.init(params), batch)
  message = str(caught[0].message)
  assert "dj.worker_value_and_grad" in message and "dj.per_worker" in message
  assert f"({(16 * 8 + 8) * 4:,} bytes)" in message  # the whole gradient, per device


def test_a_single_device_step_does_not_warn():
  tx = dj.demo(0.1, compression_chunk=8, axis_name=None)
  _no_warning(_jit_step(tx), PARAMS, tx.init(PARAMS), _batch())


@pytest.mark.slow  # compiles two DeMo steps: about 3 s here
def test_one_worker_sharded_over_the_devices_warns_unless_quiet(mesh):
  # FSDP over all devices with one DeMo worker (nanodo's default sharding): the
  # gradient is reduce-scattered across devices holding different rows, as
  # dense as an all-reduce (issue 67). One site's FSDP on purpose traces quiet.
  tx = dj.demo(0.1, compression_chunk=2, axis_name=None)
  params = {"w": jax.device_put(PARAMS["w"], NamedSharding(mesh, P("data")))}
  batch = jax.device_put(_batch(), NamedSharding(mesh, P("data")))
  loss = lambda p, b: jnp.mean((b[0] @ p["w"] - b[1]) ** 2)

  def step(params, state, batch):
    updates, state = tx.update(jax.grad(loss)(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  with pytest.warns(dj.DenseStepWarning, match="partitioned over them.*reduce-scattered"):
    _compile(jax.jit(step), params, tx.init(params), batch)
  with dj.dense_step.quiet():
    _no_warning(jax.jit(step), params, tx.init(params), batch)


def _shard_map_step(tx, mesh, value_and_grad):
  def local(params, state, batch):
    _, grads = value_and_grad(_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  specs = dj.worker_state_specs(tx, PARAMS, mesh)
  return jax.jit(
    jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
  )


@pytest.mark.slow  # compiling DeMo's exchange: about 9 s here
def test_the_shard_map_path_does_not_warn():
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  tx = dj.demo(0.1, compression_chunk=8)
  step = _shard_map_step(tx, mesh, lambda f: dj.local_value_and_grad(f, "data"))
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  batch = jax.device_put(_batch(), NamedSharding(mesh, P("data")))
  _no_warning(step, params, dj.abstract_worker_state(tx, PARAMS, mesh), batch)


def test_axis_name_none_inside_shard_map_does_not_warn(mesh):
  # Each device its own worker, exchanging nothing: no collective at all.
  tx = dj.demo(0.1, compression_chunk=8, axis_name=None)

  def local(params, state, batch):
    params, _ = _jit_step(tx)(params, state, batch)
    return jax.tree.map(lambda x: x[None], params)

  step = jax.jit(
    jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P("data"))
  )
  _no_warning(step, PARAMS, tx.init(PARAMS), _batch())


def test_grad_of_replicated_params_inside_shard_map_warns(mesh):
  # jax.value_and_grad with respect to replicated params psums the gradient.
  tx = dj.demo(0.1, compression_chunk=8)
  with pytest.warns(dj.DenseStepWarning, match="dj.local_value_and_grad"):
    _shard_map_step(tx, mesh, jax.value_and_grad).trace(
      PARAMS, dj.abstract_worker_state(tx, PARAMS, mesh), _batch()
    )


@pytest.mark.slow  # the generic search through MultiSteps in a chain: about 11 s here
def test_the_state_analysis_does_not_warn():
  # dj.worker_state_specs traces MultiSteps (inside a chain, so by its generic
  # search) with the accumulated gradients typed as shared: no warning for that.
  tx = optax.chain(optax.identity(), optax.MultiSteps(dj.demo(0.1, compression_chunk=8), 2))
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  with warnings.catch_warnings():
    warnings.simplefilter("error", dj.DenseStepWarning)
    dj.worker_state_specs(tx, {"w": PARAMS["w"]}, mesh)


def test_quiet_leaves_the_checks_out_of_the_step(mesh):
  tx = dj.demo(0.1, compression_chunk=8, axis_name=None)
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  args = params, tx.init(params), jax.device_put(_batch(), NamedSharding(mesh, P("data")))
  assert "InspectSharding" in _jit_step(tx).lower(*args).as_text()
  with dj.dense_step.quiet():
    assert "InspectSharding" not in _jit_step(tx).lower(*args).as_text()
