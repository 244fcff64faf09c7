"""The all-to-all exchange: every message straight to every peer, the same bits as the ring."""

import jax
import numpy as np
import pytest
import sharded_step
from jax.sharding import PartitionSpec as P

import distro_jax as dj

# The recommended 1,000x message, small enough to compile fast.
_OPTS = dict(
  compression_topk=1,
  compression_chunk=8,
  quantize_1bit=True,
  random_positions=True,
  frequency_bias=1.0,
  compression_decay=0.95,
)
_SHAPES = {"w": (16, 24), "b": (24,)}


def _run(collective, check_vma, delayed_apply=False, steps=3):
  mesh = sharded_step.mesh_of(4)
  tx = dj.demo(1e-2, collective=collective, delayed_apply=delayed_apply, normalize="orth", **_OPTS)
  init, grads = sharded_step.random_problem(_SHAPES, 4, steps, seed=0)
  step, params, state = sharded_step.build(tx, init, mesh, check_vma=check_vma)
  placed = [sharded_step.place_grads(g, mesh) for g in grads]
  for g in placed:
    params, state = step(params, state, g)
  return params, step.lower(params, state, placed[0]).compile().as_text()


@pytest.mark.parametrize("delayed_apply", [False, True])
def test_the_all_to_all_steps_to_the_ring_s_bits(delayed_apply):
  ring, ring_hlo = _run("all_gather", True, delayed_apply)
  direct, direct_hlo = _run("all_to_all", False, delayed_apply)
  for k in _SHAPES:
    np.testing.assert_array_equal(np.asarray(direct[k]), np.asarray(ring[k]))
  assert "all-gather" in ring_hlo and "all-to-all" not in ring_hlo
  assert "all-to-all" in direct_hlo and "all-gather" not in direct_hlo


def test_under_checked_types_the_all_to_all_is_refused_with_the_fix():
  with pytest.raises(ValueError, match="check_vma=False"):
    _run("all_to_all", True, steps=1)


def test_an_unknown_collective_is_refused():
  with pytest.raises(ValueError, match="all_to_all"):
    dj.demo(1e-2, collective="ring")
  # The exchange itself refuses it too, for callers of the stages.
  with pytest.raises(ValueError, match="all_to_all"):
    dj.exchange.all_gather_messages(np.zeros(4, np.uint8), None, "ring")


def test_gather_pending_by_all_to_all_matches_the_ring():
  mesh = sharded_step.mesh_of(4)
  tx = dj.demo(1e-2, delayed_apply=True, **_OPTS)
  init, grads = sharded_step.random_problem(_SHAPES, 4, 2, seed=1)
  step, params, state = sharded_step.build(tx, init, mesh)
  for g in grads:
    params, state = step(params, state, sharded_step.place_grads(g, mesh))
  specs = dj.worker_state_specs(tx, init, mesh)

  def gather(collective, check_vma):
    fn = lambda s: dj.gather_pending(s, "data", collective)  # noqa: E731
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(specs,), out_specs=P(), check_vma=check_vma)
    return np.asarray(jax.jit(mapped)(state))

  ring = gather("all_gather", True)
  assert ring.shape[0] == 4 and ring.any()
  np.testing.assert_array_equal(gather("all_to_all", False), ring)
