"""dj.demo against the plain-NumPy reference of docs/design.md, section 2."""

import functools

import jax
import numpy as np
import pytest
from numpy_reference import ReferenceDeMo
from sharded_step import build, mesh_of, place_grads

import distro_jax as dj

SHAPES = {"a": (64, 128), "b": (96, 40), "c": (128,), "d": (7,), "e": (256, 256)}


def _grads(rng, params, workers):
  # Gradients depend on the params, so the trajectories are coupled, and differ by worker.
  return [
    {k: 0.5 * np.asarray(p, np.float64) + rng.normal(size=p.shape) for k, p in params.items()}
    for _ in range(workers)
  ]


@functools.cache
def _draw(block_shape, k, bias):
  """``dj.codec.draw_positions`` at a position key, jitted once per block view: the
  reference draws 240 times, and op by op each draw took 50 ms."""

  def draw(step, tensor, worker):
    key = dj.codec.position_key(step, tensor, worker)
    return dj.codec.draw_positions(key, block_shape, k, bias)

  return jax.jit(draw)


def _drawn(name, worker, step, k, bias=None):
  """The positions dj.demo(random_positions=True) draws, from its documented key."""
  plan = dj.dct.plan_chunks(SHAPES[name], 64)
  draw = _draw(plan.block_shape, k, bias or 0.0)
  return draw(np.int32(step), np.int32(sorted(SHAPES).index(name)), np.int32(worker))


SLOW = pytest.mark.slow


# The defaults stay in the quick loop; each variant costs a compile of its own.
@pytest.mark.parametrize(
  "random_positions, bias, normalize",
  [
    pytest.param(False, None, "sign", id="topk"),
    pytest.param(True, None, "sign", id="random-positions", marks=SLOW),
    pytest.param(True, 1.0, "sign", id="random-positions-bias1", marks=SLOW),
    pytest.param(False, None, "rms", id="topk-rms", marks=SLOW),
    pytest.param(True, 1.0, "rms", id="random-bias1-rms", marks=SLOW),
    pytest.param(True, 1.0, "orth", id="random-bias1-orth", marks=SLOW),
  ],
)
def test_demo_matches_numpy_reference_over_12_steps(random_positions, bias, normalize):
  workers, lr, wd = 4, 1e-3, 0.1
  rng = np.random.default_rng(0)
  init = {k: rng.normal(size=s).astype(np.float32) * 0.1 for k, s in SHAPES.items()}
  ref = ReferenceDeMo(
    SHAPES,
    workers,
    lr=lr,
    decay=0.999,
    topk=32,
    chunk=64,
    weight_decay=wd,
    positions=functools.partial(_drawn, bias=bias) if random_positions else None,
    normalize=normalize,
  )
  mesh = mesh_of(workers)
  tx = dj.demo(
    lr,
    weight_decay=wd,
    random_positions=random_positions,
    frequency_bias=bias,
    normalize=normalize,
  )
  step, params, state = build(tx, {k: jax.numpy.asarray(v) for k, v in init.items()}, mesh)

  ref_params = {k: v.astype(np.float64) for k, v in init.items()}
  for _ in range(12):
    grads = _grads(rng, ref_params, workers)
    ref_params = ref.step(ref_params, grads)
    grads_W = {k: np.stack([g[k] for g in grads]).astype(np.float32) for k in SHAPES}
    params, state = step(params, state, place_grads(grads_W, mesh))

  # Each tensor on its own, so no tensor (not even the 7 entries of "d") can hide
  # in a pooled count. The real agreement is about 1e-7 in every tensor.
  for k in SHAPES:
    np.testing.assert_allclose(
      np.asarray(params[k], np.float64), ref_params[k], rtol=0, atol=1e-6, err_msg=k
    )
  # Every tensor must actually have moved (or the comparison proves nothing for it):
  # by 3.8 to 15 steps of lr here, so 2 * lr is far above the 1e-6 tolerance.
  for k in SHAPES:
    moved = np.abs(np.asarray(params[k]) - init[k]).max()
    assert moved > 2 * lr, f"{k} moved only {moved}"
