"""Every transformation through the battery an optax optimizer is expected to pass.

The checks follow what optax asks of its own optimizers (the contrib common
tests, the alias and sharding tests): empty trees, ``optax.masked`` and
``optax.multi_transform`` that leave nothing to it, state specs from
``optax.tree_map_params``, params sharded on explicit and auto meshes under
plain ``jax.jit``, dtypes kept, ``inject_hyperparams``, ``MultiSteps``,
``jax.eval_shape`` of ``init``, and ``jit``. Each transformation runs as one
worker (``axis_name=None``); the exchange across workers is tested elsewhere.

:data:`TRANSFORMATIONS` is the list to extend: a name and a factory that takes
the learning rate and returns the transformation.
"""

import contextlib
import functools
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import distro_jax as dj

Factory = Callable[..., optax.GradientTransformation]


def _sign_then_adam(learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformation:
  return optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(learning_rate))


TRANSFORMATIONS: list[tuple[str, Factory]] = [
  ("demo", functools.partial(dj.demo, axis_name=None)),
  (
    "demo-k8-1bit",
    functools.partial(dj.demo, compression_topk=8, quantize_1bit=True, axis_name=None),
  ),
  ("demo-nodct", functools.partial(dj.demo, use_dct=False, axis_name=None)),
  (
    "demo-random-1bit",
    functools.partial(dj.demo, random_positions=True, quantize_1bit=True, axis_name=None),
  ),
  ("demo-delayed", functools.partial(dj.demo, delayed_apply=True, axis_name=None)),
  (
    "demo-random-1bit-rms",
    functools.partial(
      dj.demo, random_positions=True, quantize_1bit=True, normalize="rms", axis_name=None
    ),
  ),
  (
    "demo-random-1bit-orth",
    functools.partial(
      dj.demo, random_positions=True, quantize_1bit=True, normalize="orth", axis_name=None
    ),
  ),
  ("distro_adamw", functools.partial(dj.distro_adamw, axis_name=None)),
  (
    "demo-random-1bit-orth-momentum",
    functools.partial(
      dj.demo,
      random_positions=True,
      quantize_1bit=True,
      normalize="orth",
      aggregate_momentum=0.95,
      axis_name=None,
    ),
  ),
  (
    "demo-random-1bit-orth-estimate",
    functools.partial(
      dj.demo,
      random_positions=True,
      quantize_1bit=True,
      normalize="orth",
      compression_decay=0.95,
      estimate_step=0.5,
      axis_name=None,
    ),
  ),
  ("scale_by_demo", functools.partial(dj.scale_by_demo, axis_name=None)),
  (
    "distro-adam-inner",
    lambda learning_rate: dj.distro(_sign_then_adam(learning_rate), learning_rate, axis_name=None),
  ),
  (
    "diloco",
    lambda learning_rate: dj.diloco(optax.adamw(learning_rate), sync_every=2, axis_name=None),
  ),
  (
    "sparseloco",
    lambda learning_rate: dj.sparseloco(
      optax.adamw(learning_rate), sync_every=2, compression_topk=8, axis_name=None
    ),
  ),
  (
    "sparseloco-drawn-orth",
    lambda learning_rate: dj.sparseloco(
      optax.adamw(learning_rate),
      sync_every=2,
      outer_learning_rate=learning_rate,
      compression_topk=1,
      compression_chunk=8,
      value_bits=1,
      use_dct=True,
      random_positions=True,
      frequency_bias=1.0,
      normalize="orth",
      axis_name=None,
    ),
  ),
]

# Transformations that compress (top-k by magnitude: complex, integer and bool params
# are refused at init).
COMPRESSING = {name for name, _ in TRANSFORMATIONS if name != "diloco"}

COMPRESSING_TRANSFORMATIONS = [t for t in TRANSFORMATIONS if t[0] in COMPRESSING]

# Those whose inner transformation is Adam.
ADAM_INNER = {"distro_adamw", "distro-adam-inner"}

# The public factories whose signatures tooling reads.
PUBLIC = [dj.demo, dj.distro_adamw, dj.scale_by_demo, dj.distro]

LR = 1e-2

# The quick loop runs the battery's compiling checks on plain DeMo; every
# transformation runs all of them in the whole suite.
QUICK = {"demo"}


def _params_of(transformations, every_one_quick=False):
  # A transformation's slow checks go to one xdist worker, where they share
  # its jitted update (see _plain).
  return [
    pytest.param(
      name,
      factory,
      id=name,
      marks=()
      if every_one_quick or name in QUICK
      else (pytest.mark.slow, pytest.mark.xdist_group(f"conformance-{name}")),
    )
    for name, factory in transformations
  ]


EVERY = _params_of(TRANSFORMATIONS)
# For the checks that compile nothing, or only a step over no params.
EVERY_QUICK = _params_of(TRANSFORMATIONS, every_one_quick=True)
EVERY_COMPRESSING = _params_of(COMPRESSING_TRANSFORMATIONS)
EVERY_ORTH = _params_of([t for t in TRANSFORMATIONS if "orth" in t[0]])
FACTORIES = dict(TRANSFORMATIONS)


def _params(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  return {
    "w": jnp.asarray(rng.normal(size=(16, 512)), dtype),
    "b": jnp.asarray(rng.normal(size=(512,)), dtype),
    "s": jnp.asarray(1.5, dtype),
  }


def _grads(params, seed=1):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=np.shape(p)), p.dtype), params)


def _steps(tx, params, n, grads=None):
  """``n`` jitted updates from ``tx.init``; returns the updates of each and the final state."""
  state = jax.jit(tx.init)(params)
  update = jax.jit(tx.update)
  out = []
  for t in range(n):
    updates, state = update(_grads(params, t) if grads is None else grads, state, params)
    out.append(updates)
  return out, state


@functools.cache
def _plain(name):
  """``FACTORIES[name](LR)``, one per worker process.

  The checks that run it unwrapped share its jitted init and update: a new
  instance is a new function to JAX, traced and compiled again.
  """
  return FACTORIES[name](LR)


@functools.cache
def _plain_three_steps(name):
  """The updates of ``_steps(_plain(name), _params(), 3)``, which several checks compare with."""
  return _steps(_plain(name), _params(), 3)[0]


@pytest.mark.parametrize("name, factory", EVERY_QUICK)
@pytest.mark.parametrize("empty", [{}, ()], ids=["dict", "tuple"])
def test_empty_tree(name, factory, empty):
  tx = factory(LR)
  state = tx.init(empty)
  updates, state = jax.jit(tx.update)(empty, state, empty)
  assert updates == empty
  updates, _ = tx.update(empty, state, empty)
  assert updates == empty


@pytest.mark.parametrize("name, factory", EVERY)
def test_zero_size_params_change_nothing_else(name, factory):
  # optax.adamw takes a param with no entries (a layer of width 0); these
  # transformations send nothing for it, and the others train as without it.
  params = _params()
  with_empty = {**params, "e": jnp.zeros((0, 64)), "f": jnp.zeros((0,), jnp.bfloat16)}
  grads = [_grads(params, t) for t in range(3)]
  ref = _plain_three_steps(name)
  tx = factory(LR)
  jax.eval_shape(tx.init, with_empty)
  state = jax.jit(tx.init)(with_empty)
  update = jax.jit(tx.update)
  for t in range(3):
    g = {**grads[t], "e": jnp.zeros((0, 64)), "f": jnp.zeros((0,), jnp.bfloat16)}
    updates, state = update(g, state, with_empty)
    for k in params:
      np.testing.assert_array_equal(updates[k], ref[t][k], err_msg=f"{name}: {k} at step {t}")
    assert (updates["e"].shape, updates["e"].dtype) == ((0, 64), jnp.float32)
    assert (updates["f"].shape, updates["f"].dtype) == ((0,), jnp.bfloat16)
  only_empty = {"e": jnp.zeros((0, 64))}
  state = tx.init(only_empty)
  updates, _ = update(only_empty, state, only_empty)
  assert updates["e"].shape == (0, 64)


@pytest.mark.parametrize("name, factory", EVERY_QUICK)
def test_masked_selecting_nothing(name, factory):
  params = _params()
  tx = optax.masked(factory(LR), jax.tree.map(lambda _: False, params))
  (updates,), _ = _steps(tx, params, 1)
  # Masked-out leaves pass through unchanged, as optax documents.
  jax.tree.map(np.testing.assert_array_equal, updates, _grads(params, 0))


@pytest.mark.parametrize("name, factory", EVERY_QUICK)
def test_multi_transform_with_no_param_labelled(name, factory):
  params = _params()
  labels = jax.tree.map(lambda _: "sgd", params)
  tx = optax.multi_transform({"ours": factory(LR), "sgd": optax.sgd(1.0)}, labels)
  (updates,), _ = _steps(tx, params, 1)
  jax.tree.map(lambda u, g: np.testing.assert_allclose(u, -g), updates, _grads(params, 0))


@pytest.mark.parametrize("name, factory", EVERY)
def test_multi_transform_mixing_it_with_sgd(name, factory):
  params = _params()
  labels = {"w": "ours", "b": "sgd", "s": "ours"}
  tx = optax.multi_transform({"ours": factory(LR), "sgd": optax.sgd(1.0)}, labels)
  updates, _ = _steps(tx, params, 3)
  np.testing.assert_allclose(updates[-1]["b"], -_grads(params, 2)["b"])
  for k in ("w", "s"):
    assert all(np.isfinite(np.asarray(u[k])).all() for u in updates), k
    # The transformation was applied: all zeros (as if it never ran) would pass the above.
    assert any(np.any(np.asarray(u[k])) for u in updates), f"{name}: {k} never moved"


def _param_specs():
  return {"w": P(None, "x"), "b": P("x"), "s": P()}


def _state_specs(tx, params, param_specs):
  state = jax.eval_shape(tx.init, params)
  return optax.tree_map_params(
    tx,
    lambda _, spec: spec,
    state,
    param_specs,
    transform_non_params=lambda _: P(),
    is_leaf=lambda x: isinstance(x, P),
  )


@pytest.mark.parametrize("name, factory", EVERY_QUICK)
def test_tree_map_params_specs_place_the_state(name, factory):
  mesh = jax.make_mesh((8,), ("x",))
  params = _params()
  tx = factory(LR)
  specs = _state_specs(tx, params, _param_specs())
  state = jax.device_put(
    tx.init(params), jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)
  )
  # Every state leaf that mirrors a param is split as that param is.
  mirrored = optax.tree_map_params(
    tx, lambda x, p: (x.shape, x.sharding.spec, p.shape), state, params
  )
  found = 0
  # The triples f made are plain tuples; a state's NamedTuple of three fields is not one.
  is_triple = lambda x: type(x) is tuple and len(x) == 3
  for leaf in jax.tree.leaves(mirrored, is_leaf=is_triple):
    if isinstance(leaf, tuple) and len(leaf) == 3 and isinstance(leaf[1], P):
      shape, spec, p_shape = leaf
      assert shape in (p_shape, (1,)), f"{name}: a mirrored leaf {shape} for a param {p_shape}"
      found += 1
  assert found >= 3


def _sets(factory, arg):
  """Whether ``factory`` (a ``functools.partial``) binds ``arg`` to a plain number."""
  return isinstance(getattr(factory, "keywords", {}).get(arg), int | float)


def _is_spec(x):
  return isinstance(x, P)


@pytest.mark.parametrize("name, factory", EVERY_ORTH)
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_orthogonalized_matrices_split_along_their_long_side_stay_split(name, factory, axis_type):
  del factory  # _plain(name) is it, with its jitted update shared
  # On a 1-D mesh, every matrix split along its long side: only the Gram sums
  # of the Newton-Schulz steps cross the shards, never a matrix. (The test
  # below places params of every kind, for every transformation.)
  mesh = jax.make_mesh((8,), ("x",), axis_types=(axis_type,))
  shardings = {k: NamedSharding(mesh, s) for k, s in _param_specs().items()}
  params = jax.device_put(_params(), shardings)
  grads = jax.device_put(_grads(_params()), shardings)
  tx = _plain(name)
  # Explicit meshes need the mesh in context, as for any optax optimizer.
  context = jax.set_mesh(mesh) if axis_type == AxisType.Explicit else contextlib.nullcontext()
  with context:
    state = jax.jit(tx.init)(params)
    update = jax.jit(tx.update)
    updates, new_state = update(grads, state, params)
    _, new_state = update(grads, new_state, params)
    measured = dj.collective_bytes(update, grads, state, params)
  for k, u in updates.items():
    assert u.sharding.spec == shardings[k].spec, f"{name}: update {k} is {u.sharding.spec}"
  mirrored = optax.tree_map_params(tx, lambda x, p: (x, p), new_state, params)
  for leaf in jax.tree.leaves(mirrored, is_leaf=lambda x: isinstance(x, tuple)):
    if isinstance(leaf, tuple) and len(leaf) == 2 and hasattr(leaf[0], "sharding"):
      x, p = leaf
      if x.ndim and x.shape == p.shape:
        assert x.sharding.spec == p.sharding.spec, f"{name}: state leaf {x.shape}"
  # No param is gathered: a few flags cross the shards, and with delayed_apply
  # (which keeps a message) pieces of the message, its bit stream one byte per
  # bit before packing at most.
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  message = dj.wire_bytes(params).payload if "delayed" in name else 0
  assert measured.by_kind["all-gather"] <= message, measured.by_kind
  # With normalize="orth" the Gram sums are all that crosses the shards
  # besides the flags: the matrix's long side stays split.
  assert measured.total <= 8 * message + 0.02 * param_bytes + _gram_bytes(name, params), (
    measured.by_kind
  )


def _gram_bytes(name, params):
  """With normalize="orth", the sums of the float32 Gram matrices of 5 Newton-Schulz steps.

  A matrix split along its long side needs each step's short-side-squared
  Gram matrix summed over its shards; the matrix itself stays split.
  """
  if "orth" not in name:
    return 0
  return 5 * sum(4 * min(x.shape) ** 2 for x in jax.tree.leaves(params) if x.ndim == 2)


@pytest.mark.parametrize("name, factory", EVERY)
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_sharded_params_keep_their_sharding_and_are_not_gathered(name, factory, axis_type):
  del factory  # _plain(name) is it, with its jitted update shared
  # MaxText style: a 2-D mesh, each matrix split along both of its axes
  # (whole 64x64 chunks on every device) or one axis over both mesh axes, a
  # vector over one mesh axis, and a scalar on every device.
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(axis_type,) * 2)
  specs = {"w": P("a", "b"), "x": P(None, ("a", "b")), "n": P("b"), "s": P()}
  shapes = {"w": (128, 256), "x": (64, 512), "n": (256,), "s": ()}
  rng = np.random.default_rng(0)
  shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
  params = {
    k: jax.device_put(rng.normal(size=s).astype(np.float32), shardings[k])
    for k, s in shapes.items()
  }
  grads = jax.tree.map(lambda p: p * 0.5 + 0.1, params)
  tx = _plain(name)
  # Explicit meshes need the mesh in context, as for any optax optimizer.
  context = jax.set_mesh(mesh) if axis_type == AxisType.Explicit else contextlib.nullcontext()
  with context:
    state = jax.jit(tx.init)(params)
    update = jax.jit(tx.update)
    updates, state = update(grads, state, params)
    updates, state = update(grads, state, params)
    measured = dj.collective_bytes(update, grads, state, params)
  for k, u in updates.items():
    assert u.sharding.is_equivalent_to(shardings[k], u.ndim), f"{name}: {k} is {u.sharding.spec}"
    assert np.isfinite(np.asarray(u)).all()
  # The state of a param is placed as the param is.
  mirrored = optax.tree_map_params(tx, lambda x, p: (x, p), state, params)
  for leaf in jax.tree.leaves(mirrored, is_leaf=lambda x: isinstance(x, tuple)):
    if isinstance(leaf, tuple) and len(leaf) == 2 and hasattr(leaf[0], "sharding"):
      x, p = leaf
      if x.ndim and x.shape == p.shape:
        assert x.sharding.is_equivalent_to(p.sharding, x.ndim), f"{name}: state leaf {x.shape}"
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  message = dj.wire_bytes(params).payload if "delayed" in name else 0
  if "orth" in name:
    # Each Newton-Schulz step sums its Gram matrix over the shards and, for a
    # matrix split along both axes, gathers the row blocks it multiplies:
    # at most a Gram matrix and a matrix per step, within the worker's mesh.
    matrices = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params) if x.ndim == 2)
    assert measured.total <= 0.02 * param_bytes + _gram_bytes(name, params) + 5 * matrices
    return
  assert measured.by_kind["all-gather"] <= message, measured.by_kind
  assert measured.total <= 8 * message + 0.02 * param_bytes, measured.by_kind


@pytest.mark.parametrize("name, factory", EVERY)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtypes_are_kept(name, factory, dtype):
  del factory
  params = _params(jnp.dtype(dtype))
  tx = _plain(name)
  state0 = jax.jit(tx.init)(params)
  updates, state1 = jax.jit(tx.update)(_grads(params), state0, params)
  for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params)):
    assert u.dtype == p.dtype
    # Adam's second moment of DeMo's Q (lr * a gradient, squared) underflows
    # float16, as plain Adam's does for gradients that small.
    if not (dtype == "float16" and name in ADAM_INNER):
      assert np.isfinite(np.asarray(u, np.float32)).all()
  # The state's types do not drift across an update (MultiSteps and cond rely on it).
  assert jax.tree.map(jax.typeof, state0) == jax.tree.map(jax.typeof, state1)


# Set by a factory, these stay as given: the sizes are structural, and a decay
# set by hand is injected in the params' dtype unless it is static (bfloat16
# would round 0.95 to 0.949 and 0.999 to 1, which the transformation refuses).
_STATIC = (
  "compression_topk",
  "compression_chunk",
  "aggregate_momentum",
  "compression_decay",
  "estimate_step",
)


@pytest.mark.parametrize("name, factory", EVERY)
def test_inject_hyperparams_matches_the_plain_transformation(name, factory):
  params = _params()
  plain = _plain_three_steps(name)
  # The sizes fix the message's shape; set explicitly, they must stay static.
  static = [a for a in _STATIC if _sets(factory, a)]
  injected_tx = optax.inject_hyperparams(factory, static_args=static)(learning_rate=LR)
  injected, state = _steps(injected_tx, params, 3)
  for a, b in zip(plain, injected):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), a, b)
  assert float(state.hyperparams["learning_rate"]) == pytest.approx(LR)


@pytest.mark.parametrize("name, factory", EVERY)
def test_inject_hyperparams_on_bfloat16_params(name, factory):
  # inject_hyperparams casts float hyperparameters, defaults included, to the
  # params' dtype; a default decay of 0.999 must not become bfloat16's 1.0
  # (a momentum that never decays; NaN from Adam's bias correction).
  params = _params(jnp.bfloat16)
  # The injected rate is bfloat16's LR; a sign step flips where Python's LR
  # and it differ, so the plain run gets the same rate.
  plain, _ = _steps(factory(float(jnp.asarray(LR, jnp.bfloat16))), params, 3)
  static = [a for a in _STATIC if _sets(factory, a)]
  injected_tx = optax.inject_hyperparams(factory, static_args=static)(learning_rate=LR)
  injected, _ = _steps(injected_tx, params, 3)
  moved = 0.0
  for a, b in zip(plain, injected):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      assert y.dtype == x.dtype == jnp.bfloat16
      y, x = np.asarray(y, np.float32), np.asarray(x, np.float32)
      assert np.isfinite(y).all()
      moved = max(moved, np.abs(y).max())
      if name not in ADAM_INNER:  # Adam's b1 and eps are injected in bfloat16 too
        np.testing.assert_array_equal(y, x)
  assert moved > 0


@pytest.mark.slow  # its last update runs eagerly, op by op: about 3 s
def test_a_decay_that_bfloat16_rounds_to_one_is_refused_with_the_fix():
  params = _params(jnp.bfloat16)
  tx = optax.inject_hyperparams(dj.demo)(learning_rate=LR, compression_decay=0.999, axis_name=None)
  with pytest.raises(ValueError, match="hyperparam_dtype=jnp.float32"):
    tx.init(params)
  # Traced (a jitted init, as dj.init_worker_state runs it) the value is
  # unknown but the dtype is not.
  with pytest.raises(ValueError, match="hyperparam_dtype=jnp.float32"):
    jax.jit(tx.init)(params)
  tx = optax.inject_hyperparams(dj.sparseloco, static_args=("inner",))(
    optax.sgd(LR), error_decay=0.999, axis_name=None
  )
  with pytest.raises(ValueError, match="error_decay arrived as bfloat16"):
    jax.jit(tx.init)(params)
  # An int stays an int under injection; 1 is out of range, not a dtype problem.
  tx = optax.inject_hyperparams(dj.demo)(learning_rate=LR, compression_decay=1, axis_name=None)
  with pytest.raises(ValueError, match=r"must be in \[0, 1\), got 1.0. Use 0"):
    tx.init(params)
  tx = optax.inject_hyperparams(dj.demo, hyperparam_dtype=jnp.float32)(
    learning_rate=LR, compression_decay=0.999, axis_name=None
  )
  updates, _ = tx.update(_grads(params), tx.init(params), params)
  assert all(np.isfinite(np.asarray(u, np.float32)).all() for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("name, factory", EVERY)
def test_multisteps_accumulates_then_updates(name, factory):
  params = _params()
  tx = optax.MultiSteps(factory(LR), every_k_schedule=2)
  grads = _grads(params)
  updates, _ = _steps(tx, params, 4, grads=grads)
  for u in updates[0::2]:
    assert all(not np.asarray(x).any() for x in jax.tree.leaves(u))  # accumulating
  moved = [any(np.asarray(x).any() for x in jax.tree.leaves(u)) for u in updates[1::2]]
  # DiLoCo moves the shared params only when it synchronizes (every other inner step here).
  assert any(moved)


@pytest.mark.parametrize("name, factory", EVERY_QUICK)
def test_init_is_shape_only(name, factory):
  params = _params()
  tx = factory(LR)
  abstract = jax.eval_shape(tx.init, jax.tree.map(jax.typeof, params))
  concrete = tx.init(params)
  assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
  for a, c in zip(jax.tree.leaves(abstract), jax.tree.leaves(concrete)):
    assert (a.shape, a.dtype) == (c.shape, c.dtype)


@pytest.mark.slow  # the eager update runs op by op: seconds for each
@pytest.mark.parametrize("name, factory", EVERY)
def test_jit_gives_the_eager_update(name, factory):
  del factory
  params = _params()
  tx = _plain(name)
  state = tx.init(params)
  grads = _grads(params)
  eager, _ = tx.update(grads, state, params)
  jitted, _ = jax.jit(tx.update)(grads, state, params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), eager, jitted)


@pytest.mark.parametrize("name, factory", EVERY_QUICK)
def test_complex_params_are_refused_at_init_or_trained(name, factory):
  params = {"z": jnp.ones((8, 8), jnp.complex64)}
  tx = factory(LR)
  if name in COMPRESSING:
    with pytest.raises(ValueError, match=r"complex.*real"):
      tx.init(params)
  else:
    updates, _ = jax.jit(tx.update)(params, tx.init(params), params)
    assert updates["z"].dtype == jnp.complex64


@pytest.mark.parametrize("name, factory", EVERY_COMPRESSING)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_], ids=["int32", "bool"])
def test_non_float_params_are_refused_with_the_fix_that_works(name, factory, dtype):
  # Left in, an int32 param got an all-zero update: it never trained, silently.
  params = {**_params(), "n": jnp.ones((16, 64), dtype)}
  with pytest.raises(ValueError, match=r"\['n'\] has the non-float dtype.*optax.masked"):
    factory(LR).init(params)
  # The fix the message names: leave the param out with optax.multi_transform.
  labels = jax.tree.map(lambda p: "frozen" if p.dtype == dtype else "trained", params)
  tx = optax.multi_transform({"trained": factory(LR), "frozen": optax.set_to_zero()}, labels)
  # Two steps: the overlapped exchange and SparseLoCo apply nothing at the first.
  (_, updates), _ = _steps(tx, params, 2, grads={**_grads(_params()), "n": params["n"]})
  assert not np.any(np.asarray(updates["n"]))
  assert np.any(np.asarray(updates["w"]))


@pytest.mark.parametrize("fn", PUBLIC, ids=[f.__name__ for f in PUBLIC])
def test_signatures_carry_real_types(fn):
  params = inspect.signature(fn).parameters
  assert not any(isinstance(p.annotation, str) for p in params.values()), params
  # optax's harness checks this to know that a schedule is accepted.
  assert params["learning_rate"].annotation is optax.ScalarOrSchedule


EVERY_FUNCTION = [
  f for f in map(functools.partial(getattr, dj), dj.__all__) if inspect.isfunction(f)
]


@pytest.mark.parametrize("fn", EVERY_FUNCTION, ids=[f.__name__ for f in EVERY_FUNCTION])
def test_every_public_function_has_real_annotations(fn):
  # Tooling (optax's harness, IDEs, docs) reads them; string annotations, as
  # `from __future__ import annotations` makes, it cannot use without the module.
  signature = inspect.signature(fn)
  for p in signature.parameters.values():
    assert not isinstance(p.annotation, str), f"{fn.__name__}({p.name}: {p.annotation!r})"
  assert not isinstance(signature.return_annotation, str), fn.__name__


@pytest.mark.parametrize("name, factory", EVERY)
def test_a_schedule_gives_the_constant_rate_it_holds(name, factory):
  params = _params()
  with_float = _plain_three_steps(name)
  with_schedule, _ = _steps(factory(optax.constant_schedule(LR)), params, 3)
  for a, b in zip(with_float, with_schedule):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), a, b)
