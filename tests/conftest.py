"""Test setup: 8 simulated CPU devices, so data-parallel code runs as on a real mesh.

XLA compiles for tests with its CPU backend's optimizations off. The suite
compiles hundreds of small programs and runs each for a few steps, so
compiling dominates: these flags halve the compile time of a train step and
cost a few milliseconds per step run. Every comparison a test makes to the bit
(two modes of one exchange, a resumed run and a straight one, one process and
two) is between programs compiled under the same flags, and the subprocesses
the tests start inherit them. An ``XLA_FLAGS`` already set is left alone.

A persistent compilation cache, shared with the subprocesses the tests start,
lets the many runs of the same small train step compile once.
"""

import os
import tempfile

TEST_XLA_FLAGS = (
  "--xla_force_host_platform_device_count=8"
  " --xla_backend_optimization_level=0"
  " --xla_llvm_disable_expensive_passes=true"
  " --xla_cpu_use_fusion_emitters=false"
)

os.environ.setdefault("XLA_FLAGS", TEST_XLA_FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="distro_jax_xla_cache_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


def pytest_collection_modifyitems(config, items):
  """Runs the slow tests first.

  Under ``-n 2`` a worker takes the next test when it is free. With the long
  tests at the front, the short ones come last and fill in around them, and
  neither worker is left alone with a long test at the end. The sort is
  stable, so each group keeps its collection order (the same on every worker).
  """
  del config
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)
