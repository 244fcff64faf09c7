"""The Llama model of experiments/: shapes, causality, variants, training, presets."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.run.model import (
  Llama,
  ModelConfig,
  abstract_params,
  next_token_loss,
  param_count,
)
from experiments.run.presets import PRESETS, describe_presets, get_preset

TINY = get_preset("tiny")


def _tokens(config: ModelConfig, B: int, L: int, seed: int = 0) -> jax.Array:
  return jax.random.randint(jax.random.key(seed), (B, L), 0, config.vocab_size, jnp.int32)


@pytest.fixture(scope="module")
def tiny_model() -> Llama:
  return Llama(TINY, rngs=nnx.Rngs(0))


def _forward(model: Llama, tokens_BxL: jax.Array) -> jax.Array:
  # Jitted: op-by-op dispatch of the eager model costs seconds per call on CPU.
  return nnx.jit(lambda m, t: m(t))(model, tokens_BxL)


def test_output_shape_and_dtype(tiny_model):
  logits = _forward(tiny_model, _tokens(TINY, 2, 16))
  assert logits.shape == (2, 16, TINY.vocab_size)
  assert logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))


def test_weights_are_plain_matrices(tiny_model):
  params = nnx.state(tiny_model, nnx.Param)
  ndims = {leaf.ndim for leaf in jax.tree.leaves(params)}
  assert ndims == {1, 2}
  attn = tiny_model.blocks[0].attn
  assert attn.wq.shape == (TINY.d_model, TINY.n_heads * TINY.head_dim)
  assert attn.wk.shape == (TINY.d_model, TINY.n_kv_heads * TINY.head_dim)


def test_causal(tiny_model):
  tokens = _tokens(TINY, 2, 12)
  changed = tokens.at[:, 7].set((tokens[:, 7] + 1) % TINY.vocab_size)
  before, after = _forward(tiny_model, tokens), _forward(tiny_model, changed)
  np.testing.assert_allclose(before[:, :7], after[:, :7], atol=1e-6)
  assert float(jnp.max(jnp.abs(before[:, 7:] - after[:, 7:]))) > 1e-4


@pytest.mark.parametrize(
  "overrides",
  [
    dict(n_kv_heads=1),  # multi-query
    dict(n_kv_heads=4),  # plain multi-head
    dict(tie_embeddings=True),
    dict(param_dtype="bfloat16", compute_dtype="bfloat16"),
    dict(scan_layers=True),
  ],
  ids=["mqa", "mha", "tied", "bf16", "scan"],
)
def test_variants_build_and_run(overrides):
  config = dataclasses.replace(TINY, **overrides)
  model = Llama(config, rngs=nnx.Rngs(1))
  logits = _forward(model, _tokens(config, 2, 8))
  assert logits.shape == (2, 8, config.vocab_size)
  assert logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))
  has_head = "lm_head" in nnx.state(model, nnx.Param)
  assert has_head == (not config.tie_embeddings)
  assert param_count(config) == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_scanned_layers_compute_what_the_unrolled_ones_do(tiny_model):
  # The unrolled model's weights, stacked layer by layer into the scanned
  # model's arrays, give the same logits and the same (stacked) gradients.
  graphdef, params = nnx.split(tiny_model, nnx.Param)
  scanned = Llama(dataclasses.replace(TINY, scan_layers=True), rngs=nnx.Rngs(0))
  s_graphdef, s_params = nnx.split(scanned, nnx.Param)
  plain = nnx.to_pure_dict(params)
  stacked = nnx.to_pure_dict(s_params)
  layers = [plain["blocks"][i] for i in range(TINY.n_layers)]
  # A layer's norm scale is a (1, d) row in the stack.
  stacked["blocks"] = jax.tree.map(
    lambda into, *xs: jnp.stack(xs).reshape(into.shape), stacked["blocks"], *layers
  )
  for name in ("embedding", "final_norm", "lm_head"):
    stacked[name] = plain[name]
  nnx.replace_by_pure_dict(s_params, stacked)
  assert jax.tree.leaves(s_params)[0].shape[0] == TINY.n_layers

  tokens = _tokens(TINY, 2, 17, seed=5)

  def loss(graphdef, params):
    logits = nnx.merge(graphdef, params)(tokens[:, :-1])
    return next_token_loss(logits, tokens[:, 1:])

  want, want_grads = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)(
    graphdef, params
  )
  got, got_grads = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)(
    s_graphdef, s_params
  )
  np.testing.assert_allclose(got, want, rtol=1e-6)
  want_grads = nnx.to_pure_dict(want_grads)
  got_grads = nnx.to_pure_dict(got_grads)
  for i in range(TINY.n_layers):
    for g, w in zip(
      jax.tree.leaves(jax.tree.map(lambda x, i=i: x[i], got_grads["blocks"])),
      jax.tree.leaves(want_grads["blocks"][i]),
      strict=True,
    ):
      np.testing.assert_allclose(np.reshape(g, w.shape), w, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(got_grads["embedding"], want_grads["embedding"], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_pure_split_merge_under_jit_and_shard_map(tiny_model):
  graphdef, params = nnx.split(tiny_model, nnx.Param)
  tokens = _tokens(TINY, 8, 16, seed=3)
  eager = tiny_model(tokens)

  def apply(params, tokens_BxL):
    return nnx.merge(graphdef, params)(tokens_BxL)

  np.testing.assert_allclose(jax.jit(apply)(params, tokens), eager, rtol=1e-5, atol=1e-5)

  mesh = jax.make_mesh((8,), ("data",))
  sharded = jax.jit(jax.shard_map(apply, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data")))
  # A jitted shard_map takes inputs already laid out as its in_specs say.
  params = jax.device_put(params, NamedSharding(mesh, P()))
  tokens = jax.device_put(tokens, NamedSharding(mesh, P("data")))
  np.testing.assert_allclose(sharded(params, tokens), eager, rtol=1e-5, atol=1e-5)


def test_adam_reduces_loss_on_repeated_sequence():
  model = Llama(TINY, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  seq = jnp.tile(jnp.arange(8, dtype=jnp.int32), 5)[None, :].repeat(2, axis=0)
  tx = optax.adam(3e-3)
  opt_state = tx.init(params)

  def loss(params, seq_BxL):
    logits = nnx.merge(graphdef, params)(seq_BxL[:, :-1])
    return next_token_loss(logits, seq_BxL[:, 1:])

  @jax.jit
  def step(params, opt_state):
    value, grads = jax.value_and_grad(loss)(params, seq)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  first = None
  for _ in range(30):
    params, opt_state, value = step(params, opt_state)
    first = float(value) if first is None else first
  final = float(jax.jit(loss)(params, seq))
  assert first == pytest.approx(np.log(TINY.vocab_size), rel=0.05)
  assert final < 0.5 * first


def test_next_token_loss_matches_uniform():
  logits = jnp.zeros((2, 3, 10))
  targets = jnp.array([[0, 1, 2], [3, 4, 9]])
  np.testing.assert_allclose(next_token_loss(logits, targets), np.log(10.0), rtol=1e-6)


def test_param_counts_without_allocation():
  assert param_count(get_preset("tiny")) < 1_000_000
  start = time.perf_counter()
  n = param_count(get_preset("report-1.2b"))
  assert time.perf_counter() - start < 10.0
  assert 1.1e9 < n < 1.3e9
  leaves = jax.tree.leaves(abstract_params(get_preset("report-1.2b")))
  assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
  assert sum(leaf.size * leaf.dtype.itemsize for leaf in leaves) == 4 * n


@pytest.mark.slow
def test_presets_ordered_and_described():
  counts = [param_count(c) for c in PRESETS.values()]
  assert counts == sorted(counts)
  table = describe_presets()
  for name in PRESETS:
    assert name in table


@pytest.mark.parametrize(
  "overrides, field",
  [
    (dict(n_heads=5), "d_model"),
    (dict(n_kv_heads=3), "n_kv_heads"),
    (dict(n_layers=0), "n_layers"),
    (dict(d_model=24, n_heads=8), "head_dim"),
    (dict(compute_dtype="int32"), "compute_dtype"),
    (dict(param_dtype="nope"), "param_dtype"),
  ],
)
def test_config_validation(overrides, field):
  with pytest.raises(ValueError, match=field):
    dataclasses.replace(TINY, **overrides)


def test_too_long_sequence_rejected(tiny_model):
  with pytest.raises(ValueError, match="max_seq_len"):
    tiny_model(_tokens(TINY, 1, TINY.max_seq_len + 1))


def test_unknown_preset():
  with pytest.raises(ValueError, match=r"unknown preset 'nope'; choose one of: tiny"):
    get_preset("nope")


def test_describe_presets_prints_params_and_payload_without_allocating():
  from experiments.run.presets import describe_presets

  table = describe_presets(num_workers=8)
  row = next(line for line in table.splitlines() if line.startswith("report-1.2b"))
  cells = row.split()
  assert cells[1] == "1,204,881,408"
  assert cells[-3] == "51,929,856"  # payload at top-k 32, chunk 64, fp32 values, 12-bit indices
