"""Bad input gets a ValueError or TypeError that names the argument and the fix."""

import compiled
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_step import mesh_of

import distro_jax as dj


@pytest.mark.parametrize("value", [0, -3])
@pytest.mark.parametrize("name", ["compression_topk", "compression_chunk"])
def test_non_positive_sizes(name, value):
  fix = rf"{name} must be a positive int, got {value}; use e\.g\. {name}=\d+\."
  with pytest.raises(ValueError, match=fix):
    dj.demo(1e-3, **{name: value})


@pytest.mark.parametrize("name", ["compression_topk", "compression_chunk"])
def test_non_integer_sizes(name):
  # The argument and the fix, as for the other sizes, not only the name.
  fix = rf"{name} must be a positive int, got 2\.5; use e\.g\. {name}=\d+\."
  with pytest.raises(TypeError, match=fix):
    dj.demo(1e-3, **{name: 2.5})


@pytest.mark.parametrize("decay", [-0.1, 1.0, 1.5])
def test_decay_outside_unit_interval(decay):
  with pytest.raises(ValueError, match=r"compression_decay must be in \[0, 1\)"):
    dj.demo(1e-3, compression_decay=decay)


@pytest.mark.parametrize("factory", [dj.demo, dj.distro_adamw, dj.scale_by_demo])
@pytest.mark.parametrize("learning_rate", ["1e-3", None, True], ids=["str", "none", "bool"])
def test_a_learning_rate_that_is_not_a_number_or_schedule(factory, learning_rate):
  # A string used to fail deep in the first update with numpy's "Only integer
  # scalar arrays can be converted to a scalar index".
  with pytest.raises(TypeError, match=r"learning_rate must be a number or a schedule.*e\.g\."):
    factory(learning_rate)


@pytest.mark.parametrize(
  "learning_rate",
  [1e-3, 1, np.float32(1e-3), jnp.asarray(1e-3, jnp.bfloat16), optax.constant_schedule(1e-3)],
  ids=["float", "int", "numpy", "bf16-array", "schedule"],
)
def test_numbers_arrays_and_schedules_are_learning_rates(learning_rate):
  params = {"w": jnp.ones((8, 8))}
  tx = dj.demo(learning_rate, axis_name=None)
  updates, _ = tx.update(params, tx.init(params), params)
  assert np.all(np.isfinite(np.asarray(updates["w"])))


def test_the_message_guess_refuses_drawn_positions():
  # The pending message of a drawn-position exchange carries no positions.
  params = {"w": jnp.ones((16, 16))}
  opts = dict(compression_topk=1, compression_chunk=8, random_positions=True)
  state = dj.demo(1e-3, axis_name=None, delayed_apply=True, **opts).init(params)
  with pytest.raises(ValueError, match='use the default guess="momentum"'):
    dj.gradient_point(state, params, 1e-3, guess="message", **opts)


def test_frequency_bias_needs_random_positions_and_a_static_non_negative_number():
  with pytest.raises(ValueError, match="pass random_positions=True"):
    dj.demo(1e-3, frequency_bias=1.0)
  with pytest.raises(ValueError, match="frequency_bias must be a finite number of 0 or more"):
    dj.demo(1e-3, random_positions=True, frequency_bias=-1.0)
  tx = optax.inject_hyperparams(dj.demo)(
    learning_rate=1e-3, random_positions=True, frequency_bias=1.0
  )
  # Injected, it would be traced under jit.
  with pytest.raises(TypeError, match=r"static_args=\('frequency_bias',\)"):
    jax.jit(tx.init)({"w": jnp.zeros((8, 8))})


def test_unbound_axis_name_inside_shard_map():
  mesh = mesh_of(2)
  params = {"w": jnp.zeros((8, 8))}
  tx = dj.demo(1e-3, axis_name="batch")
  state = tx.init(params)

  def local(p, s, g):
    return tx.update(g, s, p)[0]

  fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P())
  p = jax.device_put(params, NamedSharding(mesh, P()))
  with pytest.raises(ValueError, match=r"axis_name='batch' is not bound.*axis_name=None"):
    jax.jit(fn)(p, state, p)


def test_default_axis_outside_shard_map_says_to_use_none():
  params = {"w": jnp.zeros((8, 8))}
  tx = dj.demo(1e-3)
  with pytest.raises(ValueError, match="axis_name='data' is not bound"):
    tx.update(params, tx.init(params), params)


def test_mismatched_gradient_tree():
  params = {"w": jnp.zeros((8, 8)), "b": jnp.zeros((8,))}
  tx = dj.demo(1e-3, axis_name=None)
  with pytest.raises(ValueError, match="gradient tree does not match the parameter tree"):
    tx.update({"w": jnp.zeros((8, 8))}, tx.init(params), params)


def test_mismatched_gradient_shape():
  params = {"w": jnp.zeros((8, 8))}
  tx = dj.demo(1e-3, axis_name=None)
  with pytest.raises(ValueError, match=r"Gradient \['w'\] has shape \(8, 4\)"):
    tx.update({"w": jnp.zeros((8, 4))}, tx.init(params), params)


def test_axis_missing_from_mesh_in_state_helpers():
  mesh = mesh_of(2)
  with pytest.raises(ValueError, match="not an axis of the mesh"):
    dj.init_worker_state(dj.demo(1e-3, axis_name="x"), {"w": np.zeros(3)}, mesh, axis_name="x")


_W = {"w": jnp.zeros((64, 64))}
_W_AND_SCALAR = {"w": jnp.zeros((64, 64)), "s": jnp.ones(())}


@pytest.mark.parametrize(
  ("make_tx", "params"),
  [
    (lambda: dj.sparseloco(optax.adamw(1e-3), sync_every=3), _W_AND_SCALAR),
    (lambda: optax.MultiSteps(dj.demo(1e-3), 2), _W_AND_SCALAR),
    (lambda: optax.apply_if_finite(optax.chain(dj.pmean_gradients(), optax.adam(1e-3)), 3), _W),
    (lambda: optax.chain(optax.apply_if_finite(optax.identity(), 3), dj.demo(1e-3)), _W),
    # Its lax.cond cannot be traced with any marking; this used to surface as
    # JAX's "cond branches must have equal output types".
    (lambda: optax.apply_if_finite(dj.demo(1e-3), 3), _W),
  ],
  ids=[
    "sparseloco-scalar",
    "multisteps-demo-scalar",
    "apply_if_finite-pmean-adam",
    "chain-apply_if_finite-demo",
    "apply_if_finite-demo",
  ],
)
def test_a_per_worker_scalar_state_names_the_wrapper_and_the_fix(make_tx, params):
  with pytest.raises(
    ValueError, match=r"per-worker scalar.*apply_if_finite.*apply it after the exchange"
  ):
    dj.init_worker_state(make_tx(), params, mesh_of(4))


@pytest.mark.parametrize(
  ("name", "value", "error"),
  [
    ("compression_topk", 0, ValueError),
    ("compression_topk", -3, ValueError),
    ("compression_topk", 2.5, TypeError),
    ("compression_chunk", 0, ValueError),
    ("num_workers", 0, ValueError),
  ],
)
def test_wire_bytes_refuses_sizes_that_are_not_positive_ints(name, value, error):
  # They used to give a payload of 1 or -15 bytes, a chunk error that did not
  # name compression_chunk, or a ZeroDivisionError.
  with pytest.raises(error, match=rf"{name} must be a positive int.*e\.g\. {name}="):
    dj.wire_bytes({"w": jnp.zeros((64, 64))}, **{name: value})


@pytest.mark.parametrize(("name", "value"), [("compression_topk", 0), ("compression_chunk", 0)])
def test_the_lookahead_refuses_sizes_that_are_not_positive_ints(name, value):
  params = {"w": jnp.zeros((16, 16))}
  state = dj.demo(1e-2, axis_name=None, delayed_apply=True).init(params)
  with pytest.raises(ValueError, match=rf"{name} must be a positive int.*e\.g\. {name}="):
    dj.gradient_point(state, params, 1e-2, **{name: value})


def test_the_lookahead_needs_a_learning_rate_and_local_steps_do_not():
  # With learning_rate defaulting to 0.0, forgetting it turned the lookahead
  # off without a word.
  params = {"w": jnp.zeros((16, 16))}
  delayed = dj.demo(1e-2, axis_name=None, delayed_apply=True, compression_topk=8)
  with pytest.raises(ValueError, match=r"needs learning_rate.*e\.g\. dj\.gradient_point\("):
    dj.gradient_point(delayed.init(params), params, compression_topk=8)
  for tx in (
    dj.diloco(optax.sgd(1.0), axis_name=None),
    dj.sparseloco(optax.sgd(1.0), sync_every=3, axis_name=None),
  ):
    state = tx.init(params)
    np.testing.assert_array_equal(dj.gradient_point(state, params)["w"], params["w"])


def test_delayed_apply_tells_a_missing_pending_message_from_one_of_another_size():
  params = {"w": jnp.zeros((16, 16), jnp.float32)}
  tx = compiled.transformation(
    dj.demo(1e-2, axis_name=None, delayed_apply=True, compression_topk=8)
  )
  grads = {"w": jnp.ones((16, 16), jnp.float32)}
  plain = jax.jit(dj.demo(1e-2, axis_name=None, compression_topk=8).init)(params)
  with pytest.raises(ValueError, match=r"needs the state of a delayed_apply=True transformation"):
    tx.update(grads, plain, params)
  # With params=None the gradients' dtypes set the values' width: 8 coefficients
  # of an 8-bit index and a bf16 value (24 bytes) where the state, built from
  # fp32 params, holds fp32 values (40 bytes). This used to get the message above.
  bf16_grads = jax.tree.map(lambda g: g.astype(jnp.bfloat16), grads)
  with pytest.raises(
    ValueError, match=r"pending holds 40 bytes, but this update's message is 24.*pass params"
  ):
    tx.update(bf16_grads, tx.init(params), None)
