"""Checkpoints that guard themselves: a digest of every file, checked before a restore.

After a checkpoint is complete on disk, :func:`write_digest` records the
size and SHA-256 of every file under its step directory in
``STEP/digest.json``. :func:`verify` reads them all back before a restore:
a truncated, flipped or missing file is named. A damaged checkpoint is never
deleted: :func:`set_aside` renames it into ``OUT_DIR/damaged_checkpoints/``,
out of the way of the run that resumes and later saves the same step again.
"""

from __future__ import annotations

import hashlib
import json
import os

__all__ = ["DIGEST_NAME", "SET_ASIDE_DIR", "has_digest", "set_aside", "verify", "write_digest"]

DIGEST_NAME = "digest.json"
SET_ASIDE_DIR = "damaged_checkpoints"


def _files(step_dir: str) -> list[str]:
  out = []
  for root, _, names in os.walk(step_dir):
    for name in names:
      rel = os.path.relpath(os.path.join(root, name), step_dir)
      if rel != DIGEST_NAME:
        out.append(rel)
  return sorted(out)


def _sha256(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def write_digest(step_dir: str) -> None:
  """Records every file's size and SHA-256 in ``step_dir/digest.json``, atomically.

  Raises:
    OSError: the digest could not be written (e.g. the disk is full).
  """
  files = {
    rel: [os.path.getsize(p), _sha256(p)]
    for rel in _files(step_dir)
    for p in [os.path.join(step_dir, rel)]
  }
  tmp = os.path.join(step_dir, DIGEST_NAME + ".tmp")
  with open(tmp, "w") as f:
    json.dump({"algorithm": "sha256", "files": files}, f, indent=0, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.path.join(step_dir, DIGEST_NAME))


def has_digest(step_dir: str) -> bool:
  """Whether ``step_dir`` records a digest (checkpoints of older versions do not)."""
  return os.path.exists(os.path.join(step_dir, DIGEST_NAME))


def verify(step_dir: str) -> str | None:
  """What is wrong with ``step_dir`` against its digest, or ``None`` if it is intact.

  A checkpoint without a digest cannot be verified; :func:`has_digest` tells
  the caller so. The files are compared by size first, so a truncated file is
  found without reading it.
  """
  try:
    with open(os.path.join(step_dir, DIGEST_NAME)) as f:
      files = json.load(f)["files"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    return f"its digest is unreadable ({type(e).__name__})"
  for rel, (size, digest) in sorted(files.items()):
    path = os.path.join(step_dir, rel)
    if not os.path.isfile(path):
      return f"{rel} is missing"
    if os.path.getsize(path) != size:
      return f"{rel} has {os.path.getsize(path)} bytes, not {size}"
    if _sha256(path) != digest:
      return f"{rel} does not match its SHA-256"
  return None


def set_aside(step_dir: str, out_dir: str) -> str:
  """Renames ``step_dir`` into ``OUT_DIR/damaged_checkpoints/`` and returns where it went.

  Nothing is deleted; a name already taken gets a numbered suffix.
  """
  into = os.path.join(out_dir, SET_ASIDE_DIR)
  os.makedirs(into, exist_ok=True)
  base = os.path.join(into, f"step_{os.path.basename(step_dir.rstrip(os.sep))}")
  target, n = base, 1
  while os.path.exists(target):
    n += 1
    target = f"{base}.{n}"
  os.rename(step_dir, target)
  return target
