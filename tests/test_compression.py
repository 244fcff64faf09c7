"""The compression options are one value: every DeMo factory takes the same fields by name."""

import inspect

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import distro_jax as dj

_FACTORIES = [dj.demo, dj.distro, dj.distro_adamw, dj.scale_by_demo, dj.lookahead_update]


@pytest.mark.parametrize("factory", _FACTORIES, ids=lambda f: f.__name__)
def test_every_factory_lists_each_option_with_its_default(factory):
  params = inspect.signature(factory).parameters
  for name, default in dj.Compression._field_defaults.items():
    assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert params[name].default == default


def test_a_misspelt_option_is_refused_with_the_fields_named():
  with pytest.raises(TypeError, match="compresion_topk.*compression_topk"):
    dj.demo(1e-3, axis_name=None, compresion_topk=8)


def test_one_dict_of_options_drives_demo_and_the_lookahead():
  opts = dj.Compression(compression_topk=4, compression_chunk=8, quantize_1bit=True)._asdict()
  tx = dj.demo(1e-2, axis_name=None, delayed_apply=True, **opts)
  params = {"w": jnp.ones((16, 16))}
  state = tx.init(params)
  _, state = tx.update(params, state, params)
  moved = dj.gradient_point(state, params, 1e-2, **opts)
  assert float(jnp.abs(moved["w"] - params["w"]).max()) == pytest.approx(1e-2)
  # Other sizes give another message, which the lookahead refuses to read.
  with pytest.raises(ValueError, match="compression options"):
    dj.gradient_point(state, params, 1e-2, **{**opts, "compression_topk": 2})


def test_the_options_are_checked_with_the_fix():
  with pytest.raises(ValueError, match="random_positions=True"):
    dj.Compression(frequency_bias=1.0).checked()
  with pytest.raises(ValueError, match="compression_decay"):
    dj.Compression(compression_decay=1.0).checked()


def test_inject_hyperparams_still_leaves_the_sizes_static():
  tx = optax.inject_hyperparams(dj.demo)(learning_rate=1e-3, axis_name=None)
  assert set(tx.init({"w": jnp.ones((8, 8))}).hyperparams) == {"learning_rate", "weight_decay"}


def test_without_error_feedback_the_momentum_keeps_what_was_sent():
  params = {"w": jnp.ones((16, 16))}
  grads = {"w": jnp.arange(256.0).reshape(16, 16) / 256}
  states = {}
  for ef in (True, False):
    tx = dj.scale_by_demo(1.0, axis_name=None, compression_chunk=8, error_feedback=ef)
    _, states[ef] = tx.update(grads, tx.init(params), params)
  fed, kept = states[True].momentum["w"], states[False].momentum["w"]
  # 32 of each 8x8 chunk's 64 coefficients were sent: the fed-back momentum
  # lost those, the other holds the whole DCT of the gradient (Muon's momentum).
  assert int((fed != kept).sum()) == 4 * 32
  dct_of_g = dj.dct.from_blocks(
    dj.dct.DCT_BASIS.forward(
      dj.dct.to_blocks(grads["w"], plan := dj.dct.plan_chunks((16, 16), 8)), plan
    ),
    plan,
  )
  np.testing.assert_allclose(np.asarray(kept), np.asarray(dct_of_g), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="error_feedback"):
    dj.demo(1e-3, axis_name=None, delayed_apply=True, error_feedback=False)


def test_sent_keep_leaves_that_share_of_each_sent_value_and_nothing_else_moves():
  params = {"w": jnp.ones((16, 16))}
  grads = {"w": jnp.sin(jnp.arange(256.0)).reshape(16, 16)}
  states = {}
  for keep in (0.0, 0.3):
    tx = dj.scale_by_demo(
      1.0, axis_name=None, compression_chunk=8, compression_topk=4, sent_keep=keep
    )
    _, states[keep] = tx.update(grads, tx.init(params), params)
  _, whole = dj.scale_by_demo(
    1.0, axis_name=None, compression_chunk=8, compression_topk=4, error_feedback=False
  ).update(grads, dj.scale_by_demo(1.0, axis_name=None).init(params), params)
  fed, kept, m = (np.asarray(s.momentum["w"]) for s in (states[0.0], states[0.3], whole))
  sent = fed != m  # DeMo's feedback zeroed the 4 sent of each chunk's 64
  assert int(sent.sum()) == 4 * 4
  np.testing.assert_array_equal(kept[~sent], m[~sent])  # bit for bit where nothing was sent
  np.testing.assert_allclose(kept[sent], 0.3 * m[sent], rtol=1e-6)


def test_with_nothing_dropped_sent_keep_makes_the_sent_values_heavy_ball_momentum():
  # Every coefficient of each chunk sent in fp32: what is sent at step t is
  # decay * keep * (what was sent at t - 1) + DCT(g_t), the momentum Dion's
  # feedback gives; DeMo's (keep 0) would send DCT(g_t) alone.
  decay, keep = 0.9, 0.5
  tx = dj.scale_by_demo(
    1.0,
    axis_name=None,
    compression_chunk=8,
    compression_topk=64,
    compression_decay=decay,
    sent_keep=keep,
  )
  params = {"w": jnp.zeros((8, 8))}
  state = tx.init(params)
  rng = np.random.default_rng(0)
  heavy_ball = np.zeros((8, 8))
  plan = dj.dct.plan_chunks((8, 8), 8)
  for _ in range(3):
    g = rng.standard_normal((8, 8)).astype(np.float32)
    heavy_ball = decay * keep * heavy_ball + np.asarray(
      dj.dct.from_blocks(
        dj.dct.DCT_BASIS.forward(dj.dct.to_blocks(jnp.asarray(g), plan), plan), plan
      )
    )
    _, state = tx.update({"w": jnp.asarray(g)}, state, params)
    np.testing.assert_allclose(
      np.asarray(state.momentum["w"]), keep * heavy_ball, rtol=1e-5, atol=1e-6
    )


def test_sent_keep_is_refused_where_it_means_nothing_with_the_fix():
  with pytest.raises(ValueError, match="sent_keep.*error_feedback=True"):
    dj.Compression(sent_keep=0.5, error_feedback=False).checked()
  with pytest.raises(ValueError, match="sent_keep"):
    dj.Compression(sent_keep=1.0).checked()
  with pytest.raises(ValueError, match="sent_keep.*plain exchange"):
    dj.demo(1e-3, axis_name=None, delayed_apply=True, sent_keep=0.5)
