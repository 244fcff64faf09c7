"""One run per output directory, and the filesystem's failures as one line each.

:func:`claim` takes ``OUT_DIR/run.lock`` with ``flock`` for as long as a run
lasts. A second run on the same directory meets the lock at once and stops
with an error that names the run holding it. The kernel drops an ``flock``
when its process dies, however it dies (SIGKILL included), so a lock left by
a killed run is free: the next run takes it over and says so, with nothing to
guess from process ids or ages. The file itself stays (removing it would let
a third run lock a fresh file beside the second's); it holds the holder's
process id, host and start time, and is emptied when the run ends.

In a multi-process run only process 0 holds the lock; the others learn from
it whether the directory could be claimed, so a refused run stops on every
process at once instead of waiting on a peer that left.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator

__all__ = ["LOCK_NAME", "OutDirError", "agree", "claim", "filesystem_error"]

LOCK_NAME = "run.lock"
# Failures of the disk, not of the program: reported in one line with the fix.
_DISK_ERRNOS = {
  errno.ENOSPC: "no space left on device",
  errno.EDQUOT: "disk quota exceeded",
  errno.EROFS: "read-only file system",
  errno.EACCES: "permission denied",
  errno.EPERM: "operation not permitted",
}


class OutDirError(RuntimeError):
  """``--out_dir`` cannot be used, or the disk under it failed; the message has the fix."""


def filesystem_error(e: BaseException, what: str) -> OutDirError | None:
  """A disk failure (full, read-only, denied) as one line, or None if ``e`` is none.

  Args:
    e: the exception raised while writing.
    what: what was being written, e.g. ``"checkpoint 6 to runs/x/checkpoints"``.

  Returns:
    An :class:`OutDirError` to raise instead, or ``None`` for any other error.
  """
  code = getattr(e, "errno", None)
  text = str(e)
  if code not in _DISK_ERRNOS:
    # tensorstore (orbax) reports the OS error inside a ValueError's text.
    code = next((c for c in _DISK_ERRNOS if f"os_error_code='{c}'" in text), None)
    if code is None and "No space left on device" in text:
      code = errno.ENOSPC
  if code is None:
    return None
  fix = {
    errno.ENOSPC: "free space (or choose another --out_dir)",
    errno.EDQUOT: "free space within your quota (or choose another --out_dir)",
  }.get(code, "choose a writable --out_dir")
  return OutDirError(f"{_DISK_ERRNOS[code]} while writing {what}; {fix}.")


def _prepare(out_dir: str) -> None:
  """Creates ``out_dir``, or says in one line why it cannot be used."""
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise OutDirError(f"--out_dir={out_dir} is a file, not a directory; choose another --out_dir.")
  try:
    os.makedirs(out_dir, exist_ok=True)
  except (FileExistsError, NotADirectoryError):
    raise OutDirError(
      f"--out_dir={out_dir} lies under a file, not a directory; choose another --out_dir."
    ) from None
  except OSError as e:
    raise OutDirError(
      f"--out_dir={out_dir} cannot be created ({e.strerror}); choose a writable --out_dir."
    ) from None


def _holder(text: str) -> str:
  try:
    info = json.loads(text)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"]))
    return f"pid {info['pid']} on {info['host']}, started {started}"
  except (ValueError, KeyError, TypeError):
    return "a run whose lock file is unreadable"


def _read(fd: int) -> str:
  os.lseek(fd, 0, os.SEEK_SET)
  return os.read(fd, 4096).decode(errors="replace").strip()


def _lock(out_dir: str) -> int:
  """The locked file descriptor of ``OUT_DIR/run.lock``; refuses a held lock at once."""
  _prepare(out_dir)
  path = os.path.join(out_dir, LOCK_NAME)
  try:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  except OSError as e:
    raise OutDirError(
      f"--out_dir={out_dir} is not writable ({e.strerror}); choose a writable --out_dir."
    ) from None
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    holder = _holder(_read(fd))
    os.close(fd)
    raise OutDirError(
      f"--out_dir={out_dir} is in use by another run ({holder}); wait for it to finish, "
      "or choose another --out_dir."
    ) from None
  if stale := _read(fd):
    print(
      f"notice: took over {path}, left by a run that ended without releasing it "
      f"({_holder(stale)}).",
      file=sys.stderr,
      flush=True,
    )
  me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
  try:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    os.fsync(fd)
  except OSError as e:
    os.close(fd)
    raise filesystem_error(e, path) or OutDirError(
      f"cannot write {path} ({e.strerror}); choose another --out_dir."
    ) from None
  return fd


def _release(fd: int) -> None:
  with contextlib.suppress(OSError):  # a full disk must not hide the run's own error
    os.ftruncate(fd, 0)
  os.close(fd)  # closing drops the flock


def agree(ok: bool) -> bool:
  """Process 0's verdict, on every process of a multi-process run (a collective: all call it)."""
  import numpy as np
  from jax.experimental import multihost_utils

  return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


@contextlib.contextmanager
def claim(out_dir: str, *, main: bool = True, multiprocess: bool = False) -> Iterator[None]:
  """Holds ``OUT_DIR/run.lock`` while the ``with`` body runs.

  Args:
    out_dir: the run's output directory; created if missing.
    main: whether this process takes the lock (process 0 of a run).
    multiprocess: whether the other processes wait for process 0's verdict.

  Raises:
    OutDirError: the directory is a file, cannot be created or written, or
      another run holds it.
  """
  fd, error = None, None
  if main:
    try:
      fd = _lock(out_dir)
    except OutDirError as e:
      error = e
  if multiprocess and not agree(error is None):
    error = error or OutDirError(
      f"process 0 could not claim --out_dir={out_dir} (its error says why); fix that and rerun."
    )
  if error is not None:
    raise error
  try:
    yield
  finally:
    if fd is not None:
      _release(fd)
