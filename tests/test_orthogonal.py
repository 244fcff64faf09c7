"""dj.orthogonalize and DeMo's normalize="orth": each matrix's step orthogonalized."""

import functools

import compiled
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import distro_jax as dj


@pytest.mark.parametrize("shape", [(32, 32), (16, 48), (96, 24)], ids=["square", "wide", "tall"])
def test_singular_values_move_towards_one_and_the_vectors_stay(shape):
  rng = np.random.default_rng(0)
  # Singular values spread over two decades.
  u, _ = np.linalg.qr(rng.normal(size=(shape[0], shape[0])))
  v, _ = np.linalg.qr(rng.normal(size=(shape[1], shape[1])))
  r = min(shape)
  s = np.geomspace(10.0, 0.1, r)
  x = (u[:, :r] * s) @ v[:, :r].T
  got = np.asarray(dj.orthogonalize(jnp.asarray(x, jnp.float32)), np.float64)
  assert got.shape == shape
  sv = np.linalg.svd(got, compute_uv=False)
  # The quintic's band is about (0.7, 1.2); the smallest inputs are 100x
  # below the largest and still come up to it.
  assert sv.min() > 0.6 and sv.max() < 1.3, sv
  # Same singular vectors: projected on the input's, the result is diagonal.
  d = u[:, :r].T @ got @ v[:, :r]
  np.testing.assert_allclose(d, np.diag(np.diag(d)), atol=1e-4)


def test_zero_stays_zero_and_the_dtype_is_kept():
  np.testing.assert_array_equal(dj.orthogonalize(jnp.zeros((8, 4))), 0.0)
  for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
    out = dj.orthogonalize(jnp.eye(8, dtype=dtype) * 3)
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.eye(8), atol=0.35)


def test_orthogonalize_refuses_a_non_matrix():
  with pytest.raises(ValueError, match=r"takes a matrix; got shape \(4,\)"):
    dj.orthogonalize(jnp.ones(4))


def _unit_rms(x):
  return x / np.sqrt(np.mean(x**2))


def test_demo_orth_steps_each_matrix_orthogonalized_and_each_vector_at_unit_rms():
  # One worker and every coefficient sent: Q is the gradient itself.
  rng = np.random.default_rng(1)
  g = {
    "w": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(8,)), jnp.float32),
  }
  params = jax.tree.map(jnp.zeros_like, g)
  tx = compiled.transformation(
    dj.demo(0.1, compression_topk=64, compression_chunk=8, normalize="orth", axis_name=None)
  )
  updates, _ = tx.update(g, tx.init(params), params)
  want_w = _unit_rms(np.asarray(dj.orthogonalize(g["w"]), np.float64))
  # Q is g through a float32 DCT and back, within about 1e-7 of it.
  np.testing.assert_allclose(np.asarray(updates["w"]), -0.1 * want_w, rtol=0, atol=2e-6)
  b = np.asarray(g["b"], np.float64)
  np.testing.assert_allclose(np.asarray(updates["b"]), -0.1 * _unit_rms(b), rtol=1e-5)
  # Orthogonalized, the step is not the gradient at unit RMS.
  assert not np.allclose(np.asarray(updates["w"]), -0.1 * _unit_rms(np.asarray(g["w"])), atol=1e-2)


def test_normalize_per_param_as_a_tree_or_a_function():
  rng = np.random.default_rng(2)
  g = {k: jnp.asarray(rng.normal(size=(8, 8)), jnp.float32) for k in ("embed", "w")}
  params = jax.tree.map(jnp.zeros_like, g)
  opts = dict(compression_topk=64, compression_chunk=8, axis_name=None)

  def step(normalize):
    tx = dj.demo(0.1, normalize=normalize, **opts)
    return tx.update(g, tx.init(params), params)[0]

  per_tree = step({"embed": "rms", "w": "orth"})
  per_function = step(lambda p: {k: "rms" if k == "embed" else "orth" for k in p})
  whole_rms, whole_orth = step("rms"), step("orth")
  for got in (per_tree, per_function):
    np.testing.assert_array_equal(got["embed"], whole_rms["embed"])
    np.testing.assert_array_equal(got["w"], whole_orth["w"])
  with pytest.raises(ValueError, match="normalize='l2'; use normalize='sign'"):
    step({"embed": "rms", "w": "l2"})
  with pytest.raises(ValueError, match="normalize=1; use normalize='sign'"):
    dj.demo(0.1, normalize={"embed": "rms", "w": 1})
  with pytest.raises(ValueError, match="normalize='RMS'; use normalize='sign'"):
    step(lambda p: {k: "RMS" for k in p})
  with pytest.raises(ValueError, match="a tree of them with the params' structure"):
    step({"embed": "rms"})


def test_a_matrix_split_within_a_worker_is_refused_with_the_fix():
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
  tx = dj.demo(1e-3, compression_topk=4, compression_chunk=8, normalize="orth")

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))
  def step(block):
    params = {"w": block}
    return tx.update(params, tx.init(params), params)[0]["w"]

  x = jax.device_put(jnp.ones((32, 8)), NamedSharding(mesh, P("fsdp")))
  with pytest.raises(ValueError, match=r"split over the mesh axes \('fsdp',\).*normalize='rms'"):
    jax.jit(step)(x)
