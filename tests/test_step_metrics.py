"""The train step's metrics: each worker's loss leaves it unreduced, and the log takes their mean.

Issue 69 took the loss's two ``psum``\\ s off the step's path (they were 12 of
its 18 one-way hops on four processes, docs/netlab.md); the logged numbers
must stay what they were: the mean of the workers' finite losses.
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_runs
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.run import checks, config, records, trainer
from experiments.run import model as model_lib


@functools.cache
def _program():
  cfg = checks.resolve(trainer.TrainConfig(out_dir="unused", **tiny_runs.TINY))
  return cfg, trainer.build(cfg)


def _mesh(workers):
  devices = np.array(jax.devices()[:workers]).reshape(workers, 1)
  return jax.sharding.Mesh(devices, ("replica", "fsdp"))


@functools.cache
def _psum_mean(mesh):
  """The step's own mean before issue 69: two psums over the workers, in the step."""

  def mean(loss_1):
    loss = loss_1[0]
    finite = jnp.isfinite(loss)
    count = jax.lax.psum(finite.astype(jnp.float32), "replica")
    total = jax.lax.psum(jnp.where(finite, loss, 0.0), "replica")
    return jnp.where(count > 0, total / jnp.maximum(count, 1.0), jnp.nan)

  return jax.jit(jax.shard_map(mean, mesh=mesh, in_specs=P("replica"), out_specs=P()))


def _old_logged(losses, mesh):
  placed = jax.device_put(np.asarray(losses, np.float32), NamedSharding(mesh, P("replica")))
  return float(_psum_mean(mesh)(placed))


def _same(a, b):
  return a == b or (np.isnan(a) and np.isnan(b))


def test_the_step_returns_each_workers_loss_and_the_log_their_mean():
  cfg, program = _program()
  params = program.init_params()
  opt_state = program.init_opt_state(params)
  vocab = config.model_config(cfg).vocab_size
  tokens = np.random.default_rng(0).integers(0, vocab, (cfg.batch_size, cfg.seq_len + 1))
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  # Each worker's loss on its own rows, taken before the step donates the params.
  model = nnx.merge(program.graphdef, params)
  rows = cfg.batch_size // cfg.workers
  own = [slice(w * rows, (w + 1) * rows) for w in range(cfg.workers)]
  want = [float(model_lib.next_token_loss(model(inputs[r]), targets[r])) for r in own]
  placed = [
    jax.device_put(jnp.asarray(x, jnp.int32), program.sharding(program.rows))
    for x in (inputs, targets)
  ]
  step = trainer.step_number(1, program.sharding())
  _, _, metrics = program.train_step(params, opt_state, step, *placed)

  # One loss per worker, each on its own device, as the batch is split.
  assert metrics["loss"].shape == (cfg.workers,)
  assert metrics["loss"].sharding.spec == program.rows
  losses = np.asarray(metrics["loss"])
  np.testing.assert_allclose(losses, want, rtol=1e-5)
  logged = records.logged_loss(losses)
  assert logged == pytest.approx(float(np.mean(want)), rel=1e-5)
  # The number the step logged when it took the mean itself, to the bit.
  assert logged == _old_logged(losses, program.mesh)


@pytest.mark.parametrize("workers", [2, 3, 4, 8])
def test_the_logged_loss_is_the_psums_mean_to_the_bit_and_leaves_out_non_finite_losses(workers):
  mesh = _mesh(workers)
  rng = np.random.default_rng(workers)
  for trial in range(40):
    scale = np.float32(10.0 ** rng.integers(-2, 3))
    losses = (rng.standard_normal(workers) + 4).astype(np.float32) * scale
    if trial % 3 == 1:
      losses[rng.integers(workers)] = np.nan
    if trial % 5 == 2:
      losses[rng.integers(workers)] = np.inf
    if trial == 39:
      losses[:] = np.nan
    host = records.logged_loss(losses)
    assert _same(host, _old_logged(losses, mesh)), (losses, host)
    finite = losses[np.isfinite(losses)]
    if finite.size:
      assert host == pytest.approx(float(np.mean(finite.astype(np.float64))), rel=1e-6)
    else:
      assert np.isnan(host)


def _metrics(program, losses, excluded=0):
  """A step's metrics as the train step returns them (each worker's loss on its device)."""
  loss = jax.device_put(np.asarray(losses, np.float32), program.sharding(program.rows))
  return {"loss": loss, "excluded": jax.device_put(np.int32(excluded), program.sharding())}


def test_metrics_jsonl_holds_the_mean_of_the_workers_finite_losses(tmp_path):
  cfg, program = _program()
  cfg = checks.resolve(trainer.TrainConfig(out_dir=str(tmp_path), **tiny_runs.TINY))
  log = trainer._Log(cfg, program.method, types.SimpleNamespace(sent=10), 0)
  steps = [[3.0, 3.5, 2.25, 4.0], [1.0, np.nan, 2.0, 4.5], [2.5, 2.5, np.inf, 2.5]]
  for step, losses in enumerate(steps, start=1):
    log.stepped(step, _metrics(program, losses))
  log.flush(val_loss=1.5)
  log.close()

  written = tiny_runs.read_metrics(tmp_path)
  assert [r.step for r in written] == [1, 2, 3]
  assert [r.loss for r in written] == [3.1875, 2.5, 2.5]
  assert [r.loss for r in written] == [_old_logged(s, program.mesh) for s in steps]
  assert [r.val_loss for r in written] == [None, None, 1.5]


def test_a_step_whose_every_loss_is_nan_stops_the_run(tmp_path):
  cfg, program = _program()
  cfg = checks.resolve(trainer.TrainConfig(out_dir=str(tmp_path), **tiny_runs.TINY))
  log = trainer._Log(cfg, program.method, types.SimpleNamespace(sent=10), 0)
  log.stepped(1, _metrics(program, [2.0, 2.0, 2.0, 2.0]))
  log.stepped(2, _metrics(program, [np.nan] * 4))
  with pytest.raises(FloatingPointError, match="on every worker at step 2"):
    log.flush()
  log.close()
  assert [r.step for r in tiny_runs.read_metrics(tmp_path)] == [1]


def test_the_step_number_is_the_same_int32_on_every_device():
  cfg, program = _program()
  step = trainer.step_number(7, program.sharding())
  assert step.shape == () and step.dtype == jnp.int32 and step.sharding.is_fully_replicated
  assert sorted(s.device.id for s in step.addressable_shards) == sorted(
    d.id for d in program.mesh.devices.flat
  )
  assert [int(s.data) for s in step.addressable_shards] == [7] * cfg.workers


def test_a_multi_process_log_gathers_the_workers_losses_every_log_every_steps(
  tmp_path, monkeypatch
):
  # This process holds workers 0 and 1; a simulated second one holds 2 and 3.
  # It gathers at steps 2 and 4 (--log_every=2) and at the flush, and the
  # mean is of all four workers' losses, whatever order the processes come in.
  cfg, program = _program()
  cfg = checks.resolve(trainer.TrainConfig(out_dir=str(tmp_path), log_every=2, **tiny_runs.TINY))
  mesh = _mesh(2)
  mine = [[3.0, 3.5], [1.0, np.nan], [2.5, 2.5], [4.0, 4.0], [1.0, 1.0]]
  theirs = [[2.25, 4.0], [2.0, 4.5], [np.inf, 2.5], [np.nan, np.nan], [1.0, 3.0]]
  gathered = []

  def allgather(tree):
    n = tree["losses"].shape[0]
    done = sum(gathered)
    gathered.append(n)
    other = np.asarray(theirs[done : done + n], np.float32)
    np.testing.assert_array_equal(tree["at"], [0, 1])
    return {
      "at": np.stack([np.array([2, 3]), tree["at"]]),
      "losses": np.stack([other, tree["losses"]]),
    }

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(trainer.multihost_utils, "process_allgather", allgather)
  log = trainer._Log(cfg, program.method, types.SimpleNamespace(sent=10), 0)
  for step, losses in enumerate(mine, start=1):
    loss = jax.device_put(np.asarray(losses, np.float32), NamedSharding(mesh, P("replica")))
    log.stepped(step, {"loss": loss, "excluded": jnp.int32(0)})
    # Steps are written in bursts: step 2 once step 3 is dispatched, and so on.
    assert len(tiny_runs.read_metrics(tmp_path)) == {1: 0, 2: 0, 3: 2, 4: 2, 5: 4}[step]
  log.flush()
  log.close()

  assert gathered == [2, 2, 1]
  written = tiny_runs.read_metrics(tmp_path)
  assert [r.step for r in written] == [1, 2, 3, 4, 5]
  want = [records.logged_loss(m + t) for m, t in zip(mine, theirs)]
  assert [r.loss for r in written] == want == [3.1875, 2.5, 2.5, 4.0, 1.5]
