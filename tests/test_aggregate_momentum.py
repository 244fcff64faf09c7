"""``aggregate_momentum``: Muon's momentum, kept on the aggregate every worker decodes.

With nothing dropped (top-k the whole chunk, float values) the aggregate is
the mean gradient times the rate, whatever the decoupled momentum's decay, so
the orthogonalized step with this momentum must be dense Muon's step on a
hidden matrix: the check that the composition is right.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sharded_step import assert_identical_on_every_device, mesh_of, random_problem, trajectory

import distro_jax as dj
from experiments.run import checks, methods
from experiments.run.config import ConfigError, TrainConfig

_SHAPES = {"w": (32, 48), "b": (48,)}
_LR = 0.01
# Every coefficient of every 8x8 chunk, in float32: nothing is dropped.
_WHOLE = dict(compression_topk=64, compression_chunk=8)
# The 1,015x message's layout: one drawn sign of each 8x8 chunk.
_DRAWN = dict(compression_topk=1, compression_chunk=8, quantize_1bit=True, random_positions=True)


def _steps(params):
  return [np.asarray(b["w"]) - np.asarray(a["w"]) for a, b in zip(params, params[1:])]


def _unit_rms(x):
  return x / np.sqrt(np.mean(x**2))


def _dense_muon_steps(init, grads):
  muon = optax.contrib.muon(
    _LR,
    beta=0.95,
    muon_weight_dimension_numbers={"w": optax.contrib.MuonDimensionNumbers(0, 1), "b": None},
  )
  params, state, out = init, muon.init(init), [init]
  for g_W in grads:
    mean = jax.tree.map(lambda g: jnp.mean(jnp.asarray(g), axis=0), g_W)
    u, state = muon.update(mean, state, params)
    params = optax.apply_updates(params, u)
    out.append(params)
  return _steps(out)


@pytest.mark.parametrize("decay", [0.0, 0.95])
def test_nothing_dropped_with_momentum_on_the_aggregate_is_dense_muon(decay):
  init, grads = random_problem(_SHAPES, workers=8, steps=4, seed=0)
  tx = dj.demo(
    _LR,
    compression_decay=decay,
    normalize={"w": "orth", "b": "rms"},
    aggregate_momentum=0.95,
    **_WHOLE,
  )
  # trajectory's step checks that every device holds the same params after each step.
  params, state = trajectory(tx, init, grads, mesh_of(8))
  ours, muon = _steps(params), _dense_muon_steps(init, grads)
  for t, (a, b) in enumerate(zip(ours, muon)):
    # Muon scales its step by its own rule, DeMo to unit RMS times the rate.
    np.testing.assert_allclose(_unit_rms(a), _unit_rms(b), atol=1e-4, err_msg=f"step {t}")
    np.testing.assert_allclose(np.sqrt(np.mean(a**2)), _LR, rtol=1e-5)
  # The momentum is computed from what every worker decoded alike: no worker's is its own.
  (momentum,) = [s for s in jax.tree.leaves(state, is_leaf=_is_momentum) if _is_momentum(s)]
  assert_identical_on_every_device(momentum.mu, copies=8, context="momentum on the aggregate")


def _is_momentum(x):
  return isinstance(x, dj.MuonMomentumState)


def test_without_momentum_on_the_aggregate_nothing_dropped_has_no_momentum_at_all():
  """What the decoupled momentum cannot do: what was sent leaves it, so its decay is moot."""
  init, grads = random_problem(_SHAPES, workers=8, steps=4, seed=1)
  runs = []
  for decay in (0.0, 0.95):
    tx = dj.demo(_LR, compression_decay=decay, normalize={"w": "orth", "b": "rms"}, **_WHOLE)
    runs.append(_steps(trajectory(tx, init, grads, mesh_of(8))[0]))
  for a, b in zip(*runs):
    np.testing.assert_allclose(a, b, atol=1e-6)
  # And each step follows that step's own mean gradient, orthogonalized.
  for a, g_W in zip(runs[0], grads):
    want = -np.asarray(dj.orthogonalize(jnp.mean(jnp.asarray(g_W["w"]), axis=0)))
    np.testing.assert_allclose(_unit_rms(a), _unit_rms(want), atol=1e-4)


@pytest.mark.parametrize(
  "name, field, decay",
  [
    ("demo-k64-c8-orth-am0.95", "aggregate_momentum", 0.95),
    ("demo-k1-c8-1bit-rand-orth-sm0.9", "step_momentum", 0.9),
  ],
)
def test_the_registry_option_reaches_the_transformation(name, field, decay):
  fields = methods.parse(name)[1]
  assert fields[field] == decay, name
  cfg = checks.resolve(TrainConfig(preset="tiny", steps=4, workers=1, **fields))
  tx = methods.get("demo").build(cfg, methods.Axes(None, None))
  params = {"w": jnp.ones((16, 16))}
  assert any(map(_is_momentum, jax.tree.leaves(tx.init(params), is_leaf=_is_momentum)))


@pytest.mark.parametrize(
  "fields, match",
  [
    (dict(optimizer="adamw", aggregate_momentum=0.9), "needs --optimizer=demo"),
    (dict(optimizer="demo", aggregate_momentum=1.0), r"must be in \[0, 1\)"),
    (dict(optimizer="adamw", step_momentum=0.9), "needs --optimizer=demo"),
    (dict(optimizer="demo", step_momentum=1.0), r"must be in \[0, 1\)"),
    (dict(optimizer="adamw", muon_beta=0.0), "they need --optimizer=muon"),
    (dict(optimizer="demo", muon_adam_learning_rate=1e-3), "they need --optimizer=muon"),
    (dict(optimizer="muon", muon_beta=1.0), r"must be in \[0, 1\)"),
  ],
)
def test_settings_that_cannot_work_are_refused_with_the_fix(fields, match):
  with pytest.raises(ConfigError, match=match):
    checks.resolve(TrainConfig(preset="tiny", steps=4, workers=1, **fields))


@pytest.mark.parametrize("field", ["aggregate_momentum", "step_momentum"])
def test_the_transformation_refuses_a_decay_of_one(field):
  with pytest.raises(ValueError, match=rf"{field} must be in \[0, 1\)"):
    dj.demo(_LR, axis_name=None, **{field: 1.0})


def _nesterov(steps, decay):
  """``scale_by_muon_momentum``'s output, in numpy, over a list of inputs."""
  mu, out = np.zeros_like(steps[0]), []
  for t, g in enumerate(steps, start=1):
    mu = decay * mu + (1 - decay) * g
    out.append(decay * mu / (1 - decay ** (t + 1)) + (1 - decay) * g / (1 - decay**t))
  return out


@pytest.mark.parametrize(
  "compression",
  [_WHOLE, _DRAWN],
  ids=["whole", "drawn-1bit"],
)
def test_step_momentum_averages_the_normalized_steps(compression):
  """``step_momentum`` is Muon's momentum on what ``normalize`` made, not on the aggregate."""
  init, grads = random_problem(_SHAPES, workers=8, steps=5, seed=2)
  runs = {}
  for decay in (0.0, 0.9):
    tx = dj.demo(_LR, normalize={"w": "orth", "b": "rms"}, step_momentum=decay, **compression)
    runs[decay] = _steps(trajectory(tx, init, grads, mesh_of(8))[0])
  # The exchange never sees the params, so both runs decode the same aggregates.
  want = _nesterov([-s / _LR for s in runs[0.0]], 0.9)
  for t, (a, b) in enumerate(zip(runs[0.9], want)):
    np.testing.assert_allclose(a, -_LR * b, atol=1e-6, err_msg=f"step {t}")
  # From the second step on it is not the plain orthogonalized step.
  assert not np.allclose(runs[0.9][2], runs[0.0][2], atol=1e-6)
