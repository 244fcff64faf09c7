"""Elastic resume in the driver: --resume on another --workers or --num_processes.

The quick tests check the pieces (what a resize describes, the event lines of
``metrics.jsonl``, the refusals); the slow ones run the driver across a
worker-count change in one process. Across gloo processes, the resume on
fewer processes is the one a lost peer's survivors are offered
(tests/test_interrupted_runs.py).
"""

import hashlib
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny_runs
from sharded_step import mesh_of, place_grads

import distro_jax as dj
from experiments.run import checks, config, elastic, records
from experiments.run.records import ResizeEvent, StepRecord
from experiments.run.reporting import MetricsWriter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- pieces ---------------------------------------------------------------------


def test_resize_says_who_left_and_who_joined():
  shrink = elastic.Resize(step=40, workers_before=8, workers_after=6, processes_before=4,
                          processes_after=3)  # fmt: skip
  assert shrink.changed and shrink.left == [6, 7] and shrink.joined == []
  assert shrink.cold_until(5) is None
  grow = elastic.Resize(80, 6, 8, 1, 1)
  assert grow.left == [] and grow.joined == [6, 7]
  assert grow.cold_until(5) == (0, 0, 0, 0, 0, 0, 85, 85)
  assert grow.cold_until(0) is None
  assert not elastic.Resize(10, 4, 4, 1, 1).changed
  assert elastic.Resize(10, 4, 4, 2, 1).changed  # same workers on fewer processes
  cfg = config.TrainConfig(leaving="drop")
  event = shrink.event(cfg)
  assert (event.workers_before, event.workers_after, event.left, event.leaving) == (
    8, 6, [6, 7], "drop"
  )  # fmt: skip
  assert "8 -> 6 workers" in shrink.describe(cfg) and "dropped" in shrink.describe(cfg)


def _step(step):
  return StepRecord(step=step, loss=1.0, wall_time=0.0, bytes_sent=1, lr=0.1, tokens_per_s=1)


def _event(step):
  return ResizeEvent(step, 0.0, 8, 6, 1, 1, [6, 7], [], "fold", 0)


def test_event_lines_are_skipped_by_read_metrics_and_kept_across_resumes(tmp_path):
  writer = MetricsWriter(str(tmp_path), enabled=True)
  for s in (1, 2):
    writer.write(_step(s))
  writer.write_event(_event(2))
  for s in (3, 4):
    writer.write(_step(s))
  writer.close()
  assert [r.step for r in records.read_metrics(tmp_path)] == [1, 2, 3, 4]
  assert records.read_events(tmp_path) == [_event(2)]
  # A resume from step 3 keeps the event before it.
  MetricsWriter(str(tmp_path), enabled=True, truncate_after=3).close()
  assert [r.step for r in records.read_metrics(tmp_path)] == [1, 2, 3]
  assert records.read_events(tmp_path) == [_event(2)]
  # A resume from step 2 replaces the attempt that began there, event and all.
  MetricsWriter(str(tmp_path), enabled=True, truncate_after=2).close()
  assert records.read_events(tmp_path) == []
  assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
    1,
    2,
  ]


def test_validate_refuses_bad_elastic_flags():
  with pytest.raises(config.ConfigError, match="--leaving=drop or --leaving=fold"):
    checks.validate(config.TrainConfig(leaving="sum"))
  with pytest.raises(config.ConfigError, match="0 or more"):
    checks.validate(config.TrainConfig(cold_start_steps=-1))
  with pytest.raises(config.ConfigError, match="sends none"):
    checks.validate(config.TrainConfig(cold_start_steps=3, optimizer="adamw"))


# --- the library hook that cold start needs (see docs/elastic.md) ---------------


def _cold_step(tx, mesh, contribute_W):
  """One update on each worker, worker w passing ``contribute=contribute_W[w]``."""
  from jax.sharding import PartitionSpec as P

  params = {"w": jnp.zeros((8, 8))}
  specs = dj.worker_state_specs(tx, params, mesh)
  state = dj.init_worker_state(tx, params, mesh)
  grads = place_grads({"w": np.random.default_rng(0).normal(size=(4, 8, 8))}, mesh)
  flags = jax.device_put(jnp.asarray(contribute_W), jax.NamedSharding(mesh, P("data")))

  def local(p, s, g, c):
    g = jax.tree.map(lambda x: x[0], g)
    return tx.update(g, s, p, contribute=c[0])

  step = jax.shard_map(
    local, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")), out_specs=(P(), specs)
  )
  return state, jax.jit(step)(params, state, grads, flags)


def test_a_cold_worker_is_left_out_and_keeps_its_whole_momentum():
  mesh = mesh_of(4)
  tx = dj.scale_by_demo(0.1, compression_decay=0.5, compression_topk=2, compression_chunk=8)
  _, (q, new) = _cold_step(tx, mesh, [True, True, True, False])
  assert int(new.contributors) == 3
  _, (q3, _) = _cold_step(tx, mesh, [True, True, True, True])
  momentum = np.asarray(new.momentum["w"]).reshape(4, -1)
  # No error feedback for what was not applied: the cold worker's momentum is all of lr * g.
  assert np.count_nonzero(momentum[3]) > np.count_nonzero(momentum[0])
  assert not np.array_equal(np.asarray(q["w"]), np.asarray(q3["w"]))


def test_contribute_reaches_the_exchange_through_dj_demo():
  mesh = mesh_of(4)
  tx = optax.chain(optax.clip_by_global_norm(1.0), dj.demo(0.1, compression_topk=2))
  _, (_, new) = _cold_step(tx, mesh, [True, False, True, False])
  assert int(new[1][0].contributors) == 2


# --- the driver ---------------------------------------------------------------


def _losses(out_dir):
  return {r.step: r.loss for r in records.read_metrics(out_dir)}


ADAMW = {"optimizer": "adamw", "steps": 6, "batch_size": 24, "checkpoint_every": 3}
# The tests that read adamw_cut share a worker and its runs.
ADAMW_CUT = pytest.mark.xdist_group("elastic_adamw_cut")


@pytest.fixture(scope="module")
def adamw_cut(tmp_path_factory):
  """AdamW's 6 steps on 8 workers never stopped, and cut at 3 then resumed on 4: their dirs."""
  whole, cut = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("cut")
  tiny_runs.run_tiny(whole, workers=8, **ADAMW)
  tiny_runs.run_tiny(cut, workers=8, stop_at_step=3, **ADAMW)
  tiny_runs.run_tiny(cut, workers=4, resume=True, **ADAMW)
  return whole, cut


@pytest.mark.slow
@ADAMW_CUT
def test_adamw_resumed_on_fewer_workers_continues_the_same_data(adamw_cut):
  """AdamW's math does not depend on the worker count, so its losses must match a run that
  never stopped: any repeated or skipped batch after the resume would show."""
  whole, cut = (_losses(d) for d in adamw_cut)
  assert sorted(cut) == list(range(1, 7))
  np.testing.assert_allclose([cut[s] for s in range(1, 7)], [whole[s] for s in range(1, 7)],
                             rtol=2e-4)  # fmt: skip
  (event,) = records.read_events(adamw_cut[1])
  assert (event.step, event.workers_before, event.workers_after) == (3, 8, 4)


@pytest.mark.slow
def test_demo_6_to_8_workers_stays_finite_and_identical(tmp_path):
  # Workers joining DeMo's per-worker state; workers leaving it is the lost
  # peer's resume across gloo processes (tests/test_interrupted_runs.py).
  common = {"steps": 6, "batch_size": 24, "checkpoint_every": 3, "check_replicas": True,
            "log_every": 1}  # fmt: skip
  out = tmp_path / "run"
  tiny_runs.run_tiny(out, workers=6, stop_at_step=3, **common)
  summary = tiny_runs.run_tiny(out, workers=8, resume=True, **common)
  steps = records.read_metrics(out)
  assert [r.step for r in steps] == list(range(1, 7))
  assert all(np.isfinite(r.loss) for r in steps)
  (event,) = records.read_events(out)
  assert (event.step, event.workers_before, event.workers_after) == (3, 6, 8)
  assert event.left == [] and event.joined == [6, 7]
  assert summary.steps == 6 and summary.workers == 8


def _cli(args, timeout=300):
  return subprocess.run(
    [sys.executable, "-m", "experiments.train", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )


def _digest(directory):
  h = hashlib.sha256()
  for root, dirs, files in sorted(os.walk(directory)):
    dirs.sort()
    for name in sorted(files):
      path = os.path.join(root, name)
      h.update(path.encode())
      with open(path, "rb") as f:
        h.update(f.read())
  return h.hexdigest()


@pytest.mark.slow
@ADAMW_CUT
def test_resume_on_a_count_that_does_not_divide_the_batch_is_one_line(adamw_cut):
  cut = adamw_cut[1]
  run = [
    "--optimizer=adamw", "--preset=tiny", "--batch_size=24", "--seq_len=32", "--steps=6",
    "--eval_batches=1", "--noprogress", f"--out_dir={cut}",
  ]  # fmt: skip
  before = _digest(cut / "checkpoints")
  out = _cli([*run, "--workers=5", "--resume"])
  assert out.returncode == 2 and "Traceback" not in out.stderr
  errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "--batch_size=24" in errors[0] and "5" in errors[0], out.stderr
  assert _digest(cut / "checkpoints") == before
