"""DeMo's fused CPU kernels: built once with the machine's C++ compiler, called through ``jax.ffi``.

On XLA's CPU backend the chunked DCT is a pair of dense matmuls and the top-k a
heap over every row, each a pass of its own over param-sized buffers
(docs/performance.md). Two kernels in ``native/demo_cpu.cc`` do DeMo's
param-sized work chunk by chunk while the chunk sits in cache:

- :func:`compress`: ``m' = decay * m + lr * DCT(g)`` and the top-k of every
  chunk of ``m'``, the indices exactly those of :func:`distro_jax.codec.select_topk_blocks`
  on the same ``m'`` (largest magnitude first, ties to the lower index);
- :func:`decode`: the mean of what the workers sent (the running mean of
  :func:`distro_jax.codec.aggregate_blocks`, in the same worker order, to the
  bit) and its inverse DCT, whose first stage reads only the chunk's nonzero
  coefficients.

The DCT is the even/odd recursion, not the dense matmul, so its results differ
from :func:`distro_jax.dct.forward_blocks` by float32 rounding: against a
float64 DCT, about 1e-6 of the largest coefficient where the matmuls are off
by about 4e-7 (docs/performance.md). Every replica runs the same kernel on the
same inputs and gets the same bits: the code has no fused multiply-add, no
reassociation and no libm call.

They serve tensors cut into 64x64 chunks (the default chunk on matrices whose
sides are multiples of 64), float32 gradients, and arrays that are not placed
on a mesh by the compiler (inside ``shard_map`` or on one device); everything
else takes the XLA path. They are built on first use with ``$CXX`` (``c++`` by
default) into ``$DISTRO_JAX_CACHE`` (``~/.cache/distro_jax``) and used when
JAX's default backend is the CPU. Set ``DISTRO_JAX_CPU_KERNELS=0``, or use
:func:`disabled`, for the XLA path everywhere; a machine with no compiler
gets it with a warning.
"""

import contextlib
import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from distro_jax import dct, exchange

__all__ = ["available", "compress", "decode", "disabled", "serves", "tables"]

CHUNK = 64
# The top-k's first stage ranks the 512 groups of 8 of a chunk, so k stops there.
MAX_K = CHUNK * CHUNK // 8
SWITCH = "DISTRO_JAX_CPU_KERNELS"
_SOURCE = pathlib.Path(__file__).parent / "native" / "demo_cpu.cc"
_FLAGS = (
  "-O3",
  "-std=c++17",
  "-shared",
  "-fPIC",
  # Bits must not depend on the machine: no contraction into fused
  # multiply-adds, no reassociation. -march=native only widens the vectors.
  "-ffp-contract=off",
  "-fno-fast-math",
  "-march=native",
  "-w",
)
_COMPRESS, _DECODE = "distro_jax_demo_compress", "distro_jax_demo_decode"
_local = threading.local()


def _cpu_signature() -> str:
  """What a binary built with -march=native depends on: the CPU's feature flags."""
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith(("flags", "Features")):
        return line
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _cache_dir() -> pathlib.Path:
  default = pathlib.Path.home() / ".cache" / "distro_jax"
  return pathlib.Path(os.environ.get("DISTRO_JAX_CACHE", default))


def _build(compiler: str) -> pathlib.Path:
  source = _SOURCE.read_bytes()
  key = hashlib.sha256(source)
  headers = jax.ffi.include_dir()
  for part in (" ".join(_FLAGS), compiler, headers, _cpu_signature(), jax.__version__):
    key.update(part.encode())
  target = _cache_dir() / f"demo_cpu_{key.hexdigest()[:16]}.so"
  if target.exists():
    return target
  target.parent.mkdir(parents=True, exist_ok=True)
  # Built under a temporary name and renamed, so processes building at once
  # never load a half-written file.
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
  os.close(fd)
  try:
    cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", tmp]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    os.replace(tmp, target)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return target


_build_lock = threading.Lock()


def _library() -> bool:
  """Builds (or finds), loads and registers the kernels once; False if that fails."""
  # Threads tracing at once (a threaded train loop) build and register once.
  with _build_lock:
    return _load()


@functools.cache
def _load() -> bool:
  compiler = os.environ.get("CXX", "c++")
  if shutil.which(compiler) is None:
    warnings.warn(
      f"distro_jax: no C++ compiler ({compiler!r}) found, so DeMo's update on the CPU "
      "takes XLA's slower path. Install one (e.g. g++) or set CXX to use the fused "
      f"kernels; set {SWITCH}=0 to silence this.",
      stacklevel=3,
    )
    return False
  try:
    lib = ctypes.cdll.LoadLibrary(str(_build(compiler)))
  except (OSError, subprocess.CalledProcessError) as err:
    detail = getattr(err, "stderr", "") or str(err)
    warnings.warn(
      f"distro_jax: building DeMo's CPU kernels failed, so the update takes XLA's "
      f"slower path ({detail.strip()[:500]}). Set {SWITCH}=0 to silence this.",
      stacklevel=3,
    )
    return False
  jax.ffi.register_ffi_target(_COMPRESS, jax.ffi.pycapsule(lib.DistroJaxDemoCompress), "cpu")
  jax.ffi.register_ffi_target(_DECODE, jax.ffi.pycapsule(lib.DistroJaxDemoDecode), "cpu")
  return True


def available() -> bool:
  """Whether DeMo's update uses the kernels where they apply, as traced now.

  True when JAX's default backend is the CPU, ``DISTRO_JAX_CPU_KERNELS`` is
  not ``0``, no :func:`disabled` block is open in this thread, and the kernels
  built.
  """
  if getattr(_local, "off", False) or os.environ.get(SWITCH, "1") == "0":
    return False
  if jax.default_backend() != "cpu":
    return False
  return _library()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
  """Traces DeMo's update on XLA's path within the block (this thread only).

  Example:
    >>> import distro_jax as dj
    >>> with dj.cpu_kernels.disabled():
    ...   dj.cpu_kernels.available()
    False
  """
  before = getattr(_local, "off", False)
  _local.off = True
  try:
    yield
  finally:
    _local.off = before


def serves(plan: dct.ChunkPlan, *arrays: jax.Array, k: int | None = None) -> bool:
  """Whether the kernels handle a tensor of ``plan`` given as ``arrays`` (block views).

  ``k``, when given, is the top-k per chunk that :func:`compress` would select.
  """
  if plan.c1 != CHUNK or plan.c2 != CHUNK or (k is not None and not 1 <= k <= MAX_K):
    return False
  if any(x.dtype != jnp.float32 or dct.placed_on_mesh(x) for x in arrays):
    return False
  return available()


@functools.cache
def _tables_np() -> np.ndarray:
  parts = []
  for m in range(5, 0, -1):
    size = 1 << m
    parts.append(2.0 * np.cos(np.pi * (2 * np.arange(size) + 1) / (4.0 * size)))
  parts.append(np.array([np.cos(np.pi / 4), np.sqrt(1.0 / CHUNK), np.sqrt(2.0 / CHUNK)]))
  # NumPy's, not dct.dct_basis's jax array: this runs while the update traces.
  parts.append(dct._basis_np(CHUNK).reshape(-1))
  return np.concatenate(parts).astype(np.float32)


def _require() -> None:
  if not _library():
    raise RuntimeError(
      "distro_jax's CPU kernels could not be built here (see the warning above); "
      "check cpu_kernels.available() before calling them, or install a C++ compiler."
    )


def tables() -> jax.Array:
  """The kernels' DCT tables: DCT-IV twiddles for sizes 32 to 1, two scales, the basis."""
  return jnp.asarray(_tables_np())


def _typed_like(outs: tuple[jax.Array, ...], *inputs: jax.Array) -> tuple[jax.Array, ...]:
  """``outs`` typed as varying over every mesh axis some input varies over.

  Inside ``shard_map`` a custom call's results come out typed as the same on
  every device; what they hold depends on the inputs, so they vary as the
  inputs do (as the XLA path's elementwise results would).
  """
  axes = frozenset().union(*(exchange.varying_axes(x) for x in inputs))
  return tuple(exchange.as_varying(o, axes) for o in outs)


def _matrices(x_blocks: jax.Array) -> jax.Array:
  """A block view as the ``(batch, n1, n2)`` matrices the kernels read (no data moved)."""
  *lead, a, c1, b, c2 = x_blocks.shape
  return x_blocks.reshape(-1, a * c1, b * c2)


def compress(
  g_blocks: jax.Array, m_blocks: jax.Array, decay: jax.Array | float, lr: jax.Array | float, k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``m' = decay * m + lr * DCT(g)`` and the top-k of every chunk of ``m'``.

  Args:
    g_blocks: a float32 gradient in its block view ``(*lead, A, 64, B, 64)``.
    m_blocks: the float32 momentum, same shape.
    decay: the momentum's decay.
    lr: the learning rate that scales the new coefficients.
    k: entries kept per chunk, 1 to :data:`MAX_K` (512).

  Returns:
    ``(m', indices, values)``: ``m'`` in the block view, and int32 indices and
    float32 values of shape ``(*lead, A, B, k)`` in ``jax.lax.top_k``'s order.
  """
  _require()
  *lead, a, _, b, _ = g_blocks.shape
  scalars = jnp.stack([jnp.asarray(decay, jnp.float32), jnp.asarray(lr, jnp.float32)])
  shape = (*lead, a, b, k)
  call = jax.ffi.ffi_call(
    _COMPRESS,
    (
      jax.ShapeDtypeStruct(_matrices(g_blocks).shape, jnp.float32),
      jax.ShapeDtypeStruct(shape, jnp.int32),
      jax.ShapeDtypeStruct(shape, jnp.float32),
    ),
    vmap_method="sequential",
  )
  m_new, idx, val = call(_matrices(g_blocks), _matrices(m_blocks), scalars, tables(), k=np.int64(k))
  m_new, idx, val = _typed_like((m_new, idx, val), g_blocks, m_blocks, scalars)
  return m_new.reshape(g_blocks.shape), idx, val


def decode(
  indices: jax.Array, values: jax.Array, valid_W: jax.Array, block_shape: tuple[int, ...]
) -> jax.Array:
  """The inverse DCT of the mean of the workers' selections, in the block view.

  The workers are folded in in :func:`distro_jax.codec.worker_order`, as
  :func:`distro_jax.codec.aggregate_blocks` folds them, so the mean is the
  same to the bit.

  Args:
    indices: int chunk-local indices ``(W, *lead, A, B, k)`` from each worker.
    values: float values, same shape.
    valid_W: bool per worker; False leaves it out.
    block_shape: the tensor's block view ``(*lead, A, 64, B, 64)``.

  Returns:
    float32 of shape ``block_shape``: what :func:`distro_jax.dct.inverse_blocks`
    gives of :func:`distro_jax.codec.aggregate_blocks`'s mean.
  """
  _require()
  num_workers = indices.shape[0]
  *lead, a, c1, b, c2 = block_shape
  rows = int(np.prod(lead, dtype=np.int64)) * a * b
  idx = indices.astype(jnp.int32).reshape(num_workers, rows, -1)
  val = values.astype(jnp.float32).reshape(num_workers, rows, -1)
  call = jax.ffi.ffi_call(
    _DECODE,
    jax.ShapeDtypeStruct((rows // (a * b), a * c1, b * c2), jnp.float32),
    vmap_method="sequential",
  )
  valid = valid_W.astype(jnp.int32)
  (out,) = _typed_like((call(idx, val, valid, tables()),), idx, val, valid)
  return out.reshape(block_shape)
