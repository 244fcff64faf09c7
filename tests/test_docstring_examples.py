"""The runnable examples in the public docstrings run and print what they say."""

import doctest
import importlib

import pytest

# The modules whose public functions carry examples.
MODULES = [
  "distro_jax.bitpack",
  "distro_jax.compress",
  "distro_jax.compression",
  "distro_jax.cpu_kernels",
  "distro_jax.dct",
  "distro_jax.decode",
  "distro_jax.delivery",
  "distro_jax.dense_step",
  "distro_jax.diloco",
  "distro_jax.elastic",
  "distro_jax.exchange",
  "distro_jax.fsdp",
  # Its examples compile DeMo steps and a resize: about 15 s here.
  pytest.param("distro_jax.gspmd", marks=pytest.mark.slow),
  "distro_jax.hlo_bytes",
  # Each of these three compiles DeMo updates: 3 s or so.
  pytest.param("distro_jax.lookahead", marks=pytest.mark.slow),
  "distro_jax.message",
  "distro_jax.orthogonal",
  "distro_jax.overlap",
  "distro_jax.sparseloco",
  pytest.param("distro_jax.transforms", marks=pytest.mark.slow),
  pytest.param("distro_jax.unit_rms", marks=pytest.mark.slow),
  "distro_jax.wire",
  "distro_jax.worker_state",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0
  assert result.failed == 0
