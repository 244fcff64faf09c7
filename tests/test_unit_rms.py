"""dj.scale_to_unit_rms and DeMo's normalize="rms": each tensor's step at unit RMS."""

import functools

import compiled
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import distro_jax as dj


def test_each_tensor_gets_unit_rms_and_keeps_its_shape_of_sizes():
  rng = np.random.default_rng(0)
  tree = {
    "a": jnp.asarray(rng.normal(size=(16, 8)) * 3.0, jnp.float32),
    "b": jnp.asarray(rng.normal(size=(5,)) * 1e-4, jnp.float32),
    "zero": jnp.zeros((4, 4), jnp.float32),
  }
  tx = dj.scale_to_unit_rms()
  out, _ = jax.jit(tx.update)(tree, tx.init(tree))
  for key in ("a", "b"):
    got, x = np.asarray(out[key], np.float64), np.asarray(tree[key], np.float64)
    np.testing.assert_allclose(np.sqrt(np.mean(got**2)), 1.0, rtol=1e-6)
    np.testing.assert_allclose(got, x / np.sqrt(np.mean(x**2)), rtol=1e-5)
  # Nothing to scale (every message left out): a zero step, not a NaN.
  np.testing.assert_array_equal(out["zero"], 0.0)
  assert jax.eval_shape(tx.init, tree) == tx.init(tree)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_the_dtype_is_kept(dtype):
  tx = dj.scale_to_unit_rms()
  x = {"w": jnp.asarray([3.0, -1.0, 1.0, 1.0], dtype)}
  out, _ = tx.update(x, tx.init(x))
  assert out["w"].dtype == dtype
  np.testing.assert_allclose(np.asarray(out["w"], np.float32), [1.732, -0.577, 0.577, 0.577], 2e-2)


def test_a_tensor_sharded_within_a_worker_takes_the_whole_tensors_rms():
  # Blocks over "fsdp" of a tensor every "data" worker holds whole: each block
  # is scaled by the RMS of the whole, the same factor on every block.
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
  x = jnp.asarray(np.random.default_rng(1).normal(size=(32, 8)) * np.arange(1, 33)[:, None])
  tx = dj.scale_to_unit_rms("data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))
  def scaled(block):
    return tx.update({"w": block}, tx.init(None))[0]["w"]

  got = np.asarray(scaled(jax.device_put(x, NamedSharding(mesh, P("fsdp")))))
  whole = tx.update({"w": x}, tx.init(None))[0]["w"]
  np.testing.assert_allclose(got, np.asarray(whole), rtol=1e-6)
  # Each block alone would have had its own RMS, far from the whole's.
  first = np.asarray(x[:8])
  assert not np.allclose(got[:8], first / np.sqrt(np.mean(first**2)), rtol=1e-2)


def test_demo_refuses_an_unknown_normalize():
  with pytest.raises(ValueError, match="normalize='l2'; use normalize='sign'"):
    dj.demo(1e-3, normalize="l2")
  with pytest.raises(ValueError, match="normalize='rms'"):
    dj.lookahead_update(None, {}, 1e-3, normalize="RMS")


def test_demo_rms_steps_along_the_aggregate_at_unit_rms():
  # One worker and a gradient whose every coefficient is sent: Q is the
  # gradient itself, so the step is -lr * g / rms(g), not -lr * sign(g).
  rng = np.random.default_rng(2)
  g = {"w": jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)}
  params = {"w": jnp.zeros((8, 8), jnp.float32)}
  tx = dj.demo(0.1, compression_topk=64, compression_chunk=8, normalize="rms", axis_name=None)
  updates, _ = tx.update(g, tx.init(params), params)
  w = np.asarray(g["w"], np.float64)
  np.testing.assert_allclose(np.asarray(updates["w"]), -0.1 * w / np.sqrt(np.mean(w**2)), 1e-5)


@pytest.mark.parametrize(
  "normalize, shape, atol",
  [("rms", lambda m: m, 1e-6), ("orth", dj.orthogonalize, 1e-5)],
  ids=["rms", "orth"],
)
def test_the_lookahead_guesses_with_the_same_normalize(normalize, shape, atol):
  opts = dict(compression_topk=4, normalize=normalize)
  params = {"w": jnp.zeros((16, 16))}
  tx = compiled.transformation(
    dj.demo(0.1, compression_decay=0.9, delayed_apply=True, axis_name=None, **opts)
  )
  g = {"w": jnp.asarray(np.random.default_rng(3).normal(size=(16, 16)), jnp.float32)}
  _, state = tx.update(g, tx.init(params), params)
  at = compiled.gradient_point(0.1, **opts)(state, params)
  # The momentum before error feedback is lr * g: the guess is lr * g shaped
  # as the update is (orthogonalized or not), at unit RMS.
  w = np.asarray(shape(0.1 * g["w"]), np.float64)
  np.testing.assert_allclose(np.asarray(at["w"]), -0.1 * w / np.sqrt(np.mean(w**2)), atol=atol)
  # The same state read as a sign step guesses the sign.
  sign = compiled.gradient_point(0.1, compression_topk=4)(state, params)
  np.testing.assert_allclose(np.asarray(sign["w"]), -0.1 * np.sign(g["w"]), atol=1e-7)


@pytest.mark.parametrize("mode", ["sign", "rms", "orth"])
def test_per_layer_normalizes_each_layer_as_a_separate_param(mode):
  from distro_jax.unit_rms import normalized_step

  rng = np.random.default_rng(3)
  stack_LxMxN = jnp.asarray(rng.normal(size=(3, 16, 24)) * [[[1.0]], [[1e-3]], [[50.0]]])
  rows_Lx1xD = jnp.asarray(rng.normal(size=(3, 1, 32)) * [[[1.0]], [[1e-3]], [[50.0]]])
  got = jax.jit(normalized_step, static_argnums=1)(stack_LxMxN, dj.PerLayer(mode))
  got_rows = jax.jit(normalized_step, static_argnums=1)(rows_Lx1xD, dj.PerLayer(mode))
  for i in range(3):
    # A layer steps as the same matrix held as a param of its own.
    np.testing.assert_allclose(got[i], normalized_step(stack_LxMxN[i], mode), rtol=2e-5, atol=1e-5)
    # A (1, d) layer is a vector in row layout, which "orth" scales as a vector.
    want = normalized_step(rows_Lx1xD[i, 0], mode)
    np.testing.assert_allclose(got_rows[i, 0], want, rtol=2e-5, atol=1e-5)
  # Two layer axes, (1, 3, ...), index the same three layers.
  got_2 = normalized_step(stack_LxMxN[None], dj.PerLayer(mode, axes=2))
  np.testing.assert_allclose(got_2[0], got, rtol=2e-5, atol=1e-5)
  if mode != "sign":
    # The whole stack as one tensor is another step: that is what PerLayer is for.
    whole = normalized_step(stack_LxMxN, mode)
    assert not np.allclose(whole, got, rtol=1e-2)


def test_per_layer_refuses_what_it_cannot_mean():
  from distro_jax.unit_rms import normalized_step

  with pytest.raises(ValueError, match="use one of 'sign', 'rms', 'orth'"):
    dj.PerLayer("muon")
  with pytest.raises(ValueError, match="use an int of 1 or more"):
    dj.PerLayer("orth", axes=0)
  with pytest.raises(ValueError, match="no axes left for a layer"):
    normalized_step(jnp.ones((4,)), dj.PerLayer("rms"))
  # A tree of modes may hold PerLayer leaves, and nothing else but modes.
  dj.demo(1e-3, normalize={"w": dj.PerLayer("orth"), "b": "rms"})
  with pytest.raises(ValueError, match="dj.PerLayer"):
    dj.demo(1e-3, normalize={"w": "orthogonal"})


@pytest.mark.parametrize(
  ("mode", "shape", "axis"),
  [
    ("orth", (16, 32), 1),
    ("orth", (32, 16), 0),
    ("rms", (32, 8), 0),
    ("sign", (16, 32), 1),
    (dj.PerLayer("orth"), (4, 16, 24), 0),
    (dj.PerLayer("orth"), (3, 16, 24), 2),
    (dj.PerLayer("rms"), (3, 16, 24), 1),
  ],
  ids=[
    "orth-cols",
    "orth-rows",
    "rms",
    "sign",
    "layers-split-by-layer",
    "layers-split-within",
    "layers-rms-within",
  ],
)
def test_a_split_param_takes_its_block_of_the_whole_tensors_step(mode, shape, axis):
  from distro_jax.unit_rms import normalized_step

  # Blocks over "fsdp" of a tensor every "data" worker holds: each device
  # gets its block of the step the whole tensor gets (the same arithmetic in
  # another compiled program, so up to rounding), and the blocks of every
  # worker agree bit for bit.
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
  x = jnp.asarray(np.random.default_rng(5).normal(size=shape) * np.arange(1, shape[-1] + 1))
  spec = P(*([None] * axis), "fsdp")
  split = dj.Split(mode, axis=axis, over="fsdp")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=spec, out_specs=P("data", *spec))
  def stepped(block):
    return normalized_step(block, split)[None]

  got = np.asarray(stepped(jax.device_put(x, NamedSharding(mesh, spec))))
  whole = np.asarray(jax.jit(normalized_step, static_argnums=1)(x, mode))
  np.testing.assert_array_equal(got[0], got[1])
  np.testing.assert_allclose(got[0], whole, rtol=2e-5, atol=1e-5)
  if mode == "orth":
    # Unmarked, a block of a split matrix is refused, and the error names the fix.
    with pytest.raises(ValueError, match="dj.Split"):
      normalized_step(x, "orth", ("fsdp",))


def test_split_refuses_what_it_cannot_mean():
  with pytest.raises(ValueError, match="or a dj.PerLayer of one"):
    dj.Split("muon", axis=0)
  with pytest.raises(ValueError, match="non-negative int"):
    dj.Split("orth", axis=-1)
  dj.demo(1e-3, normalize={"w": dj.Split(dj.PerLayer("orth"), axis=2), "b": "rms"})
  from distro_jax.unit_rms import normalized_step

  # The axis is checked against the block before anything is gathered.
  with pytest.raises(ValueError, match="has no axis 2; give the axis"):
    normalized_step(jnp.ones((4, 4)), dj.Split("orth", axis=2))


@pytest.mark.parametrize("mode", ["rms", "orth"])
def test_demo_on_a_stack_marked_per_layer_updates_as_on_its_layers(mode):
  # Three steps of DeMo on a (3, 64, 96) stack and on its three matrices: the
  # same chunks, messages and error feedback; the step of each layer normalized
  # alone. Equal up to the batched Newton-Schulz matmuls' rounding.
  rng = np.random.default_rng(4)
  grads = [rng.normal(size=(3, 64, 96)).astype(np.float32) for _ in range(3)]
  stacked = {"w": jnp.zeros((3, 64, 96))}
  separate = {f"w{i}": jnp.zeros((64, 96)) for i in range(3)}
  tx_stacked = dj.demo(1e-3, axis_name=None, normalize={"w": dj.PerLayer(mode)})
  tx_separate = dj.demo(1e-3, axis_name=None, normalize=mode)
  s_stacked, s_separate = tx_stacked.init(stacked), tx_separate.init(separate)
  for g in grads:
    u_stacked, s_stacked = jax.jit(tx_stacked.update)({"w": jnp.asarray(g)}, s_stacked, stacked)
    u_separate, s_separate = jax.jit(tx_separate.update)(
      {f"w{i}": jnp.asarray(g[i]) for i in range(3)}, s_separate, separate
    )
    for i in range(3):
      np.testing.assert_allclose(u_stacked["w"][i], u_separate[f"w{i}"], rtol=1e-4, atol=1e-9)
