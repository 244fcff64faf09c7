"""``estimate_step``: the message corrects a shared estimate of the workers' mean momentum (EF21).

With nothing dropped (every coefficient of every chunk, float32) and a step
of one, the estimate is exactly the mean of the workers' unit-RMS momenta,
so the orthogonalized step is Muon's on that mean: the check that the
composition is right. With a 1-bit message the estimate must stay the same
on every worker, to the bit, and still close in on that mean.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sharded_step import assert_identical_on_every_device, mesh_of, random_problem, trajectory

import distro_jax as dj
from experiments.run import checks, methods
from experiments.run.config import ConfigError, TrainConfig

_SHAPES = {"w": (32, 48), "b": (48,)}
_LR = 0.01
_DECAY = 0.9
_WHOLE = dict(compression_topk=64, compression_chunk=8)
_ONE_BIT = dict(
  compression_topk=1,
  compression_chunk=8,
  quantize_1bit=True,
  random_positions=True,
  frequency_bias=1.0,
)


def _unit_rms(x):
  return x / np.sqrt(np.mean(np.square(x)))


def _mean_unit_rms_momenta(grads, name):
  """Per step, the mean over workers of each worker's unit-RMS momentum, in NumPy."""
  m, out = np.zeros_like(grads[0][name]), []
  for g_W in grads:
    m = _DECAY * m + (1 - _DECAY) * g_W[name]
    out.append(np.mean([_unit_rms(x) for x in m], axis=0))
  return out


def _estimate_state(state):
  found = [s for s in jax.tree.leaves(state, is_leaf=_is_estimate) if _is_estimate(s)]
  assert len(found) == 1
  return found[0]


def _is_estimate(x):
  return isinstance(x, dj.EstimateState)


def _tx(step, **compression):
  return dj.demo(
    _LR,
    compression_decay=_DECAY,
    normalize={"w": "orth", "b": "rms"},
    estimate_step=step,
    **compression,
  )


def test_nothing_dropped_at_step_one_follows_the_mean_of_the_workers_momenta():
  init, grads = random_problem(_SHAPES, workers=8, steps=4, seed=0)
  params, state = trajectory(_tx(1.0, **_WHOLE), init, grads, mesh_of(8))
  want_w = _mean_unit_rms_momenta(grads, "w")
  want_b = _mean_unit_rms_momenta(grads, "b")
  for t, (before, after) in enumerate(zip(params, params[1:])):
    step_w = np.asarray(after["w"]) - np.asarray(before["w"])
    step_b = np.asarray(after["b"]) - np.asarray(before["b"])
    orth = -np.asarray(dj.orthogonalize(jnp.asarray(want_w[t])))
    np.testing.assert_allclose(_unit_rms(step_w), _unit_rms(orth), atol=1e-4, err_msg=f"{t}")
    np.testing.assert_allclose(_unit_rms(step_b), _unit_rms(-want_b[t]), atol=1e-4)
    np.testing.assert_allclose(np.sqrt(np.mean(step_w**2)), _LR, rtol=1e-5)
  estimate = _estimate_state(state).estimate
  np.testing.assert_allclose(np.asarray(estimate["w"]), want_w[-1], rtol=1e-4, atol=1e-5)
  assert_identical_on_every_device(estimate, copies=8, context="the shared estimate")


def test_a_one_bit_message_keeps_the_estimate_identical_and_closes_in_on_the_mean():
  # A signal every worker shares under noise of each worker's own: the mean
  # momentum settles, and 60 steps of one bit per 64 coefficients must find it.
  rng = np.random.default_rng(2)
  signal = rng.normal(size=_SHAPES["w"])
  grads = [
    {
      "w": (signal + 0.5 * rng.normal(size=(8, *_SHAPES["w"]))).astype(np.float32),
      "b": rng.normal(size=(8, *_SHAPES["b"])).astype(np.float32),
    }
    for _ in range(60)
  ]
  init = {k: jnp.zeros(s) for k, s in _SHAPES.items()}
  params, state = trajectory(_tx(0.4, **_ONE_BIT), init, grads, mesh_of(8))
  estimate = _estimate_state(state).estimate
  assert_identical_on_every_device(estimate, copies=8, context="the shared estimate")
  want = _mean_unit_rms_momenta(grads, "w")[-1]
  got = np.asarray(estimate["w"])
  # An estimate of zero, where it starts, is off by 1 and has no direction.
  error = np.linalg.norm(got - want) / np.linalg.norm(want)
  cosine = np.sum(got * want) / (np.linalg.norm(got) * np.linalg.norm(want))
  assert error < 0.6 and cosine > 0.8, (error, cosine)
  assert np.all(np.isfinite(np.asarray(params[-1]["w"])))


def test_a_worker_with_a_non_finite_gradient_is_left_out_and_restarts():
  init, grads = random_problem(_SHAPES, workers=8, steps=3, seed=3)
  grads[1]["w"][5, 0, 0] = np.nan
  tx = _tx(0.5, **_ONE_BIT)
  params, state = trajectory(tx, init, grads[:2], mesh_of(8))
  assert np.all(np.isfinite(np.asarray(params[-1]["w"])))
  inner = _estimate_state(state)
  assert int(np.asarray(inner.exchange.contributors).reshape(-1)[0]) == 7
  momentum_w = np.asarray(inner.momentum["w"]).reshape(8, *_SHAPES["w"])
  assert np.all(momentum_w[5] == 0), "the failed worker's momentum restarts from zero"
  assert np.all(np.isfinite(momentum_w)) and np.any(momentum_w[0] != 0)
  assert np.all(np.isfinite(np.asarray(inner.estimate["w"])))


def test_init_is_shape_only():
  tx = _tx(0.5, **_ONE_BIT)
  shapes = jax.eval_shape(tx.init, {k: jnp.zeros(s) for k, s in _SHAPES.items()})
  assert _estimate_state(shapes).estimate["w"].shape == _SHAPES["w"]


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(estimate_step=0.5, delayed_apply=True), "arrive a step late"),
    (dict(estimate_step=-1.0), "must be a static number >= 0"),
    (dict(estimate_step=0.5, compression_decay=1.0), "each worker's momentum decay"),
  ],
)
def test_the_transformation_refuses_what_cannot_work(kwargs, match):
  with pytest.raises(ValueError, match=match):
    dj.demo(_LR, axis_name=None, **kwargs)


def test_the_registry_option_reaches_the_transformation():
  fields = methods.parse("demo-k1-c8-1bit-rand-fb1-orth-est0.5")[1]
  assert fields["estimate_step"] == 0.5
  cfg = checks.resolve(TrainConfig(preset="tiny", steps=4, workers=1, **fields))
  tx = methods.get("demo").build(cfg, methods.Axes(None, None))
  state = tx.init({"w": jnp.ones((16, 16))})
  assert any(map(_is_estimate, jax.tree.leaves(state, is_leaf=_is_estimate)))


@pytest.mark.parametrize(
  "fields, match",
  [
    (dict(optimizer="adamw", estimate_step=0.5), "needs --optimizer=demo"),
    (dict(optimizer="demo", estimate_step=0.5, delayed_apply=True), "not --delayed_apply"),
    (dict(optimizer="demo", estimate_step=-0.5), "must be 0 or more"),
  ],
)
def test_settings_that_cannot_work_are_refused_with_the_fix(fields, match):
  with pytest.raises(ConfigError, match=match):
    checks.resolve(TrainConfig(preset="tiny", steps=4, workers=1, **fields))
