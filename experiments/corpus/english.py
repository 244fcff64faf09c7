"""Writes the ~1 MB English text the measured results train on.

The embedded corpus (``experiments.corpus``) is generated and easy to learn;
the quality-per-byte results in ``docs/results.md`` need real prose. This
command gathers it from what a Python install already holds: the language
reference's topic texts (``pydoc_data.topics``), the license texts under
``/usr/share/common-licenses`` when the system has them (Debian and Ubuntu
do), and the longer docstrings of common standard-library modules. The
result is ASCII, cut to ``--size`` bytes, and its SHA-256 is printed, so a
run elsewhere can tell whether it trains on the same bytes (other Python
versions or systems give other text).

Usage::

  python -m experiments.english_corpus --out=english.txt
  python -m experiments.train --data_path=english.txt --preset=small --steps=300
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
from collections.abc import Sequence

from absl import app, flags

__all__ = ["english_text"]

_LICENSES = "/usr/share/common-licenses"
# fmt: off
_MODULES = (
  "os", "re", "json", "collections", "itertools", "functools", "argparse", "logging",
  "subprocess", "threading", "asyncio", "unittest", "email", "http.client", "urllib.request",
  "decimal", "fractions", "statistics", "random", "datetime", "calendar", "pathlib", "shutil",
  "tarfile", "zipfile", "csv", "sqlite3", "socket", "ssl", "typing", "dataclasses", "enum",
  "inspect", "pickle", "copy", "string", "textwrap", "difflib", "heapq", "bisect", "queue",
  "contextlib", "abc", "io", "codecs", "locale", "gettext", "doctest", "pdb", "trace",
  "tokenize", "ast", "dis", "ftplib", "smtplib", "imaplib", "xml.dom.minidom", "configparser",
  "optparse", "getopt", "tempfile", "glob", "fnmatch", "hashlib", "hmac", "secrets", "uuid",
  "zlib", "gzip", "bz2", "lzma", "mailbox", "mimetypes", "base64", "binascii", "struct",
)
# fmt: on
# Short docstrings are mostly signatures; the long ones are prose.
_MIN_DOCSTRING = 200


def _docstrings(module_name: str) -> list[str]:
  try:
    module = importlib.import_module(module_name)
  except ImportError:
    return []
  members = [
    v for _, v in inspect.getmembers(module) if inspect.isclass(v) or inspect.isfunction(v)
  ]
  found = (inspect.getdoc(obj) for obj in [module, *members])
  return [d for d in found if d and len(d) > _MIN_DOCSTRING]


def english_text(size: int = 1_050_000) -> bytes:
  """About ``size`` bytes of English prose from this Python install, as ASCII.

  Args:
    size: the length to cut the text to.

  Returns:
    The text; shorter than ``size`` only if the sources run out.
  """
  import pydoc_data.topics

  parts = [pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)]
  if os.path.isdir(_LICENSES):
    for name in sorted(os.listdir(_LICENSES)):
      path = os.path.join(_LICENSES, name)
      if os.path.isfile(path) and not os.path.islink(path):
        with open(path, errors="ignore") as f:
          parts.append(f.read())
  seen: set[str] = set()
  total = sum(map(len, parts))
  for module_name in _MODULES:
    if total > size * 1.05:  # ASCII filtering drops a little
      break
    for doc in _docstrings(module_name):
      if doc not in seen:
        seen.add(doc)
        parts.append(doc)
        total += len(doc)
  return "\n\n".join(parts).encode("ascii", "ignore")[:size]


def main(argv: Sequence[str] | None = None) -> None:
  """The command; its flags are defined here, not at import."""
  out = flags.DEFINE_string("out", "english.txt", "Where to write the text.")
  size = flags.DEFINE_integer("size", 1_050_000, "Bytes of text.")

  def _main(argv: Sequence[str]) -> None:
    del argv
    text = english_text(size.value)
    with open(out.value, "wb") as f:
      f.write(text)
    print(f"{out.value}: {len(text):,} bytes, sha256 {hashlib.sha256(text).hexdigest()}")

  app.run(_main, argv=argv)


if __name__ == "__main__":
  main()
