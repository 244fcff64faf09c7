"""The bytes that enter collectives, read from compiled HLO, are the payload."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sharded_step import build, mesh_of

import distro_jax as dj


@pytest.mark.parametrize(
  "quantize_1bit, random_positions, expected",
  # 4096 chunks of 64x64, 32 coefficients each: 12-bit indices, then fp32 values or sign bits
  # (16 per chunk: the other 16 signs travel in the order of the index pairs). Drawn
  # positions send no indices: a flag byte, then the values or one sign bit each.
  # The quick loop keeps the default message.
  [
    pytest.param(False, False, 4096 * 32 * (12 / 8 + 4), id="fp32"),
    pytest.param(True, False, 4096 * (32 * 12 + 16) / 8, id="1bit", marks=pytest.mark.slow),
    pytest.param(False, True, 1 + 4096 * 32 * 4, id="fp32-random", marks=pytest.mark.slow),
    pytest.param(True, True, 1 + 4096 * 32 / 8, id="1bit-random", marks=pytest.mark.slow),
  ],
)
def test_measured_collective_bytes_equal_computed_payload(
  quantize_1bit, random_positions, expected
):
  mesh = mesh_of(8)
  params = {"w": jnp.zeros((4096, 4096), jnp.float32)}
  options = dict(quantize_1bit=quantize_1bit, random_positions=random_positions)
  tx = dj.demo(1e-3, compression_topk=32, compression_chunk=64, **options)
  step, p, state = build(tx, params, mesh)
  grads_abstract = {
    "w": jax.ShapeDtypeStruct(
      (8, 4096, 4096), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, jax.P("data"))
    )
  }
  measured = dj.collective_bytes(step, p, state, grads_abstract)
  computed = dj.wire_bytes(params, num_workers=8, **options).payload

  assert computed == expected
  assert measured.total == computed
  assert measured.by_kind["all-gather"] == measured.total
  for kind in ("all-reduce", "reduce-scatter", "collective-permute", "all-to-all"):
    assert measured.by_kind[kind] == 0, f"hidden {kind} of {measured.by_kind[kind]} bytes"


def test_wire_bytes_baselines():
  params = {"w": jnp.zeros((4096, 4096), jnp.bfloat16)}
  b = dj.wire_bytes(params, num_workers=4)
  assert b.payload == 4096 * 32 * (12 / 8 + 2)
  assert b.grad_bf16 == b.grad == 4096 * 4096 * 2
  assert b.grad_fp32 == 4096 * 4096 * 4
  assert b.ring_allreduce == pytest.approx(2 * 3 / 4 * 4096 * 4096 * 2)
  assert b.ratio_vs_bf16 == pytest.approx(4096 * 4096 * 2 / b.payload)
  # Psyche's format (top-k 8, uint16 indices, 1-bit values) costs 17 bytes per 64x64
  # chunk, ~480x below bf16; with 12-bit indices and half the signs in the pairs' order it
  # is 12.5 bytes (8 x 12 + 4 bits), under 13/17 of that.
  psyche = dj.wire_bytes(params, compression_topk=8, quantize_1bit=True)
  assert psyche.payload == 4096 * 100 // 8 <= 13 / 17 * 4096 * 17
  assert 655 <= psyche.ratio_vs_bf16 <= 656


def _train_step(tx, mesh, specs, grad_fn):
  from functools import partial

  import optax
  from jax.sharding import PartitionSpec as P

  def loss_fn(params, x_BxD):
    return jnp.mean(jnp.tanh(x_BxD @ params["w1"]) @ params["w2"])

  @jax.jit
  @partial(
    jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs, P("data"))
  )
  def step(params, opt_state, x_BxD):
    loss, grads = grad_fn(loss_fn)(params, x_BxD)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss[None]

  return step


def test_train_step_with_local_grads_sends_only_the_payload():
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = mesh_of(8)
  params = {"w1": jnp.zeros((256, 512)), "w2": jnp.zeros((512, 64))}
  tx = dj.demo(1e-3)
  specs = dj.worker_state_specs(tx, params, mesh)
  state = dj.init_worker_state(tx, params, mesh)
  p = jax.device_put(params, NamedSharding(mesh, P()))
  x = jax.device_put(jnp.ones((8 * 4, 256)), NamedSharding(mesh, P("data")))
  payload = dj.wire_bytes(params).payload

  local = dj.collective_bytes(_train_step(tx, mesh, specs, dj.local_value_and_grad), p, state, x)
  assert local.total == local.by_kind["all-gather"] == payload

  # The pitfall local_value_and_grad exists for: plain autodiff all-reduces the gradient.
  plain = dj.collective_bytes(_train_step(tx, mesh, specs, jax.value_and_grad), p, state, x)
  assert plain.by_kind["all-reduce"] >= 4 * (256 * 512 + 512 * 64)


def _trajectory(tx, init, grads, mesh):
  """``(step, params before each step and after the last, final state)``."""
  from sharded_step import place_grads

  step, params, state = build(tx, init, mesh)
  out = [params]
  for g in grads:
    params, state = step(params, state, place_grads(g, mesh))
    out.append(params)
  return step, out, state


# The default message stays in the quick loop; each variant compiles two steps.
@pytest.mark.parametrize(
  "name, tx",
  [
    pytest.param("demo", dj.demo(1e-2), id="demo"),
    pytest.param(
      "demo-delayed", dj.demo(1e-2, delayed_apply=True), id="demo-delayed", marks=pytest.mark.slow
    ),
    pytest.param(
      "demo-k8-1bit",
      dj.demo(1e-2, compression_topk=8, quantize_1bit=True),
      id="demo-k8-1bit",
      marks=pytest.mark.slow,
    ),
    pytest.param(
      "demo-drawn-rms",
      dj.demo(
        1e-2,
        compression_topk=1,
        compression_chunk=8,
        quantize_1bit=True,
        random_positions=True,
        normalize="rms",
      ),
      id="demo-drawn-rms",
      marks=pytest.mark.slow,
    ),
    pytest.param(
      "sparseloco",
      dj.sparseloco(optax.adamw(1e-2), sync_every=2, compression_topk=8),
      id="sparseloco",
      marks=pytest.mark.slow,
    ),
  ],
)
def test_zero_size_params_add_no_bytes_and_change_no_bits(name, tx):
  from sharded_step import place_grads, random_problem

  mesh = mesh_of(8)
  shapes = {"a": (64, 128), "c": (96,)}
  init, grads = random_problem(shapes, 8, 3, seed=0)
  empty = {"b": jnp.zeros((0, 64)), "d": jnp.zeros((0,))}
  with_empty = {**init, **empty}
  grads_with = [
    {**g, **{k: np.zeros((8, *v.shape), np.float32) for k, v in empty.items()}} for g in grads
  ]

  step0, plain, state0 = _trajectory(tx, init, grads, mesh)
  step, padded, state = _trajectory(tx, with_empty, grads_with, mesh)
  for before, after in zip(plain, padded):
    for k in shapes:
      np.testing.assert_array_equal(after[k], before[k])
    assert after["b"].shape == (0, 64) and after["d"].shape == (0,)

  # The steps that ran, measured at the arguments of their last step.
  measured = dj.collective_bytes(step, padded[-2], state, place_grads(grads_with[-1], mesh))
  without = dj.collective_bytes(step0, plain[-2], state0, place_grads(grads[-1], mesh))
  assert measured.total == without.total > 0
  if name != "sparseloco":
    kw = _demo_options(name)
    assert dj.wire_bytes(with_empty, **kw).payload == dj.wire_bytes(init, **kw).payload
    assert measured.by_kind["all-gather"] == dj.wire_bytes(init, **kw).payload


def _demo_options(name):
  return {
    "demo": {},
    "demo-delayed": {},
    "demo-k8-1bit": dict(compression_topk=8, quantize_1bit=True),
    "demo-drawn-rms": dict(
      compression_topk=1, compression_chunk=8, quantize_1bit=True, random_positions=True
    ),
  }[name]
