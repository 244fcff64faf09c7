"""Token data for a byte-level or pre-tokenized language model, fed through grain.

The pipeline is a grain ``MapDataset`` over fixed windows of one flat token
array, so the whole input state is a single integer (how many global steps have
been drawn) and restores exactly. Layout of one training step:

* the shuffled, endlessly repeated stream of windows is cut into global batches
  of ``global_batch_size`` rows;
* process ``p`` of ``P`` owns rows ``[p * L, (p + 1) * L)`` of every global
  batch (``L = global_batch_size // P``), and reads only those rows;
* within a process the rows are worker-major: splitting them into equal
  contiguous blocks, one per local device (what ``PartitionSpec("data")`` does),
  gives global worker ``g`` rows ``[g * b, (g + 1) * b)`` of the global batch,
  ``b = global_batch_size // num_workers``.

Neither the worker count nor the process count enters the order: global
batch ``t`` is windows ``[t * G, (t + 1) * G)`` of the shuffled stream
(``G = global_batch_size``) whoever reads it, and every process's iterator
state is the same step count. A run resumed on another number of workers or
processes (an elastic resume) therefore continues with exactly the rows it
would have drawn, and a checkpoint's data position stays valid.

Usage::

  tokens = load_tokens(None, vocab_size=256)
  train, val = split_tokens(tokens)
  it = make_train_iterator(train, seq_len=256, global_batch_size=64, num_workers=8)
  batch = next(it)  # {"inputs": int32[64, 256], "targets": int32[64, 256]}
  evals = make_eval_batches(val, seq_len=256, batch_size=64, max_batches=8)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Any

import grain
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from experiments.corpus import corpus_dir
from experiments.corpus.generated import default_corpus

# Tokens examined per step when scanning a memory-mapped file for bad ids, so a
# multi-gigabyte dump is checked without loading it whole.
_SCAN_CHUNK = 1 << 24


class DataError(ValueError):
  """A problem with the input data or data flags, stated with its fix in one line."""


def _check_ids(tokens: np.ndarray, vocab_size: int, source: str) -> None:
  """Raises DataError at the first token id outside ``[0, vocab_size)``."""
  if np.issubdtype(tokens.dtype, np.unsignedinteger) and np.iinfo(tokens.dtype).max < vocab_size:
    return  # Every representable id is in range; skip the scan.
  signed = np.issubdtype(tokens.dtype, np.signedinteger)
  largest = -1
  first_bad = None
  for start in range(0, tokens.shape[0], _SCAN_CHUNK):
    chunk = np.asarray(tokens[start : start + _SCAN_CHUNK])
    if signed and chunk.min() < 0:
      pos = int(np.argmax(chunk < 0))
      raise DataError(
        f"token id {int(chunk[pos])} at position {start + pos} of {source} is negative; "
        "token ids must be in [0, vocab_size): re-tokenize the data"
      )
    chunk_max = int(chunk.max())
    largest = max(largest, chunk_max)
    if first_bad is None and chunk_max >= vocab_size:
      pos = int(np.argmax(chunk >= vocab_size))
      first_bad = (int(chunk[pos]), start + pos)
  if first_bad is not None:
    bad_id, pos = first_bad
    raise DataError(
      f"token id {bad_id} at position {pos} of {source} is outside the vocabulary of "
      f"{vocab_size} (largest id {largest}); use a preset with vocab_size >= {largest + 1} "
      "or re-tokenize"
    )


# File formats by extension. Text of any encoding is read as bytes (vocab 256);
# anything else is refused, since bytes of an archive would train without a word.
TEXT_SUFFIXES = (".txt", ".text", ".md", ".jsonl", ".json", ".csv", ".tsv", ".html", ".xml")
SUPPORTED = (
  "text (" + ", ".join(TEXT_SUFFIXES) + ") read as bytes, .npy token ids, .bin raw uint16 ids"
)
# What a file is by its first bytes, for files whose name says otherwise.
_MAGIC = (
  (b"\x93NUMPY", "a NumPy .npy array"),
  (b"PK\x03\x04", "a zip archive (e.g. .npz)"),
  (b"\x1f\x8b", "gzip-compressed data"),
  (b"BZh", "bzip2-compressed data"),
  (b"\xfd7zXZ\x00", "xz-compressed data"),
  (b"\x28\xb5\x2f\xfd", "zstd-compressed data"),
  (b"\x89HDF", "an HDF5 file"),
  (b"%PDF", "a PDF document"),
  (b"\x7fELF", "an executable"),
)
# How much of a file is looked at: a NUL in its first 64 KiB means binary data,
# or UTF-16/32 text, neither of which a byte-level model should read as bytes.
_SNIFF = 1 << 16


def _head(data_path: str, n: int = _SNIFF) -> bytes:
  try:
    with open(data_path, "rb") as f:
      return f.read(n)
  except OSError as e:
    raise DataError(
      f"data file {data_path!r} cannot be read ({e.strerror}); check its permissions, or "
      "pass --data_path=... to a readable file"
    ) from None


def _sniff(data_path: str, suffix: str, head: bytes) -> None:
  """Refuses a file whose content is not what its extension says."""
  found = next((what for magic, what in _MAGIC if head.startswith(magic)), None)
  if suffix == ".npy":
    if found != "a NumPy .npy array":
      raise DataError(
        f"data file {data_path!r} is named .npy but is {found or 'not a NumPy array'}; "
        "save token ids with np.save(path, tokens)"
      )
    return
  if found is not None:
    raise DataError(
      f"data file {data_path!r} is named {suffix} but holds {found}; convert it to "
      f"one of: {SUPPORTED}"
    )
  if suffix in TEXT_SUFFIXES and b"\x00" in head:
    raise DataError(
      f"data file {data_path!r} is named {suffix} but holds NUL bytes, so it is binary or "
      "UTF-16/32 text; save text as UTF-8, or token ids as .npy"
    )


# What :func:`check_file` calls a corpus directory in place of a file's extension.
CORPUS_DIR = "corpus directory"


def check_file(data_path: str) -> tuple[str, int]:
  """``(suffix, size)`` of a data file that exists, is a file, is readable, and is supported.

  Reads only the file's first 64 KiB, so a command can refuse a wrong file
  before it writes or compiles anything; :func:`load_tokens` calls it too.
  A corpus directory (``experiments.fetch_corpus``) gives
  ``(CORPUS_DIR, train and val bytes)`` once its manifest and its files'
  sizes agree; their digests are checked when it is loaded.

  Raises:
    DataError: naming the file and the fix.
  """
  if not os.path.exists(data_path):
    raise DataError(
      f"data file {data_path!r} does not exist; pass --data_path=... to an existing "
      ".txt/.npy/.bin file or corpus directory, or omit it for the embedded corpus"
    )
  if os.path.isdir(data_path):
    manifest = _manifest(data_path, verify=False)
    return CORPUS_DIR, manifest["train"]["bytes"] + manifest["val"]["bytes"]
  if not os.path.isfile(data_path):
    raise DataError(
      f"data file {data_path!r} is not a regular file; pass --data_path=... to a "
      ".txt/.npy/.bin file or a corpus directory"
    )
  suffix = os.path.splitext(data_path)[1].lower()
  if suffix not in (*TEXT_SUFFIXES, ".npy", ".bin"):
    raise DataError(
      f"data file {data_path!r} has {'the extension ' + repr(suffix) if suffix else 'no extension'}"
      f", which is not a supported format; supported: {SUPPORTED}"
    )
  size = os.path.getsize(data_path)
  if size == 0:
    raise DataError(
      f"data file {data_path!r} is empty; pass --data_path=... to a file with tokens, "
      "or omit it for the embedded corpus"
    )
  _sniff(data_path, suffix, _head(data_path))
  return suffix, size


def _read_npy(data_path: str) -> np.ndarray:
  try:
    tokens = np.load(data_path, mmap_mode="r", allow_pickle=False)
  except (ValueError, OSError) as e:
    raise DataError(
      f"data file {data_path!r} is not a readable .npy array ({e}); save it with "
      "np.save(path, tokens)"
    ) from e
  if not np.issubdtype(tokens.dtype, np.integer):
    raise DataError(
      f"data file {data_path!r} has dtype {tokens.dtype}, not integer token ids; "
      "re-save it with np.save(path, tokens.astype(np.int32))"
    )
  return tokens.reshape(-1)


def load_tokens(data_path: str | None, vocab_size: int) -> np.ndarray:
  """Loads a flat array of token ids and checks them against the vocabulary.

  The format follows the extension, and the content must agree with it:

  * text (:data:`TEXT_SUFFIXES`: ``.txt``, ``.md``, ``.jsonl``, ...) is read as
    bytes, i.e. byte-level tokens with vocab 256 (memory-mapped); a file that
    starts like an archive or an array, or holds NUL bytes, is refused;
  * ``.npy``: integer token ids (memory-mapped; flattened if not 1-D);
  * ``.bin``: raw uint16 token ids (memory-mapped);
  * any other extension, or none, is refused with the list of these.

  Args:
    data_path: ``None`` for the embedded generated corpus (bytes, vocab 256),
      else the path of a file as above.
    vocab_size: The model's vocabulary size; every id must be below it.

  Returns:
    A 1-D integer array (possibly a read-only memory map) of at least 2 tokens.

  Raises:
    DataError: the file is missing, unreadable, empty, of an unsupported
      format, malformed, or holds ids outside ``[0, vocab_size)``.
  """
  if vocab_size <= 0:
    raise DataError(f"vocab_size must be positive, got {vocab_size}")
  if data_path is None:
    tokens = np.frombuffer(default_corpus(), dtype=np.uint8)
    source = "the embedded corpus"
  else:
    source = f"data file {data_path!r}"
    suffix, size = check_file(data_path)
    if suffix == CORPUS_DIR:
      raise DataError(
        f"{data_path!r} is a corpus directory, split by document; read it with load_splits"
      )
    if suffix == ".npy":
      tokens = _read_npy(data_path)
    elif suffix == ".bin":
      if size % 2:
        raise DataError(
          f"data file {data_path!r} has {size} bytes, an odd count; .bin files are read "
          "as raw uint16 tokens, so save them with tokens.astype(np.uint16).tofile(path)"
        )
      tokens = np.memmap(data_path, dtype=np.uint16, mode="r")
    else:
      tokens = np.memmap(data_path, dtype=np.uint8, mode="r")
  if tokens.shape[0] < 2:
    raise DataError(
      f"{source} holds {tokens.shape[0]} token(s), too few for a single input/target "
      "pair; use a file with more data"
    )
  _check_ids(tokens, vocab_size, source)
  return tokens


def identity(data_path: str | None) -> dict[str, Any] | None:
  """What a checkpoint records of its data file: size and SHA-256 of both ends.

  A resume with a file that was replaced or edited (not only renamed) is
  refused through it. Both ends, not the whole file, so a file of many GB is
  identified in milliseconds; an edit confined to the middle of a file of the
  same size goes unseen.

  Returns:
    ``{"bytes": size, "ends_sha256": hex}``; for a corpus directory
    ``{"corpus_digest": hex}``, its manifest's digest of both files (which
    loading checks); ``None`` for the embedded corpus.
  """
  if data_path is None:
    return None
  if os.path.isdir(data_path):
    manifest = _manifest(data_path, verify=False)
    return {"corpus_digest": manifest["digest"]}
  size = os.path.getsize(data_path)
  digest = hashlib.sha256()
  with open(data_path, "rb") as f:
    digest.update(f.read(_SNIFF))
    f.seek(max(size - _SNIFF, 0))
    digest.update(f.read(_SNIFF))
  return {"bytes": size, "ends_sha256": digest.hexdigest()}


def split_tokens(tokens: np.ndarray, val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
  """Splits tokens into a training head and a held-out validation tail.

  The split is contiguous, so no validation token is ever inside a training
  window (windows never cross the boundary because they are cut per split).

  Args:
    tokens: 1-D token array from ``load_tokens``.
    val_fraction: Fraction of the tokens (rounded up) held out, in ``[0, 1)``.

  Returns:
    ``(train, val)`` views of ``tokens``; ``val`` is empty if ``val_fraction`` is 0.
  """
  if not 0.0 <= val_fraction < 1.0:
    raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
  n = tokens.shape[0]
  n_val = math.ceil(n * val_fraction)
  return tokens[: n - n_val], tokens[n - n_val :]


def _manifest(path: str, *, verify: bool) -> dict[str, Any]:
  try:
    return corpus_dir.read_manifest(path, verify=verify)
  except corpus_dir.CorpusError as e:
    raise DataError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class Splits:
  """A run's training and validation tokens.

  Attributes:
    train: the training tokens (1-D).
    val: the validation tokens (1-D).
    by_document: the split is a corpus directory's, by document; its
      validation text is ordered by source, so evaluation takes windows
      spread over all of it (:func:`make_eval_batches` ``spread``), not its
      first ones.
  """

  train: np.ndarray
  val: np.ndarray
  by_document: bool = False


def load_splits(data_path: str | None, vocab_size: int, val_fraction: float = 0.05) -> Splits:
  """The training and validation tokens of ``--data_path``.

  A corpus directory (``python -m experiments.fetch_corpus``) gives its own
  ``train.txt`` and ``val.txt``, split by document, once their SHA-256 match
  its manifest; a file or the embedded corpus is :func:`load_tokens` cut by
  :func:`split_tokens`.

  Args:
    data_path: ``None``, a file :func:`load_tokens` reads, or a corpus directory.
    vocab_size: The model's vocabulary size; every id must be below it.
    val_fraction: For a file, the share held out (a corpus has its own).

  Raises:
    DataError: as :func:`load_tokens`; for a corpus directory, one without a
      manifest or whose files do not match it.
  """
  if data_path is None or not os.path.isdir(data_path):
    return Splits(*split_tokens(load_tokens(data_path, vocab_size), val_fraction))
  if vocab_size < 256:
    raise DataError(
      f"{data_path!r} is text, read as bytes (ids up to 255); use a preset with "
      f"vocab_size >= 256, not {vocab_size}"
    )
  _manifest(data_path, verify=True)
  train, val = (
    np.memmap(os.path.join(data_path, name), dtype=np.uint8, mode="r")
    for name in (corpus_dir.TRAIN, corpus_dir.VAL)
  )
  return Splits(train, val, by_document=True)


def window_count(tokens: np.ndarray, seq_len: int) -> int:
  """Training windows of ``seq_len + 1`` tokens that :class:`TokenWindows` cuts from ``tokens``."""
  return tokens.shape[0] // (seq_len + 1)


@dataclasses.dataclass(frozen=True)
class Reading:
  """How much of its training split a run has read.

  The sampler (:func:`make_train_iterator`) cuts the split into
  non-overlapping windows of ``seq_len + 1`` tokens (a remainder shorter
  than one is never read) and draws them in a new shuffled order each epoch,
  ``global_batch_size`` per step. Within an epoch no token is read twice;
  ``steps * global_batch_size`` draws read every window ``train_epochs``
  times, so a run reads some token twice exactly when ``train_epochs > 1``.

  Attributes:
    train_epochs: windows drawn over windows in the split: the fraction of
      the training split read (2.0: every window twice).
    train_windows: windows in the training split.
    rereads_data: some window, so some byte, was read more than once.
  """

  train_epochs: float
  train_windows: int
  rereads_data: bool

  @classmethod
  def of(cls, steps: int, global_batch_size: int, train_windows: int) -> Reading:
    if train_windows < 1:
      raise DataError(
        "the training split holds no window of --seq_len + 1 tokens; use a smaller "
        "--seq_len, or more data"
      )
    drawn = steps * global_batch_size
    return cls(drawn / train_windows, train_windows, drawn > train_windows)

  def describe(self, steps: int) -> str:
    """One line for the run's log; a warning where data is read twice."""
    line = (
      f"data: {steps} steps read the training split {self.train_epochs:.3f} times "
      f"(train_epochs; {self.train_windows:,} windows)"
    )
    if not self.rereads_data:
      return line + ", each window at most once"
    return (
      f"warning: {line}, so some windows {math.ceil(self.train_epochs)} times: its "
      "validation loss also measures memorization; fewer --steps, or more data, reads "
      "each once"
    )


def planned_reading(
  data_path: str | None, vocab_size: int, *, seq_len: int, steps: int, global_batch_size: int
) -> Reading:
  """How much of ``data_path``'s training split a run of ``steps`` steps will read.

  For commands that plan many runs (``compare``, ``frontier``), so a run that
  would read its data twice is known before any trains.
  """
  splits = load_splits(data_path, vocab_size)
  return Reading.of(steps, global_batch_size, window_count(splits.train, seq_len))


class TokenWindows:
  """Grain random-access source of non-overlapping windows of ``seq_len + 1`` tokens.

  Window ``i`` is ``tokens[i * (seq_len + 1) : (i + 1) * (seq_len + 1)]`` as
  int32; a model reads ``window[:-1]`` and predicts ``window[1:]``. A trailing
  remainder shorter than a window is never used.
  """

  def __init__(self, tokens: np.ndarray, seq_len: int):
    if seq_len < 1:
      raise DataError(f"--seq_len must be at least 1, got {seq_len}")
    self._tokens = tokens
    self._width = seq_len + 1
    self._len = tokens.shape[0] // self._width

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, index: int) -> np.ndarray:
    index = int(index)
    if not 0 <= index < self._len:
      raise IndexError(f"window {index} out of range for {self._len} windows")
    start = index * self._width
    return np.asarray(self._tokens[start : start + self._width], dtype=np.int32)

  def __repr__(self) -> str:
    return f"TokenWindows(windows={self._len}, width={self._width})"


def _inputs_and_targets(windows: np.ndarray) -> dict[str, np.ndarray]:
  return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


def _nearest_multiple(value: int, base: int) -> int:
  lower = (value // base) * base
  upper = lower + base
  if lower == 0 or upper - value <= value - lower:
    return upper
  return lower


def make_train_iterator(
  tokens: np.ndarray,
  *,
  seq_len: int,
  global_batch_size: int,
  num_workers: int,
  process_index: int = 0,
  process_count: int = 1,
  seed: int = 0,
  read_threads: int = 0,
) -> grain.DatasetIterator:
  """An endless, checkpointable iterator over this process's share of each global batch.

  Windows are shuffled within each epoch (a different permutation per epoch,
  derived from ``seed`` and the epoch number) and epochs follow each other
  without a gap, so a global batch may straddle an epoch boundary.

  Args:
    tokens: Training tokens (1-D), e.g. the first part of ``split_tokens``.
    seq_len: Tokens per training row.
    global_batch_size: Rows per step over all processes; flag ``--batch_size``.
    num_workers: Data-parallel workers over all processes; flag ``--workers``.
    process_index: This process's index (``jax.process_index()``).
    process_count: Number of processes (``jax.process_count()``).
    seed: Shuffle seed in ``[0, 2**32)``.
    read_threads: Grain reader threads; 0 reads synchronously on ``next()``,
      which is cheapest for in-memory or page-cached data.

  Returns:
    A ``grain.DatasetIterator`` whose ``next()`` gives
    ``{"inputs": int32[L, seq_len], "targets": int32[L, seq_len]}`` with
    ``L = global_batch_size // process_count``, rows worker-major. Its
    ``get_state()`` is ``{"next_index": steps_drawn}``; ``set_state`` restores it.

  Raises:
    DataError: the batch does not divide over workers or processes, or there
      are too few tokens for one window.
  """
  if num_workers < 1 or global_batch_size < 1:
    raise DataError(
      f"--batch_size={global_batch_size} and --workers={num_workers} must both be positive"
    )
  if global_batch_size % num_workers:
    suggestion = _nearest_multiple(global_batch_size, num_workers)
    raise DataError(
      f"--batch_size={global_batch_size} does not divide evenly over --workers={num_workers}; "
      f"use --batch_size={suggestion} (a multiple of --workers)"
    )
  if process_count < 1 or not 0 <= process_index < process_count:
    raise DataError(f"process_index={process_index} is not in [0, process_count={process_count})")
  if num_workers % process_count:
    raise DataError(
      f"--workers={num_workers} does not divide evenly over {process_count} processes; "
      f"use --workers={_nearest_multiple(num_workers, process_count)} "
      f"(a multiple of the process count)"
    )
  if not 0 <= seed < 2**32:
    raise DataError(f"--seed must be in [0, 2**32), got {seed}")
  windows = TokenWindows(tokens, seq_len)
  if len(windows) == 0:
    raise DataError(
      f"--seq_len={seq_len} needs {seq_len + 1} tokens per window but the training split "
      f"holds only {tokens.shape[0]}; use --seq_len={max(1, tokens.shape[0] - 1)} or smaller, "
      "or more data"
    )
  local_batch = global_batch_size // process_count
  ds = grain.MapDataset.source(windows).shuffle(seed=seed).repeat()
  # Batch i of size L is global rows [i*L, (i+1)*L); global step s is batches
  # s*P .. s*P+P-1, so taking every P-th batch from p gives this process only
  # its own rows, never reading the others'.
  ds = ds.batch(local_batch, drop_remainder=True)[process_index::process_count]
  ds = ds.map(_inputs_and_targets)
  read_options = grain.ReadOptions(
    num_threads=read_threads, prefetch_buffer_size=4 * read_threads if read_threads else 0
  )
  it = iter(ds.to_iter_dataset(read_options))
  # How the batch is split; checkpoints record it next to the position (``split.json``).
  it.split = {"workers": num_workers, "processes": process_count}
  return it


def make_eval_batches(
  tokens: np.ndarray,
  *,
  seq_len: int,
  batch_size: int,
  max_batches: int | None,
  spread: bool = False,
) -> list[dict[str, np.ndarray]]:
  """Deterministic validation batches, in order, each a full global batch.

  Uses non-overlapping windows from the start of ``tokens``, or with
  ``spread`` windows evenly spaced over all of them. If the split is
  too short for even one batch of separate windows, it falls back to
  ``batch_size`` evenly spaced, overlapping windows, so a small validation
  split still gives a (noisier) held-out loss instead of none.

  Args:
    tokens: Validation tokens (1-D), e.g. the second part of ``split_tokens``.
    seq_len: Tokens per row.
    batch_size: Rows per batch (the global batch size).
    max_batches: Upper bound on the number of batches; ``None`` for all.
    spread: When ``max_batches`` leaves windows out, take the windows
      evenly spaced over the split instead of its first ones (a corpus
      whose validation text is ordered by source is then measured on every
      source).

  Returns:
    A list of ``{"inputs": int32[batch_size, seq_len], "targets": ...}``.

  Raises:
    DataError: there are fewer than ``seq_len + 1`` tokens.
  """
  if batch_size < 1:
    raise DataError(f"--batch_size must be positive, got {batch_size}")
  if max_batches is not None and max_batches < 1:
    raise DataError(f"max_batches must be positive or None, got {max_batches}")
  width = seq_len + 1
  n = tokens.shape[0]
  if seq_len < 1 or n < width:
    raise DataError(
      f"--seq_len={seq_len} needs {width} tokens per window but the validation split holds "
      f"only {n}; use --seq_len={max(1, n - 1)} or smaller, or a larger validation fraction"
    )
  num_batches = (n // width) // batch_size
  if num_batches == 0:
    starts = np.linspace(0, n - width, batch_size).round().astype(np.int64)
    num_batches = 1
  else:
    available = n // width
    if max_batches is not None:
      num_batches = min(num_batches, max_batches)
    windows = np.arange(num_batches * batch_size, dtype=np.int64)
    if spread:
      # Distinct, since there are at least as many windows as are taken.
      windows = np.linspace(0, available - 1, num_batches * batch_size).round().astype(np.int64)
    starts = windows * width
  rows = np.stack([np.asarray(tokens[s : s + width], dtype=np.int32) for s in starts])
  rows = rows.reshape(num_batches, batch_size, width)
  return [_inputs_and_targets(r) for r in rows]


class _IteratorHandler(grain.checkpoint.CheckpointHandler):
  """Grain's handler, except that a restore on another process count reads any process's file.

  Every process's position is the number of global steps drawn (see
  :func:`make_train_iterator`), so after a resume on a different number of
  processes the position saved by any process is every process's position;
  they are checked to agree. Files are named as grain names them
  (``process_<i>-of-<n>.json``), so checkpoints stay readable both ways.
  """

  def save(self, directory: Any, item: Any = None, args: Any = None) -> None:
    args = args or _IteratorSave(item)
    index, count = _process(args)
    (directory / f"process_{index}-of-{count}.json").write_text(
      json.dumps(args.item.get_state(), indent=4)
    )
    if index == 0 and hasattr(args.item, "split"):
      (directory / _SPLIT).write_text(json.dumps(args.item.split))

  def restore(self, directory: Any, item: Any = None, args: Any = None) -> Any:
    args = args or _IteratorRestore(item)
    index, count = _process(args)
    own = directory / f"process_{index}-of-{count}.json"
    if own.exists():
      state = json.loads(own.read_text())
    else:
      saved = {json.dumps(json.loads(f.read_text()), sort_keys=True) for f in _saved(directory)}
      if len(saved) != 1:
        raise ValueError(
          f"{directory} holds {'no' if not saved else 'differing'} data positions for a "
          f"resume on {count} processes; the data iterator cannot be restored."
        )
      state = json.loads(saved.pop())
    args.item.set_state(state)
    if hasattr(args.item, "start_prefetch"):
      args.item.start_prefetch()  # as grain's own handler does
    return args.item


def _saved(directory: Any) -> list[Any]:
  return sorted(directory.glob("process_*-of-*.json"))


_SPLIT = "split.json"


def saved_split(directory: str | os.PathLike[str]) -> dict[str, int]:
  """How the saving run split its batches, from a checkpoint's ``data`` item.

  Returns:
    ``{"processes": P}`` from the position files' names, and ``"workers"``
    (devices over all processes) where the checkpoint recorded it; empty for
    a directory without position files.
  """
  directory = epath.Path(directory)
  out = {}
  counts = {int(p.stem.rsplit("-of-", 1)[1]) for p in _saved(directory)}
  if len(counts) == 1:
    out["processes"] = counts.pop()
  if (directory / _SPLIT).exists():
    out["workers"] = int(json.loads((directory / _SPLIT).read_text())["workers"])
  return out


def _process(args: Any) -> tuple[int, int]:
  import jax

  index = jax.process_index() if args.process_index is None else args.process_index
  count = jax.process_count() if args.process_count is None else args.process_count
  return index, count


@ocp.args.register_with_handler(_IteratorHandler, for_save=True)
@dataclasses.dataclass
class _IteratorSave(ocp.args.CheckpointArgs):
  item: Any
  process_index: int | None = None
  process_count: int | None = None


@ocp.args.register_with_handler(_IteratorHandler, for_restore=True)
@dataclasses.dataclass
class _IteratorRestore(ocp.args.CheckpointArgs):
  item: Any
  process_index: int | None = None
  process_count: int | None = None


def iterator_checkpoint_args(
  it: grain.DatasetIterator,
  *,
  restore: bool = False,
  process_index: int | None = None,
  process_count: int | None = None,
) -> Any:
  """Orbax ``CheckpointArgs`` for a grain iterator, for one item of ``ocp.args.Composite``.

  Saving writes ``get_state()`` as JSON to ``process_<i>-of-<n>.json`` (one file
  per JAX process); restoring calls ``it.set_state`` in place and returns ``it``.
  A restore on another number of processes than the save's reads the
  position the saving processes agreed on (the global steps drawn), so a
  resume on a different process count neither repeats nor skips data.

  Example::

    mngr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), data=iterator_checkpoint_args(it)))
    mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract), data=iterator_checkpoint_args(it, restore=True)))

  Args:
    it: The iterator to save, or to restore into.
    restore: Whether to build restore args instead of save args.
    process_index: This process's index (default ``jax.process_index()``).
    process_count: The number of processes (default ``jax.process_count()``).

  Returns:
    The save or restore args of this module's handler.
  """
  cls = _IteratorRestore if restore else _IteratorSave
  return cls(it, process_index, process_count)
