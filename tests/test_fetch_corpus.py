"""The fetched corpus: pinned archives checked, downloads resumed, a split by document.

Archives of a few KB are built here, served by a local HTTP server that
answers ``Range`` requests (and, when told, drops a connection half-way or
ignores ranges), so nothing leaves the machine.
"""

import hashlib
import http.server
import io
import json
import os
import subprocess
import sys
import threading
import zipfile

import pytest

from experiments.corpus import build, corpus_dir, download, fetch, nltk_sources
from experiments.corpus.corpus_dir import CorpusError
from experiments.corpus.nltk_sources import Source


def _zip(files):
  buf = io.BytesIO()
  with zipfile.ZipFile(buf, "w") as z:
    for name, text in files.items():
      z.writestr(name, text)
  return buf.getvalue()


def _lines(tag, n):
  return "\n".join(
    f"{tag} line {i}: the quick brown fox jumps over the lazy dog." for i in range(n)
  )


# Three small sources: tagged Brown-like files, one file per document, and a
# big file cut into runs of lines.
ARCHIVES = {
  "tagged": _zip(
    {
      "tagged/README": "not text",
      **{
        f"tagged/ca0{i}": f"\n\n\tThe/at jury/nn said/vbd ``/`` no/at {i}/cd ''/'' ./.\n"
        for i in range(6)
      },
    }
  ),
  "reviews": _zip(
    {f"reviews/pos/cv{i:03d}.txt": f"review {i}: " + "good film. " * (20 + i) for i in range(12)}
  ),
  "big": _zip({"big/news.txt": _lines("news", 900), "big/README": "x"}),
}
SHA = {name: hashlib.sha256(data).hexdigest() for name, data in ARCHIVES.items()}
SOURCES = (
  Source("tagged", SHA["tagged"], r"tagged/ca\d\d", clean=nltk_sources._strip_tags),
  Source("reviews", SHA["reviews"], r"reviews/pos/[^/]+\.txt"),
  Source("big", SHA["big"], r"big/[^/]+\.txt", grouped=True),
)


class _Server:
  """Serves ``files`` over HTTP with Range; ``cut_after`` drops the first response of a file."""

  def __init__(self):
    self.files = {f"/{n}.zip": d for n, d in ARCHIVES.items()}
    self.ranges = []  # (path, Range header or None) per request
    self.cut_after = {}  # path -> bytes to send before dropping the connection, once
    self.serve_ranges = True
    server = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def log_message(self, *args):
        pass

      def do_GET(self):
        data = server.files.get(self.path)
        header = self.headers.get("Range")
        server.ranges.append((self.path, header))
        if data is None:
          self.send_error(404)
          return
        start = 0
        if header and server.serve_ranges:
          start = int(header.removeprefix("bytes=").rstrip("-"))
          if start >= len(data):
            self.send_error(416)
            return
          self.send_response(206)
          self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
          self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        cut = server.cut_after.pop(self.path, None)
        self.wfile.write(body if cut is None else body[:cut])
        if cut is not None:
          self.close_connection = True

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
    self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.01,), daemon=True)

  def __enter__(self):
    self.thread.start()
    return self

  def __exit__(self, *exc):
    self.httpd.shutdown()
    self.httpd.server_close()


@pytest.fixture
def server():
  with _Server() as s:
    yield s


@pytest.fixture
def from_dir(tmp_path):
  d = tmp_path / "corpora"
  d.mkdir()
  for name, data in ARCHIVES.items():
    (d / f"{name}.zip").write_bytes(data)
  return str(d)


def _build(out, **kw):
  return fetch.fetch_corpus(str(out), sources=SOURCES, val_fraction=0.2, **kw)


def test_a_clean_build_splits_every_source_by_document(server, tmp_path):
  out = tmp_path / "corpus"
  manifest = _build(out, base_url=server.url, cache_dir=str(tmp_path / "cache"))
  assert corpus_dir.read_manifest(out) == manifest
  train, val = (out / "train.txt").read_bytes(), (out / "val.txt").read_bytes()
  assert manifest["digest"] == corpus_dir.corpus_digest(
    hashlib.sha256(train).hexdigest(), hashlib.sha256(val).hexdigest()
  )
  # Tags stripped, quotes made plain, the README left out.
  assert b'The jury said " no 0 " .' in train + val
  assert b"/nn" not in train + val and b"not text" not in train + val
  by_name = {s["name"]: s for s in manifest["sources"]}
  assert [s["name"] for s in manifest["sources"]] == ["tagged", "reviews", "big"]
  for s in by_name.values():
    # Every source on both sides, and at least the fraction of its bytes held out.
    assert 1 <= s["val_documents"] < s["documents"]
    assert s["val_bytes"] >= 0.2 * s["bytes"]
  # 900 lines of about 62 bytes, in runs of at least 16 KiB: three, and the rest.
  assert by_name["big"]["documents"] == 4
  assert {doc_id.split("/")[0] for doc_id in manifest["val_documents"]} == set(by_name)
  assert manifest["val"]["documents"] == len(manifest["val_documents"])
  assert manifest["train"]["documents"] + manifest["val"]["documents"] == sum(
    s["documents"] for s in by_name.values()
  )


def test_val_documents_are_whole_and_unseen_in_training(from_dir, tmp_path):
  manifest = _build(tmp_path / "c", from_dir=from_dir)
  train = (tmp_path / "c" / "train.txt").read_bytes()
  val = (tmp_path / "c" / "val.txt").read_bytes()
  held = set(manifest["val_documents"])
  for source in SOURCES:
    for doc in nltk_sources.documents(source, os.path.join(from_dir, source.archive)):
      side, other = (val, train) if doc.id in held else (train, val)
      assert doc.text in side and doc.text not in other, doc.id


def test_the_split_and_digest_are_deterministic_whatever_the_route(server, from_dir, tmp_path):
  a = _build(tmp_path / "a", from_dir=from_dir)
  b = _build(tmp_path / "b", base_url=server.url, cache_dir=str(tmp_path / "cache"))
  assert a == b
  assert (tmp_path / "a" / "train.txt").read_bytes() == (tmp_path / "b" / "train.txt").read_bytes()
  # The order of a source's documents as given does not move the split.
  docs = nltk_sources.documents(SOURCES[1], os.path.join(from_dir, "reviews.zip"))
  assert build.split_documents(docs, 0.2) == build.split_documents(docs[::-1], 0.2)
  # A rebuild over an intact corpus leaves it be; over a damaged one, replaces it.
  mtime = os.stat(tmp_path / "a" / "train.txt").st_mtime_ns
  assert _build(tmp_path / "a", from_dir=from_dir) == a
  assert os.stat(tmp_path / "a" / "train.txt").st_mtime_ns == mtime
  (tmp_path / "a" / "val.txt").write_bytes(b"edited")
  assert _build(tmp_path / "a", from_dir=from_dir) == a
  corpus_dir.read_manifest(tmp_path / "a")


def test_a_corrupted_download_is_refused_naming_both_digests(server, tmp_path):
  server.files["/reviews.zip"] = ARCHIVES["reviews"][:-1] + b"!"
  actual = hashlib.sha256(server.files["/reviews.zip"]).hexdigest()
  with pytest.raises(download.ChecksumError) as e:
    _build(tmp_path / "c", base_url=server.url, cache_dir=str(tmp_path / "cache"))
  message = str(e.value)
  assert "reviews.zip" in message and SHA["reviews"] in message and actual in message
  assert "--base_url" in message and "\n" not in message
  assert not (tmp_path / "c").exists()
  # Neither the bad download nor a .part of it is kept: a rerun fetches it anew.
  assert not [n for n in os.listdir(tmp_path / "cache") if n.startswith("reviews")]


def test_a_corrupted_local_archive_is_refused(from_dir, tmp_path):
  with open(os.path.join(from_dir, "big.zip"), "ab") as f:
    f.write(b"tail")
  with pytest.raises(download.ChecksumError, match=r"big\.zip has SHA-256 [0-9a-f]{64}, expected"):
    _build(tmp_path / "c", from_dir=from_dir)
  os.remove(os.path.join(from_dir, "big.zip"))
  with pytest.raises(CorpusError, match=r"big\.zip does not exist; --from_dir needs"):
    _build(tmp_path / "c", from_dir=from_dir)
  assert not (tmp_path / "c").exists()


def test_the_command_refuses_a_bad_archive_with_one_line(tmp_path):
  (tmp_path / "brown.zip").write_bytes(b"not the archive")
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.fetch_corpus",
      f"--out={tmp_path / 'c'}",
      f"--from_dir={tmp_path}",
    ],
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert proc.returncode != 0
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr
  brown = next(s for s in nltk_sources.SOURCES if s.name == "brown")
  assert lines[0].startswith("error: archive") and brown.sha256 in lines[0]
  assert hashlib.sha256(b"not the archive").hexdigest() in lines[0]
  assert not (tmp_path / "c").exists()


def test_an_interrupted_download_resumes_with_a_range_request(server, tmp_path):
  cache = tmp_path / "cache"
  server.cut_after["/big.zip"] = 1000
  _build(tmp_path / "c", base_url=server.url, cache_dir=str(cache))
  assert [h for p, h in server.ranges if p == "/big.zip"] == [None, "bytes=1000-"]
  corpus_dir.read_manifest(tmp_path / "c")


def test_a_part_left_by_a_killed_process_is_resumed(server, tmp_path):
  cache = tmp_path / "cache"
  cache.mkdir()
  dest = cache / f"big-{SHA['big'][:12]}.zip"
  (cache / (dest.name + ".part")).write_bytes(ARCHIVES["big"][:700])
  _build(tmp_path / "c", base_url=server.url, cache_dir=str(cache))
  assert ("/big.zip", "bytes=700-") in server.ranges
  assert dest.read_bytes() == ARCHIVES["big"]
  # The cached archives are read back, not downloaded again.
  server.ranges.clear()
  _build(tmp_path / "d", base_url=server.url, cache_dir=str(cache))
  assert server.ranges == []


def test_a_server_without_ranges_gets_the_whole_file_again(server, tmp_path):
  cache = tmp_path / "cache"
  cache.mkdir()
  (cache / f"big-{SHA['big'][:12]}.zip.part").write_bytes(b"junk" * 50)
  server.serve_ranges = False
  _build(tmp_path / "c", base_url=server.url, cache_dir=str(cache))
  corpus_dir.read_manifest(tmp_path / "c")


def test_a_download_that_keeps_failing_keeps_its_part_for_a_rerun(server, tmp_path, monkeypatch):
  monkeypatch.setattr(download, "ATTEMPTS", 1)
  server.cut_after["/tagged.zip"] = 300
  with pytest.raises(
    CorpusError, match=r"failed 1 times .* 300 bytes are kept in .* a rerun resumes"
  ):
    _build(tmp_path / "c", base_url=server.url, cache_dir=str(tmp_path / "cache"))
  _build(tmp_path / "c", base_url=server.url, cache_dir=str(tmp_path / "cache"))
  assert ("/tagged.zip", "bytes=300-") in server.ranges


def test_nothing_half_written_is_read_as_a_corpus(from_dir, tmp_path, monkeypatch):
  written = build._write_split

  def die_on_val(path, docs):
    if path.endswith("val.txt"):
      raise KeyboardInterrupt
    return written(path, docs)

  monkeypatch.setattr(build, "_write_split", die_on_val)
  with pytest.raises(KeyboardInterrupt):
    _build(tmp_path / "c", from_dir=from_dir)
  assert os.listdir(tmp_path) == ["corpora"]  # no corpus, no temporary directory left
  monkeypatch.undo()
  # A directory without its manifest is no corpus, whatever else it holds.
  half = tmp_path / "half"
  half.mkdir()
  (half / "train.txt").write_bytes(b"some text")
  with pytest.raises(CorpusError, match="no corpus.json, so it is unfinished"):
    corpus_dir.read_manifest(half)
  # ... and an --out that is something else is not overwritten.
  with pytest.raises(CorpusError, match="exists and is not a corpus directory"):
    _build(half, from_dir=from_dir)
  _build(tmp_path / "c", from_dir=from_dir)
  (tmp_path / "c" / "train.txt").write_bytes(b"truncated")
  with pytest.raises(CorpusError, match="train.txt holds 9 bytes, not the"):
    corpus_dir.read_manifest(tmp_path / "c")


def test_the_pinned_sources_are_the_briefed_archives():
  names = [s.name for s in nltk_sources.SOURCES]
  assert names == ["brown", "movie_reviews", "abc", "state_union", "webtext", "inaugural"]
  assert all(len(s.sha256) == 64 for s in nltk_sources.SOURCES)
  assert nltk_sources.COMMIT in nltk_sources.DEFAULT_BASE_URL


def test_the_manifest_is_json_with_the_rule(from_dir, tmp_path):
  _build(tmp_path / "c", from_dir=from_dir)
  manifest = json.loads((tmp_path / "c" / "corpus.json").read_text())
  assert manifest["rule"] == build.RULE and manifest["val_fraction"] == 0.2
  assert {s["sha256"] for s in manifest["sources"]} == set(SHA.values())
