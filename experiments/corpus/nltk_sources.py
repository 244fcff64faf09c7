"""The pinned archives of the fetched corpus, and how each one is cut into documents.

Six corpora of the public ``nltk/nltk_data`` repository (``packages/corpora/``),
pinned at one commit and checked against their SHA-256: together about 22.6 MB
of English prose of six kinds (news, fiction and essays, film reviews,
speeches, web forums and scripts). A *document* is the unit the split into
training and validation text moves whole:

* ``brown``: one file of the Brown corpus (500 samples of about 2,000 words),
  its part-of-speech tags stripped (``word/tag`` becomes ``word``) and its
  ````` and ``''`` quotes written as ``"``, one sentence per line;
* ``movie_reviews``: one review (2,000 files);
* ``state_union`` and ``inaugural``: one address (one file);
* ``abc`` (two files of Australian news) and ``webtext`` (six files of forum
  posts, scripts, ads and wine notes) come as a few big files: each file is
  cut into runs of whole lines of at least :data:`GROUP_BYTES`, in order (the
  file's last run takes what is left), and each run is a document.

Every text is decoded as UTF-8, or as Windows-1252 where it is not valid
UTF-8 (a few files of ``abc``, ``inaugural``, ``state_union`` and
``webtext``), and written back as UTF-8 with ``\\n`` line ends, trailing
spaces stripped and no blank lines at either end.
"""

from __future__ import annotations

import dataclasses
import re
import zipfile
from collections.abc import Callable

__all__ = [
  "COMMIT",
  "DEFAULT_BASE_URL",
  "GROUP_BYTES",
  "SOURCES",
  "Document",
  "Source",
  "documents",
]

# nltk/nltk_data, branch gh-pages.
COMMIT = "5db857e6f7df11eabb5e5665836db9ec8df07e28"
DEFAULT_BASE_URL = f"https://raw.githubusercontent.com/nltk/nltk_data/{COMMIT}/packages/corpora"
# Runs of lines that make one document of a big file: big enough that an
# article cut at a run's end leaves most of its text on one side of the split.
GROUP_BYTES = 16 * 1024


@dataclasses.dataclass(frozen=True)
class Document:
  """One document: ``id`` is ``"<source>/<member>"``, with ``#<run>`` for a run of a big file."""

  id: str
  text: bytes


@dataclasses.dataclass(frozen=True)
class Source:
  """One pinned archive: its name (``<name>.zip``), SHA-256, and which members are documents.

  Attributes:
    name: the corpus name, e.g. ``"brown"``.
    sha256: the archive's SHA-256 at :data:`COMMIT`.
    member: a regular expression that a member's whole path matches when it
      holds text (READMEs and indexes do not).
    clean: turns a member's decoded text into its document's text.
    grouped: the member is cut into runs of lines (:data:`GROUP_BYTES`).
  """

  name: str
  sha256: str
  member: str
  clean: Callable[[str], str] = lambda text: text
  grouped: bool = False

  @property
  def archive(self) -> str:
    return f"{self.name}.zip"


def _strip_tags(text: str) -> str:
  """Brown's ``word/tag`` tokens as words, one sentence per line."""
  lines = []
  for line in text.splitlines():
    words = [token.rpartition("/")[0] or token for token in line.split()]
    if words:
      lines.append(" ".join('"' if w in ("``", "''") else w for w in words))
  return "\n".join(lines)


SOURCES: tuple[Source, ...] = (
  Source(
    "brown",
    "9b275f9b3b95d7bd66ccfb7cd259f445a13bbe5d1f4107aba09fd3e8364bafa6",
    r"brown/c[a-r]\d\d",
    clean=_strip_tags,
  ),
  Source(
    "movie_reviews",
    "a41211ae685019137410268134db6a1a14428c89b671eb83056151a878539008",
    r"movie_reviews/(neg|pos)/[^/]+\.txt",
  ),
  Source(
    "abc",
    "129bb6001beb828049a90a59b7dd3c2f0594a47012e48fc5177dfae38e658565",
    r"abc/[^/]+\.txt",
    grouped=True,
  ),
  Source(
    "state_union",
    "366c1dc82b2abf896f42b2ec50ba802a0141a29f75d29ca48a7a243ce5bfbe8d",
    r"state_union/[^/]+\.txt",
  ),
  Source(
    "webtext",
    "9e32dbae4879464b8f420a0dc721855bb26167b720d7695588d2ca2aeadf501a",
    r"webtext/[^/]+\.txt",
    grouped=True,
  ),
  Source(
    "inaugural",
    "7c5fb5793e31fbeae12bf1aa0ffda5336468f07cedb50654c6d31ca384e2046b",
    r"inaugural/[^/]+\.txt",
  ),
)


def _decode(raw: bytes) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError:
    return raw.decode("cp1252", errors="replace")


def _tidy(text: str) -> str:
  lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
  return "\n".join(lines).strip("\n")


def _runs(text: str) -> list[str]:
  """``text`` as runs of whole lines, each of at least :data:`GROUP_BYTES` but the last."""
  runs, current, size = [], [], 0
  for line in text.split("\n"):
    current.append(line)
    size += len(line.encode()) + 1
    if size >= GROUP_BYTES:
      runs.append("\n".join(current).strip("\n"))
      current, size = [], 0
  if current:
    runs.append("\n".join(current).strip("\n"))
  return [r for r in runs if r]


def documents(source: Source, archive_path: str) -> list[Document]:
  """The documents of one archive, in the order of its members' names.

  Args:
    source: the archive's entry in :data:`SOURCES`.
    archive_path: the ``.zip`` file, already checked against ``source.sha256``.

  Returns:
    Every non-empty document, with its id and its UTF-8 text.
  """
  pattern = re.compile(source.member)
  out = []
  with zipfile.ZipFile(archive_path) as z:
    members = sorted(n for n in z.namelist() if pattern.fullmatch(n))
    for member in members:
      text = _tidy(source.clean(_decode(z.read(member))))
      doc_id = f"{source.name}/{member.partition('/')[2]}"
      if source.grouped:
        out += [Document(f"{doc_id}#{i}", r.encode()) for i, r in enumerate(_runs(text))]
      elif text:
        out.append(Document(doc_id, text.encode()))
  return out
