"""DeMo's fused CPU kernels: the XLA path's results, replicas identical, and a fallback."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sharded_step import build, mesh_of, place_grads, random_problem

import distro_jax as dj
from distro_jax import codec, cpu_kernels, dct

# One program per call where JAX would compile one per operation (tests/compiled.py).
to_blocks = jax.jit(dct.to_blocks, static_argnames="plan")
select_topk_blocks = jax.jit(codec.select_topk_blocks, static_argnames="k")
draw_positions = jax.jit(codec.draw_positions, static_argnums=(1, 2, 3))
gather_blocks = jax.jit(codec.gather_blocks)

pytestmark = pytest.mark.skipif(
  not cpu_kernels.available(), reason="no C++ compiler here to build the CPU kernels"
)

# Float32 rounding of the two DCTs, relative to the largest coefficient: the
# kernels' recursion against the dense matmuls (measured about 1e-6 and 4e-7).
DCT_RTOL = 4e-6


def _float64_basis(n=64):
  k, i = np.arange(n)[:, None], np.arange(n)[None, :]
  d = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * i + 1) * k / (2 * n))
  d[0] /= np.sqrt(2.0)
  return d


def _float64_dct_blocks(x_blocks, n=64):
  d = _float64_basis(n)
  return np.einsum("ip,...apbq,jq->...aibj", d, np.asarray(x_blocks, np.float64), d)


def _float64_inverse_blocks(y_blocks, n=64):
  d = _float64_basis(n)
  return np.einsum("pi,...apbq,qj->...aibj", d, np.asarray(y_blocks, np.float64), d)


@pytest.mark.parametrize("shape", [(64, 64), (128, 192), (3, 64, 128), (2, 2, 128, 64)])
@pytest.mark.parametrize("k", [1, 8, 32, 512])
def test_compress_is_the_momentum_and_its_top_k(shape, k):
  rng = np.random.default_rng(0)
  plan = dct.plan_chunks(shape, 64)
  g = to_blocks(jnp.asarray(rng.normal(size=shape), jnp.float32), plan)
  m = to_blocks(jnp.asarray(rng.normal(size=shape) * 0.01, jnp.float32), plan)
  lr = jnp.float32(3e-3)
  m_new, idx, val = jax.jit(lambda g, m, lr: cpu_kernels.compress(g, m, 0.95, lr, k))(g, m, lr)

  want = 0.95 * np.asarray(m, np.float64) + 3e-3 * _float64_dct_blocks(g)
  scale = np.abs(want).max()
  np.testing.assert_allclose(np.asarray(m_new), want, rtol=0, atol=DCT_RTOL * scale)
  # The selection is exactly the library's top-k of the momentum it returns.
  want_idx, want_val = select_topk_blocks(m_new, k)
  np.testing.assert_array_equal(idx, want_idx)
  np.testing.assert_array_equal(val, want_val)


def test_compress_breaks_ties_as_top_k_does():
  # No gradient, so m' = decay * m exactly, with many equal magnitudes.
  rng = np.random.default_rng(1)
  plan = dct.plan_chunks((64, 128), 64)
  m = rng.integers(-3, 4, size=(64, 128)).astype(np.float32)
  m_blocks = to_blocks(jnp.asarray(m), plan)
  zeros = jnp.zeros_like(m_blocks)
  m_new, idx, val = cpu_kernels.compress(zeros, m_blocks, 0.5, 1.0, 32)
  np.testing.assert_array_equal(m_new, 0.5 * m_blocks)
  want_idx, want_val = select_topk_blocks(m_new, 32)
  np.testing.assert_array_equal(idx, want_idx)
  np.testing.assert_array_equal(val, want_val)


def test_compress_ranks_negative_zero_as_zero():
  # Mostly signed zeros and a few entries per chunk, so the top-k reaches
  # the zeros, whose ties go to the lower index whatever their sign.
  rng = np.random.default_rng(6)
  plan = dct.plan_chunks((64, 128), 64)
  m = np.where(rng.random((64, 128)) < 0.5, -0.0, 0.0).astype(np.float32)
  m[rng.integers(0, 64, 10), rng.integers(0, 128, 10)] = rng.normal(size=10)
  m_blocks = to_blocks(jnp.asarray(m), plan)
  zeros = jnp.zeros_like(m_blocks)
  # With a zero gradient, lr = -1 adds -0.0, which keeps each zero's sign.
  m_new, idx, val = cpu_kernels.compress(zeros, m_blocks, 1.0, -1.0, 32)
  assert np.sum(np.signbit(np.asarray(m_new)) & (np.asarray(m_new) == 0)) > 1000
  want_idx, want_val = select_topk_blocks(m_new, 32)
  np.testing.assert_array_equal(idx, want_idx)
  np.testing.assert_array_equal(val, want_val)


def test_compress_marks_a_chunk_with_a_non_finite_gradient():
  plan = dct.plan_chunks((64, 128), 64)
  g = np.ones((64, 128), np.float32)
  g[3, 70] = np.nan  # in the second chunk
  g_blocks = to_blocks(jnp.asarray(g), plan)
  _, _, val = cpu_kernels.compress(g_blocks, jnp.zeros_like(g_blocks), 0.9, 1.0, 4)
  val = np.asarray(val).reshape(2, 4)
  assert np.isfinite(val[0]).all()
  assert not np.isfinite(val[1]).all()


@pytest.mark.parametrize(
  "shape, chunk, k, bias",
  [
    ((16, 24), 8, 1, 1.0),
    ((2, 8, 40), 8, 3, 0.0),
    ((64, 128), 64, 8, 0.5),
    ((64, 64), 64, 32, 0.0),
  ],
)
def test_draw_positions_are_codecs_to_the_bit(shape, chunk, k, bias):
  block_shape = dct.plan_chunks(shape, chunk).block_shape
  for step, tensor, worker in [(0, 0, 0), (7, 3, 5)]:
    key = codec.position_key(step, tensor, worker)
    want = draw_positions(key, block_shape, k, bias)
    np.testing.assert_array_equal(cpu_kernels.draw_positions(key, block_shape, k, bias), want)

  # A receiver draws every sender's positions at once, under vmap.
  def draws(fn):
    return jax.vmap(lambda w: fn(codec.position_key(4, 1, w), block_shape, k, bias))(jnp.arange(5))

  np.testing.assert_array_equal(draws(cpu_kernels.draw_positions), draws(codec.draw_positions))


@pytest.mark.parametrize("shape, chunk", [((16, 24), 8), ((2, 8, 1040), 8), ((64, 128), 64)])
def test_compress_at_drawn_positions_takes_the_momentum_there(shape, chunk):
  rng = np.random.default_rng(7)
  plan = dct.plan_chunks(shape, chunk)
  g = to_blocks(jnp.asarray(rng.normal(size=shape), jnp.float32), plan)
  m = to_blocks(jnp.asarray(rng.normal(size=shape) * 0.01, jnp.float32), plan)
  positions = draw_positions(codec.position_key(2, 0, 1), plan.block_shape, 2, 1.0)
  m_new, idx, val = jax.jit(lambda g, m, p: cpu_kernels.compress(g, m, 0.95, 3e-3, 2, positions=p))(
    g, m, positions
  )
  want = 0.95 * np.asarray(m, np.float64) + 3e-3 * _float64_dct_blocks(g, chunk)
  np.testing.assert_allclose(m_new, want, rtol=0, atol=DCT_RTOL * np.abs(want).max())
  np.testing.assert_array_equal(idx, positions)
  np.testing.assert_array_equal(val, gather_blocks(m_new, positions))


def test_decode_of_8x8_chunks_is_the_inverse_dct_of_the_workers_mean():
  rng = np.random.default_rng(8)
  k = 2
  plan = dct.plan_chunks((2, 16, 1040), 8)
  # Drawn positions from a few runs, so workers often send the same ones.
  idx = jnp.stack(
    [draw_positions(codec.position_key(0, 0, w), plan.block_shape, k, 2.0) for w in range(8)]
  )
  val = jnp.asarray(np.sign(rng.normal(size=idx.shape)), jnp.float32)
  valid = jnp.asarray([True, True, True, False, True, True, True, True])
  got = cpu_kernels.decode(idx, val, valid, plan.block_shape)
  ((mean, _),) = codec.aggregate_blocks([(idx, val)], [plan.block_shape], valid)
  want = _float64_inverse_blocks(mean, 8)
  np.testing.assert_allclose(got, want, rtol=0, atol=DCT_RTOL * np.abs(want).max())


def test_decode_is_the_inverse_dct_of_the_workers_mean():
  rng = np.random.default_rng(2)
  workers, k = 8, 32
  plan = dct.plan_chunks((2, 128, 64), 64)
  rows = plan.rows
  # Few positions, so several workers send the same coefficients.
  idx = rng.integers(0, 48, size=(workers, rows, k)).astype(np.int32)
  for w in range(workers):
    for r in range(rows):
      idx[w, r] = rng.choice(48, size=k, replace=False)
  val = rng.normal(size=(workers, rows, k)).astype(np.float32)
  valid = jnp.asarray([True, True, False, True, True, True, True, True])
  lead = plan.block_shape[:-4] + (plan.block_shape[-4], plan.block_shape[-2], k)
  idx_b, val_b = jnp.asarray(idx).reshape(workers, *lead), jnp.asarray(val).reshape(workers, *lead)

  got = cpu_kernels.decode(idx_b, val_b, valid, plan.block_shape)
  ((mean, _),) = codec.aggregate_blocks([(idx_b, val_b)], [plan.block_shape], valid)
  want = _float64_inverse_blocks(mean)
  np.testing.assert_allclose(got, want, rtol=0, atol=DCT_RTOL * np.abs(want).max())


@pytest.mark.parametrize("chunk", [64, 8])
def test_decode_folds_the_workers_in_aggregate_blocks_order_to_the_bit(chunk):
  # Every worker sends only chunk position 0, the DC term, whose inverse DCT
  # is the mean times the basis's constant d0, twice, at every entry (1/8
  # each at 64, so exact; 1/sqrt(8), rounded, at 8). So the kernel's mean can
  # be read back to the bit, and the order of a running mean shows in its
  # last bits.
  rng = np.random.default_rng(5)
  workers = 8
  plan = dct.plan_chunks((128, 192), chunk)
  a, b = plan.block_shape[0], plan.block_shape[2]
  rows = a * b
  idx = np.zeros((workers, a, b, 1), np.int32)
  val = rng.normal(size=(workers, a, b, 1)) * 10.0 ** rng.integers(-3, 3, (workers, a, b, 1))
  val = jnp.asarray(val, jnp.float32)
  valid = jnp.asarray([True, False, True, True, True, True, True, True])
  got = cpu_kernels.decode(jnp.asarray(idx), val, valid, plan.block_shape)
  ((mean, count),) = codec.aggregate_blocks([(jnp.asarray(idx), val)], [plan.block_shape], valid)
  dc = np.asarray(mean)[:, 0, :, 0]  # (A, B): each chunk's position 0
  d0 = np.float32(dct.dct_basis(chunk)[0, 0])
  want = d0 * (dc * d0)  # float32 throughout, as the kernel rounds it
  np.testing.assert_array_equal(np.asarray(got)[:, 0, :, 0], want)
  np.testing.assert_array_equal(np.asarray(got)[:, chunk - 1, :, chunk // 3], want)
  assert np.asarray(count)[:, 0, :, 0].min() == workers - 1 and rows == dc.size
  # The order matters to these bits: folded in worker-index order, some
  # chunk's mean comes out otherwise, so a kernel that ignored the order fails.
  order = np.asarray(
    codec.worker_order(
      jnp.asarray(idx).reshape(workers, rows, 1), val.reshape(workers, rows, 1), chunk * chunk
    )
  )

  def running_mean(order):
    mu, n = np.zeros(rows, np.float32), 0
    for w in order:
      if bool(valid[w]):
        n += 1
        v = np.asarray(val[w], np.float32).reshape(rows)
        mu = (mu + (v - mu) / np.float32(n)).astype(np.float32)
    return mu.reshape(dc.shape)

  np.testing.assert_array_equal(running_mean(order), dc)
  assert not np.array_equal(running_mean(range(workers)), dc)


SHAPES = {"w": (128, 192), "stack": (2, 64, 128), "bias": (192,)}


def _run(tx, steps=4):
  init, grads = random_problem(SHAPES, workers=8, steps=steps, seed=3)
  mesh = mesh_of(8)
  # build() asserts after every step that the params are the same on every device.
  step, params, state = build(tx, init, mesh)
  for g in grads:
    g = place_grads(g, mesh)
    params, state = step(params, state, g)
  return step, params, state, g


@pytest.mark.parametrize("delayed", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_update_keeps_replicas_identical_and_agrees_with_the_xla_path(delayed):
  def tx():
    return dj.demo(3e-3, weight_decay=0.01, delayed_apply=delayed)

  step, params, state, g = _run(tx())
  hlo = step.lower(params, state, g).compile().as_text()
  assert "distro_jax_demo_compress" in hlo and "distro_jax_demo_decode" in hlo
  with cpu_kernels.disabled():
    xla_step, xla_params, xla_state, _ = _run(tx())
    xla_hlo = xla_step.lower(xla_params, xla_state, g).compile().as_text()
  assert "distro_jax_demo" not in xla_hlo
  for name in SHAPES:
    got, want = np.asarray(params[name]), np.asarray(xla_params[name])
    # Sign steps: an entry differs only where a decoded direction near zero
    # changed sign with the rounding of the DCTs.
    assert np.mean(got != want) < 1e-3, name
    np.testing.assert_allclose(got, want, rtol=0, atol=2 * 3e-3 * 4)


DRAWN = dict(compression_topk=1, compression_chunk=8, quantize_1bit=True, random_positions=True)


# The drawn kernels' parts have quick tests of their own; their whole updates run in the
# whole suite.
@pytest.mark.slow
@pytest.mark.parametrize("normalize", ["sign", "orth"])
def test_drawn_update_keeps_replicas_identical_and_agrees_with_the_xla_path(normalize):
  def tx():
    return dj.demo(3e-3, frequency_bias=1.0, normalize=normalize, **DRAWN)

  step, params, state, g = _run(tx(), steps=3)
  hlo = step.lower(params, state, g).compile().as_text()
  for target in ("compress8", "decode8", "draw"):
    assert f"distro_jax_demo_{target}" in hlo, target
  with cpu_kernels.disabled():
    _, xla_params, xla_state, _ = _run(tx(), steps=3)
  # The same positions were drawn and sent: the momenta agree to the DCTs'
  # rounding everywhere, and are zero at the same places (error feedback).
  for name in SHAPES:
    got, want = np.asarray(state[0].momentum[name]), np.asarray(xla_state[0].momentum[name])
    np.testing.assert_array_equal(got == 0, want == 0)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    got, want = np.asarray(params[name]), np.asarray(xla_params[name])
    if normalize == "sign":
      # An entry differs only where a decoded direction near zero changed
      # sign (or left zero) with the rounding of the DCTs.
      assert np.mean(got != want) < 1e-3, name
      np.testing.assert_allclose(got, want, rtol=0, atol=2 * 3e-3 * 3)
    else:
      np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_serves_only_what_the_kernels_can_do():
  plan = dct.plan_chunks((64, 128), 64)
  x = jnp.zeros(plan.block_shape, jnp.float32)
  assert cpu_kernels.serves(plan, x, k=cpu_kernels.MAX_K)
  assert not cpu_kernels.serves(plan, x, k=cpu_kernels.MAX_K + 1)
  assert not cpu_kernels.serves(plan, x.astype(jnp.bfloat16))
  small = dct.plan_chunks((64, 128), 32)
  assert not cpu_kernels.serves(small, jnp.zeros(small.block_shape, jnp.float32))
  # 8x8 chunks: drawn positions and the decode, not a top-k.
  eight = dct.plan_chunks((64, 128), 8)
  y = jnp.zeros(eight.block_shape, jnp.float32)
  assert cpu_kernels.serves(eight, y) and cpu_kernels.serves(eight, y, k=1, drawn=True)
  assert not cpu_kernels.serves(eight, y, k=1)
  uneven = dct.plan_chunks((4, 128), 8)  # 4x8 chunks
  assert not cpu_kernels.serves(uneven, jnp.zeros(uneven.block_shape, jnp.float32), drawn=True)


def test_switch_turns_the_kernels_off(monkeypatch):
  assert cpu_kernels.available()
  monkeypatch.setenv(cpu_kernels.SWITCH, "0")
  assert not cpu_kernels.available()
  with cpu_kernels.disabled():
    monkeypatch.delenv(cpu_kernels.SWITCH)
    assert not cpu_kernels.available()
  assert cpu_kernels.available()


def test_no_compiler_means_the_xla_path_and_a_warning(monkeypatch, tmp_path):
  monkeypatch.setenv("CXX", "no-such-compiler-here")
  monkeypatch.setenv("DISTRO_JAX_CACHE", str(tmp_path))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert cpu_kernels._load.__wrapped__() is False
  assert any("no C++ compiler" in str(w.message) for w in caught)
  assert not list(tmp_path.iterdir())


def test_the_build_is_cached_and_reused():
  # The cache the session's kernels came from (built here if no test has yet,
  # as on a fresh machine): asked again, the build is the same file, untouched.
  first = cpu_kernels._build("c++")
  stamp = first.stat().st_mtime_ns
  assert first.parent == cpu_kernels._cache_dir() and first.suffix == ".so"
  assert cpu_kernels._build("c++") == first
  assert first.stat().st_mtime_ns == stamp


def test_builders_starting_at_once_build_once(monkeypatch, tmp_path):
  # Processes of one machine starting together (a multi-process run, the
  # suite's workers) each find the cache empty; one compiles, the others wait.
  import threading
  import time

  monkeypatch.setenv("DISTRO_JAX_CACHE", str(tmp_path))
  compiles = []

  def compile_slowly(cmd, **kwargs):
    compiles.append(cmd)
    time.sleep(0.3)
    with open(cmd[cmd.index("-o") + 1], "wb") as f:
      f.write(b"built")

  monkeypatch.setattr(cpu_kernels.subprocess, "run", compile_slowly)
  built = []
  threads = [
    threading.Thread(target=lambda: built.append(cpu_kernels._build("c++"))) for _ in range(3)
  ]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(compiles) == 1 and len(set(built)) == 1 and len(built) == 3
  assert built[0].read_bytes() == b"built"


def test_vmap_runs_the_kernel_per_example():
  rng = np.random.default_rng(4)
  plan = dct.plan_chunks((64, 64), 64)
  g = jnp.asarray(rng.normal(size=(3, *plan.block_shape)), jnp.float32)
  m = jnp.zeros_like(g)
  batched = jax.vmap(lambda g, m: cpu_kernels.compress(g, m, 0.9, 0.1, 4))(g, m)
  for b in range(3):
    one = cpu_kernels.compress(g[b], m[b], 0.9, 0.1, 4)
    for x, y in zip(batched, one):
      np.testing.assert_array_equal(x[b], y)


def test_results_vary_over_the_axes_their_inputs_vary_over():
  # Inside shard_map a custom call's results are typed as the same on every
  # device unless told otherwise; the state specs read that typing (FSDP).
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from distro_jax import exchange

  mesh = jax.make_mesh((2, 2), ("replica", "fsdp"), devices=jax.devices()[:4])
  plan = dct.plan_chunks((64, 128), 64)
  seen = {}

  def body(g, m):
    g_blocks, m_blocks = to_blocks(g, plan), to_blocks(m, plan)
    m_new, idx, val = cpu_kernels.compress(g_blocks, m_blocks, 0.9, 0.1, 4)
    valid = jnp.ones((2,), bool)
    q = cpu_kernels.decode(jnp.stack([idx, idx]), jnp.stack([val, val]), valid, plan.block_shape)
    seen.update(m=m_new, idx=idx, val=val, q=q)
    return jnp.zeros(())

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P("replica"), P("fsdp")), out_specs=P())
  g = jax.device_put(jnp.zeros((128, 128)), NamedSharding(mesh, P("replica")))
  m = jax.device_put(jnp.zeros((128, 128)), NamedSharding(mesh, P("fsdp")))
  jax.eval_shape(fn, g, m)
  for name, x in seen.items():
    assert exchange.varying_axes(x) == {"replica", "fsdp"}, name
