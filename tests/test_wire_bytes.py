"""The bytes that enter collectives, read from compiled HLO, are the payload."""

import jax
import jax.numpy as jnp
import pytest
from sharded_step import build, mesh_of

import distro_jax as dj


@pytest.mark.parametrize(
  "quantize_1bit, random_positions, expected",
  # 4096 chunks of 64x64, 32 coefficients each: 12-bit indices, then fp32 values or sign bits
  # (16 per chunk: the other 16 signs travel in the order of the index pairs). Drawn
  # positions send no indices: a flag byte, then the values or one sign bit each.
  [
    (False, False, 4096 * 32 * (12 / 8 + 4)),
    (True, False, 4096 * (32 * 12 + 16) / 8),
    (False, True, 1 + 4096 * 32 * 4),
    (True, True, 1 + 4096 * 32 / 8),
  ],
  ids=["fp32", "1bit", "fp32-random", "1bit-random"],
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
