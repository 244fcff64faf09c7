r"""Builds a 22 MB English corpus from pinned public archives, split by document.

The archives are six corpora of the public ``nltk/nltk_data`` repository
(``experiments.corpus.nltk_sources``: Brown with its tags stripped, film
reviews, Australian news, State of the Union and inaugural addresses, web
text), pinned at one commit, each checked against its SHA-256. They are
downloaded into a cache (resuming a download that stopped), or read from a
local copy of that repository's ``packages/corpora/`` with ``--from_dir``.
The corpus directory holds ``train.txt``, ``val.txt`` and ``corpus.json``
(the sources and their digests, the split's rule and its validation
documents, the files' sizes and SHA-256); it appears whole or not at all.

Usage::

  python -m experiments.fetch_corpus --out=nltk_corpus
  python -m experiments.fetch_corpus --out=nltk_corpus --from_dir=nltk_data/packages/corpora
  python -m experiments.train --preset=small --data_path=nltk_corpus

The same archives give the same corpus, to the byte, on every machine: the
digest printed at the end names it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from absl import app, flags

from experiments.corpus import build, download
from experiments.corpus.corpus_dir import CorpusError
from experiments.corpus.nltk_sources import COMMIT, DEFAULT_BASE_URL, SOURCES, Source, documents

__all__ = ["default_cache_dir", "fetch_corpus", "main"]


def default_cache_dir() -> str:
  """``$XDG_CACHE_HOME/distro_jax/corpora``, or ``~/.cache/distro_jax/corpora``."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "distro_jax", "corpora")


def _archive(source: Source, from_dir: str | None, base_url: str, cache_dir: str) -> str:
  """The path of ``source``'s archive, checked: in ``from_dir``, or fetched into the cache."""
  if from_dir is not None:
    return download.checked_local(
      os.path.join(from_dir, source.archive),
      source.sha256,
      fix=f"--from_dir needs nltk_data's packages/corpora/ at commit {COMMIT[:12]}; replace "
      f"it with {DEFAULT_BASE_URL}/{source.archive}",
    )
  # The digest in the name: an archive of another pin never passes for this one.
  dest = os.path.join(cache_dir, f"{source.name}-{source.sha256[:12]}.zip")
  return download.fetch(f"{base_url.rstrip('/')}/{source.archive}", dest, source.sha256)


def fetch_corpus(
  out: str,
  *,
  from_dir: str | None = None,
  base_url: str = DEFAULT_BASE_URL,
  cache_dir: str | None = None,
  val_fraction: float = 0.05,
  sources: Sequence[Source] = SOURCES,
) -> dict[str, Any]:
  """Fetches (or reads) every archive, checks it, and writes the corpus directory ``out``.

  Args:
    out: the corpus directory to write (replaced whole if it holds a corpus).
    from_dir: a directory holding ``<name>.zip`` for every source; then
      nothing is downloaded.
    base_url: where ``<name>.zip`` is served (a mirror of nltk_data's
      ``packages/corpora/``).
    cache_dir: where downloads go (default :func:`default_cache_dir`).
    val_fraction: the share of each source's bytes held out for validation.
    sources: the archives (default: the pinned six).

  Returns:
    The corpus manifest (``experiments.corpus.corpus_dir``).

  Raises:
    CorpusError: an archive missing, not downloadable, or not the pinned
      one; an ``out`` that is something else; a fraction out of range.

  Example::

    manifest = fetch_corpus("nltk_corpus", from_dir="nltk_data/packages/corpora")
    print(manifest["digest"], manifest["train"]["bytes"])
  """
  if not 0 < val_fraction < 1:
    raise CorpusError(f"--val_fraction={val_fraction} must be in (0, 1), e.g. 0.05")
  if from_dir is not None and not os.path.isdir(from_dir):
    raise CorpusError(
      f"--from_dir={from_dir} is not a directory; give a copy of nltk_data's packages/corpora/"
    )
  build.check_out_dir(out)  # before any download
  cache_dir = cache_dir or default_cache_dir()
  paths = {s.name: _archive(s, from_dir, base_url, cache_dir) for s in sources}
  docs = {s.name: documents(s, paths[s.name]) for s in sources}
  archives = {
    s.name: {
      "name": s.name,
      "archive": s.archive,
      "url": f"{DEFAULT_BASE_URL}/{s.archive}",
      "sha256": s.sha256,
    }
    for s in sources
  }
  return build.write_corpus(out, docs, archives, val_fraction)


def _report(out: str, manifest: dict[str, Any]) -> str:
  lines = [f"{'source':<14} {'documents':>9} {'bytes':>12} {'val docs':>8} {'val bytes':>10}"]
  for s in manifest["sources"]:
    lines.append(
      f"{s['name']:<14} {s['documents']:>9,} {s['bytes']:>12,} {s['val_documents']:>8,} "
      f"{s['val_bytes']:>10,}"
    )
    train, val = manifest["train"], manifest["val"]
  lines += [
    f"{out}: train.txt {train['bytes']:,} bytes ({train['documents']:,} documents), "
    f"val.txt {val['bytes']:,} bytes ({val['documents']:,} documents)",
    f"corpus digest {manifest['digest']}",
    f"train on it: python -m experiments.train --preset=small --data_path={out}",
  ]
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
  """The command; its flags are defined here, not at import."""
  out = flags.DEFINE_string("out", "nltk_corpus", "The corpus directory to write.")
  from_dir = flags.DEFINE_string(
    "from_dir",
    None,
    "Read the archives (<name>.zip) from this copy of nltk_data's packages/corpora/ "
    "instead of downloading them.",
  )
  base_url = flags.DEFINE_string(
    "base_url", DEFAULT_BASE_URL, "Where <name>.zip is served: nltk_data at the pinned commit."
  )
  cache_dir = flags.DEFINE_string(
    "cache_dir", None, "Where downloads go (default: ~/.cache/distro_jax/corpora)."
  )
  val_fraction = flags.DEFINE_float(
    "val_fraction", 0.05, "Share of each source's bytes held out for validation, whole documents."
  )

  def _main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
      manifest = fetch_corpus(
        out.value,
        from_dir=from_dir.value,
        base_url=base_url.value,
        cache_dir=cache_dir.value,
        val_fraction=val_fraction.value,
      )
    except CorpusError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    print(_report(out.value, manifest))

  app.run(_main, argv=argv)


if __name__ == "__main__":
  main()
