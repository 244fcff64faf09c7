"""The method registry: the grammar, the entries, and that nothing else branches on a name."""

import ast
import dataclasses
import pathlib
import re
import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny_runs

import distro_jax as dj
from experiments.run import checks, methods, model, presets
from experiments.run.config import ConfigError, TrainConfig

ROOT = pathlib.Path(__file__).parent.parent


def test_method_names_map_to_config_fields():
  parse = lambda name: methods.parse(name)[1]
  assert parse("demo-k8-1bit") == {
    "optimizer": "demo",
    "compression_topk": 8,
    "quantize_1bit": True,
  }
  assert parse("demo-k2-c32")["compression_chunk"] == 32
  assert parse("topk-nodct") == {"optimizer": "demo", "use_dct": False}
  assert parse("topk-nodct-k8-1bit")["compression_topk"] == 8
  assert parse("demo-stateless")["compression_decay"] == 0.0
  assert parse("demo-delayed")["delayed_apply"] is True
  assert parse("demo-k8-1bit-delayed")["quantize_1bit"] is True
  assert parse("demo-k1-c8-1bit-rand-fb1.5") == {
    "optimizer": "demo",
    "compression_topk": 1,
    "compression_chunk": 8,
    "quantize_1bit": True,
    "random_positions": True,
    "frequency_bias": 1.5,
  }
  assert parse("demo-k1-c8-1bit-rand-fb1-rms")["normalize"] == "rms"
  assert parse("demo-k1-c8-1bit-rand-fb1-orth")["normalize"] == "orth"
  assert parse("distro_adamw-k8") == {"optimizer": "distro_adamw", "compression_topk": 8}
  assert parse("diloco") == {"optimizer": "diloco"}
  assert parse("diloco-h100")["diloco_sync_every"] == 100
  assert parse("adamw") == {"optimizer": "adamw"}
  assert parse("sparseloco-h15-k32-1bit") == {
    "optimizer": "sparseloco",
    "sparseloco_sync_every": 15,
    "sparseloco_topk": 32,
    "sparseloco_value_bits": 1,
  }
  assert parse("sparseloco-h15-k1-c8")["sparseloco_chunk"] == 8
  assert parse("sparseloco-noclip-dct") == {
    "optimizer": "sparseloco",
    "sparseloco_clip": False,
    "sparseloco_dct": True,
  }
  assert parse("sparseloco-h2-k1-c8-1bit-dct-rand-fb1-orth-muon") == {
    "optimizer": "sparseloco",
    "sparseloco_sync_every": 2,
    "sparseloco_topk": 1,
    "sparseloco_chunk": 8,
    "sparseloco_value_bits": 1,
    "sparseloco_dct": True,
    "sparseloco_random_positions": True,
    "sparseloco_frequency_bias": 1.0,
    "sparseloco_normalize": "orth",
    "sparseloco_inner": "muon",
  }
  assert parse("sparseloco-rand-1bit-rms")["sparseloco_normalize"] == "rms"


# One 64x64 param, and a gradient that does not depend on it.
_W = {"w": jnp.linspace(-1.0, 1.0, 64 * 64).reshape(64, 64)}
_G = {"w": jnp.cos(jnp.arange(64 * 64, dtype=jnp.float32)).reshape(64, 64)}


def _first_outer_step(name):
  """``(outer update, method, cfg)`` of the method ``name`` on one worker, H 1."""
  method, fields = methods.parse(name)
  cfg = checks.resolve(TrainConfig(preset="tiny", steps=4, workers=1, **fields))
  tx = method.build(cfg, methods.Axes(None, None))
  update = jax.jit(tx.update)
  # The schedule's first rate is 0 (warmup); the second step moves.
  _, state = update(_G, tx.init(_W), _W)
  outer, _ = update(_G, state, _W)
  return outer["w"], method, cfg


def test_drawn_positions_reach_the_transformation_and_its_bytes():
  # One sign bit per 8x8 chunk and a flag byte: no index bits.
  _, method, cfg = _first_outer_step("demo-k1-c8-1bit-rand-fb1")
  assert method.payload(cfg, _W).message == 1 + 64 // 8
  # A 64x64 param has 64 chunks of 8x8; the update moves every entry by the
  # rate (a sign step) once a drawn coefficient of its chunk was sent.
  for name in ("demo-k1-c8-1bit-rand", "demo-k1-c8-1bit-rand-fb1"):
    outer, _, _ = _first_outer_step(name)
    assert np.count_nonzero(np.asarray(outer)) == 64 * 64, name
  drawn, _, _ = _first_outer_step("demo-k1-c8-1bit-rand")
  top, _, _ = _first_outer_step("demo-k1-c8-1bit")
  assert not np.array_equal(np.asarray(drawn), np.asarray(top))


def test_groups_each_send_a_message_of_their_sizes():
  # The allocation measured in docs/results.md: attention with 2 drawn
  # coefficients of each 8x8 chunk, the MLP and norm scales 1 of each 16x16,
  # embedding and head 1 of each 4x4.
  spec = "'attn'=8:2;'mlp'=16:1;'embedding'|'lm_head'=4:1;norm=16:1"
  fields = dict(compression_topk=1, compression_chunk=8, quantize_1bit=True, random_positions=True)
  cfg = checks.resolve(TrainConfig(preset="small", compression_groups=spec, **fields))
  method = methods.get("demo")
  params = model.abstract_params(presets.get_preset("small"))
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  # Every param of `small` falls in one of the four groups, and each
  # group is a message of its own (a flag byte and its sign bits).
  expected = 0
  taken = set()
  for g in methods.compression_groups(spec):
    members = [
      (k, x) for k, x in leaves if re.search(g.pattern, jax.tree_util.keystr(k)) and k not in taken
    ]
    taken |= {k for k, _ in members}
    expected += dj.wire_bytes(
      [x for _, x in members],
      compression_topk=g.topk,
      compression_chunk=g.chunk,
      quantize_1bit=True,
      random_positions=True,
    ).payload
  assert len(taken) == len(leaves)
  assert method.payload(cfg, params).message == expected == 1837
  # Past 1,000x fewer bytes than a bf16 gradient, as the unsplit message.
  assert 2 * sum(x.size for _, x in leaves) / expected >= 1000


def test_orth_orthogonalizes_the_hidden_matrices_only():
  params = model.abstract_params(presets.get_preset("tiny"))
  modes = methods.demo_normalize("orth")(params)
  by_path = {
    jax.tree_util.keystr(path): mode
    for path, mode in jax.tree_util.tree_flatten_with_path(modes)[0]
  }
  rms = sorted(p for p, m in by_path.items() if m == "rms")
  # Muon's split: the embedding and the output head step at unit RMS.
  assert rms == ["['embedding'].value", "['lm_head'].value"]
  assert by_path["['blocks'][0]['attn']['wq'].value"] == "orth"
  assert by_path["['blocks'][0]['mlp']['w_down'].value"] == "orth"
  assert methods.demo_normalize("rms") == "rms"


@pytest.mark.slow
def test_groups_and_orth_train_with_identical_replicas_and_the_bytes_they_count(tmp_path):
  # Attention with 2 drawn coefficients of each 8x8 chunk, the MLP with one of
  # each 16x16, the rest with the flags' sizes: three messages, whose bytes
  # the compiled step's all-gathers carry, and replicas checked every step,
  # each hidden matrix's aggregate orthogonalized (one run proves both).
  options = dict(
    compression_groups="'attn'=8:2;'mlp'=16:1",
    compression_topk=1,
    compression_chunk=8,
    quantize_1bit=True,
    random_positions=True,
  )
  summary = tiny_runs.run_tiny(
    tmp_path, steps=4, log_every=1, check_replicas=True, normalize="orth", **options
  )
  cfg = checks.resolve(TrainConfig(**{**tiny_runs.TINY, **options}))
  params = model.abstract_params(presets.get_preset("tiny"))
  one = dataclasses.replace(cfg, compression_groups="")
  assert summary.measured_exchange_bytes_per_step == summary.payload_bytes_per_step
  assert summary.payload_bytes_per_step == methods.get("demo").payload(cfg, params).message
  # The groups' sizes, not the flags', made the message.
  assert summary.payload_bytes_per_step != methods.get("demo").payload(one, params).message
  losses = [r.loss for r in tiny_runs.read_metrics(tmp_path)]
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_sparseloco_dct_option_reaches_the_transformation():
  """``sparseloco-dct`` selects in the DCT domain: same bytes, a different outer step."""
  outer = {}
  for name in ("sparseloco-h1-k8", "sparseloco-h1-k8-dct"):
    outer[name], method, cfg = _first_outer_step(name)
    assert (
      method.payload(cfg, _W).message
      == method.payload(dataclasses.replace(cfg, sparseloco_dct=False), _W).message
    )
  plain, dct = outer["sparseloco-h1-k8"], outer["sparseloco-h1-k8-dct"]
  # Top-8 raw entries of one chunk touch 8 params; top-8 DCT coefficients touch all.
  assert int(jnp.sum(plain != 0)) == 8
  assert int(jnp.sum(dct != 0)) > 8


def test_sparseloco_drawn_orth_options_reach_the_transformation_and_its_bytes():
  """The drawn message's bytes; an orthogonalized outer step of ``outer_lr * H * lr_t`` RMS."""
  steps = {}
  for name in (
    "sparseloco-h1-k1-c8-1bit-dct-rand-fb1-orth",
    "sparseloco-h1-k1-c8-1bit-dct-rand-fb1-rms",
  ):
    steps[name], method, cfg = _first_outer_step(name)
    # One sign bit per 8x8 chunk and a flag byte: no index bits, no codebook.
    assert method.payload(cfg, _W).message == 1 + 64 // 8
    rms = float(jnp.sqrt(jnp.mean(steps[name] ** 2)))
    np.testing.assert_allclose(rms, float(methods.lr_schedule(cfg)(1)), rtol=1e-4)
  # Orthogonalized, the step's nonzero singular values sit in a band (Newton-Schulz's,
  # about 0.6 to 1 of the largest here); at unit RMS they spread (down to 0.13).
  spread = []
  for u in steps.values():
    s = np.linalg.svd(np.asarray(u), compute_uv=False)
    s = s[s > 1e-3 * s[0]]  # rank 29 here: the rest is rounding
    spread.append(s[-1] / s[0])
  orth, rms = spread
  assert orth > 0.5 > 0.3 > rms


def test_sparseloco_muon_inner_option_builds_muon():
  _, method, cfg = _first_outer_step("sparseloco-h1-k1-c8-1bit-dct-rand-orth-muon")
  tx = method.build(cfg, methods.Axes(None, None))
  is_muon = lambda x: type(x).__name__ == "MuonState"
  assert any(map(is_muon, jax.tree.leaves(tx.init(_W).inner_state, is_leaf=is_muon)))


@pytest.mark.parametrize(
  "name, match",
  [
    ("sparseloco-h1-rand", "use --sparseloco_value_bits=1"),
    ("sparseloco-h1-fb1", "shapes the draw of --sparseloco_random_positions"),
  ],
)
def test_sparseloco_drawn_settings_that_cannot_work_are_refused(name, match):
  fields = methods.parse(name)[1]
  with pytest.raises(ConfigError, match=match):
    checks.resolve(TrainConfig(preset="tiny", steps=4, workers=1, **fields))


def test_sparseloco_chunk_option_reaches_the_transformation_and_its_bytes():
  """``sparseloco-...-c8`` keeps its top-k in each 8x8 chunk, and counts those bytes."""
  moved = {}
  for name, chunk in (("sparseloco-h1-k1", 64), ("sparseloco-h1-k1-c8", 8)):
    outer, method, cfg = _first_outer_step(name)
    moved[name] = int(jnp.sum(outer != 0))
    expected = dj.sparseloco_bytes(_W, sync_every=1, compression_topk=1, compression_chunk=chunk)
    assert method.payload(cfg, _W).message == expected.payload
  # One entry of the one 64x64 chunk, against one of each of 64 chunks of 8x8.
  assert moved == {"sparseloco-h1-k1": 1, "sparseloco-h1-k1-c8": 64}


@pytest.mark.parametrize("bad", ["sgd", "demo-k", "demo-x8", "diloco-k8", "adamw-1bit", "demo-"])
def test_unknown_names_list_the_grammar(bad):
  with pytest.raises(ConfigError, match=f"unknown method '{bad}'") as e:
    methods.parse(bad)
  assert "diloco[-hH]" in str(e.value)


def test_get_refuses_an_unknown_family_with_the_choices():
  with pytest.raises(ConfigError, match="one of demo, distro_adamw, adamw, diloco"):
    methods.get("sgd")


@pytest.mark.slow
@pytest.mark.parametrize("name", methods.names())
def test_every_entry_builds_updates_and_accounts_its_bytes(name):
  method = methods.get(name)
  cfg = checks.resolve(TrainConfig(optimizer=name, preset="tiny", workers=4, batch_size=8))
  params = model.abstract_params(presets.get_preset("tiny"))
  jax.eval_shape(method.build(cfg, methods.Axes("replica", None)).init, params)
  # One worker, no collective: an update has the params' shapes and dtypes.
  tx = method.build(cfg, methods.Axes(None, None))
  real = jax.tree.map(lambda x: jnp.full(x.shape, 0.01, x.dtype), params)
  updates, _ = jax.jit(tx.update)(real, tx.init(real), real)
  chex.assert_trees_all_equal_shapes_and_dtypes(updates, real)
  chex.assert_tree_all_finite(updates)
  payload = method.payload(cfg, params)
  assert payload.message > 0
  assert payload.per_step == payload.message / method.exchange_every(cfg)
  assert payload.sent >= payload.per_step
  assert method.collective in (methods.ALL_GATHER, methods.ALL_REDUCE)
  for option in method.options:
    assert option.field in {f.name for f in dataclasses.fields(TrainConfig)}


def _string_comparisons(path):
  """(line, text) of every comparison against a registered family's name in ``path``."""
  names = set(methods.names())
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if not isinstance(node, ast.Compare):
      continue
    consts = [c for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
    for c in node.comparators:
      if isinstance(c, (ast.Tuple, ast.List, ast.Set)):
        consts += [e for e in c.elts if isinstance(e, ast.Constant)]
    if any(isinstance(c.value, str) and c.value in names for c in consts):
      found.append((node.lineno, ast.unparse(node)))
  return found


def test_no_module_but_the_registry_compares_an_optimizer_name():
  offenders = {}
  for path in sorted((ROOT / "experiments").rglob("*.py")):
    if path.name == "methods.py":
      continue
    if found := _string_comparisons(path):
      offenders[str(path.relative_to(ROOT))] = found
  assert not offenders, offenders


def test_the_scan_finds_a_comparison():
  # The check above can fail: it sees this very function's kind of code.
  src = 'if cfg.optimizer == "diloco" or name in ("adamw", "x"):\n  pass\n'
  tmp = ROOT / "tests" / "_scan_probe.py"
  try:
    tmp.write_text(src)
    assert len(_string_comparisons(tmp)) == 2
  finally:
    tmp.unlink()


# --- muon: the dense Muon baseline ----------------------------------------------


def _by_path(tree):
  is_leaf = lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
  return {jax.tree_util.keystr(p): v for p, v in leaves}


def test_muon_takes_the_hidden_matrices_and_leaves_the_rest_to_adamw():
  params = model.abstract_params(presets.get_preset("tiny"))
  dims = _by_path(methods.muon_dimensions(params))
  on_adamw = sorted(p for p, d in dims.items() if d is None)
  assert on_adamw == [
    "['blocks'][0]['attn_norm']['scale'].value",
    "['blocks'][0]['mlp_norm']['scale'].value",
    "['blocks'][1]['attn_norm']['scale'].value",
    "['blocks'][1]['mlp_norm']['scale'].value",
    "['embedding'].value",
    "['final_norm']['scale'].value",
    "['lm_head'].value",
  ]
  assert dims["['blocks'][0]['mlp']['w_down'].value"] == (0, 1)
  scanned = model.abstract_params(presets.get_preset("tiny", scan_layers=True))
  stacked = _by_path(methods.muon_dimensions(scanned))
  # A stack's layer axis is a batch axis; its norm scales, (layers, 1, d), stay vectors.
  assert stacked["['blocks']['attn']['wq'].value"] == (1, 2)
  assert stacked["['blocks']['attn_norm']['scale'].value"] is None


def _layer_grad(name, layer, shape):
  """A gradient for one layer's param ``name``, the same whichever layout holds it."""
  rng = np.random.default_rng([zlib.crc32(name.encode()), layer + 1])
  return jnp.asarray(rng.normal(size=shape), jnp.float32)


def _grads(params, scan_layers):
  def grad(path, x):
    keys = [getattr(p, "key", getattr(p, "idx", None)) for p in path]
    if keys[0] != "blocks":
      return _layer_grad(str(keys), -1, x.shape)
    if scan_layers:  # one stack: each layer's gradient, stacked
      name = str(keys[1:])
      return jnp.stack([_layer_grad(name, i, x.shape[1:]) for i in range(x.shape[0])])
    return _layer_grad(str(keys[2:]), keys[1], x.shape)

  return jax.tree_util.tree_map_with_path(grad, params)


def _muon_updates(scan_layers, steps=3):
  cfg = checks.resolve(
    TrainConfig(optimizer="muon", preset="tiny", steps=10, warmup_steps=0, scan_layers=scan_layers)
  )
  config = presets.get_preset("tiny", scan_layers=scan_layers)
  params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), model.abstract_params(config))
  grads = _grads(params, scan_layers)
  tx = methods.get("muon").build(cfg, methods.Axes(None, None))
  state, update = tx.init(params), jax.jit(tx.update)
  for _ in range(steps):
    updates, state = update(grads, state, params)
  return cfg, updates


def test_muon_steps_a_hidden_matrix_orthogonally_and_a_scanned_stack_layer_by_layer():
  cfg, plain = _muon_updates(False)
  _, scanned = _muon_updates(True)
  gate = np.asarray(plain["blocks"][0]["mlp"]["w_gate"][...])  # 64 x 192
  # Orthogonalized, then scaled to an RMS of 0.2 per unit rate: singular values
  # in Newton-Schulz's band around 0.2 * sqrt(192) times the rate.
  s = np.linalg.svd(gate / (cfg.learning_rate * 0.2 * np.sqrt(192)), compute_uv=False)
  assert s.min() > 0.5 and s.max() < 1.3
  # The norm scales step with AdamW: about the rate per entry, not orthogonalized.
  scale = np.abs(np.asarray(plain["blocks"][0]["attn_norm"]["scale"][...]))
  assert np.median(scale) == pytest.approx(cfg.learning_rate, rel=0.2)
  # The stacked layout steps each layer as the separate layout does.
  for i in range(2):
    for part, name in (("attn", "wq"), ("mlp", "w_down"), ("attn_norm", "scale")):
      a = np.asarray(plain["blocks"][i][part][name][...]).reshape(-1)
      b = np.asarray(scanned["blocks"][part][name][...][i]).reshape(-1)
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7, err_msg=f"{part}.{name} layer {i}")
  np.testing.assert_allclose(
    np.asarray(plain["embedding"][...]), np.asarray(scanned["embedding"][...]), rtol=1e-5
  )


def test_muon_is_a_dense_baseline_and_refuses_fsdp():
  dense = [n for n in methods.names() if methods.get(n).dense]
  assert dense == ["adamw", "muon"]
  with pytest.raises(ConfigError, match="--fsdp"):
    checks.validate(TrainConfig(optimizer="muon", preset="tiny", workers=8, fsdp=2))


@pytest.mark.slow
def test_muon_trains_through_the_driver_with_identical_replicas(tmp_path):
  summary = tiny_runs.run_tiny(
    tmp_path, optimizer="muon", workers=8, batch_size=16, steps=4, log_every=1, check_replicas=True
  )
  # The whole fp32 gradient, all-reduced: what the HLO moves across the replicas.
  params = model.abstract_params(presets.get_preset("tiny"))
  assert summary.payload_bytes_per_step == dj.wire_bytes(params).grad
  assert summary.measured_by_kind["all-reduce"] >= summary.payload_bytes_per_step
  losses = [r.loss for r in tiny_runs.read_metrics(tmp_path)]
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
