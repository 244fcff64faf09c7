"""Chunk planning and the chunked orthonormal DCT."""

import compiled
import jax.numpy as jnp
import numpy as np
import pytest
from numpy_reference import Chunker

import distro_jax as dj


@pytest.mark.parametrize(
  "n, target, expected",
  [(4096, 64, 64), (40, 64, 40), (96, 64, 48), (7, 64, 7), (127, 64, 1), (1, 64, 1), (64, 64, 64)],
)
def test_chunk_length_is_largest_divisor_not_above_target(n, target, expected):
  assert dj.dct.chunk_length(n, target) == expected


def test_dct_basis_is_orthonormal_dct_ii():
  for n in (1, 2, 7, 64):
    d = np.asarray(dj.dct.dct_basis(n), np.float64)
    np.testing.assert_allclose(d @ d.T, np.eye(n), atol=1e-6)
  d = np.asarray(dj.dct.dct_basis(8), np.float64)
  x = np.random.default_rng(0).normal(size=8)
  # DCT-II by its definition, orthonormal scaling.
  k = np.arange(8)
  direct = np.array([np.sum(x * np.cos(np.pi * (2 * k + 1) * j / 16)) for j in range(8)])
  direct *= np.sqrt(2 / 8)
  direct[0] /= np.sqrt(2)
  np.testing.assert_allclose(d @ x, direct, atol=1e-5)


def _forward(x, plan):
  return dj.dct.DCT_BASIS.forward(dj.dct.to_blocks(x, plan), plan)


def _inverse(y, plan):
  return dj.dct.from_blocks(dj.dct.DCT_BASIS.inverse(y, plan), plan)


@pytest.mark.parametrize("shape", [(), (1,), (7,), (128,), (96, 40), (64, 128), (13, 31)])
def test_transform_matches_independent_numpy_chunking(shape):
  x = np.random.default_rng(1).normal(size=shape)
  plan = dj.dct.plan_chunks(shape, 64)
  ours = np.asarray(compiled.dct_rows(jnp.asarray(x, jnp.float32), plan), np.float64)
  ref = Chunker(shape, 64).forward(x)
  np.testing.assert_allclose(ours, ref.reshape(ours.shape), atol=1e-5)


@pytest.mark.parametrize("shape", [(), (5,), (96, 40), (3, 64, 128), (2, 3, 12, 10)])
def test_inverse_inverts_the_transform_for_any_rank(shape):
  x = jnp.asarray(np.random.default_rng(2).normal(size=shape), jnp.float32)
  plan = dj.dct.plan_chunks(shape, 8)
  y = _forward(x, plan)
  assert y.shape == plan.block_shape and y.dtype == jnp.float32
  np.testing.assert_allclose(_inverse(y, plan), x, atol=1e-5)


def test_leading_axes_are_batch_axes():
  x = jnp.asarray(np.random.default_rng(3).normal(size=(3, 16, 24)), jnp.float32)
  plan = dj.dct.plan_chunks(x.shape, 8)
  stacked = _forward(x, plan)
  for i in range(3):
    single = _forward(x[i], dj.dct.plan_chunks(x[i].shape, 8))
    np.testing.assert_allclose(stacked[i], single, atol=1e-6)


def test_bf16_input_is_transformed_in_float32():
  x = jnp.asarray(np.random.default_rng(4).normal(size=(64, 64)), jnp.bfloat16)
  plan = dj.dct.plan_chunks(x.shape, 64)
  y = _forward(x, plan)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(_inverse(y, plan), np.asarray(x, np.float32), atol=1e-5)


@pytest.mark.parametrize("shape", [(), (7,), (96, 40), (2, 64, 128)])
def test_to_chunks_is_the_transform_without_the_dct(shape):
  x = np.random.default_rng(3).normal(size=shape).astype(np.float32)
  plan = dj.dct.plan_chunks(shape, 64)
  blocks = np.asarray(dj.dct.to_chunks(jnp.asarray(x), plan), np.float64)
  assert blocks.shape == plan.coeff_shape
  # Row r of the transform is the 2-D DCT of chunk r, flattened c1-major.
  kron = np.kron(np.asarray(dj.dct.dct_basis(plan.c1)), np.asarray(dj.dct.dct_basis(plan.c2)))
  np.testing.assert_allclose(
    blocks @ kron.T.astype(np.float64),
    np.asarray(compiled.dct_rows(jnp.asarray(x), plan)),
    atol=1e-5,
  )
  np.testing.assert_array_equal(np.asarray(dj.dct.from_chunks(jnp.asarray(blocks), plan)), x)
