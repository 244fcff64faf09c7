"""The ladder: every message budget crossed with every step rule, against dense references."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distro_jax as dj
from experiments.run import checks, methods
from experiments.run.config import ConfigError, TrainConfig
from experiments.run.records import Summary
from experiments.study import frontier, ladder

_SUMMARY = Summary(**{f.name: None for f in dataclasses.fields(Summary)})


def test_every_rung_and_rule_is_a_registered_method_and_the_references_are_dense():
  names = ladder.ladder_methods()
  assert len(names) == len(ladder.DENSE) + len(ladder.RUNGS) * len(ladder.RULES)
  for name in names:
    method, fields = methods.parse(name)
    assert method.dense == (name in ladder.DENSE), name
  assert methods.parse("muon-beta0")[1] == {"optimizer": "muon", "muon_beta": 0.0}
  # Nothing dropped is the whole 8x8 chunk; the last rung's momentum is Muon's decay.
  assert methods.parse("demo-k64-c8-orth-am0.95")[1]["compression_topk"] == 64
  assert methods.parse("demo-k64-c8-orth-am0.95")[1]["aggregate_momentum"] == 0.95


def test_a_subset_of_rungs_and_rules_and_unknown_keys_refused():
  names = ladder.ladder_methods(["drawn8"], ["orth", "momentum-orth"])
  assert names == [
    *ladder.DENSE,
    "demo-k1-c8-1bit-rand-fb1-orth",
    "demo-k1-c8-1bit-rand-fb1-orth-am0.95",
  ]
  with pytest.raises(ConfigError, match=r"--rungs: unknown \['top4'\]; choose from"):
    ladder.ladder_methods(["top4"])
  with pytest.raises(ConfigError, match=r"--rules: unknown \['adam'\]"):
    ladder.ladder_methods(rules=["adam"])


def _point(method, loss, nbytes=100.0):
  summary = dataclasses.replace(
    _SUMMARY, final_val_loss=loss, payload_bytes_per_step=nbytes, ratio_vs_bf16_grad=1e3
  )
  return frontier.Point(method, 300, {"learning_rate": 3e-3}, method, summary)


def test_the_table_puts_each_rule_in_its_column_with_its_gap_to_the_best_dense(tmp_path):
  points = [
    _point("adamw", 2.0),
    _point("muon", 1.6),
    _point("demo-k1-c8-1bit-rand-fb1", 2.4, 1811.0),
    _point("demo-k1-c8-1bit-rand-fb1-orth-am0.95", 1.68, 1811.0),
  ]
  table = ladder.ladder_table(points, 300)
  (row,) = [line for line in table.splitlines() if line.startswith("| drawn8 |")]
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert cells[1:3] == ["1,811", "1,000x"]
  assert cells[3].startswith("2.4000 (+50.0% vs muon)")
  assert cells[4] == ""  # orth did not run
  assert cells[5].startswith("1.6800 (+5.0% vs muon)")
  assert "- `muon` (learning_rate 0.003): 1.6000 (+0.0% vs muon)" in table
  assert "| whole |" not in table  # a rung with no finished run is left out
  assert ladder.write(points, str(tmp_path)) == table
  assert (tmp_path / "ladder.png").stat().st_size > 1000


def test_muon_without_momentum_steps_along_this_steps_gradient_alone():
  """``muon-beta0``, the ladder's reference for a step rule with no momentum."""

  def second_step(name):
    fields = methods.parse(name)[1]
    cfg = checks.resolve(TrainConfig(preset="tiny", steps=10, workers=1, **fields))
    tx = methods.get("muon").build(cfg, methods.Axes(None, None))
    params = {"blocks": [{"mlp": {"w": jnp.zeros((16, 24))}}]}
    state = tx.init(params)
    rng = np.random.default_rng(0)
    for _ in range(2):
      g = {"blocks": [{"mlp": {"w": jnp.asarray(rng.normal(size=(16, 24)), jnp.float32)}}]}
      u, state = tx.update(g, state, params)
    return np.asarray(jax.tree.leaves(u)[0]), np.asarray(jax.tree.leaves(g)[0])

  u, g = second_step("muon-beta0")
  direction = lambda x: x / np.linalg.norm(x)
  want = -np.asarray(dj.orthogonalize(jnp.asarray(g)))
  np.testing.assert_allclose(direction(u), direction(want), atol=1e-3)
  with_momentum, _ = second_step("muon")
  assert np.abs(direction(with_momentum) - direction(want)).max() > 1e-2
