"""dj.per_worker and dj.worker_value_and_grad: DisTrO in a jax.jit step, no shard_map in user code.

The jit path must train exactly as the shard_map path does (the same update
for the same per-worker gradients, also inside optax wrappers), keep every
replica bit-identical, and move only the message across the workers' axis.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import meta
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_step import (
  assert_identical_on_every_device,
  bits,
  mesh_of,
  random_problem,
  trajectory,
)

import distro_jax as dj

SHAPES = {"w": (16, 8), "b": (8,), "v": (8, 16)}
WORKERS = 4
CHUNK = 8


def assert_replicas_identical(tree):
  """Every device holding the same block of a leaf holds the same bits (sharded leaves too)."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    blocks = {}
    for shard in leaf.addressable_shards:
      blocks.setdefault(str(shard.index), []).append(bits(shard.data))
    assert len(leaf.addressable_shards) > len(blocks), "no block is held twice"
    for copies in blocks.values():
      for c in copies[1:]:
        np.testing.assert_array_equal(c, copies[0], err_msg=jax.tree_util.keystr(path))


def _auto_mesh(shape, names):
  """A mesh of Auto axes, as ``jax.sharding.Mesh`` builds one (nanodo's, MaxText's)."""
  devices = np.asarray(jax.devices()[: int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, names)


def _wrapped_demo():
  """DeMo inside every wrapper the jit path must serve: MultiSteps, chain, masked, inject.

  The bias takes the all-reduce baseline instead (a common split: DeMo for the
  matrices, an ordinary all-reduce for the small vectors).
  """
  demo = optax.inject_hyperparams(dj.demo, static_args=("compression_chunk",))(
    learning_rate=0.05, compression_chunk=CHUNK
  )
  vectors = {"w": False, "b": True, "v": False}
  matrices = jax.tree.map(lambda f: not f, vectors)
  inner = optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.masked(demo, matrices),
    optax.masked(optax.chain(dj.pmean_gradients("data"), optax.sgd(0.05)), vectors),
  )
  return optax.MultiSteps(inner, 2)


def _jit_trajectory(tx, init, grads, mesh):
  """Params before each step and after the last, stepping in ``jax.jit`` with ``dj.per_worker``."""
  tx = dj.per_worker(tx, mesh)
  params = jax.device_put(init, NamedSharding(mesh, P()))
  state = tx.init(params)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  out = [params]
  for g in grads:
    params, state = step(params, state, jax.device_put(g, NamedSharding(mesh, P("data"))))
    assert_identical_on_every_device(params, copies=mesh.devices.size)
    out.append(params)
  return out, state


@pytest.mark.slow  # two paths compiled, each with MultiSteps: about 25 s here
def test_the_jit_path_steps_as_the_shard_map_path_inside_optax_wrappers():
  init, grads = random_problem(SHAPES, WORKERS, steps=4, seed=0)
  want, _ = trajectory(_wrapped_demo(), init, grads, mesh_of(WORKERS))
  got, state = _jit_trajectory(_wrapped_demo(), init, grads, _auto_mesh((WORKERS,), ("data",)))
  for step, (a, b) in enumerate(zip(got, want)):
    for name in SHAPES:
      np.testing.assert_array_equal(a[name], b[name], err_msg=f"{name} after {step} steps")
  for name in SHAPES:
    assert not np.array_equal(got[-1][name], got[0][name]), name
  # Per-worker leaves stacked and boxed over the workers' axis, shared ones as optax has them.
  momentum = state.inner_opt_state[1].inner_state.inner_state[0].momentum["w"]
  assert isinstance(momentum, meta.Partitioned) and momentum.names == ("data", None, None)
  assert momentum.value.shape == (WORKERS, 16, 8)
  assert momentum.value.sharding.shard_shape(momentum.value.shape) == (1, 16, 8)
  assert state.gradient_step.shape == () and int(state.gradient_step) == 2


def _loss(params, batch):
  x, y = batch
  h = jnp.tanh(x @ params["w"] + params["b"])
  return jnp.mean((h @ params["v"] - y) ** 2)


def _batches(steps, rows=32):
  rng = np.random.default_rng(1)
  return [
    (
      rng.normal(size=(rows, 16)).astype(np.float32),
      rng.normal(size=(rows, 16)).astype(np.float32),
    )
    for _ in range(steps)
  ]


def _demo():
  return dj.demo(0.05, compression_topk=2, compression_chunk=CHUNK)


def _train_step(tx, mesh):
  grad_fn = dj.worker_value_and_grad(_loss, mesh, "data")

  def step(params, state, batch):
    loss, grads = grad_fn(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return step


@pytest.fixture(scope="module")
def fsdp_run():
  """Three steps on 4 workers of 2 devices, params FSDP-sharded as dj.plan_fsdp plans them."""
  mesh = _auto_mesh((WORKERS, 2), ("data", "fsdp"))
  init, _ = random_problem(SHAPES, WORKERS, steps=0, seed=2)
  plan = dj.plan_fsdp(init, 2, compression_chunk=CHUNK)
  assert all(d is not None for d in plan.axes[1:])  # w and v are split within a site
  params_sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), plan.specs)
  tx = dj.per_worker(_demo(), mesh)
  params = jax.device_put(init, params_sharding)
  state = tx.init(params)
  state_sharding = jax.tree.map(lambda x: x.sharding, state)
  rows = NamedSharding(mesh, P(("data", "fsdp")))
  step = jax.jit(
    _train_step(tx, mesh),
    in_shardings=(params_sharding, state_sharding, rows),
    out_shardings=(params_sharding, state_sharding, NamedSharding(mesh, P())),
  )
  losses, batches = [], _batches(3)
  hlo = step.lower(params, state, jax.device_put(batches[0], rows)).compile().as_text()
  for batch in batches:
    params, state, loss = step(params, state, jax.device_put(batch, rows))
    losses.append(float(loss))
  return mesh, init, params, losses, hlo


@pytest.mark.slow  # compiles and runs a DeMo step on 8 devices: about 10 s here
@pytest.mark.xdist_group("gspmd_fsdp_run")
def test_only_the_message_crosses_the_workers_axis_under_fsdp(fsdp_run):
  mesh, init, _, _, hlo = fsdp_run
  by_axes = dj.collective_bytes_by_axes(hlo, mesh)
  crossing = [op for axes, b in by_axes.items() if "data" in axes for op in b.ops]
  message = dj.wire_bytes(init, compression_topk=2, compression_chunk=CHUNK).payload
  # Each device sends the whole message (GSPMD keeps it whole within a site),
  # and the mean loss is the other 4 bytes; nothing else crosses the workers.
  assert sorted((kind, n) for kind, _, n in crossing) == [
    ("all-gather", message),
    ("all-reduce", 4),
  ]
  assert by_axes[("fsdp",)].total > 0  # the site's own gradient traffic stays on its links


@pytest.mark.slow  # a second DeMo step to compile: about 7 s here
@pytest.mark.xdist_group("gspmd_fsdp_run")
def test_fsdp_within_a_site_trains_as_unsharded_workers(fsdp_run):
  _, init, params, losses, _ = fsdp_run
  mesh = _auto_mesh((WORKERS,), ("data",))
  tx = dj.per_worker(_demo(), mesh)
  plain = jax.device_put(init, NamedSharding(mesh, P()))
  state = tx.init(plain)
  step = jax.jit(_train_step(tx, mesh))
  want = []
  for batch in _batches(3):
    plain, state, loss = step(plain, state, batch)
    want.append(float(loss))
  # The site's gradient sums its rows in another order: equal up to rounding.
  np.testing.assert_allclose(losses, want, rtol=1e-5)
  for name in SHAPES:
    np.testing.assert_allclose(params[name], plain[name], atol=1e-6, err_msg=name)
  assert_replicas_identical(params)


def test_the_gradient_of_the_whole_batch_is_refused_with_the_fix():
  mesh = _auto_mesh((WORKERS,), ("data",))
  tx = dj.per_worker(_demo(), mesh)
  params = {name: jnp.zeros(shape) for name, shape in SHAPES.items()}
  dense = jax.grad(_loss)(params, _batches(1)[0])
  with pytest.raises(ValueError, match="gradient of the whole batch.*dj.worker_value_and_grad"):
    jax.eval_shape(tx.update, dense, jax.eval_shape(tx.init, params), params)


def test_an_optimizer_that_exchanges_nothing_is_refused():
  mesh = _auto_mesh((WORKERS,), ("data",))
  tx = dj.per_worker(dj.demo(0.1, compression_chunk=CHUNK, axis_name=None), mesh)
  params = {name: jnp.zeros(shape) for name, shape in SHAPES.items()}
  grads = {name: jnp.zeros((WORKERS, *shape)) for name, shape in SHAPES.items()}
  with pytest.raises(ValueError, match="differs from worker to worker.*axis_name='data'"):
    jax.eval_shape(tx.update, grads, jax.eval_shape(tx.init, params), params)


def test_params_partitioned_over_the_workers_axis_are_refused_at_init():
  mesh = _auto_mesh((WORKERS,), ("data",))
  params = {"w": meta.Partitioned(jnp.zeros((16, 8)), names=("data", None))}
  with pytest.raises(ValueError, match=r"params\['w'\].*workers' axis.*dj.plan_fsdp"):
    dj.per_worker(_demo(), mesh).init(params)
  with pytest.raises(ValueError, match="workers' axis"):
    dj.worker_value_and_grad(_loss, mesh)(params, _batches(1)[0])


@pytest.mark.slow  # two resizes, each tracing the optimizer: about 10 s here
def test_a_state_of_another_worker_count_is_refused_and_resized():
  params = {name: jnp.zeros(shape) for name, shape in SHAPES.items()}
  on_4 = dj.per_worker(_demo(), _auto_mesh((4,), ("data",)))
  on_2 = dj.per_worker(_demo(), _auto_mesh((2,), ("data",)))
  state = on_4.init(params)
  momentum = {
    k: v.value + jnp.arange(4.0).reshape(4, *[1] * len(SHAPES[k]))
    for k, v in state[0].momentum.items()
  }
  state = (
    state[0]._replace(
      momentum=jax.tree.map(
        lambda box, m: box.replace(value=m),
        state[0].momentum,
        momentum,
        is_leaf=lambda x: isinstance(x, meta.Partitioned),
      )
    ),
    *state[1:],
  )
  grads = {name: jnp.zeros((2, *shape)) for name, shape in SHAPES.items()}
  with pytest.raises(ValueError, match="another worker count.*dj.resize_per_worker"):
    jax.eval_shape(on_2.update, grads, state, params)
  resized = dj.resize_per_worker(on_2, state, params)
  # Workers 0 and 1 stay with their own momentum; 2 and 3 leave.
  np.testing.assert_array_equal(resized[0].momentum["w"].value[:, 0, 0], [0.0, 1.0])
  assert resized[0].momentum["w"].value.sharding.spec == P("data", None, None)
  grown = dj.resize_per_worker(on_4, resized, params)  # two join, at zero momentum
  np.testing.assert_array_equal(grown[0].momentum["w"].value[:, 0, 0], [0.0, 1.0, 0.0, 0.0])


@pytest.mark.slow  # compiles a DeMo step: about 6 s here
def test_per_worker_state_placed_replicated_warns():
  mesh = _auto_mesh((WORKERS,), ("data",))
  tx = dj.per_worker(_demo(), mesh)
  replicated = NamedSharding(mesh, P())
  params = jax.device_put({name: jnp.zeros(shape) for name, shape in SHAPES.items()}, replicated)
  state = jax.device_put(tx.init(params), replicated)
  step = jax.jit(_train_step(tx, mesh), out_shardings=replicated)
  with pytest.warns(dj.DenseStepWarning, match="replicated over 'data'"):
    step.lower(params, state, _batches(1)[0]).compile()


def test_an_explicit_mesh_is_refused_with_the_fix():
  mesh = jax.make_mesh((WORKERS,), ("data",), devices=jax.devices()[:WORKERS])
  with pytest.raises(ValueError, match="Explicit.*AxisType.Auto"):
    dj.per_worker(_demo(), mesh)
  with pytest.raises(ValueError, match="Explicit"):
    dj.worker_value_and_grad(_loss, mesh)


@pytest.mark.slow  # two paths compiled, one under nnx.jit: about 50 s here
def test_flax_nnx_optimizer_steps_as_plain_params():
  from flax import nnx

  class Mlp(nnx.Module):
    def __init__(self, rngs):
      self.hidden = nnx.Linear(16, 8, rngs=rngs)
      self.out = nnx.Linear(8, 16, rngs=rngs)

    def __call__(self, x):
      return self.out(jnp.tanh(self.hidden(x)))

  mesh = _auto_mesh((WORKERS,), ("data",))
  replicated = NamedSharding(mesh, P())
  model = Mlp(nnx.Rngs(0))
  nnx.update(model, jax.device_put(nnx.state(model), replicated))
  graphdef, _ = nnx.split(model)
  plain = jax.device_put(nnx.to_pure_dict(nnx.state(model, nnx.Param)), replicated)
  tx = dj.per_worker(_demo(), mesh)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def loss(params, batch):
    x, y = batch
    return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)

  @nnx.jit
  def nnx_step(model, optimizer, batch):
    value, grads = tx.value_and_grad(loss)(nnx.state(model, nnx.Param), batch)
    optimizer.update(model, grads)
    return value

  def pure_loss(params, batch):
    x, y = batch
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, params)
    return jnp.mean((nnx.merge(graphdef, state)(x) - y) ** 2)

  @jax.jit
  def plain_step(params, state, batch):
    value, grads = tx.value_and_grad(pure_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  plain_state = tx.init(plain)
  for batch in _batches(2):
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    got = nnx_step(model, optimizer, batch)
    plain, plain_state, want = plain_step(plain, plain_state, batch)
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(model.hidden.kernel[...], plain["hidden"]["kernel"])
  assert_identical_on_every_device(nnx.state(model, nnx.Param))
  momentum = optimizer.opt_state[0].momentum["hidden"]["kernel"]
  assert momentum[...].shape == (WORKERS, 16, 8)


def test_workers_mesh_splits_the_trainers_own_mesh():
  # nanodo's mesh, split into 4 workers: its axis stays, within each worker.
  own = Mesh(np.asarray(jax.devices()), ("data",))
  mesh = dj.workers_mesh(4, own)
  assert mesh.axis_names == ("workers", "data")
  assert mesh.devices.shape == (4, 2)
  assert [d.id for d in mesh.devices[1]] == [d.id for d in own.devices[2:4]]  # consecutive
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  flat = dj.workers_mesh(2, jax.devices()[:6], names=("fsdp",))
  assert flat.axis_names == ("workers", "fsdp") and flat.devices.shape == (2, 3)
  with pytest.raises(
    ValueError, match=r"num_workers=3 does not split the 8 devices.*\[1, 2, 4, 8\]"
  ):
    dj.workers_mesh(3, own)
  with pytest.raises(ValueError, match="'data' is already an axis"):
    dj.workers_mesh(2, own, axis_name="data")


def test_a_mesh_without_the_workers_axis_suggests_one_from_its_devices():
  # nanodo's own 1-D mesh: the fix keeps its "data" axis as FSDP within a worker.
  mesh = Mesh(np.asarray(jax.devices()), ("data",))
  with pytest.raises(ValueError) as caught:
    dj.per_worker(_demo(), mesh, "workers")
  message = str(caught.value)
  assert "dj.workers_mesh(W, mesh)" in message
  assert "Mesh(mesh.devices.reshape(W, 8 // W, ...), ('workers', *mesh.axis_names))" in message
  assert "[2, 4, 8]" in message and "('data',)" in message
  assert "jax.sharding.Mesh(jax.devices(), ('data',))" not in message  # the mesh it already has
  with pytest.raises(ValueError, match="dj.workers_mesh"):
    dj.worker_value_and_grad(_loss, mesh, "workers")


def test_reduce_over_workers_sums_the_named_counts_and_averages_the_rest():
  from flax import struct

  @struct.dataclass
  class LossAuxData:  # nanodo's aux
    ntokens: jax.Array
    state: dict
    log_perplexity: jax.Array

  aux = LossAuxData(
    ntokens=jnp.array([8.0, 8.0, 4.0]),
    state={"acts": jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])},
    log_perplexity=jnp.array([1.0, 2.0, 6.0]),
  )
  out = dj.reduce_over_workers(aux, summed=("ntokens",))
  assert float(out.ntokens) == 20.0 and float(out.log_perplexity) == 3.0
  np.testing.assert_array_equal(out.state["acts"], [3.0, 4.0])
  with pytest.raises(ValueError, match=r"summed names \['ntoken'\].*ntokens"):
    dj.reduce_over_workers(aux, summed=("ntoken",))
  with pytest.raises(ValueError, match=r"aux\['n'\] is a scalar"):
    dj.reduce_over_workers({"n": jnp.float32(1.0)})


def test_all_reduce_runs_a_dense_optimizer_on_the_mean_gradient():
  # The baseline through the same path: AdamW on the workers' mean gradient,
  # all of its state shared (stored once), and an update every worker shares.
  mesh = _auto_mesh((WORKERS,), ("data",))
  tx = dj.per_worker(optax.MultiSteps(optax.adamw(0.1), 1), mesh, all_reduce=True)
  init, grads = random_problem(SHAPES, WORKERS, steps=2, seed=3)
  params = jax.device_put(init, NamedSharding(mesh, P()))
  state = tx.init(params)
  assert not any(isinstance(x, meta.Partitioned) for x in jax.tree.leaves(state, is_leaf=_boxed))
  assert tx.per_worker_leaves(params) == [False] * len(jax.tree.leaves(state))
  dense = optax.MultiSteps(optax.adamw(0.1), 1)
  want_state = dense.init(init)
  for g in grads:
    updates, state = jax.jit(tx.update)(g, state, params)
    mean = jax.tree.map(lambda x: jnp.mean(x, axis=0), g)
    want, want_state = dense.update(mean, want_state, init)
    for name in SHAPES:
      np.testing.assert_allclose(updates[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)
  # Nothing depends on the worker count: the state resizes as it is.
  on_2 = dj.per_worker(
    optax.MultiSteps(optax.adamw(0.1), 1), _auto_mesh((2,), ("data",)), all_reduce=True
  )
  resized = dj.resize_per_worker(on_2, state, init)
  for a, b in zip(jax.tree.leaves(resized), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)


def _boxed(x):
  return isinstance(x, meta.Partitioned)
