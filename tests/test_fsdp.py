"""DeMo on a 2-D ("replica", "fsdp") mesh against unsharded DeMo with one device per replica."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import distro_jax as dj

CHUNK, TOPK, LR, STEPS = 16, 4, 1e-2, 10
ROWS_PER_DEVICE = 8


def _init_params(rng):
  # b2 has 2 chunks of 16, so fsdp=4 cannot split it into whole chunks, and
  # the scalar has no axis at all: both stay whole on every device of a site.
  return {
    "w1": jnp.asarray(rng.normal(size=(32, 256)) * 0.3, jnp.float32),
    "b1": jnp.zeros((256,), jnp.float32),
    "w2": jnp.asarray(rng.normal(size=(256, 32)) * 0.1, jnp.float32),
    "b2": jnp.zeros((32,), jnp.float32),
    "scale": jnp.ones((), jnp.float32),
  }


def _loss(params, x_BxD, y_BxE):
  h = jnp.tanh(x_BxD @ params["w1"] + params["b1"])
  pred = (h @ params["w2"] + params["b2"]) * params["scale"]
  return jnp.mean((pred - y_BxE) ** 2)


def _batches(rng, devices):
  w_true = rng.normal(size=(32, 32)) / 6
  for _ in range(STEPS):
    x = rng.normal(size=(devices * ROWS_PER_DEVICE, 32)).astype(np.float32)
    yield x, np.sin(x @ w_true).astype(np.float32)


def _make_tx(name, axis_name):
  kw = {"compression_chunk": CHUNK, "compression_topk": TOPK, "axis_name": axis_name}
  if name in ("demo", "demo-rms"):
    normalize = "rms" if name == "demo-rms" else "sign"
    return dj.demo(LR, weight_decay=0.01, normalize=normalize, **kw)
  if name.startswith("demo-random"):
    delayed = name.endswith("-delayed")
    return dj.demo(LR, weight_decay=0.01, random_positions=True, delayed_apply=delayed, **kw)
  return dj.distro_adamw(LR, weight_decay=0.01, **kw)


def _unsharded_run(name, params, replicas, data):
  """Plain data-parallel DeMo: one device per replica, each on its site's rows."""
  mesh = jax.make_mesh((replicas,), ("data",), devices=jax.devices()[:replicas])
  tx = _make_tx(name, "data")
  specs = dj.worker_state_specs(tx, params, mesh)
  state = dj.init_worker_state(tx, params, mesh)
  params = jax.device_put(params, NamedSharding(mesh, P()))

  @jax.jit
  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(P(), specs, P("data"), P("data")),
    out_specs=(P(), specs),
  )
  def step(params, state, x, y):
    _, grads = dj.local_value_and_grad(_loss)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  rows = NamedSharding(mesh, P("data"))
  for x, y in data:
    params, state = step(params, state, jax.device_put(x, rows), jax.device_put(y, rows))
  return params


def _fsdp_setup(name, params, replicas, fsdp):
  mesh = jax.make_mesh((replicas, fsdp), ("replica", "fsdp"))
  plan = dj.plan_fsdp(params, fsdp, compression_chunk=CHUNK)
  tx = _make_tx(name, "replica")
  specs = dj.worker_state_specs(tx, params, mesh, "replica", param_specs=plan.specs)
  params = jax.device_put(
    params, jax.tree.map(lambda s: NamedSharding(mesh, s), plan.specs, is_leaf=_is_spec)
  )
  state = dj.init_worker_state(tx, params, mesh, "replica", param_specs=plan.specs)
  rows = P(("replica", "fsdp"))

  @jax.jit
  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(plan.specs, specs, rows, rows),
    out_specs=(plan.specs, specs),
  )
  def step(params, state, x, y):
    _, grads = dj.fsdp_value_and_grad(_loss, plan.specs)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return mesh, plan, step, params, state


def _fsdp_run(name, init, data, replicas, fsdp):
  """``(mesh, plan, params, state)`` after :func:`_fsdp_setup`'s step over ``data``."""
  mesh, plan, step, params, state = _fsdp_setup(name, init, replicas, fsdp)
  rows = NamedSharding(mesh, P(("replica", "fsdp")))
  for x, y in data:
    params, state = step(params, state, jax.device_put(x, rows), jax.device_put(y, rows))
  return mesh, plan, params, state


def _is_spec(x):
  return isinstance(x, P)


def _assert_copies_identical(params, replicas, fsdp):
  """Every device's copy of a given slice matches, to the bit.

  Replicas hold ``replicas`` copies of a shard, and ``replicas * fsdp`` of a
  param kept whole on every device of a site.
  """
  for leaf in jax.tree.leaves(params):
    by_index = {}
    for shard in leaf.addressable_shards:
      by_index.setdefault(str(shard.index), []).append(np.asarray(shard.data).view(np.uint32))
    assert all(len(c) in (replicas, replicas * fsdp) for c in by_index.values())
    for copies in by_index.values():
      for c in copies[1:]:
        np.testing.assert_array_equal(c, copies[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["demo-random", "demo-random-delayed"])
def test_fsdp_with_random_positions_keeps_every_copy_identical(name):
  # Each shard draws its own positions (a message of its own), while a param
  # kept whole on a site's devices must draw the same ones on each of them;
  # overlapped, the message in flight is decoded at the step before's draw.
  replicas, fsdp = 2, 4
  rng = np.random.default_rng(1)
  init = _init_params(rng)
  data = _batches(rng, replicas * fsdp)
  mesh, _, params, state = _fsdp_run(name, init, data, replicas, fsdp)
  _assert_copies_identical(params, replicas, fsdp)
  # The devices of a site hold the same momentum for a param kept whole there,
  # so they sent the same positions (they would differ, and each zero
  # others, had each device drawn its own).
  for key in ("b2", "scale"):
    by_device = {s.device: s.data for s in state[0].momentum[key].addressable_shards}
    for site in mesh.devices:
      first = np.asarray(by_device[site[0]]).view(np.uint32)
      for device in site[1:]:
        np.testing.assert_array_equal(np.asarray(by_device[device]).view(np.uint32), first)
  # Sign steps of LR over 10 steps: every kind of param moved by several.
  for key in ("w1", "b2", "scale"):
    assert np.abs(np.asarray(params[key]) - np.asarray(init[key])).max() > 2.5 * LR, key


@pytest.mark.slow
@pytest.mark.parametrize(
  ("name", "replicas", "fsdp"),
  # demo-rms: each tensor's step at the RMS of the whole tensor, not of a shard.
  [("demo", 2, 4), ("demo", 4, 2), ("distro_adamw", 2, 4), ("demo-rms", 2, 4)],
)
def test_fsdp_trajectory_equals_unsharded(name, replicas, fsdp):
  rng = np.random.default_rng(0)
  init = _init_params(rng)
  data = list(_batches(rng, replicas * fsdp))
  want = _unsharded_run(name, init, replicas, data)

  _, plan, params, state = _fsdp_run(name, init, data, replicas, fsdp)

  # Each tensor on its own, so no tensor can hide in a pooled count. DeMo agrees
  # to ~1e-7 or exactly. AdamW's 1/sqrt(v) magnifies the rounding of the FSDP
  # gradient's other summation order where v is tiny: 1.4e-5 at most (one entry
  # of w2), so it gets 1e-4, still 100x below the step.
  atol = 1e-4 if name == "distro_adamw" else 1e-6
  for key in init:
    np.testing.assert_allclose(
      np.asarray(params[key], np.float64),
      np.asarray(want[key], np.float64),
      rtol=0,
      atol=atol,
      err_msg=key,
    )
  # Steps of LR: every param moved (by 2 to 19 steps) far beyond the tolerance.
  for key in init:
    moved = np.abs(np.asarray(params[key]) - np.asarray(init[key])).max()
    assert moved > LR, f"{key} moved only {moved}"

  _assert_copies_identical(params, replicas, fsdp)

  # Each device holds 1/fsdp of the sharded params and of their momentum.
  whole = {path for path, _ in plan.whole}
  assert whole == ({"['b2']", "['scale']"} if fsdp == 4 else {"['scale']"})
  w1 = params["w1"].addressable_shards[0].data
  assert w1.size == init["w1"].size // fsdp
  momentum = state[0].momentum["w1"]
  assert momentum.addressable_shards[0].data.size == init["w1"].size // fsdp


def test_chunks_never_straddle_a_shard():
  shapes = {
    "emb": (32000, 2048),
    "mlp": (2048, 8192),
    "norm": (2048,),
    "odd": (96, 40),
    "stacked": (4, 192, 64),
    "scalar": (),
    "empty": (0, 64),
  }
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
  for fsdp in (2, 4, 8):
    plan = dj.plan_fsdp(params, fsdp, compression_chunk=64)
    local = dj.local_shapes(params, plan.specs, {"fsdp": fsdp})
    for key, axis in zip(sorted(params), plan.axes):  # tree order
      if axis is None:
        continue
      full = dj.dct.plan_chunks(params[key].shape, 64)
      part = dj.dct.plan_chunks(local[key].shape, 64)
      # The shard is chunked exactly as the full tensor: same chunk lengths,
      # and 1/fsdp of its chunks.
      assert (part.c1, part.c2) == (full.c1, full.c2), key
      assert part.rows * fsdp == full.rows, key
    whole = dict(plan.whole)
    assert "['scalar']" in whole
    assert "zero-size" in whole["['empty']"]
    # The embedding's 500 chunks along its 32000 axis split 2 or 4 ways, not
    # 8; then it is split along its 2048 axis instead.
    assert plan.axes[sorted(params).index("emb")] == (1 if fsdp == 8 else 0)
  # (96, 40) has 2 x 1 chunks of (48, 40): fsdp=4 cannot split it, and says so.
  whole4 = dict(dj.plan_fsdp(params, 4, compression_chunk=64).whole)
  assert "none divisible by fsdp=4" in whole4["['odd']"]


@pytest.mark.slow
def test_only_the_payload_crosses_replica():
  replicas, fsdp = 2, 4
  rng = np.random.default_rng(1)
  init = _init_params(rng)
  mesh, plan, step, params, state = _fsdp_setup("demo", init, replicas, fsdp)
  rows = jax.ShapeDtypeStruct(
    (replicas * fsdp * ROWS_PER_DEVICE, 32),
    jnp.float32,
    sharding=NamedSharding(mesh, P(("replica", "fsdp"))),
  )
  hlo = step.lower(params, state, rows, rows).compile().as_text()
  by_axes = dj.collective_bytes_by_axes(hlo, mesh)

  local = dj.local_shapes(init, plan.specs, {"fsdp": fsdp})
  message = dj.wire.wire_layout(
    local, compression_topk=TOPK, compression_chunk=CHUNK, quantize_1bit=False
  ).num_bytes
  assert set(by_axes) <= {("replica",), ("fsdp",)}
  crossing = by_axes[("replica",)]
  assert crossing.by_kind["all-gather"] == message
  assert crossing.total == message
  assert [kind for kind, _, _ in crossing.ops] == ["all-gather"]
  # Inside a site: params all-gathered, gradients reduce-scattered.
  inside = by_axes[("fsdp",)].by_kind
  assert inside["all-gather"] > 0 and inside["reduce-scatter"] > 0
  # Every device's message is 1/fsdp of the unsharded one, plus the params kept
  # whole on every device, plus its own validity byte.
  whole_msg = dj.wire.wire_layout(
    {k: init[k] for k in ("b2", "scale")},
    compression_topk=TOPK,
    compression_chunk=CHUNK,
    quantize_1bit=False,
  ).num_bytes
  full_msg = dj.wire_bytes(init, compression_topk=TOPK, compression_chunk=CHUNK).payload
  assert message == (full_msg - whole_msg) // fsdp + whole_msg


def test_report_preset_memory_at_fsdp_8():
  from experiments.bench import memory_report

  rows = memory_report.measure("report-1.2b", (1, 8))
  assert rows[8]["demo"].total * 6 <= rows[1]["demo"].total


def test_stacked_layers_keep_fewer_params_whole_and_send_less_per_device():
  from experiments.bench import memory_report

  # On tiny, fsdp 2 keeps every d_model-wide matrix whole when the layers are
  # separate (each is one chunk); stacked, the layer axis can be split. The
  # bytes are those the compiled step moves (tests/test_scan_layers_train.py).
  assert memory_report.device_message("tiny", 2) == (6024, 19)
  assert memory_report.device_message("tiny", 2, scan_layers=True) == (3440, 1)
  # At fsdp 1 a device holds and sends everything, stacked or not.
  assert memory_report.device_message("tiny", 1) == memory_report.device_message(
    "tiny", 1, scan_layers=True
  )
