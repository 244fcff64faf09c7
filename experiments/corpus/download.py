"""Archives fetched over HTTP(S) into a cache, resumed where a download stopped, and checked.

A download goes to ``<cache>/<name>.part`` and becomes ``<cache>/<name>``
only once its SHA-256 is the pinned one, so the cache never holds an archive
that was not checked. A download that stops (a dropped connection, a killed
process) leaves its ``.part``; the next attempt asks the server for the rest
with an HTTP ``Range`` request, and starts over only where the server does
not serve ranges.
"""

from __future__ import annotations

import http.client
import os
import sys
import time
import urllib.error
import urllib.request
from typing import IO

from experiments.corpus.corpus_dir import CorpusError, file_sha256

__all__ = ["ATTEMPTS", "ChecksumError", "Progress", "checked_local", "fetch", "verify"]

# Tries per archive in one call, each resuming the last; a rerun resumes too.
ATTEMPTS = 3
_BLOCK = 1 << 16
_TIMEOUT_S = 60


class ChecksumError(CorpusError):
  """An archive whose SHA-256 is not the pinned one."""


def verify(path: str, expected: str, *, what: str, fix: str) -> None:
  """Raises :class:`ChecksumError` naming ``what``, both digests and ``fix`` on a mismatch."""
  actual = file_sha256(path)
  if actual != expected:
    raise ChecksumError(f"{what} has SHA-256 {actual}, expected {expected}; {fix}")


class Progress:
  """A one-line progress bar on a stream; off a terminal, one line when a file is done."""

  def __init__(self, label: str, total: int | None, stream: IO[str] | None = None):
    self.label, self.total, self.done = label, total, 0
    self.stream = stream or sys.stderr
    self.live = self.stream.isatty()
    self._shown = 0.0

  def advance(self, n: int) -> None:
    self.done += n
    now = time.monotonic()
    if self.live and now - self._shown > 0.1:
      self._shown = now
      self.stream.write("\r" + self._line())
      self.stream.flush()

  def _line(self) -> str:
    mb = self.done / 1e6
    if not self.total:
      return f"{self.label}: {mb:.1f} MB"
    share = self.done / self.total
    bar = "#" * int(30 * share)
    return f"{self.label}: [{bar:<30}] {100 * share:3.0f}% {mb:.1f}/{self.total / 1e6:.1f} MB"

  def close(self) -> None:
    self.stream.write(("\r" if self.live else "") + self._line() + "\n")
    self.stream.flush()


def _request(url: str, start: int) -> urllib.request.Request:
  headers = {"User-Agent": "distro_jax-fetch-corpus"}
  if start:
    headers["Range"] = f"bytes={start}-"
  return urllib.request.Request(url, headers=headers)


def _resumed_at(response, start: int) -> int:
  """Where the body of ``response`` starts: ``start`` if the server served the range, else 0."""
  if start and response.status == 206:
    content_range = response.headers.get("Content-Range", "")
    # "bytes START-END/TOTAL": a server that answers another range is not trusted.
    if content_range.startswith(f"bytes {start}-"):
      return start
  return 0


def _total(response, offset: int) -> int | None:
  length = response.headers.get("Content-Length")
  return offset + int(length) if length and length.isdigit() else None


def _attempt(url: str, part: str, label: str) -> None:
  """One request for the rest of ``part``; raises ``OSError`` where it stops short."""
  start = os.path.getsize(part) if os.path.exists(part) else 0
  with urllib.request.urlopen(_request(url, start), timeout=_TIMEOUT_S) as response:
    offset = _resumed_at(response, start)
    total = _total(response, offset)
    progress = Progress(label, total)
    progress.advance(offset)
    with open(part, "ab" if offset else "wb") as f:
      while block := response.read(_BLOCK):
        f.write(block)
        progress.advance(len(block))
    progress.close()
    if total is not None and os.path.getsize(part) < total:
      raise OSError(f"the connection closed at {os.path.getsize(part):,} of {total:,} bytes")


def fetch(url: str, dest: str, sha256: str, *, label: str | None = None) -> str:
  """``dest``, downloaded from ``url`` unless it is there already, checked against ``sha256``.

  Args:
    url: where the archive is served.
    dest: its path in the cache; the download goes to ``dest + ".part"``.
    sha256: the pinned digest.
    label: what the progress bar says (default: the file's name).

  Returns:
    ``dest``, whose SHA-256 is ``sha256``.

  Raises:
    ChecksumError: the downloaded archive is not the pinned one (the
      ``.part`` is deleted, so a rerun downloads it afresh).
    CorpusError: the download failed :data:`ATTEMPTS` times (the ``.part``
      is kept, so a rerun resumes it).
  """
  name = os.path.basename(dest)
  if os.path.exists(dest):
    verify(
      dest, sha256, what=f"cached archive {dest}", fix="delete it and run again to download it anew"
    )
    return dest
  os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
  part = dest + ".part"
  problem: Exception | None = None
  for _ in range(ATTEMPTS):
    try:
      _attempt(url, part, label or name)
      problem = None
      break
    except urllib.error.HTTPError as e:
      if e.code == 416:  # a .part that is already whole, or longer than the file
        problem = None
        break
      raise CorpusError(
        f"{url} answered HTTP {e.code} ({e.reason}); check --base_url, or fetch the archives "
        "yourself and pass --from_dir"
      ) from None
    except (OSError, http.client.HTTPException) as e:
      problem = e
  if problem is not None:
    have = os.path.getsize(part) if os.path.exists(part) else 0
    raise CorpusError(
      f"downloading {url} failed {ATTEMPTS} times ({problem}); {have:,} bytes are kept in "
      f"{part} and a rerun resumes from there; or pass --from_dir=DIR with the archives"
    )
  try:
    verify(
      part,
      sha256,
      what=f"archive {name} downloaded from {url}",
      fix="it was deleted; check --base_url (it must serve nltk_data's packages/corpora at "
      "the pinned commit) and run again",
    )
  except ChecksumError:
    os.remove(part)
    raise
  os.replace(part, dest)
  return dest


def checked_local(src: str, sha256: str, *, fix: str) -> str:
  """``src`` itself (a local archive of ``--from_dir``), once its SHA-256 is ``sha256``."""
  if not os.path.isfile(src):
    raise CorpusError(f"{src} does not exist; {fix}")
  verify(src, sha256, what=f"archive {src}", fix=fix)
  return src
