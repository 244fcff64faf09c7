"""Test setup: 8 simulated CPU devices, so data-parallel code runs as on a real mesh.

XLA compiles for tests with its CPU backend's optimizations off. The suite
compiles hundreds of small programs and runs each for a few steps, so
compiling dominates: these flags halve the compile time of a train step and
cost a few milliseconds per step run. Every comparison a test makes to the bit
(two modes of one exchange, a resumed run and a straight one, one process and
two) is between programs compiled under the same flags, and the subprocesses
the tests start inherit them. An ``XLA_FLAGS`` already set is left alone.

A persistent compilation cache, shared with the subprocesses the tests start,
lets the many runs of the same small train step compile once. It lives in a
temporary directory that the session removes at its end. To keep compiled
programs from one run to the next, point ``JAX_COMPILATION_CACHE_DIR`` at a
directory of your own (and ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0``
to keep the small ones too): a second quick loop then takes about 30% less
CPU time. Nothing removes old entries from such a directory.
"""

import collections
import os
import shutil
import tempfile

import pytest

TEST_XLA_FLAGS = (
  "--xla_force_host_platform_device_count=8"
  " --xla_backend_optimization_level=0"
  " --xla_llvm_disable_expensive_passes=true"
  " --xla_cpu_use_fusion_emitters=false"
)

os.environ.setdefault("XLA_FLAGS", TEST_XLA_FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Made by the session that started the others (xdist's workers and the
# tests' subprocesses inherit the variable), which removes it at its end.
SESSION_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  SESSION_CACHE = tempfile.mkdtemp(prefix="distro_jax_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = SESSION_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
  """Orders the tests for ``-n 2``: slow ones first, one at a time; quick ones by file.

  A worker takes the next test (or group, see ``xdist_group``) when it is
  free. With the long tests at the front, the short ones come last and fill
  in around them, and neither worker is left alone with a long test at the
  end. The quick tests go out a file at a time, so that the functions a file
  compiles once (module fixtures, caches) are compiled on one worker only;
  the files with the most quick tests go first. The order is the same on
  every worker, as xdist requires.
  """
  del config

  def is_slow(item):
    return item.get_closest_marker("slow") is not None

  def path(item):
    return item.nodeid.split("::")[0]

  quick_per_file = collections.Counter(path(item) for item in items if not is_slow(item))
  for item in items:
    if not is_slow(item) and item.get_closest_marker("xdist_group") is None:
      item.add_marker(pytest.mark.xdist_group(f"quick-{path(item)}"))
  items.sort(key=lambda item: (0, 0) if is_slow(item) else (1, -quick_per_file[path(item)]))


def pytest_unconfigure(config):
  if SESSION_CACHE is not None and not hasattr(config, "workerinput"):
    shutil.rmtree(SESSION_CACHE, ignore_errors=True)
