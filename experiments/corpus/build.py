"""The split of documents into training and validation text, and the corpus directory it makes.

The split is by document and per source, so validation text is unseen text of
every kind the model trains on: within each source, documents are ordered by
the SHA-256 of their id, and taken in that order into validation until they
hold at least ``val_fraction`` of the source's bytes (at least one document,
and never all). The order depends on the ids alone, so the split is the same
on every machine, and a document keeps its side when other sources are added.
Each split's documents are written in the sources' order, then their own,
separated by a blank line.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from experiments.corpus.corpus_dir import (
  FORMAT,
  MANIFEST,
  TRAIN,
  VAL,
  CorpusError,
  corpus_digest,
  is_corpus_dir,
  read_manifest,
)
from experiments.corpus.nltk_sources import Document

__all__ = ["RULE", "check_out_dir", "split_documents", "write_corpus"]

RULE = (
  "by document, per source: documents ordered by the SHA-256 of their id go to validation "
  "until they hold at least val_fraction of the source's bytes (at least one document, "
  "never all); the rest train"
)
_SEPARATOR = b"\n\n"


def _order(doc: Document) -> str:
  return hashlib.sha256(doc.id.encode()).hexdigest()


def split_documents(docs: Sequence[Document], val_fraction: float) -> tuple[set[str], set[str]]:
  """The ids of one source's validation and training documents.

  Args:
    docs: every document of one source.
    val_fraction: the share of the source's bytes to hold out, in ``(0, 1)``.

  Raises:
    CorpusError: the source has fewer than two documents, or a fraction out of range.
  """
  if not 0 < val_fraction < 1:
    raise CorpusError(f"--val_fraction={val_fraction} must be in (0, 1), e.g. 0.05")
  if len(docs) < 2:
    raise CorpusError(
      f"source {docs[0].id.partition('/')[0] if docs else '?'} has {len(docs)} document(s); "
      "a split by document needs at least two (is the archive the pinned one?)"
    )
  target = val_fraction * sum(len(d.text) for d in docs)
  val, held = set(), 0
  for doc in sorted(docs, key=_order)[:-1]:
    val.add(doc.id)
    held += len(doc.text)
    if held >= target:
      break
  return val, {d.id for d in docs} - val


def _holds_a_corpus(out: str) -> bool:
  """Whether ``out`` holds a manifest of this format (its files may since have been damaged)."""
  if not is_corpus_dir(out):
    return False
  try:
    with open(os.path.join(out, MANIFEST)) as f:
      return json.load(f).get("format") == FORMAT
  except (OSError, ValueError, AttributeError):
    return False


def check_out_dir(out: str) -> None:
  """Refuses an ``--out`` that exists as something other than a corpus or an empty directory."""
  if not os.path.exists(out) or _holds_a_corpus(out):
    return
  if not os.path.isdir(out) or os.listdir(out):
    raise CorpusError(
      f"--out={out} exists and is not a corpus directory (no {MANIFEST} of ours); choose "
      "another --out, or delete it first"
    )


def _write_split(path: str, docs: Sequence[Document]) -> dict[str, Any]:
  digest = hashlib.sha256()
  size = 0
  with open(path, "wb") as f:
    for i, doc in enumerate(docs):
      chunk = (_SEPARATOR if i else b"") + doc.text
      f.write(chunk)
      digest.update(chunk)
      size += len(chunk)
    f.write(b"\n")
    digest.update(b"\n")
    f.flush()
    os.fsync(f.fileno())
  return {"bytes": size + 1, "sha256": digest.hexdigest(), "documents": len(docs)}


def write_corpus(
  out: str,
  docs_by_source: Mapping[str, Sequence[Document]],
  archives: Mapping[str, Mapping[str, Any]],
  val_fraction: float,
) -> dict[str, Any]:
  """Splits the documents and writes the corpus directory ``out``, all or nothing.

  Everything is written into a temporary directory beside ``out``, the
  manifest last, and the directory is then renamed to ``out``; an ``out``
  that held an older corpus is replaced only then. A build killed half-way
  leaves a temporary directory without a manifest, which nothing reads.

  Args:
    out: the corpus directory to write.
    docs_by_source: each source's documents, in the sources' order.
    archives: each source's record for the manifest (archive, url, sha256).
    val_fraction: the share of each source's bytes held out for validation.

  Returns:
    The manifest (see ``experiments.corpus.corpus_dir``).
  """
  check_out_dir(out)
  train, val, sources, val_ids = [], [], [], []
  for name, docs in docs_by_source.items():
    held_out, _ = split_documents(docs, val_fraction)
    train += [d for d in docs if d.id not in held_out]
    val += [d for d in docs if d.id in held_out]
    val_ids += [d.id for d in docs if d.id in held_out]
    sources.append(
      {
        **archives[name],
        "documents": len(docs),
        "bytes": sum(len(d.text) for d in docs),
        "val_documents": len(held_out),
        "val_bytes": sum(len(d.text) for d in docs if d.id in held_out),
      }
    )
  parent = os.path.dirname(os.path.abspath(out))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.tmp-", dir=parent)
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would keep the corpus from other users
  try:
    train_rec = _write_split(os.path.join(tmp, TRAIN), train)
    val_rec = _write_split(os.path.join(tmp, VAL), val)
    manifest = {
      "format": FORMAT,
      "digest": corpus_digest(train_rec["sha256"], val_rec["sha256"]),
      "train": train_rec,
      "val": val_rec,
      "val_fraction": val_fraction,
      "rule": RULE,
      "sources": sources,
      "val_documents": val_ids,
    }
    with open(os.path.join(tmp, MANIFEST), "w") as f:
      json.dump(manifest, f, indent=1)
      f.write("\n")
      f.flush()
      os.fsync(f.fileno())
    if not _already(out, manifest):
      _install(tmp, out)
  finally:
    if os.path.isdir(tmp):
      shutil.rmtree(tmp)
  return manifest


def _already(out: str, manifest: dict[str, Any]) -> bool:
  """Whether ``out`` holds this very corpus, intact: then it is left as it is."""
  if not _holds_a_corpus(out):
    return False
  try:
    return read_manifest(out) == json.loads(json.dumps(manifest))
  except CorpusError:
    return False


def _install(tmp: str, out: str) -> None:
  """Renames ``tmp`` to ``out``; a corpus (or empty directory) already there is replaced."""
  if not os.path.exists(out):
    os.rename(tmp, out)
    return
  check_out_dir(out)
  parent, base = os.path.split(os.path.abspath(out))
  old = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
  os.rmdir(old)
  os.rename(out, old)
  os.rename(tmp, out)
  shutil.rmtree(old)
