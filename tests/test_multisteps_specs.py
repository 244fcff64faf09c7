"""dj.worker_state_specs under optax.MultiSteps: about as many traces as without it.

MultiSteps' update is a ``lax.cond`` that cannot be traced with a per-worker
leaf passed in as shared, so the generic search used to trace one full update
per state leaf (27 s against 0.7 s without MultiSteps on a 19-leaf model, in
issue 55). These tests count the traces instead of timing them.
"""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import distro_jax as dj

PARAMS = {f"layer{i}": {"w": jnp.zeros((16, 8)), "b": jnp.zeros((8,))} for i in range(2)}


def _counted(tx, calls):
  """``tx`` whose update appends to ``calls`` each time it is traced."""

  def update(*args, **kwargs):
    calls.append(1)
    return tx.update(*args, **kwargs)

  return optax.GradientTransformationExtraArgs(tx.init, update)


def _mesh():
  return jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])


def test_multisteps_costs_one_trace_more_than_its_inner_optimizer():
  demo = dj.demo(0.1, compression_topk=2, compression_chunk=8)
  alone, wrapped = [], []
  inner_specs = dj.worker_state_specs(_counted(demo, alone), PARAMS, _mesh())
  specs = dj.worker_state_specs(optax.MultiSteps(_counted(demo, wrapped), 2), PARAMS, _mesh())
  # Alone: one trace from all-shared, one that finds nothing new. Wrapped: one
  # trace of the inner update from all-shared, then one of MultiSteps, which
  # traces the inner update twice (to apply it, and under eval_shape to skip it).
  assert len(alone) == 2 and len(wrapped) == 3, (len(alone), len(wrapped))
  assert specs.inner_opt_state == inner_specs
  assert specs.mini_step == P() and specs.gradient_step == P()
  assert specs.acc_grads == jax.tree.map(lambda _: P("data"), PARAMS)
  assert inner_specs[0].momentum == specs.acc_grads and inner_specs[0].count == P()


def test_gradient_transformation_form_and_shared_inner_state():
  # DisTrO-AdamW's moments are shared: the analysis must not mark them per worker.
  tx = optax.MultiSteps(dj.distro_adamw(0.1, compression_topk=2, compression_chunk=8), 2)
  calls = []
  specs = dj.worker_state_specs(
    optax.MultiSteps(_counted(tx.inner_opt, calls), 2).gradient_transformation(), PARAMS, _mesh()
  )
  adam = specs.inner_opt_state[1][0]
  assert adam.mu == jax.tree.map(lambda _: P(), PARAMS) and adam.count == P()
  assert specs.inner_opt_state[0].momentum == jax.tree.map(lambda _: P("data"), PARAMS)
  assert len(calls) <= 6, len(calls)


def test_the_same_question_is_answered_without_tracing_again():
  calls = []
  tx = _counted(dj.demo(0.1, compression_topk=2, compression_chunk=8), calls)
  first = dj.worker_state_specs(tx, PARAMS, _mesh())
  assert len(calls) == 2
  # Arrays or their shapes, the same answer: init_worker_state asks with the
  # params, a train step's setup with their abstract shapes.
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), PARAMS)
  assert dj.worker_state_specs(tx, abstract, _mesh()) == first
  dj.init_worker_state(tx, PARAMS, _mesh())
  assert len(calls) == 2
  # Other shapes, another optimizer or another mesh: traced anew.
  dj.worker_state_specs(tx, {"w": jnp.zeros((16, 16))}, _mesh())
  dj.worker_state_specs(
    _counted(dj.demo(0.1, compression_topk=2, compression_chunk=8), calls), PARAMS, _mesh()
  )
  dj.worker_state_specs(tx, PARAMS, jax.make_mesh((4,), ("data",), devices=jax.devices()[:4]))
  assert len(calls) == 8
