"""The embedded corpus, token loading, the grain pipeline and its checkpointed state."""

import hashlib
import re
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments.corpus.generated import default_corpus
from experiments.run import data

# Pinned so that an edit to the grammar, or a platform difference, shows up here
# rather than as a silently different training run.
_CORPUS_SHA256 = "4fbfb22ee49454669381e49cb5634777dba793b976bcb17aea382fb0791748e3"


def _rows(batch):
  """Each row as its full window (inputs plus the last target), as hashable bytes."""
  full = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
  return [r.tobytes() for r in full]


def _same(a, b):
  return all(np.array_equal(a[k], b[k]) for k in ("inputs", "targets"))


# --- corpus -------------------------------------------------------------------


def test_corpus_size_ascii_and_pinned_bytes():
  text = default_corpus()
  assert len(text) == 1_200_000
  assert max(text) < 128
  assert hashlib.sha256(text).hexdigest() == _CORPUS_SHA256
  assert default_corpus(5000) == text[:5000]
  assert default_corpus() is text  # cached


def test_corpus_identical_in_a_fresh_process():
  code = "import hashlib; from experiments.corpus.generated import default_corpus as c; "
  code += "print(hashlib.sha256(c()).hexdigest())"
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
  )
  assert out.stdout.strip() == _CORPUS_SHA256


def test_corpus_has_structure():
  text = default_corpus().decode()
  words = set(re.findall(r"[A-Za-z]+", text))
  assert len(words) > 300
  # Every paragraph closes on the character and town it opened with.
  paragraphs = text.split("\n\n")[:-1]
  assert len(paragraphs) > 2000
  for para in paragraphs:
    opening = re.match(r"\d+\. In the \w+, (\w+) the \w+ of (.+?) set out", para)
    closing = re.search(r"At last (\w+) came home to (.+?) and put away the [\w ]+\.$", para)
    assert opening.groups() == closing.groups()


# --- loading ------------------------------------------------------------------


def test_load_embedded():
  tokens = data.load_tokens(None, 256)
  assert tokens.dtype == np.uint8 and tokens.shape == (1_200_000,)
  assert tokens.tobytes() == default_corpus()


def test_load_text_npy_bin(tmp_path):
  txt = tmp_path / "a.txt"
  txt.write_bytes(b"hello world")
  np.testing.assert_array_equal(
    data.load_tokens(str(txt), 256), np.frombuffer(b"hello world", np.uint8)
  )

  ids = np.arange(1000, dtype=np.int32) % 700
  npy = tmp_path / "a.npy"
  np.save(npy, ids.reshape(10, 100))  # 2-D dumps are flattened
  loaded = data.load_tokens(str(npy), 700)
  assert loaded.shape == (1000,)
  np.testing.assert_array_equal(loaded, ids)

  binf = tmp_path / "a.bin"
  ids.astype(np.uint16).tofile(binf)
  loaded = data.load_tokens(str(binf), 700)
  assert isinstance(loaded, np.memmap) and loaded.dtype == np.uint16
  np.testing.assert_array_equal(loaded, ids)


def test_chunked_id_scan_reports_first_bad_position(tmp_path, monkeypatch):
  monkeypatch.setattr(data, "_SCAN_CHUNK", 7)
  ids = np.zeros(50, np.uint16)
  ids[23], ids[40] = 260, 999
  path = tmp_path / "t.bin"
  ids.tofile(path)
  with pytest.raises(data.DataError, match=r"token id 260 at position 23 .*vocab_size >= 1000"):
    data.load_tokens(str(path), 256)


# --- errors -------------------------------------------------------------------


def _one_line(excinfo):
  assert "\n" not in str(excinfo.value)
  return str(excinfo.value)


def test_missing_file():
  with pytest.raises(data.DataError) as e:
    data.load_tokens("/nonexistent/x.txt", 256)
  msg = _one_line(e)
  assert "'/nonexistent/x.txt' does not exist" in msg and "--data_path=" in msg
  assert "omit it for the embedded corpus" in msg


@pytest.mark.parametrize("name", ["e.txt", "e.bin", "e.npy"])
def test_empty_file(tmp_path, name):
  (tmp_path / name).write_bytes(b"")
  with pytest.raises(data.DataError, match="is empty"):
    data.load_tokens(str(tmp_path / name), 256)


def test_too_short_file(tmp_path):
  (tmp_path / "one.txt").write_bytes(b"x")
  with pytest.raises(data.DataError, match=r"holds 1 token\(s\), too few"):
    data.load_tokens(str(tmp_path / "one.txt"), 256)


def test_id_outside_vocab(tmp_path):
  ids = np.full(20, 5, np.int32)
  ids[12] = 300
  np.save(tmp_path / "v.npy", ids)
  with pytest.raises(data.DataError) as e:
    data.load_tokens(str(tmp_path / "v.npy"), 256)
  msg = _one_line(e)
  assert "token id 300 at position 12 " in msg and "outside the vocabulary of 256" in msg
  assert "vocab_size >= 301" in msg and "re-tokenize" in msg


def test_text_bytes_outside_small_vocab(tmp_path):
  (tmp_path / "t.txt").write_bytes(b"abc\xff")
  with pytest.raises(data.DataError, match="token id 255 at position 3 .*vocab_size >= 256"):
    data.load_tokens(str(tmp_path / "t.txt"), 128)


def test_negative_id(tmp_path):
  np.save(tmp_path / "n.npy", np.array([1, 2, -1, 3], np.int64))
  with pytest.raises(data.DataError, match="token id -1 at position 2 .* is negative"):
    data.load_tokens(str(tmp_path / "n.npy"), 256)


def test_float_npy(tmp_path):
  np.save(tmp_path / "f.npy", np.ones(10, np.float32))
  with pytest.raises(data.DataError, match="dtype float32, not integer token ids"):
    data.load_tokens(str(tmp_path / "f.npy"), 256)


def test_odd_sized_bin(tmp_path):
  (tmp_path / "o.bin").write_bytes(b"abc")
  with pytest.raises(data.DataError, match="odd count.*uint16"):
    data.load_tokens(str(tmp_path / "o.bin"), 256)


@pytest.mark.parametrize("name", ["tokens.npz", "book", "book.pdf", "dump.pt", "x.TXT.gz"])
def test_unknown_extensions_are_refused_with_the_supported_list(tmp_path, name):
  (tmp_path / name).write_bytes(b"hello world, as bytes")
  with pytest.raises(data.DataError) as e:
    data.load_tokens(str(tmp_path / name), 256)
  msg = _one_line(e)
  assert "is not a supported format; supported: text (.txt, " in msg
  assert ".npy token ids, .bin raw uint16 ids" in msg


def test_a_real_npz_is_refused_not_trained_on_as_bytes(tmp_path):
  np.savez(tmp_path / "t.npz", tokens=np.arange(100))
  with pytest.raises(data.DataError, match="extension '.npz', which is not a supported format"):
    data.load_tokens(str(tmp_path / "t.npz"), 256)


@pytest.mark.parametrize(
  ("write", "says"),
  [
    (lambda f: np.save(f, np.arange(100)), "named .txt but holds a NumPy .npy array"),
    (lambda f: np.savez(f, t=np.arange(100)), "named .txt but holds a zip archive"),
    (lambda f: f.write(b"\x1f\x8b\x08rest"), "named .txt but holds gzip-compressed"),
    (lambda f: f.write("text".encode("utf-16")), "holds NUL bytes, so it is binary or"),
  ],
)
def test_text_files_are_checked_by_content(tmp_path, write, says):
  with open(tmp_path / "data.txt", "wb") as f:
    write(f)
  with pytest.raises(data.DataError, match=says):
    data.load_tokens(str(tmp_path / "data.txt"), 256)


def test_a_bin_or_npy_that_is_something_else(tmp_path):
  with open(tmp_path / "t.bin", "wb") as f:
    np.savez(f, t=np.arange(100))
  with pytest.raises(data.DataError, match="named .bin but holds a zip archive"):
    data.load_tokens(str(tmp_path / "t.bin"), 256)
  (tmp_path / "t.npy").write_bytes(b"plain text, not an array")
  with pytest.raises(data.DataError, match="named .npy but is not a NumPy array"):
    data.load_tokens(str(tmp_path / "t.npy"), 256)


def test_an_unreadable_file_is_one_line(tmp_path, monkeypatch):
  # Root reads any file whatever its mode bits, so the refusal is simulated.
  path = tmp_path / "secret.txt"
  path.write_bytes(b"hello world")
  real_open = open

  def denied(file, *args, **kwargs):
    if str(file) == str(path):
      raise PermissionError(13, "Permission denied", str(file))
    return real_open(file, *args, **kwargs)

  monkeypatch.setattr("builtins.open", denied)
  with pytest.raises(data.DataError) as e:
    data.load_tokens(str(path), 256)
  assert "cannot be read (Permission denied); check its permissions" in _one_line(e)


def test_identity_changes_with_the_content_not_the_name(tmp_path):
  a, b = tmp_path / "a.txt", tmp_path / "b.txt"
  a.write_bytes(b"x" * 100_000)
  b.write_bytes(b"x" * 100_000)
  assert data.identity(str(a)) == data.identity(str(b))
  b.write_bytes(b"x" * 99_999 + b"y")
  assert data.identity(str(a)) != data.identity(str(b))
  assert data.identity(None) is None


def test_batch_not_divisible_by_workers():
  tokens = np.arange(1000) % 256
  with pytest.raises(data.DataError) as e:
    data.make_train_iterator(tokens, seq_len=8, global_batch_size=30, num_workers=8)
  msg = _one_line(e)
  assert "--batch_size=30" in msg and "--workers=8" in msg and "use --batch_size=32" in msg
  with pytest.raises(data.DataError, match="use --batch_size=8 "):
    data.make_train_iterator(tokens, seq_len=8, global_batch_size=3, num_workers=8)


def test_workers_not_divisible_by_processes():
  with pytest.raises(data.DataError, match=r"--workers=6 does not divide evenly over 4 processes"):
    data.make_train_iterator(
      np.zeros(100, np.uint8),
      seq_len=4,
      global_batch_size=12,
      num_workers=6,
      process_index=0,
      process_count=4,
    )


def test_seq_len_too_long():
  with pytest.raises(data.DataError) as e:
    data.make_train_iterator(
      np.zeros(100, np.uint8), seq_len=128, global_batch_size=4, num_workers=2
    )
  msg = _one_line(e)
  assert "--seq_len=128" in msg and "holds only 100" in msg and "--seq_len=99 or smaller" in msg


# --- split and windows --------------------------------------------------------


def test_split_is_a_contiguous_tail_without_overlap():
  tokens = np.arange(1001, dtype=np.int32)
  train, val = data.split_tokens(tokens, val_fraction=0.05)
  assert len(val) == 51 and len(train) + len(val) == len(tokens)
  np.testing.assert_array_equal(np.concatenate([train, val]), tokens)
  assert not set(train.tolist()) & set(val.tolist())
  _, none = data.split_tokens(tokens, val_fraction=0.0)
  assert len(none) == 0
  with pytest.raises(data.DataError, match="val_fraction"):
    data.split_tokens(tokens, val_fraction=1.0)


def test_windows_and_shifted_targets():
  tokens = np.arange(103, dtype=np.uint16)
  windows = data.TokenWindows(tokens, seq_len=9)
  assert len(windows) == 10  # the 3-token remainder is dropped
  np.testing.assert_array_equal(windows[4], np.arange(40, 50))
  assert windows[4].dtype == np.int32
  with pytest.raises(IndexError):
    windows[10]

  it = data.make_train_iterator(tokens, seq_len=9, global_batch_size=4, num_workers=2)
  seen = []
  for _ in range(5):  # two full epochs of 10 windows
    batch = next(it)
    assert batch["inputs"].shape == (4, 9) and batch["inputs"].dtype == np.int32
    np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)
    assert np.all(batch["inputs"][:, 0] % 10 == 0)  # windows start on boundaries
    seen.extend(batch["inputs"][:, 0].tolist())
  # Each epoch is a permutation of all windows, reshuffled the next time.
  assert sorted(seen[:10]) == sorted(seen[10:]) == list(range(0, 100, 10))
  assert seen[:10] != seen[10:]


def test_processes_get_disjoint_shares_of_the_global_batch():
  tokens, _ = data.split_tokens(data.load_tokens(None, 256))
  kw = dict(seq_len=32, global_batch_size=8, num_workers=4, seed=3)
  whole = data.make_train_iterator(tokens, **kw)
  parts = [
    data.make_train_iterator(tokens, process_index=p, process_count=2, **kw) for p in range(2)
  ]
  for _ in range(6):
    g = next(whole)
    p0, p1 = next(parts[0]), next(parts[1])
    assert p0["inputs"].shape == (4, 32)
    for k in ("inputs", "targets"):
      np.testing.assert_array_equal(np.concatenate([p0[k], p1[k]]), g[k])
    assert not set(_rows(p0)) & set(_rows(p1))
    # Per-worker slices (2 rows per worker) differ across all 4 global workers.
    assert len(set(_rows(g))) == 8


def test_different_seeds_differ():
  tokens = np.arange(2000) % 256
  a = data.make_train_iterator(tokens, seq_len=7, global_batch_size=4, num_workers=1, seed=0)
  b = data.make_train_iterator(tokens, seq_len=7, global_batch_size=4, num_workers=1, seed=1)
  assert not _same(next(a), next(b))


# --- iterator state -----------------------------------------------------------


@pytest.mark.parametrize("read_threads", [0, 2])
def test_state_round_trip_across_epochs(read_threads):
  # 13 windows and 2 processes x 3 rows: epochs end mid-batch.
  tokens = np.arange(13 * 6) % 251
  kw = dict(seq_len=5, global_batch_size=6, num_workers=2, process_index=1, process_count=2)
  it = data.make_train_iterator(tokens, read_threads=read_threads, **kw)
  for _ in range(3):
    next(it)
  state = it.get_state()
  assert state == {"next_index": 3}
  expected = [next(it) for _ in range(12)]  # crosses several epoch boundaries

  fresh = data.make_train_iterator(tokens, read_threads=read_threads, **kw)
  fresh.set_state(state)
  assert all(_same(a, b) for a, b in zip(expected, [next(fresh) for _ in range(12)]))
  # Rewinding the same iterator works too.
  it.set_state(state)
  assert all(_same(a, b) for a, b in zip(expected, [next(it) for _ in range(12)]))


def test_orbax_checkpoint_manager_round_trip(tmp_path):
  tokens = np.arange(40 * 9) % 256
  kw = dict(seq_len=8, global_batch_size=4, num_workers=2)
  it = data.make_train_iterator(tokens, **kw)
  for _ in range(13):  # past the first epoch of 40 windows
    next(it)
  params = {"w": np.arange(3.0)}
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(
      13,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), data=data.iterator_checkpoint_args(it)
      ),
    )
    # Advancing before the save is finalised must not leak into the checkpoint.
    expected = [next(it) for _ in range(5)]
    mngr.wait_until_finished()
  assert (tmp_path / "ckpt/13/data/process_0-of-1.json").exists()

  restored_it = data.make_train_iterator(tokens, **kw)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    assert mngr.latest_step() == 13
    out = mngr.restore(
      13,
      args=ocp.args.Composite(
        params=ocp.args.StandardRestore({"w": np.zeros(3)}),
        data=data.iterator_checkpoint_args(restored_it, restore=True),
      ),
    )
  assert out["data"] is restored_it and restored_it.get_state() == {"next_index": 13}
  np.testing.assert_array_equal(out["params"]["w"], params["w"])
  assert all(_same(a, b) for a, b in zip(expected, [next(restored_it) for _ in range(5)]))


def _global_batches(tokens, steps, *, workers, processes, seed=3, start=None):
  """The concatenation over processes of each step's rows, as ``processes`` would draw them."""
  its = [
    data.make_train_iterator(
      tokens,
      seq_len=16,
      global_batch_size=24,
      num_workers=workers,
      process_index=p,
      process_count=processes,
      seed=seed,
    )
    for p in range(processes)
  ]
  if start is not None:
    for it in its:
      it.set_state(start)
  return [np.concatenate([next(it)["inputs"] for it in its]) for _ in range(steps)]


def test_global_batch_rows_are_the_same_for_8_6_and_4_workers_and_any_process_count():
  tokens, _ = data.split_tokens(data.load_tokens(None, 256))
  reference = _global_batches(tokens, 5, workers=8, processes=1)
  for workers, processes in [(8, 2), (8, 4), (6, 1), (6, 2), (6, 3), (4, 1), (4, 2)]:
    got = _global_batches(tokens, 5, workers=workers, processes=processes)
    for a, b in zip(reference, got):
      np.testing.assert_array_equal(a, b)
  # Workers only split the rows: worker g of W takes rows [g * 24 / W, (g + 1) * 24 / W).
  assert len({r.tobytes() for b in reference for r in b}) == 5 * 24


@pytest.mark.parametrize(("before", "after"), [(2, 3), (2, 1), (4, 3)])
def test_resume_on_another_process_count_neither_repeats_nor_skips(tmp_path, before, after):
  tokens, _ = data.split_tokens(data.load_tokens(None, 256))
  whole = _global_batches(tokens, 9, workers=12, processes=1)
  kw = dict(seq_len=16, global_batch_size=24, num_workers=12, seed=3)
  its = [
    data.make_train_iterator(tokens, process_index=p, process_count=before, **kw)
    for p in range(before)
  ]
  for it in its:
    for _ in range(5):
      next(it)
  # Each simulated process writes its own file into the step's data item, as a real run does.
  step_dir = tmp_path / "5"
  step_dir.mkdir()
  for p, it in enumerate(its):
    args = data.iterator_checkpoint_args(it, process_index=p, process_count=before)
    data._IteratorHandler().save(_epath(step_dir), args=args)
  assert data.saved_split(step_dir) == {"processes": before, "workers": 12}
  resumed = [
    data.make_train_iterator(tokens, process_index=p, process_count=after, **kw)
    for p in range(after)
  ]
  for p, it in enumerate(resumed):
    args = data.iterator_checkpoint_args(it, restore=True, process_index=p, process_count=after)
    data._IteratorHandler().restore(_epath(step_dir), args=args)
  for t in range(5, 9):
    got = np.concatenate([next(it)["inputs"] for it in resumed])
    np.testing.assert_array_equal(got, whole[t])


def _epath(path):
  from etils import epath

  return epath.Path(path)


def test_checkpoints_saved_by_grains_own_handler_restore(tmp_path):
  import grain

  tokens = np.arange(40 * 9) % 256
  kw = dict(seq_len=8, global_batch_size=4, num_workers=2)
  it = data.make_train_iterator(tokens, **kw)
  for _ in range(7):
    next(it)
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(7, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
  expected = next(it)
  fresh = data.make_train_iterator(tokens, **kw)
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.restore(
      7, args=ocp.args.Composite(data=data.iterator_checkpoint_args(fresh, restore=True))
    )
  assert _same(next(fresh), expected)


# --- evaluation batches -------------------------------------------------------


def test_eval_batches_deterministic_and_in_order():
  tokens = np.arange(1000) % 256
  batches = data.make_eval_batches(tokens, seq_len=9, batch_size=4, max_batches=3)
  again = data.make_eval_batches(tokens, seq_len=9, batch_size=4, max_batches=3)
  assert len(batches) == 3 and all(_same(a, b) for a, b in zip(batches, again))
  assert batches[0]["inputs"].shape == (4, 9) and batches[0]["inputs"].dtype == np.int32
  np.testing.assert_array_equal(batches[1]["inputs"][0], tokens[40:49])
  np.testing.assert_array_equal(batches[1]["targets"][0], tokens[41:50])
  assert len(data.make_eval_batches(tokens, seq_len=9, batch_size=4, max_batches=None)) == 25


def test_eval_batches_fall_back_to_overlapping_windows():
  tokens = np.arange(30)
  (batch,) = data.make_eval_batches(tokens, seq_len=9, batch_size=8, max_batches=5)
  assert batch["inputs"].shape == (8, 9)
  assert batch["inputs"][0, 0] == 0 and batch["targets"][-1, -1] == 29
  np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)
  with pytest.raises(data.DataError, match="validation split holds only 30"):
    data.make_eval_batches(tokens, seq_len=30, batch_size=2, max_batches=1)


def test_eval_batches_spread_over_the_split_take_its_ends_and_no_window_twice():
  tokens = np.arange(1000) % 256
  batches = data.make_eval_batches(tokens, seq_len=9, batch_size=4, max_batches=3, spread=True)
  starts = np.concatenate([b["inputs"][:, 0] for b in batches])
  # 100 windows, 12 taken: the first, the last, evenly between, each once.
  assert len(set(starts.tolist())) == 12
  np.testing.assert_array_equal(batches[0]["inputs"][0], tokens[0:9])
  np.testing.assert_array_equal(batches[-1]["targets"][-1], tokens[991:1000])
  # With every window taken, the spread is the plain order.
  plain = data.make_eval_batches(tokens, seq_len=9, batch_size=4, max_batches=None)
  spread = data.make_eval_batches(tokens, seq_len=9, batch_size=4, max_batches=None, spread=True)
  assert all(_same(a, b) for a, b in zip(plain, spread))


# --- a corpus directory (experiments.fetch_corpus) ------------------------------


def _corpus(tmp_path):
  from experiments.corpus import build
  from experiments.corpus.nltk_sources import Document

  docs = {
    kind: [Document(f"{kind}/{i}", f"{kind} {i} ".encode() * 40) for i in range(8)]
    for kind in ("news", "film")
  }
  archives = {k: {"name": k, "sha256": "0" * 64} for k in docs}
  out = tmp_path / "corpus"
  return str(out), build.write_corpus(str(out), docs, archives, val_fraction=0.2)


def test_a_corpus_directory_gives_its_own_split_by_document(tmp_path):
  path, manifest = _corpus(tmp_path)
  splits = data.load_splits(path, 256)
  assert splits.by_document
  assert splits.train.tobytes() == (tmp_path / "corpus" / "train.txt").read_bytes()
  assert splits.val.tobytes() == (tmp_path / "corpus" / "val.txt").read_bytes()
  assert b"news" in splits.val.tobytes() and b"film" in splits.val.tobytes()
  assert data.check_file(path) == (
    data.CORPUS_DIR,
    manifest["train"]["bytes"] + manifest["val"]["bytes"],
  )
  assert data.identity(path) == {"corpus_digest": manifest["digest"]}
  with pytest.raises(data.DataError, match="corpus directory, split by document"):
    data.load_tokens(path, 256)
  with pytest.raises(data.DataError, match="vocab_size >= 256"):
    data.load_splits(path, 128)


def test_files_and_the_embedded_corpus_split_as_before():
  splits = data.load_splits(None, 256)
  train, val = data.split_tokens(data.load_tokens(None, 256))
  assert not splits.by_document
  np.testing.assert_array_equal(splits.train, train)
  np.testing.assert_array_equal(splits.val, val)


def test_a_corpus_edited_or_unfinished_is_refused(tmp_path):
  path, _ = _corpus(tmp_path)
  train = tmp_path / "corpus" / "train.txt"
  text = train.read_bytes()
  train.write_bytes(text[:-1] + b"?")  # same size, other bytes
  with pytest.raises(data.DataError, match=r"train.txt has SHA-256 [0-9a-f]{64}, not the"):
    data.load_splits(path, 256)
  (tmp_path / "corpus" / "corpus.json").unlink()
  with pytest.raises(data.DataError, match="no corpus.json, so it is unfinished"):
    data.check_file(path)


# --- how much of its data a run reads --------------------------------------------


def test_train_epochs_count_the_windows_the_sampler_draws():
  # 10 windows of 10 tokens (and a remainder of 3 that is never read).
  tokens = np.arange(103, dtype=np.uint16)
  windows = data.window_count(tokens, seq_len=9)
  assert windows == 10
  it = data.make_train_iterator(tokens, seq_len=9, global_batch_size=2, num_workers=2)
  drawn = []
  for steps in range(1, 8):
    drawn += _rows(next(it))
    reading = data.Reading.of(steps, 2, windows)
    assert reading.train_epochs == steps / 5
    # Exactly when some window came twice does the reading say the data was reread.
    assert reading.rereads_data == (len(set(drawn)) < len(drawn)), steps
  assert "at most once" in data.Reading.of(5, 2, windows).describe(5)
  assert data.Reading.of(6, 2, windows).describe(6).startswith("warning:")
