"""Whole runs that the guards must carry through: damaged checkpoints, resumes, a full disk.

Each is a few tiny-preset runs, so the file is marked slow.
"""

import glob
import os
import pathlib
import subprocess

import pytest
from tiny_runs import read_metrics, run_tiny

from experiments.run import integrity, trainer
from experiments.run.rundir import OutDirError

pytestmark = pytest.mark.slow


def _losses(out_dir):
  return [(r.step, r.loss, r.val_loss) for r in read_metrics(out_dir)]


def _damage(step_dir, how):
  files = glob.glob(os.path.join(step_dir, "state", "**", "*"), recursive=True)
  path = pathlib.Path(max((f for f in files if os.path.isfile(f)), key=os.path.getsize))
  raw = bytearray(path.read_bytes())
  if how == "flipped":
    raw[len(raw) // 3] ^= 0x10
  else:
    raw = raw[: len(raw) // 2]
  path.write_bytes(bytes(raw))


COMMON = {"steps": 8, "eval_every": 4}

# The tests that read the straight run share a worker and the run.
STRAIGHT = pytest.mark.xdist_group("guarded_straight")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """8 steps never stopped, checkpointed every 2: ``(out_dir, summary)``."""
  out_dir = tmp_path_factory.mktemp("straight")
  return out_dir, run_tiny(out_dir, checkpoint_every=2, **COMMON)


@STRAIGHT
def test_damaged_newest_checkpoints_are_set_aside_and_the_run_finishes_exactly(
  tmp_path, capsys, straight
):
  straight_dir, straight = straight
  run = tmp_path / "run"
  run_tiny(run, checkpoint_every=2, stop_at_step=4, **COMMON)
  _damage(str(run / "checkpoints" / "4"), "flipped")
  # Resumed without --checkpoint_every: the run keeps its interval of 2 ...
  run_tiny(run, resume=True, stop_at_step=7, **COMMON)
  assert "checkpoint of step 4 is damaged" in capsys.readouterr().err
  assert sorted(os.listdir(run / "checkpoints")) == ["2", "4", "6", "7"]
  assert (run / integrity.SET_ASIDE_DIR / "step_4").is_dir()  # kept, not deleted
  # ... so a second crash, which cuts the newest checkpoint short, loses
  # nothing, and the run ends as if never interrupted.
  _damage(str(run / "checkpoints" / "7"), "truncated")
  resumed = run_tiny(run, resume=True, **COMMON)
  assert "checkpoint of step 7 is damaged" in capsys.readouterr().err
  assert (run / integrity.SET_ASIDE_DIR / "step_7").is_dir()
  assert _losses(run) == _losses(straight_dir)
  assert resumed.params_digest == straight.params_digest
  assert sorted(os.listdir(run / "checkpoints")) == ["2", "4", "6", "8"]


@STRAIGHT
def test_a_resume_that_would_train_nothing_is_refused(straight):
  straight_dir, _ = straight
  before = _losses(straight_dir)
  with pytest.raises(trainer.CheckpointError, match="already finished .*step 8 of --steps=8"):
    run_tiny(straight_dir, resume=True, **COMMON)
  assert _losses(straight_dir) == before


def test_a_short_diloco_run_returns_trained_params_and_eval_every_zero_validates_at_the_end(
  tmp_path,
):
  # 6 steps at H=4: the outer step at 4, and a final one for steps 5 and 6.
  full = run_tiny(tmp_path / "full", optimizer="diloco", steps=6, diloco_sync_every=4, eval_every=0)
  # --eval_every=0: only after the last step.
  assert [r.step for r in read_metrics(tmp_path / "full") if r.val_loss is not None] == [6]
  assert full.final_val_loss is not None
  at_four = run_tiny(
    tmp_path / "four", optimizer="diloco", steps=6, diloco_sync_every=4, stop_at_step=5
  )
  assert full.params_digest != at_four.params_digest
  assert full.total_bytes_sent_per_worker == 2 * full.bytes_sent_per_step * 4


def _mount_tmpfs(path, size):
  if os.geteuid() != 0:
    pytest.skip("mounting a filesystem needs root")
  path.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode:
    pytest.skip("this machine does not allow mounting a tmpfs")


def _fill(disk, leave):
  """Fills ``disk`` with a ballast file until ``leave`` bytes are free; returns the file."""
  ballast = disk / "ballast"
  stat = os.statvfs(disk)
  with open(ballast, "wb", buffering=0) as f:
    f.write(b"\0" * (stat.f_bavail * stat.f_frsize - leave))
  return ballast


def test_a_disk_too_full_for_a_checkpoint_is_refused_before_compiling(tmp_path, monkeypatch):
  disk = tmp_path / "disk"
  _mount_tmpfs(disk, "16m")  # a checkpoint of this run is about 2.4 MB
  try:
    _fill(disk, 1 << 20)
    monkeypatch.setattr(trainer.Program, "init_params", lambda self: pytest.fail("compiled"))
    with pytest.raises(OutDirError, match=r"has 1.0 MB free, less than one checkpoint of this"):
      run_tiny(disk / "run", steps=4, checkpoint_every=2)
  finally:
    subprocess.run(["umount", str(disk)], check=True)


def test_a_disk_that_fills_during_a_save_leaves_the_last_checkpoint_intact(
  tmp_path, caplog, monkeypatch
):
  disk = tmp_path / "disk"
  _mount_tmpfs(disk, "16m")
  try:
    run = disk / "run"
    # The straight run's settings, so that its compiled programs are reused.
    run_tiny(run, checkpoint_every=2, stop_at_step=2, **COMMON)
    # Another program fills the disk after the run's check: the save itself fails.
    monkeypatch.setattr(trainer, "_check_space", lambda out_dir, program: None)
    ballast = _fill(disk, 64 << 10)  # enough for the metrics, not for a checkpoint
    with pytest.raises(OutDirError) as e:
      run_tiny(run, resume=True, stop_at_step=4, **COMMON)
    assert str(e.value).startswith("no space left on device while writing checkpoint 4 to ")
    assert str(e.value).endswith("The checkpoint of step 2 is intact; --resume continues from it.")
    assert "\n" not in str(e.value)
    assert not [r for r in caplog.records if "orbax" in r.pathname and r.levelname == "ERROR"]
    assert integrity.verify(str(run / "checkpoints" / "2")) is None
    ballast.unlink()
    assert run_tiny(run, resume=True, stop_at_step=4, **COMMON).steps == 4
    assert [r.step for r in read_metrics(run)] == [1, 2, 3, 4]
  finally:
    subprocess.run(["umount", str(disk)], check=True)
