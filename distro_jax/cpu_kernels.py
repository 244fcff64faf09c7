"""DeMo's fused CPU kernels, built with the C++ compiler on first use, called through ``jax.ffi``.

What they compute, how they round, when they run and where they are built:
docs/performance.md, "The fused CPU kernels". ``DISTRO_JAX_CPU_KERNELS=0`` or
:func:`disabled` turns them off; :func:`serves` says which tensors they take.
"""

import contextlib
import ctypes
import functools
import hashlib
import math
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from distro_jax import codec, dct, exchange, kernel_switch

try:
  import fcntl
except ImportError:  # not POSIX: concurrent first builds each build
  fcntl = None

__all__ = [
  "available",
  "compress",
  "decode",
  "disabled",
  "draw_positions",
  "serves",
  "serves_draw",
  "switched_off",
  "tables",
]

CHUNK = 64
SIDES = (8, 64)  # 8x8 chunks only with drawn positions and in the decode
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
_COMPRESS_AT, _COMPRESS8 = "distro_jax_demo_compress_at", "distro_jax_demo_compress8"
_DECODE8, _DRAW = "distro_jax_demo_decode8", "distro_jax_demo_draw"
_TARGETS = (_COMPRESS, _DECODE, _COMPRESS_AT, _COMPRESS8, _DECODE8, _DRAW)
_switch = kernel_switch.Switch(SWITCH)


def _cpu_signature() -> str:
  """What a binary built with -march=native depends on: the CPU's feature flags."""
  with contextlib.suppress(OSError):
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith(("flags", "Features")):
        return line
  return platform.processor() or platform.machine()


def _cache_dir() -> pathlib.Path:
  default = pathlib.Path.home() / ".cache" / "distro_jax"
  return pathlib.Path(os.environ.get("DISTRO_JAX_CACHE", default))


def _build(compiler: str) -> pathlib.Path:
  key = hashlib.sha256(_SOURCE.read_bytes())
  headers = jax.ffi.include_dir()
  for part in (" ".join(_FLAGS), compiler, headers, _cpu_signature(), jax.__version__):
    key.update(part.encode())
  target = _cache_dir() / f"demo_cpu_{key.hexdigest()[:16]}.so"
  if target.exists():
    return target
  target.parent.mkdir(parents=True, exist_ok=True)
  # Processes starting at once build once: the others wait for the lock (which
  # closing the file releases). The rename keeps any process from loading a
  # half-written file.
  with open(target.with_suffix(".lock"), "a") as lock:
    if fcntl is not None:
      fcntl.flock(lock, fcntl.LOCK_EX)
    if target.exists():
      return target
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
      cmd = [compiler, *_FLAGS, f"-I{headers}", str(_SOURCE), "-o", tmp]
      subprocess.run(cmd, check=True, capture_output=True, text=True)
      os.replace(tmp, target)
    finally:
      pathlib.Path(tmp).unlink(missing_ok=True)
  return target


_build_lock = threading.Lock()


def _library() -> bool:
  """Builds (or finds), loads and registers the kernels once, under a lock; False if that fails."""
  with _build_lock:
    return _load()


@functools.cache
def _load() -> bool:
  compiler = os.environ.get("CXX", "c++")
  if shutil.which(compiler) is None:
    warnings.warn(
      f"distro_jax: no C++ compiler ({compiler!r}) found, so DeMo's CPU update takes XLA's "
      f"slower path. Install one (e.g. g++) or set CXX; set {SWITCH}=0 to silence this.",
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
  for target in _TARGETS:
    # The library names each kernel in CamelCase: DistroJaxDemoCompressAt.
    symbol = target.title().replace("_", "")
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), "cpu")
  return True


def available() -> bool:
  """Whether DeMo's update takes the kernels where they serve: on a CPU, not switched off, built."""
  return not _switch.off() and jax.default_backend() == "cpu" and _library()


def disabled() -> contextlib.AbstractContextManager[None]:
  """Traces DeMo's update on XLA's path within the block (this thread only).

  Example:
    >>> import distro_jax as dj
    >>> with dj.cpu_kernels.disabled():
    ...   dj.cpu_kernels.available()
    False
  """
  return _switch.disabled()


def switched_off() -> bool:
  """Whether ``DISTRO_JAX_CPU_KERNELS=0`` or a :func:`disabled` block is on (builds nothing)."""
  return _switch.off()


def serves(
  plan: dct.ChunkPlan, *arrays: jax.Array, k: int | None = None, drawn: bool = False
) -> bool:
  """Whether the kernels take a tensor of ``plan`` given as block views ``arrays``.

  ``k`` (``None``: :func:`decode`) and ``drawn`` as in :func:`distro_jax.kernel_switch.fits`.
  """
  fit = kernel_switch.fits(
    plan, arrays, k=k, drawn=drawn, sides=SIDES, top_k_side=CHUNK, max_k=MAX_K
  )
  return fit and available()


def serves_draw(block_shape: tuple[int, ...], like: jax.Array) -> bool:
  """Whether :func:`draw_positions` takes the positions of ``block_shape`` for tensor ``like``."""
  *lead, a, _, b, _ = block_shape
  return math.prod(lead) * a * b > 0 and not dct.placed_on_mesh(like) and available()


@functools.cache
def _tables_np() -> np.ndarray:
  parts = []
  for m in range(5, 0, -1):
    size = 1 << m
    parts.append(2.0 * np.cos(np.pi * (2 * np.arange(size) + 1) / (4.0 * size)))
  parts.append(np.array([np.cos(np.pi / 4), np.sqrt(1.0 / CHUNK), np.sqrt(2.0 / CHUNK)]))
  # NumPy's, not a jax array: this runs while the update traces.
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
  """``outs`` typed as varying over the inputs' mesh axes (a custom call's are typed invariant)."""
  axes = frozenset().union(*(exchange.varying_axes(x) for x in inputs))
  return tuple(exchange.as_varying(o, axes) for o in outs)


def _matrices(x_blocks: jax.Array) -> jax.Array:
  """A block view as the ``(batch, n1, n2)`` matrices the kernels read (no data moved)."""
  *lead, a, c1, b, c2 = x_blocks.shape
  return x_blocks.reshape(-1, a * c1, b * c2)


def compress(
  g_blocks: jax.Array,
  m_blocks: jax.Array,
  decay: jax.Array | float,
  lr: jax.Array | float,
  k: int,
  positions: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``m' = decay * m + lr * DCT(g)`` and the top-k (or the drawn entries) of every chunk of ``m'``.

  Args:
    g_blocks: a float32 gradient's block view ``(*lead, A, c, B, c)``, ``c`` 64 (8 if drawn).
    m_blocks: the float32 momentum, same shape.
    decay: the momentum's decay.
    lr: the learning rate that scales the new coefficients.
    k: entries kept per chunk, 1 to ``MAX_K``.
    positions: drawn chunk-local positions ``(*lead, A, B, k)``, taken instead of the top-k.

  Returns:
    ``(m', indices, values)``: ``m'``'s block view, and int32 indices (in
    ``jax.lax.top_k``'s order) and float32 values, ``(*lead, A, B, k)``.
  """
  _require()
  *lead, a, side, b, _ = g_blocks.shape
  scalars = jnp.stack([jnp.asarray(decay, jnp.float32), jnp.asarray(lr, jnp.float32)])
  g, m = _matrices(g_blocks), _matrices(m_blocks)
  m_shape = jax.ShapeDtypeStruct(g.shape, jnp.float32)
  values = jax.ShapeDtypeStruct((*lead, a, b, k), jnp.float32)
  if positions is None:
    indices = values.update(dtype=jnp.int32)
    call = jax.ffi.ffi_call(_COMPRESS, (m_shape, indices, values), vmap_method="sequential")
    m_new, idx, val = call(g, m, scalars, tables(), k=np.int64(k))
  else:
    idx = positions.astype(jnp.int32)
    target, table = (_COMPRESS8, basis8()) if side == 8 else (_COMPRESS_AT, tables())
    call = jax.ffi.ffi_call(target, (m_shape, values), vmap_method="sequential")
    m_new, val = call(g, m, scalars, table, idx)
  m_new, idx, val = _typed_like((m_new, idx, val), g_blocks, m_blocks, scalars, idx)
  return m_new.reshape(g_blocks.shape), idx, val


def decode(
  indices: jax.Array, values: jax.Array, valid_W: jax.Array, block_shape: tuple[int, ...]
) -> jax.Array:
  """The inverse DCT of :func:`distro_jax.codec.aggregate_blocks`'s mean, same bits, float32.

  Args:
    indices: int chunk-local indices ``(W, *lead, A, B, k)`` from each worker.
    values: float values, same shape.
    valid_W: bool per worker; False leaves it out.
    block_shape: the tensor's block view ``(*lead, A, c, B, c)``, ``c`` 64 or 8.
  """
  _require()
  num_workers = indices.shape[0]
  *lead, a, c1, b, c2 = block_shape
  batch = int(np.prod(lead, dtype=np.int64))
  idx = indices.astype(jnp.int32).reshape(num_workers, batch * a * b, -1)
  val = values.astype(jnp.float32).reshape(num_workers, batch * a * b, -1)
  target, table = (_DECODE8, basis8()) if c1 == 8 else (_DECODE, tables())
  matrices = jax.ShapeDtypeStruct((batch, a * c1, b * c2), jnp.float32)
  call = jax.ffi.ffi_call(target, matrices, vmap_method="sequential")
  valid = valid_W.astype(jnp.int32)
  (out,) = _typed_like((call(idx, val, valid, table),), idx, val, valid)
  return out.reshape(block_shape)


def draw_positions(
  key: jax.Array, block_shape: tuple[int, ...], k: int, frequency_bias: float = 0.0
) -> jax.Array:
  """:func:`distro_jax.codec.draw_positions` with a threefry key, to the bit, in one pass."""
  _require()
  *lead, a, c1, b, c2 = block_shape
  lo, hi, ends = codec.draw_tables(c1, c2, k, frequency_bias)
  if ends is None:
    ends = np.full((1,), -1, np.int32)  # the kernel's mark of a uniform draw
  # randint splits its key in two: one for the higher draw, one for the lower.
  halves = jax.random.key_data(jax.random.split(key))
  keys = jax.lax.bitcast_convert_type(halves, jnp.uint32).reshape(4)
  call = jax.ffi.ffi_call(
    _DRAW, jax.ShapeDtypeStruct((*lead, a, b, k), jnp.int32), vmap_method="expand_dims"
  )
  (out,) = _typed_like((call(keys, jnp.asarray(lo), jnp.asarray(hi), jnp.asarray(ends)),), keys)
  return out


def basis8() -> jax.Array:
  """The 8x8 kernels' table: the orthonormal 8-point DCT-II basis, row-major."""
  return jnp.asarray(dct._basis_np(8).reshape(-1))
