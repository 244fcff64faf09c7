"""DeMo's Pallas kernels for the GPU, checked on the CPU in Pallas's interpret mode.

No GPU runs here: the kernels run in interpret mode against XLA's path and
float64 references, and their lowering to Triton for CUDA is checked by
exporting them (the last step, Triton to PTX, needs the GPU).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_step import assert_identical_on_every_device, mesh_of, place_grads, random_problem

import distro_jax as dj
from distro_jax import codec, cpu_kernels, dct, pallas_kernels

DCT_RTOL = 4e-6
# Jitted, as the update calls them: eager, the interpreter runs the kernel's
# ops one by one, and the values it hands back can round otherwise.
compress = jax.jit(pallas_kernels.compress, static_argnums=(4,), static_argnames="interpret")
decode = jax.jit(pallas_kernels.decode, static_argnums=(3,), static_argnames="interpret")


def _basis64(n):
  k, i = np.arange(n)[:, None], np.arange(n)[None, :]
  d = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * i + 1) * k / (2 * n))
  d[0] /= np.sqrt(2.0)
  return d


def _dct64(x_blocks, n):
  d = _basis64(n)
  return np.einsum("ip,...apbq,jq->...aibj", d, np.asarray(x_blocks, np.float64), d)


def _idct64(y_blocks, n):
  d = _basis64(n)
  return np.einsum("pi,...apbq,qj->...aibj", d, np.asarray(y_blocks, np.float64), d)


def _problem(shape, chunk, seed=0):
  rng = np.random.default_rng(seed)
  plan = dct.plan_chunks(shape, chunk)
  g = dct.to_blocks(jnp.asarray(rng.normal(size=shape), jnp.float32), plan)
  m = dct.to_blocks(jnp.asarray(rng.normal(size=shape) * 0.01, jnp.float32), plan)
  return plan, g, m


def test_compress_of_64x64_chunks_is_the_momentum_and_its_top_k():
  plan, g, m = _problem((64, 128), 64)
  # k = 3 is not a power of two: the kernel pads its slots and drops them.
  m_new, idx, val = compress(g, m, 0.95, 3e-3, 3, interpret=True)
  want = 0.95 * np.asarray(m, np.float64) + 3e-3 * _dct64(g, 64)
  np.testing.assert_allclose(m_new, want, rtol=0, atol=DCT_RTOL * np.abs(want).max())
  want_idx, want_val = codec.select_topk_blocks(m_new, 3)
  np.testing.assert_array_equal(idx, want_idx)
  np.testing.assert_array_equal(val, want_val)


@pytest.mark.slow
def test_compress_marks_a_chunk_with_a_non_finite_gradient():
  plan = dct.plan_chunks((64, 128), 64)
  g = np.ones((64, 128), np.float32)
  g[5, 100] = np.nan  # in the second chunk
  g_blocks = dct.to_blocks(jnp.asarray(g), plan)
  _, idx, val = pallas_kernels.compress(
    g_blocks, jnp.zeros_like(g_blocks), 0.9, 1.0, 2, interpret=True
  )
  val, idx = np.asarray(val).reshape(2, 2), np.asarray(idx).reshape(2, 2)
  assert np.isfinite(val[0]).all() and not np.isfinite(val[1]).any()
  np.testing.assert_array_equal(idx[1], [0, 1])  # in the chunk, for the error feedback


@pytest.mark.slow
@pytest.mark.parametrize("shape, chunk", [((16, 24), 8), ((64, 64), 64)])
def test_compress_at_drawn_positions_takes_the_momentum_there(shape, chunk):
  plan, g, m = _problem(shape, chunk, seed=1)
  positions = codec.draw_positions(codec.position_key(2, 0, 1), plan.block_shape, 2, 1.0)
  m_new, idx, val = compress(g, m, 0.95, 3e-3, 2, positions, interpret=True)
  want = 0.95 * np.asarray(m, np.float64) + 3e-3 * _dct64(g, chunk)
  np.testing.assert_allclose(m_new, want, rtol=0, atol=DCT_RTOL * np.abs(want).max())
  np.testing.assert_array_equal(idx, positions)
  np.testing.assert_array_equal(val, codec.gather_blocks(m_new, positions))


@pytest.mark.parametrize("chunk", [64, 8])
def test_decode_folds_the_workers_in_aggregate_blocks_order_to_the_bit(chunk):
  # Only the DC term is sent: the inverse DCT is the mean times d0, twice,
  # at every entry, so the kernel's mean reads back to the bit (as in
  # test_cpu_kernels), and a fold in another worker order shows.
  rng = np.random.default_rng(5)
  workers = 6
  plan = dct.plan_chunks((chunk, 2 * chunk), chunk)
  idx = jnp.zeros((workers, 1, 2, 1), jnp.int32)
  val = rng.normal(size=(workers, 1, 2, 1)) * 10.0 ** rng.integers(-3, 3, (workers, 1, 2, 1))
  val = jnp.asarray(val, jnp.float32)
  valid = jnp.asarray([True, False, True, True, True, True])
  got = decode(idx, val, valid, plan.block_shape, interpret=True)
  ((mean, _),) = codec.aggregate_blocks([(idx, val)], [plan.block_shape], valid)
  d0 = np.float32(dct.dct_basis(chunk)[0, 0])
  want = d0 * (np.asarray(mean)[:, 0, :, 0] * d0)
  np.testing.assert_array_equal(np.asarray(got)[:, 0, :, 0], want)
  np.testing.assert_array_equal(np.asarray(got)[:, chunk - 1, :, 1], want)


@pytest.mark.slow
@pytest.mark.parametrize("shape, chunk, k", [((64, 128), 64, 4), ((16, 16), 8, 2)])
def test_decode_is_the_inverse_dct_of_the_workers_mean(shape, chunk, k):
  rng = np.random.default_rng(2)
  plan = dct.plan_chunks(shape, chunk)
  # Drawn from few runs, so workers often send the same positions.
  idx = jnp.stack(
    [codec.draw_positions(codec.position_key(0, 0, w), plan.block_shape, k, 2.0) for w in range(4)]
  )
  val = jnp.asarray(rng.normal(size=idx.shape), jnp.float32)
  valid = jnp.asarray([True, True, False, True])
  got = decode(idx, val, valid, plan.block_shape, interpret=True)
  ((mean, _),) = codec.aggregate_blocks([(idx, val)], [plan.block_shape], valid)
  want = _idct64(mean, chunk)
  np.testing.assert_allclose(got, want, rtol=0, atol=DCT_RTOL * np.abs(want).max())


def test_serves_only_what_the_kernels_can_do_and_only_on_a_gpu():
  eight, sixty_four = dct.plan_chunks((16, 32), 8), dct.plan_chunks((64, 64), 64)
  x8 = jnp.zeros(eight.block_shape, jnp.float32)
  x64 = jnp.zeros(sixty_four.block_shape, jnp.float32)
  assert not pallas_kernels.serves(sixty_four, x64, k=32)  # this is a CPU
  with pallas_kernels.interpreted():
    assert pallas_kernels.serves(sixty_four, x64, k=32) and pallas_kernels.serves(sixty_four, x64)
    assert pallas_kernels.serves(eight, x8, k=1, drawn=True) and pallas_kernels.serves(eight, x8)
    assert not pallas_kernels.serves(eight, x8, k=1)  # a top-k of 8x8 chunks
    assert not pallas_kernels.serves(sixty_four, x64, k=pallas_kernels.MAX_K + 1)
    assert not pallas_kernels.serves(sixty_four, x64.astype(jnp.bfloat16), k=8)
    with pallas_kernels.disabled():
      assert not pallas_kernels.available()


def test_switch_turns_them_off(monkeypatch):
  with pallas_kernels.interpreted():
    assert pallas_kernels.available()
    monkeypatch.setenv(pallas_kernels.SWITCH, "0")
    assert not pallas_kernels.available()


def _steps(tx, init, grads, mesh):
  """Two data-parallel steps; params must stay the same on every device after each.

  Pallas's interpreter cannot type a kernel's reads inside ``shard_map``'s
  varying-axes check (a compiled kernel is typed by its ``out_shape``), so
  the step is mapped with the check off.
  """
  specs = dj.worker_state_specs(tx, init, mesh)
  state = dj.init_worker_state(tx, init, mesh)
  params = jax.device_put(init, NamedSharding(mesh, P()))

  def local(p, s, g):
    u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(
    jax.shard_map(
      local, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs), check_vma=False
    )
  )
  for g in grads:
    params, state = step(params, state, place_grads(g, mesh))
    assert_identical_on_every_device(params, copies=mesh.devices.size)
  return step, params, state


@pytest.mark.slow
@pytest.mark.parametrize(
  "options",
  [
    dict(compression_topk=4),
    dict(compression_topk=1, compression_chunk=8, quantize_1bit=True, random_positions=True),
  ],
  ids=["top-k-64", "drawn-8"],
)
def test_update_keeps_replicas_identical_and_agrees_with_the_xla_path(options):
  init, grads = random_problem({"w": (64, 128)}, workers=4, steps=2, seed=3)
  mesh = mesh_of(4)
  with cpu_kernels.disabled(), pallas_kernels.interpreted():
    step, params, state = _steps(dj.demo(3e-3, **options), init, grads, mesh)
    traced = str(jax.make_jaxpr(step)(params, state, place_grads(grads[-1], mesh)))
  with cpu_kernels.disabled():
    _, xla_params, xla_state = _steps(dj.demo(3e-3, **options), init, grads, mesh)
  assert "pallas_call" in traced and "distro_jax_demo" not in traced  # Pallas's, not the CPU's
  got, want = np.asarray(state[0].momentum["w"]), np.asarray(xla_state[0].momentum["w"])
  np.testing.assert_array_equal(got == 0, want == 0)  # the same entries sent
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
  got, want = np.asarray(params["w"]), np.asarray(xla_params["w"])
  assert np.mean(got != want) < 1e-2
  np.testing.assert_allclose(got, want, rtol=0, atol=2 * 3e-3 * 2)


@pytest.mark.slow
def test_the_kernels_lower_with_triton_for_cuda():
  # Exported for CUDA from this CPU: Pallas lowers each kernel to Triton's IR
  # (what a GPU then compiles to PTX), so an unsupported op fails here.
  triton = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]

  def lowers(fn, *args):
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=triton)(*args)
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()

  p64, p8 = dct.plan_chunks((64, 128), 64), dct.plan_chunks((16, 128), 8)
  g64, g8 = jnp.zeros(p64.block_shape), jnp.zeros(p8.block_shape)
  lowers(lambda g, m: pallas_kernels.compress(g, m, 0.9, 0.1, 32), g64, g64)
  positions = jnp.zeros((2, 16, 1), jnp.int32)
  lowers(lambda g, m, p: pallas_kernels.compress(g, m, 0.9, 0.1, 1, p), g8, g8, positions)
  valid = jnp.ones((4,), bool)
  idx64, idx8 = jnp.zeros((4, 1, 2, 32), jnp.int32), jnp.zeros((4, 2, 16, 1), jnp.int32)
  lowers(lambda i, v: pallas_kernels.decode(i, v, valid, p64.block_shape), idx64, idx64 * 1.0)
  lowers(lambda i, v: pallas_kernels.decode(i, v, valid, p8.block_shape), idx8, idx8 * 1.0)
