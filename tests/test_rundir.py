"""One run per output directory, and the filesystem's failures as one line each."""

import errno
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from experiments.run import rundir
from experiments.run.rundir import OutDirError

ROOT = pathlib.Path(__file__).parent.parent


def _refused(out_dir, match):
  """Asserts that claiming ``out_dir`` fails with an error matching ``match``."""
  with pytest.raises(OutDirError, match=match), rundir.claim(out_dir):
    pass


def test_a_second_claim_fails_at_once_naming_the_holder(tmp_path):
  with rundir.claim(str(tmp_path)):
    _refused(str(tmp_path), f"in use by another run \\(pid {os.getpid()} on ")
  # Released: the next run takes it without a word about a stale lock.
  with rundir.claim(str(tmp_path)):
    pass
  assert (tmp_path / rundir.LOCK_NAME).read_text() == ""  # emptied, not removed


def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path, capsys):
  holder = subprocess.Popen(
    [
      sys.executable,
      "-c",
      "import sys, time\nfrom experiments.run import rundir\n"
      "with rundir.claim(sys.argv[1]):\n  print('held', flush=True)\n  time.sleep(60)\n",
      str(tmp_path),
    ],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline().strip() == "held"
    _refused(str(tmp_path), f"pid {holder.pid}")
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
  finally:
    holder.kill()
    holder.stdout.close()
  assert str(holder.pid) in (tmp_path / rundir.LOCK_NAME).read_text()  # it never released
  with rundir.claim(str(tmp_path)):
    assert str(os.getpid()) in (tmp_path / rundir.LOCK_NAME).read_text()  # now ours
  notice = capsys.readouterr().err
  assert f"took over {tmp_path / rundir.LOCK_NAME}" in notice and f"pid {holder.pid}" in notice


def test_out_dir_that_is_a_file(tmp_path):
  (tmp_path / "f").write_text("x")
  _refused(str(tmp_path / "f"), "is a file, not a directory; choose another --out_dir")
  _refused(str(tmp_path / "f" / "run"), "lies under a file")


def test_out_dir_that_cannot_be_written(tmp_path, monkeypatch):
  # Root ignores permission bits, so the read-only filesystem is simulated here;
  # test_read_only_and_full_filesystems_for_real mounts one where it can.
  real_open = os.open

  def read_only(path, *args, **kwargs):
    if str(path).endswith(rundir.LOCK_NAME):
      raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
    return real_open(path, *args, **kwargs)

  monkeypatch.setattr(os, "open", read_only)
  _refused(str(tmp_path), "is not writable \\(Read-only file system\\)")


@pytest.mark.parametrize(
  ("error", "says"),
  [
    (OSError(errno.ENOSPC, "No space left on device"), "no space left on device while writing"),
    (OSError(errno.EROFS, "Read-only file system"), "read-only file system while writing"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "disk quota exceeded"),
    (
      ValueError("RESOURCE_EXHAUSTED: ... No space left on device [os_error_code='28']"),
      "no space left on device",
    ),
  ],
)
def test_disk_failures_become_one_line(error, says):
  err = rundir.filesystem_error(error, "checkpoint 4 to /runs/x")
  assert says in str(err) and "/runs/x" in str(err)


def test_other_errors_are_not_mistaken_for_the_disk():
  assert rundir.filesystem_error(ValueError("shape mismatch"), "x") is None
  assert rundir.filesystem_error(OSError(errno.EBADF, "bad fd"), "x") is None


def _mount_tmpfs(path, options):
  if os.geteuid() != 0:
    pytest.skip("mounting a filesystem needs root")
  path.mkdir(parents=True, exist_ok=True)
  out = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=False)
  if out.returncode:
    pytest.skip("this machine does not allow mounting a tmpfs")


def test_read_only_and_full_filesystems_for_real(tmp_path):
  ro, full = tmp_path / "ro", tmp_path / "full"
  _mount_tmpfs(ro, "ro,size=1m")
  try:
    _refused(str(ro / "run"), "Read-only file system")
  finally:
    subprocess.run(["umount", str(ro)], check=True)
  _mount_tmpfs(full, "size=64k")
  try:
    (full / "run").mkdir()
    with open(full / "ballast", "wb", buffering=0) as f:  # fill the disk to the last byte
      try:
        while True:
          f.write(b"\0" * 4096)
      except OSError:
        pass
    _refused(str(full / "run"), "no space left on device while writing .*run.lock")
  finally:
    subprocess.run(["umount", str(full)], check=True)
