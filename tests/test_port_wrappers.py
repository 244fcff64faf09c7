"""The jit path's mistakes get the library's messages inside and around every optax wrapper.

Issue 67: ``optax.MultiSteps`` turned ``axis_name=None`` inside ``dj.per_worker``
into a raw ``AssertionError`` from optax's ``lax.cond`` on a mesh with an FSDP
axis beside the workers', and ``axis_name=None`` in a jit step with
FSDP-sharded params (nanodo's default) trained as dense data parallelism with
no warning. Each wrapper nanodo or a port may put around DeMo
(``MultiSteps``, ``inject_hyperparams``, ``masked``, ``multi_transform``,
``apply_if_finite``) is tested with each mistake, on a 4-worker x 2-way FSDP
mesh: the update is only traced (``jax.eval_shape``), which is where the
errors are raised, except for the warning, which compiling the step issues.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import meta
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import distro_jax as dj

WORKERS, FSDP = 4, 2
CHUNK = 8
MASK = {"w": True, "b": False}


def _mesh(workers=WORKERS):
  return dj.workers_mesh(workers, jax.devices()[: workers * FSDP])


def _params():
  # As nanodo's: the kernel partitioned over "data" (FSDP), the bias not.
  return {"w": meta.Partitioned(jnp.zeros((16, 8)), names=("data", None)), "b": jnp.zeros((8,))}


def _demo(axis_name):
  def make(learning_rate):
    return dj.demo(learning_rate, compression_chunk=CHUNK, axis_name=axis_name)

  return make


def _adamw(learning_rate):
  return optax.adamw(learning_rate)


# Each wraps an optimizer factory ``make(learning_rate)`` as a trainer would.
WRAPPERS = {
  "none": lambda make: make(0.1),
  "MultiSteps": lambda make: optax.MultiSteps(make(0.1), 2),
  "inject_hyperparams": lambda make: optax.inject_hyperparams(make)(learning_rate=0.1),
  # Both halves selected: a leaf left out would pass its raw per-worker gradient through.
  "masked": lambda make: optax.chain(
    optax.masked(make(0.1), MASK), optax.masked(make(0.1), {k: not v for k, v in MASK.items()})
  ),
  "multi_transform": lambda make: optax.multi_transform(
    {"matrix": make(0.1), "vector": make(0.05)}, {"w": "matrix", "b": "vector"}
  ),
  "apply_if_finite": lambda make: optax.apply_if_finite(make(0.1), 3),
}

# optax.apply_if_finite inside dj.per_worker is a mistake of its own, whatever it
# wraps: each worker would decide on its own gradient whether to skip the step.
# The library names it before anything else.
SKIPS_PER_WORKER = "per-worker scalar.*apply_if_finite"


def _stacked_grads():
  """Gradients as dj.worker_value_and_grad returns them for ``_params()``: stacked, boxed."""
  return {
    "w": meta.Partitioned(jnp.zeros((WORKERS, 16, 8)), names=("workers", "data", None)),
    "b": meta.Partitioned(jnp.zeros((WORKERS, 8)), names=("workers", None)),
  }


def _whole_batch_grads():
  """Gradients as jax.grad of the whole batch returns them for ``_params()``."""
  return {"w": meta.Partitioned(jnp.zeros((16, 8)), names=("data", None)), "b": jnp.zeros((8,))}


def _update(tx, grads=None, state=None):
  """Traces ``tx.update`` as a jit step would (it raises the errors the step would)."""
  params = _params()
  grads = _stacked_grads() if grads is None else grads
  state = jax.eval_shape(tx.init, params) if state is None else state
  return jax.eval_shape(tx.update, grads, state, params)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_axis_name_none_inside_per_worker_names_the_fix(wrapper):
  tx = dj.per_worker(WRAPPERS[wrapper](_demo(None)), _mesh(), "workers")
  want = SKIPS_PER_WORKER if wrapper == "apply_if_finite" else "differs from worker to worker"
  with pytest.raises(ValueError, match=want) as caught:
    _update(tx)
  if wrapper != "apply_if_finite":
    assert "axis_name='workers'" in str(caught.value)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_dense_optimizer_without_all_reduce_names_the_switch(wrapper):
  # The ported tree run with optimizer="adamw" but without the switch.
  tx = dj.per_worker(WRAPPERS[wrapper](_adamw), _mesh(), "workers")
  want = SKIPS_PER_WORKER if wrapper == "apply_if_finite" else "differs.*all_reduce=True"
  with pytest.raises(ValueError, match=want):
    _update(tx)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_the_gradient_of_the_whole_batch_names_worker_value_and_grad(wrapper):
  tx = dj.per_worker(WRAPPERS[wrapper](_demo("workers")), _mesh(), "workers")
  want = SKIPS_PER_WORKER if wrapper == "apply_if_finite" else "whole batch.*worker_value_and_grad"
  with pytest.raises(ValueError, match=want):
    _update(tx, grads=_whole_batch_grads())


@pytest.mark.parametrize("wrapper", [w for w in WRAPPERS if w != "apply_if_finite"])
def test_a_state_of_another_worker_count_names_the_resize(wrapper):
  make = WRAPPERS[wrapper]
  on_2 = dj.per_worker(make(_demo("workers")), _mesh(2), "workers")
  on_4 = dj.per_worker(make(_demo("workers")), _mesh(), "workers")
  with pytest.raises(ValueError, match="another worker count.*dj.resize_per_worker"):
    _update(on_4, state=jax.eval_shape(on_2.init, _params()))


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_params_partitioned_over_the_workers_axis_name_the_fix(wrapper):
  tx = dj.per_worker(WRAPPERS[wrapper](_demo("workers")), _mesh(), "workers")
  clash = {"w": meta.Partitioned(jnp.zeros((16, 8)), names=("workers", None)), "b": jnp.zeros(8)}
  with pytest.raises(ValueError, match=r"params\['w'\].*workers' axis.*dj.workers_mesh"):
    tx.init(clash)


# Around dj.per_worker: the wrapper sees the stacked gradients.
AROUND = {
  "inject_hyperparams": lambda make: optax.inject_hyperparams(
    lambda learning_rate: dj.per_worker(make(learning_rate), _mesh(), "workers")
  )(learning_rate=0.1),
  "masked": lambda make: optax.masked(dj.per_worker(make(0.1), _mesh(), "workers"), MASK),
  "multi_transform": lambda make: optax.multi_transform(
    {"d": dj.per_worker(make(0.1), _mesh(), "workers"), "s": optax.set_to_zero()},
    {"w": "d", "b": "s"},
  ),
  "apply_if_finite": lambda make: optax.apply_if_finite(
    dj.per_worker(make(0.1), _mesh(), "workers"), 3
  ),
}


@pytest.mark.parametrize("wrapper", AROUND)
def test_axis_name_none_around_per_worker_names_the_fix(wrapper):
  with pytest.raises(ValueError, match="differs from worker to worker.*axis_name='workers'"):
    _update(AROUND[wrapper](_demo(None)))


@pytest.mark.parametrize("wrapper", AROUND)
def test_the_whole_batch_around_per_worker_names_worker_value_and_grad(wrapper):
  with pytest.raises(ValueError, match="whole batch.*worker_value_and_grad"):
    _update(AROUND[wrapper](_demo("workers")), grads=_whole_batch_grads())


@pytest.mark.parametrize("boxed", [True, False])
@pytest.mark.parametrize("axis_name", [None, "workers"])
def test_multi_steps_around_per_worker_says_to_put_it_inside(axis_name, boxed):
  # MultiSteps would accumulate the stacked gradients into zeros shaped like the
  # params: optax's tree.map fails on boxed params, and per_worker would see
  # params-shaped gradients. Its init is refused, naming the fix.
  tx = optax.MultiSteps(dj.per_worker(_demo(axis_name)(0.1), _mesh(), "workers"), 2)
  params = _params() if boxed else {"w": jnp.zeros((16, 8)), "b": jnp.zeros((8,))}
  with pytest.raises(ValueError, match=r"MultiSteps is wrapped around.*MultiSteps\(tx, k\)"):
    tx.init(params)


def _fsdp_step(tx, mesh):
  """nanodo's step with its default FSDP: params and batch over "data", the plain gradient."""

  def loss(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

  def step(params, state, batch):
    batch = jax.lax.with_sharding_constraint(batch, NamedSharding(mesh, P("data")))
    grads = jax.grad(loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = {
    "w": jax.device_put(jnp.full((16, 8), 0.1), NamedSharding(mesh, P("data"))),
    "b": jax.device_put(jnp.zeros((8,)), NamedSharding(mesh, P())),
  }
  rng = np.random.default_rng(0)
  batch = (
    rng.normal(size=(16, 16)).astype(np.float32),
    rng.normal(size=(16, 8)).astype(np.float32),
  )
  return jax.jit(step), params, tx.init(params), batch


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_axis_name_none_under_fsdp_warns_inside_every_wrapper(wrapper):
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("data",))
  step, params, state, batch = _fsdp_step(WRAPPERS[wrapper](_demo(None)), mesh)
  with pytest.warns(dj.DenseStepWarning) as caught:
    step.lower(params, state, batch).compile()
  # The FSDP-sharded kernel's gradient was reduce-scattered; the bias's (masked
  # apart, in two of the wrappers) was all-reduced whole.
  messages = [str(w.message) for w in caught]
  assert any("over 8 devices, with the gradient" in m and "reduce-scattered" in m for m in messages)
  assert all("dj.per_worker" in m for m in messages)
  # An error where the trainer asks for one: raised from the compile-time check,
  # it reaches the caller wrapped by XLA (a fresh step: the check runs at compile).
  step, params, state, batch = _fsdp_step(WRAPPERS[wrapper](_demo(None)), mesh)
  with warnings.catch_warnings():
    warnings.simplefilter("error", dj.DenseStepWarning)
    with pytest.raises(jax.errors.JaxRuntimeError, match="DenseStepWarning.*over 8 devices"):
      step.lower(params, state, batch).compile()


def test_apply_if_finite_inside_works_with_all_reduce():
  # Every worker sees the averaged gradient, so its skip decision is shared.
  tx = dj.per_worker(optax.apply_if_finite(_adamw(0.1), 3), _mesh(), "workers", all_reduce=True)
  state = jax.eval_shape(tx.init, _params())
  assert state.notfinite_count.shape == ()
  updates, new_state = _update(tx)
  assert updates["w"].value.shape == (16, 8) and new_state.notfinite_count.shape == ()
