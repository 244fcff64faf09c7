"""The train driver on the 2-D (replica, fsdp) mesh, and with delayed_apply."""

import numpy as np
import pytest
import tiny_runs

from experiments.run import trainer


@pytest.mark.slow
def test_two_sites_of_two_devices_train_as_two_workers(tmp_path):
  steps = 5
  plain = tiny_runs.run_tiny(tmp_path / "plain", workers=2, steps=steps)
  sharded = tiny_runs.run_tiny(
    tmp_path / "fsdp", replicas=2, fsdp=2, steps=steps, check_replicas=True, log_every=1
  )
  a = [r.loss for r in tiny_runs.read_metrics(tmp_path / "plain")]
  b = [r.loss for r in tiny_runs.read_metrics(tmp_path / "fsdp")]
  # Same rows per site as per worker; only the reduction order differs.
  np.testing.assert_allclose(b, a, rtol=1e-4)
  assert a[-1] < a[0]
  assert sharded.workers == 4
  # Between sites: each device's message, plus the 8-byte loss metric.
  assert sharded.measured_by_axes["replica"] == sharded.payload_bytes_per_step
  assert sharded.measured_crossing_replicas_per_step <= sharded.payload_bytes_per_step + 8
  assert sharded.measured_by_axes["fsdp"] > 0
  # The embedding (4 chunks of 64 rows) is sharded; d_model-wide tensors
  # (a single 64-wide chunk) are not, and the summary names them.
  kept = sharded.params_kept_whole
  assert not any("embed" in p for p in kept)
  assert any("final_norm" in p for p in kept)
  # One device per site is the same mesh: everything crosses only "replica".
  assert plain.measured_by_axes == {"replica": plain.measured_collective_bytes_per_step}


@pytest.mark.slow
def test_the_lookahead_trains_sites_of_two_devices_as_two_workers(tmp_path):
  # The lookahead reads the pending message, which under FSDP covers a site's
  # shards; the params a site keeps whole must still get a whole point. The
  # attention is exchanged in its own step, the rest overlapped: both kinds.
  steps, flags = 5, dict(delayed_apply=True, synchronous_params="'attn'")
  plain = tiny_runs.run_tiny(tmp_path / "plain", workers=2, steps=steps, **flags)
  tiny_runs.run_tiny(
    tmp_path / "fsdp", replicas=2, fsdp=2, steps=steps, check_replicas=True, log_every=1, **flags
  )
  a = [r.loss for r in tiny_runs.read_metrics(tmp_path / "plain")]
  b = [r.loss for r in tiny_runs.read_metrics(tmp_path / "fsdp")]
  # With one device per site: step 1 has no previous message to apply, so
  # both workers' count as left out, and the all-gathers carry the payload.
  records = tiny_runs.read_metrics(tmp_path / "plain")
  assert [r.excluded_contributions for r in records] == [2, 0, 0, 0, 0]
  assert plain.measured_by_kind["all-gather"] == plain.payload_bytes_per_step
  # Step 2 is the first taken at a lookahead. The guess is a sign, so the
  # rounding of the site's gradient sum flips it where the momentum's IDCT is
  # near zero, and a few entries 2 x lr apart make later losses differ more
  # than the plain exchange's do (3e-4 at step 5 with every param overlapped,
  # against 2e-7).
  np.testing.assert_allclose(b[:2], a[:2], rtol=1e-6)
  np.testing.assert_allclose(b, a, rtol=1e-3)
  assert a[-1] < a[0]


@pytest.mark.slow
def test_orthogonalized_steps_train_sites_as_workers(tmp_path):
  # An orthogonalized matrix needs the whole tensor: FSDP's devices gather
  # the aggregate (dj.Split) and each keeps its block. On tiny at fsdp 2 the
  # separate layers' matrices stay whole and the embedding is split, so both
  # kinds of param are exercised, in the update and in the lookahead's
  # guess. The stacked layers' runs (orth overlapped, rms) are in
  # tests/test_scan_layers_train.py.
  flags = dict(steps=5, log_every=1, normalize="orth", delayed_apply=True)
  tiny_runs.run_tiny(tmp_path / "plain", workers=2, **flags)
  split = tiny_runs.run_tiny(tmp_path / "fsdp", replicas=2, fsdp=2, check_replicas=True, **flags)
  a = [r.loss for r in tiny_runs.read_metrics(tmp_path / "plain")]
  b = [r.loss for r in tiny_runs.read_metrics(tmp_path / "fsdp")]
  np.testing.assert_allclose(b, a, rtol=1e-3)
  assert a[-1] < a[0]
  # The gathers of the aggregate stay within the site: across "replica"
  # goes the device's message alone.
  assert split.measured_by_axes["replica"] == split.payload_bytes_per_step


@pytest.mark.parametrize(
  ("overrides", "message"),
  [
    ({"workers": 8, "fsdp": 3}, "does not divide by --fsdp=3"),
    ({"replicas": 2, "fsdp": 2, "batch_size": 6}, "--replicas x --fsdp=4 devices"),
    ({"optimizer": "adamw", "delayed_apply": True}, "needs --optimizer=demo"),
    ({"fsdp": 0}, "--fsdp=0 must be 1 or more; use --fsdp=1"),
  ],
)
def test_bad_mesh_flags_name_the_fix(tmp_path, overrides, message):
  with pytest.raises(trainer.ConfigError, match=message):
    tiny_runs.run_tiny(tmp_path, **overrides)
