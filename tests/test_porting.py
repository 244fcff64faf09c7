"""docs/porting.md, executed: a nanodo-shaped jit trainer ported from AdamW to DeMo.

``jit_trainer_adamw.py`` is the trainer before, ``jit_trainer_demo.py`` after.
The port must change at most 15 lines and hold no ``shard_map``, train within
2% of the shard_map path's loss over 30 steps, move only the message (and a
few logged scalars) across the workers' axis, keep every replica
bit-identical, run AdamW from the same config switch as the trainer before
did, and restore its checkpoint on another worker count in both of orbax's
styles. Every Python snippet of the guide runs, in order, in one namespace.
"""

import dataclasses
import difflib
import inspect
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import jit_trainer_adamw as before
import jit_trainer_demo as after
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_step import bits

import distro_jax as dj

DOCS = Path(__file__).resolve().parent.parent / "docs" / "porting.md"
C = dataclasses.replace(after.Config(), optimizer="demo")
WORKERS, FSDP = C.workers, 2


def _code(module):
  """The module's source lines after its docstring."""
  source = inspect.getsource(module)
  return source[source.index('"""', 3) + 4 :].splitlines()


def port_diff():
  """The unified diff of the port, as docs/porting.md shows it."""
  diff = difflib.unified_diff(
    _code(before), _code(after), "jit_trainer_adamw.py", "jit_trainer_demo.py", n=1, lineterm=""
  )
  return ["..." if line.startswith("@@") else line for line in diff]


def test_the_port_changes_at_most_15_lines_and_holds_no_shard_map():
  diff = port_diff()[2:]
  added = [line for line in diff if line.startswith("+") and line[1:].strip()]
  removed = [line for line in diff if line.startswith("-") and line[1:].strip()]
  assert len(added) <= 15, added
  assert len(removed) <= len(added)
  assert "shard_map" not in inspect.getsource(after)


def _snippets():
  return re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)


def _run_snippets():
  """The guide's Python snippets run in order, as a reader pastes them; their namespace."""
  namespace = {"__name__": "porting_md"}
  for code in _snippets():
    exec(compile(code, str(DOCS), "exec"), namespace)
  return namespace


def test_the_guides_snippets_run():
  # Each snippet asserts what the guide says of it (the mesh, the two
  # optimizers' state layouts, the metric reduction); the restore one is
  # called on a trained state by test_the_port_end_to_end.
  assert len(_snippets()) == 4
  namespace = _run_snippets()
  assert callable(namespace["_restore_ckpt"]) and callable(namespace["get_optimizer"])


def test_the_docs_show_the_port_as_it_is():
  blocks = re.findall(r"```diff\n(.*?)```", DOCS.read_text(), re.S)
  assert blocks, "docs/porting.md shows the port as a ```diff block"
  shown = "\n".join(line.rstrip() for line in blocks[0].splitlines()).strip()
  assert shown == "\n".join(line.rstrip() for line in port_diff()).strip()


def _batches(steps, seed=0):
  """Rows of a fixed random teacher's classes, the same for every run."""
  rng = np.random.default_rng(seed)
  teacher = rng.normal(size=(C.features, C.vocab))
  out = []
  for _ in range(steps):
    x = rng.normal(size=(C.batch_size, C.features)).astype(np.float32)
    out.append((x, np.argmax(x @ teacher, axis=-1).astype(np.int32)))
  return out


def _mesh(c, fsdp=FSDP):
  """The ported trainer's mesh: ``c.workers`` workers of ``fsdp`` devices."""
  return after.make_mesh(c, jax.devices()[: c.workers * fsdp])


def _shard_map_losses(batches, rng):
  """The same trainer on the library's shard_map path: one device per worker, no FSDP."""
  mesh = jax.make_mesh((WORKERS,), ("workers",), devices=jax.devices()[:WORKERS])
  inner = after.get_optimizer(C)
  model = after.Mlp(C)
  params = jax.tree.map(
    lambda p: p.unbox() if hasattr(p, "unbox") else p,
    model.init(rng, jnp.zeros((1, C.features)))["params"],
    is_leaf=lambda p: hasattr(p, "unbox"),
  )
  specs = dj.worker_state_specs(inner, params, mesh, "workers")
  state = dj.init_worker_state(inner, params, mesh, "workers")
  params = jax.device_put(params, NamedSharding(mesh, P()))

  def local(params, state, batch):
    loss_of = lambda p: before.get_loss_fn(batch, model.apply)(p)[0]  # noqa: E731
    loss, grads = dj.local_value_and_grad(loss_of, "workers")(params)
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, "workers")

  step = jax.jit(
    jax.shard_map(
      local, mesh=mesh, in_specs=(P(), specs, P("workers")), out_specs=(P(), specs, P())
    )
  )
  losses = []
  for batch in batches:
    params, state, loss = step(
      params, state, jax.device_put(batch, NamedSharding(mesh, P("workers")))
    )
    losses.append(float(loss))
  return losses


def assert_replicas_identical(tree):
  """Every device holding the same block of a leaf holds the same bits."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    blocks = {}
    for shard in leaf.addressable_shards:
      blocks.setdefault(str(shard.index), []).append(bits(shard.data))
    assert len(leaf.addressable_shards) > len(blocks), "no block is held twice"
    for copies in blocks.values():
      for c in copies[1:]:
        np.testing.assert_array_equal(c, copies[0], err_msg=jax.tree_util.keystr(path))


def _assert_trains_as_the_shard_map_path(batches, state, history):
  losses = [float(m["train_loss"]) for m in history]
  want = _shard_map_losses(batches, jax.random.key(0))
  np.testing.assert_allclose(losses, want, rtol=0.02)
  assert losses[-1] < 0.8 * losses[0]  # it trains
  assert all(float(m["train_ntokens"]) == C.batch_size for m in history)
  assert_replicas_identical(state.params)


def _assert_only_the_message_and_logged_scalars_cross(mesh, hlo, params):
  crossing = [
    (kind, n)
    for axes, b in dj.collective_bytes_by_axes(hlo, mesh).items()
    if "workers" in axes
    for kind, _, n in b.ops
  ]
  params = jax.tree.map(
    lambda p: p.unbox() if hasattr(p, "unbox") else p, params, is_leaf=lambda p: hasattr(p, "unbox")
  )
  gathers = [n for kind, n in crossing if kind == "all-gather"]
  scalars = [n for kind, n in crossing if kind != "all-gather"]
  assert gathers == [dj.wire_bytes(params).payload], crossing
  # Logged scalars only: the mean loss, the summed token count, and the sums of
  # squares of the per-worker gradients (4 leaves) for their norm; XLA combines them.
  assert sum(scalars) <= 6 * 4, crossing


def _momentum(state):
  return jax.tree.leaves(state.opt_state.inner_opt_state[1][0].momentum)


def _assert_legacy_restore(state, directory):
  """The guide's copy of nanodo's legacy orbax restore, on this worker count and on 2."""
  namespace = _run_snippets()
  manager = namespace["_get_ckpt_manager"]
  with manager(directory) as mngr:
    mngr.save(int(state.step), {"state": state})
    mngr.wait_until_finished()
  fresh, _ = after.init_train_state(C, jax.random.key(1), _mesh(C))
  with manager(directory) as mngr:
    restored = namespace["_restore_ckpt"](mngr, fresh)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(a, b)
  on_2 = dataclasses.replace(C, workers=2)
  fresh, _ = after.init_train_state(on_2, jax.random.key(1), _mesh(on_2))
  with manager(directory) as mngr:
    restored = namespace["_restore_ckpt"](mngr, fresh)
  for a, b in zip(_momentum(restored), _momentum(state)):
    assert a.shape[0] == 2 and a.sharding.spec[0] == "workers"
    np.testing.assert_array_equal(a, np.asarray(b)[:2])


def _assert_the_switch_runs_adamw_as_before(batches, adamw):
  """The ported tree with optimizer="adamw": the trainer before, all-reduced over the workers."""
  switch = dataclasses.replace(C, optimizer="adamw")
  mesh = _mesh(switch)
  state, shardings = after.init_train_state(switch, jax.random.key(0), mesh)
  assert not any(state.tx.per_worker_leaves(state.params))  # all of AdamW's state is shared
  step = after.make_train_step(mesh, shardings).lower(state, batches[0]).compile()
  crossing = [
    (kind, n)
    for axes, b in dj.collective_bytes_by_axes(step.as_text(), mesh).items()
    if "workers" in axes
    for kind, _, n in b.ops
  ]
  # The dense baseline: each device's FSDP half of the float32 gradient, all-reduced.
  grad_bytes = 4 * sum(np.size(x) for x in jax.tree.leaves(state.params))
  assert {kind for kind, _ in crossing} == {"all-reduce"}, crossing
  assert sum(n for _, n in crossing) >= grad_bytes // FSDP, crossing
  history = []
  for batch in batches:
    state, metrics = step(state, batch)
    history.append(jax.device_get(metrics))
  for name in ("train_loss", "grads/norm", "train_ntokens"):
    np.testing.assert_allclose(
      [float(m[name]) for m in history], [float(m[name]) for m in adamw], rtol=1e-6, err_msg=name
    )


def _assert_restores_on_another_worker_count(state, directory):
  after.save_checkpoint(directory, state)
  on_2 = dataclasses.replace(C, workers=2)
  mesh = _mesh(on_2)
  fresh, _ = after.init_train_state(on_2, jax.random.key(1), mesh)
  restored = after.restore_checkpoint(directory, fresh)
  assert int(restored.step) == C.num_train_steps
  for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(a, b)
  # Workers 0 and 1 keep their momentum; the shared counts carry over.
  for a, b in zip(_momentum(restored), _momentum(state)):
    assert a.shape[0] == 2 and a.sharding.spec[0] == "workers"
    np.testing.assert_array_equal(a, np.asarray(b)[:2])
  assert int(restored.opt_state.gradient_step) == int(state.opt_state.gradient_step)
  restored, history = after.train(on_2, mesh, _batches(1, seed=1), state=restored)
  assert np.isfinite(float(history[0]["train_loss"]))
  assert_replicas_identical(restored.params)


# One test, so that the trained state is built once (a module fixture would be
# built again by each pytest-xdist worker that runs one of its tests).
@pytest.mark.slow  # six trainers compiled: about 30 s here, unloaded
def test_the_port_end_to_end(tmp_path):
  mesh = _mesh(C)
  batches = _batches(C.num_train_steps)
  state, shardings = after.init_train_state(C, jax.random.key(0), mesh)
  # after.train's loop, on the step compiled once for both the run and its HLO.
  step = after.make_train_step(mesh, shardings).lower(state, batches[0]).compile()
  _assert_only_the_message_and_logged_scalars_cross(mesh, step.as_text(), state.params)
  history = []
  for batch in batches:
    state, metrics = step(state, batch)
    history.append(jax.device_get(metrics))
  _assert_trains_as_the_shard_map_path(batches, state, history)
  _assert_restores_on_another_worker_count(state, tmp_path / "standard")
  _assert_legacy_restore(state, tmp_path / "legacy")
  adamw_c = dataclasses.replace(C, optimizer="adamw")
  _, adamw = before.train(
    adamw_c, before.make_mesh(adamw_c, jax.devices()), batches, rng=jax.random.key(0)
  )
  assert float(adamw[-1]["train_loss"]) < 0.8 * float(adamw[0]["train_loss"])  # "before" runs
  _assert_the_switch_runs_adamw_as_before(batches, adamw)


@pytest.mark.slow  # one DeMo step compiled: about 5 s here
def test_a_batch_left_on_data_alone_crosses_the_workers():
  # Why the port changes the batch constraint: split over "data" only, every
  # worker holds a copy of the rows, and the gradient helper's cut then moves
  # rows across the workers' links (docs/porting.md, "The batch").
  mesh = _mesh(C)
  state, shardings = after.init_train_state(C, jax.random.key(0), mesh)

  def step(state, batch):
    batch = jax.lax.with_sharding_constraint(batch, NamedSharding(mesh, P("data")))
    grad_fn = state.tx.value_and_grad(lambda p, b: after.get_loss_fn(b, state.apply_fn)(p)[0])
    _, grads = grad_fn(state.params, batch)
    return state.tx.update(grads, state.opt_state, state.params)

  hlo = jax.jit(step).lower(state, _batches(1)[0]).compile().as_text()
  by_axes = dj.collective_bytes_by_axes(hlo, mesh)
  moved = [(kind, n) for kind, _, n in by_axes[("workers", "data")].ops]
  assert moved and {kind for kind, _ in moved} == {"collective-permute"}, moved
  assert sum(n for _, n in moved) == 2112  # the rows (2,048 bytes) and their labels
