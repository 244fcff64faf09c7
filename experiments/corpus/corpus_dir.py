"""A corpus directory: ``train.txt``, ``val.txt`` and the manifest that vouches for them.

``python -m experiments.fetch_corpus`` writes one; ``--data_path=DIR`` trains
on it with its own split by document (``experiments.run.data``). The
manifest, ``corpus.json``, is written last and the directory renamed into
place whole, so a directory holding a manifest is complete; reading checks
the two files' sizes and SHA-256 against it, so an edited or truncated file
is refused, not trained on.

The manifest's keys: ``format`` (:data:`FORMAT`), ``digest`` (SHA-256 of the
two files' digests, ``"<train>\\n<val>\\n"``: the corpus in one string),
``train`` and ``val`` (each ``bytes``, ``sha256``, ``documents``),
``val_fraction``, ``rule`` (the split rule in words), ``sources`` (each
archive's name, URL, SHA-256, documents, bytes and validation documents)
and ``val_documents`` (every validation document's id; the others train).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

__all__ = [
  "FORMAT",
  "MANIFEST",
  "TRAIN",
  "VAL",
  "CorpusError",
  "corpus_digest",
  "file_sha256",
  "is_corpus_dir",
  "read_manifest",
]

MANIFEST = "corpus.json"
TRAIN = "train.txt"
VAL = "val.txt"
FORMAT = "distro_jax corpus 1"


class CorpusError(ValueError):
  """A corpus archive or directory that cannot be used, stated with its fix in one line."""


def file_sha256(path: str | os.PathLike[str]) -> str:
  """The SHA-256 of a file, read in blocks."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(1 << 20):
      digest.update(block)
  return digest.hexdigest()


def corpus_digest(train_sha256: str, val_sha256: str) -> str:
  """One digest for the corpus: SHA-256 of ``"<train>\\n<val>\\n"``, the files' digests."""
  return hashlib.sha256(f"{train_sha256}\n{val_sha256}\n".encode()).hexdigest()


def is_corpus_dir(path: str | os.PathLike[str]) -> bool:
  """Whether ``path`` is a directory that claims to be a corpus (holds a manifest)."""
  return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def read_manifest(path: str | os.PathLike[str], *, verify: bool = True) -> dict[str, Any]:
  """The manifest of the corpus directory ``path``, checked against its two files.

  Args:
    path: a directory that ``experiments.fetch_corpus`` wrote.
    verify: also check the files' SHA-256 (about 0.1 s for 22 MB), not
      only their sizes.

  Returns:
    The manifest, as the module docstring describes it.

  Raises:
    CorpusError: no manifest (an unfinished or foreign directory), a manifest
      of another format, or a file missing, of another size or digest.
  """
  path = os.fspath(path)
  fix = f"build it again with python -m experiments.fetch_corpus --out={path}"
  manifest_path = os.path.join(path, MANIFEST)
  if not os.path.isfile(manifest_path):
    raise CorpusError(
      f"{path} is not a corpus directory: it has no {MANIFEST}, so it is unfinished or "
      f"something else; {fix}, or pass --data_path=... to a text file"
    )
  try:
    with open(manifest_path) as f:
      manifest = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise CorpusError(f"{manifest_path} cannot be read ({e}); {fix}") from None
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
    raise CorpusError(f"{manifest_path} is not a manifest of format {FORMAT!r}; {fix}")
  for name, key in ((TRAIN, "train"), (VAL, "val")):
    file_path = os.path.join(path, name)
    want = manifest[key]
    if not os.path.isfile(file_path):
      raise CorpusError(f"{file_path} is missing from the corpus; {fix}")
    if (size := os.path.getsize(file_path)) != want["bytes"]:
      raise CorpusError(
        f"{file_path} holds {size:,} bytes, not the {want['bytes']:,} its manifest records: "
        f"it was changed after the build; {fix}"
      )
    if verify and (actual := file_sha256(file_path)) != want["sha256"]:
      raise CorpusError(
        f"{file_path} has SHA-256 {actual}, not the {want['sha256']} its manifest records: "
        f"it was changed after the build; {fix}"
      )
  return manifest
