"""Jitted handles on transformations and functions that tests call outside a step.

Called eagerly, JAX compiles one program per operation: an update of a small
DeMo tree is about a hundred programs, and a test of three updates spent
3 CPU-seconds compiling them where one jitted update takes 0.5. Tests that
drive an update by hand go through these, so each step is one program.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import optax

import distro_jax as dj


def transformation(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` with its ``init`` and ``update`` each compiled as one program."""
  return optax.GradientTransformation(jax.jit(tx.init), jax.jit(tx.update))


def gradient_point(learning_rate: Any = None, **lookahead: Any) -> Callable[[Any, Any], Any]:
  """``dj.gradient_point`` with its options fixed, as one program of (state, params)."""
  return jax.jit(functools.partial(dj.gradient_point, learning_rate=learning_rate, **lookahead))


# Tests of the codec that need no tensor shape give each chunk a row: the
# block view (rows, 1, 1, chunk) of one chunk per row, whose chunk-local
# indices are the row's positions.


def topk_rows(coeffs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """``dj.codec.select_topk_blocks`` of ``(rows, chunk)``: ``(indices, values)``, ``(rows, k)``."""
  rows, chunk = coeffs.shape
  idx, val = dj.codec.select_topk_blocks(coeffs.reshape(rows, 1, 1, chunk), k)
  return idx.reshape(rows, k), val.reshape(rows, k)


@functools.partial(jax.jit, static_argnames="chunk_size")
def aggregate_rows(
  indices: jax.Array, values: jax.Array, chunk_size: int, valid_W: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """``dj.codec.aggregate_blocks`` of ``(W, rows, k)`` selections: mean, count ``(rows, chunk)``."""
  rows = indices.shape[1]
  shape = (rows, 1, 1, chunk_size)
  ((mean, count),) = dj.codec.aggregate_blocks([(indices, values)], [shape], valid_W)
  return mean.reshape(rows, chunk_size), count.reshape(rows, chunk_size)


def dct_rows(x: jax.Array, plan: dj.dct.ChunkPlan) -> jax.Array:
  """``x``'s chunked DCT, one chunk's coefficients per row, each in chunk-local order."""
  return dj.dct.to_chunks(dj.dct.DCT_BASIS.forward(dj.dct.to_blocks(x, plan), plan), plan)
