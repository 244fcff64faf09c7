"""A worker with non-finite gradients is left out; the others go on, identical."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_step import build, mesh_of, per_device_copies, place_grads
from tiny_runs import TINY, read_metrics, run_tiny

import distro_jax as dj
from experiments.run import checks

SHAPES = {"w": (64, 96), "b": (96,)}


def _grads(rng, workers):
  return {k: rng.normal(size=(workers, *s)).astype(np.float32) for k, s in SHAPES.items()}


def _assert_replicas_identical(params):
  for leaf in jax.tree.leaves(params):
    copies = per_device_copies(leaf)
    for c in copies[1:]:
      np.testing.assert_array_equal(c.view(np.uint32), copies[0].view(np.uint32))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize(
  "make_tx",
  [lambda: dj.demo(1e-2, weight_decay=0.1), lambda: dj.distro_adamw(1e-2)],
  ids=["demo", "distro_adamw"],
)
def test_one_bad_worker_is_excluded_and_replicas_stay_identical(bad, make_tx):
  workers, faulty, bad_step = 8, 5, 3
  mesh = mesh_of(workers)
  rng = np.random.default_rng(0)
  params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}
  step, params, state = build(make_tx(), params, mesh)
  for t in range(6):
    grads = _grads(rng, workers)
    if t == bad_step:
      grads["w"][faulty, 3, 7] = bad
    params, state = step(params, state, place_grads(grads, mesh))
    demo_state = state[0]
    assert int(demo_state.contributors) == workers - (1 if t == bad_step else 0)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
    _assert_replicas_identical(params)
    if t == bad_step:
      momentum = np.asarray(demo_state.momentum["w"]).reshape(workers, -1)
      assert np.all(momentum[faulty] == 0)  # the faulty worker starts over
      assert np.any(momentum[faulty - 1] != 0)


def test_all_workers_bad_is_a_no_op():
  workers = 4
  mesh = mesh_of(workers)
  rng = np.random.default_rng(1)
  params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}
  step, params, state = build(dj.demo(1e-2, weight_decay=0.1), params, mesh)
  params, state = step(params, state, place_grads(_grads(rng, workers), mesh))
  before_p = jax.tree.map(np.asarray, params)
  before_s = jax.tree.map(np.asarray, state)
  grads = _grads(rng, workers)
  grads["b"][:] = np.nan
  params, state = step(params, state, place_grads(grads, mesh))
  for a, b in zip(jax.tree.leaves(before_p), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  # The state is held, except that the count of contributors says that every
  # worker was left out.
  assert int(state[0].contributors) == 0
  after_s = jax.tree.map(np.asarray, state)
  held = (before_s[0]._replace(contributors=None), *before_s[1:])
  now = (after_s[0]._replace(contributors=None), *after_s[1:])
  for a, b in zip(jax.tree.leaves(held), jax.tree.leaves(now)):
    np.testing.assert_array_equal(a, b)
  # The next good step trains again.
  params, state = step(params, state, place_grads(_grads(rng, workers), mesh))
  assert int(state[0].contributors) == workers
  assert not np.array_equal(np.asarray(params["w"]), before_p["w"])


def test_one_bit_messages_flag_a_bad_worker_too():
  workers = 4
  mesh = mesh_of(workers)
  rng = np.random.default_rng(2)
  params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}
  step, params, state = build(dj.demo(1e-2, compression_topk=4, quantize_1bit=True), params, mesh)
  grads = _grads(rng, workers)
  grads["w"][0, 0, 0] = np.nan
  params, state = step(params, state, place_grads(grads, mesh))
  assert int(state[0].contributors) == workers - 1
  _assert_replicas_identical(params)


def _run(tmp_path, **kw):
  return run_tiny(
    tmp_path, workers=8, steps=6, eval_every=100, check_replicas=True, log_every=1, **kw
  )


@pytest.mark.slow
def test_driver_counts_the_excluded_worker_and_keeps_training(tmp_path):
  summary = _run(tmp_path, inject_nan_step=3, inject_nan_worker=6)
  records = read_metrics(tmp_path)
  assert [r.excluded_contributions for r in records] == [0, 0, 1, 0, 0, 0]
  assert all(np.isfinite(r.loss) for r in records)
  assert np.isfinite(summary.final_val_loss)


@pytest.mark.slow
@pytest.mark.parametrize(
  "method",
  [
    dict(optimizer="diloco", diloco_sync_every=3),
    # Stacked layers compile SparseLoCo's update in a fraction of the time;
    # its clip would take a stack as one tensor.
    dict(optimizer="sparseloco", sparseloco_sync_every=3, scan_layers=True, sparseloco_clip=False),
  ],
  ids=["diloco", "sparseloco"],
)
def test_driver_local_step_methods_leave_a_failed_worker_out(tmp_path, method):
  # Worker 6's inner params go NaN at step 2; the round's exchange at step 3
  # leaves it out, so no replica sees the NaN and the run trains on.
  summary = _run(tmp_path, inject_nan_step=2, inject_nan_worker=6, **method)
  records = read_metrics(tmp_path)
  assert [r.excluded_contributions for r in records] == [0, 0, 1, 0, 0, 0]
  assert all(np.isfinite(r.loss) for r in records)
  assert np.isfinite(summary.final_val_loss)


@pytest.mark.slow
def test_no_checkpoint_is_written_of_params_that_are_not_finite(tmp_path):
  # Under AdamW the NaN of step 4 is all-reduced into the update, so step 4's
  # loss (taken before it) is finite but its params are not.
  with pytest.raises(
    FloatingPointError,
    match="not finite after step 4.*checkpoint 4 was not written.*--skip_nonfinite",
  ):
    _run(tmp_path / "a", optimizer="adamw", inject_nan_step=4, checkpoint_every=2)
  assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["2"]
  # As the error says: with --skip_nonfinite AdamW skips that step and trains on.
  summary = _run(tmp_path / "b", optimizer="adamw", inject_nan_step=4, skip_nonfinite=True)
  assert np.isfinite(summary.final_train_loss)


def _drifted(mesh, shape, spec, device, index):
  """A global array equal on every device except one entry of one device's shard."""
  sharding = NamedSharding(mesh, spec)
  shard_shape = sharding.shard_shape(shape)
  arrays = []
  for i, d in enumerate(mesh.devices.flat):
    v = np.zeros(shard_shape, np.float32)
    if i == device:
      v[index] = 1e-30  # too small to see in a loss
    arrays.append(jax.device_put(v, d))
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


@pytest.mark.parametrize(
  ("spec", "device", "expected"),
  [
    (P(), 2, 1),  # a whole param differs on one device of one site
    (P(), 1, 1),  # ... or between the two devices of a site
    (P("fsdp"), 3, 1),  # a shard differs between the replicas that hold it
    (P("fsdp"), None, 0),
  ],
)
def test_replica_check_fires_when_one_device_differs(spec, device, expected):
  import functools

  from experiments.run import launch, steps

  mesh = launch.make_mesh(4, fsdp=2)
  params = {"w": _drifted(mesh, (4, 5), spec, device, (1, 4))}
  check = jax.jit(
    jax.shard_map(
      functools.partial(steps.replica_mismatches, param_specs={"w": spec}),
      mesh=mesh,
      in_specs=({"w": spec},),
      out_specs=P(),
      check_vma=False,
    )
  )
  assert int(check(params)) == expected


@pytest.mark.parametrize("drifted", [["sharded"], ["sharded", "whole"]])
def test_the_trainers_replica_check_raises_naming_the_step_and_the_count(drifted, capsys):
  # The check the driver runs every log_every steps under --check_replicas,
  # on params that differ in one entry of one device's copy of each drifted
  # param: a shard (between its replicas) or a param kept whole on a site.
  from experiments.run import cli, trainer

  fields = {**TINY, "workers": 4, "fsdp": 2, "out_dir": "unused"}
  program = trainer.build(checks.resolve(trainer.TrainConfig(**fields)))
  leaves, treedef = jax.tree.flatten(program.abstract)
  specs = treedef.flatten_up_to(program.fsdp_plan.specs)
  pick = {
    "sharded": next(i for i, s in enumerate(specs) if s != P()),
    "whole": next(i for i, s in enumerate(specs) if s == P()),
  }
  # 4 devices, 2 sites of 2: the second device of the second site, the first of the first.
  assert program.mesh.devices.shape == (2, 2)
  at = {pick[kind]: device for kind, device in zip(drifted, (3, 0))}

  def params(drift):
    return treedef.unflatten(
      [
        _drifted(program.mesh, a.shape, s, at.get(i) if drift else None, (0,) * a.ndim)
        for i, (a, s) in enumerate(zip(leaves, specs))
      ]
    )

  trainer._check_replicas(program, params(drift=False), 7)  # identical: no error
  message = f"replicas diverged at step 7: {len(drifted)} param entries differ between workers"
  with pytest.raises(trainer.ReplicaDivergenceError, match=message):
    trainer._check_replicas(program, params(drift=True), 7)
  # The CLI reports it as one error line and exit status 2.
  with pytest.raises(SystemExit) as exited:
    cli.report_user_errors(trainer._check_replicas, program, params(drift=True), 7)
  assert exited.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"error: {message}"), err
