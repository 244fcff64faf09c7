"""What a step's all-gathers read: walks of a jaxpr, and the trainer's step as one."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

import distro_jax as dj
from experiments.run import checks


def _sub_jaxprs(eqn):
  for sub in eqn.params.values():
    inner = sub.jaxpr if isinstance(sub, jex_core.ClosedJaxpr) else sub
    if isinstance(inner, jex_core.Jaxpr):
      yield inner


def gathers_fed_by(jaxpr, tainted):
  """For each all-gather in ``jaxpr``, whether its operand depends on a ``tainted`` var."""
  found = []
  for eqn in jaxpr.eqns:
    hit = any(isinstance(v, jex_core.Var) and v in tainted for v in eqn.invars)
    if eqn.primitive.name.startswith("all_gather"):
      found.append(hit)
    for inner in _sub_jaxprs(eqn):
      if len(inner.invars) == len(eqn.invars):
        inner_tainted = {
          iv
          for iv, v in zip(inner.invars, eqn.invars)
          if isinstance(v, jex_core.Var) and v in tainted
        }
      else:
        inner_tainted = set(inner.invars) if hit else set()
      found += gathers_fed_by(inner, inner_tainted)
    if hit:
      tainted.update(eqn.outvars)
  return found


_CALLS = frozenset(
  {"jit", "pjit", "closed_call", "shard_map", "custom_jvp_call", "custom_vjp_call", "checkpoint"}
)


def outputs_fed_by(jaxpr, tainted):
  """For each output of ``jaxpr``, whether it depends on a ``tainted`` var.

  Calls whose inner jaxpr takes and returns the equation's own vars (jit,
  shard_map, custom derivatives, remat) are followed output by output; any
  other equation (cond, while, scan, whose carries feed each other) counts
  each of its outputs as fed by all of its inputs, so the answer can only
  over-taint.
  """
  tainted = set(tainted)
  for eqn in jaxpr.eqns:
    fed = [isinstance(v, jex_core.Var) and v in tainted for v in eqn.invars]
    subs = list(_sub_jaxprs(eqn))
    if (
      eqn.primitive.name in _CALLS
      and len(subs) == 1
      and len(subs[0].invars) == len(eqn.invars)
      and len(subs[0].outvars) == len(eqn.outvars)
    ):
      outs = outputs_fed_by(subs[0], {iv for iv, hit in zip(subs[0].invars, fed) if hit})
    else:
      outs = [any(fed)] * len(eqn.outvars)
    tainted.update(v for v, hit in zip(eqn.outvars, outs) if hit)
  return [isinstance(v, jex_core.Var) and v in tainted for v in jaxpr.outvars]


def gather_branch_paths(jaxpr, path=()):
  """Each all-gather's enclosing ``cond`` branches, outermost first, e.g. ``("cond[1]",)``."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name.startswith("all_gather"):
      found.append(path)
    if eqn.primitive.name == "cond":
      for i, branch in enumerate(eqn.params["branches"]):
        found += gather_branch_paths(branch.jaxpr, (*path, f"cond[{i}]"))
    else:
      for inner in _sub_jaxprs(eqn):
        found += gather_branch_paths(inner, path)
  return found


def gather_operand_bytes(jaxpr):
  """Each all-gather's operand bytes, in the order :func:`gathers_fed_by` visits them."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name.startswith("all_gather"):
      aval = eqn.invars[0].aval
      found.append(int(np.prod(aval.shape)) * aval.dtype.itemsize)
    for inner in _sub_jaxprs(eqn):
      found += gather_operand_bytes(inner)
  return found


def trainer_step_jaxpr(**overrides):
  """The driver's train step on ``tiny`` (4 workers, 8 x 32 tokens) as a jaxpr.

  Returns:
    ``(cfg, program, closed)``; the last two inputs of ``closed`` are the batch.
  """
  from experiments.run import config, trainer

  fields = dict(preset="tiny", workers=4, batch_size=8, seq_len=32, **overrides)
  cfg = checks.resolve(config.TrainConfig(**fields))
  program = trainer.build(cfg)
  params = program.placed(program.abstract, program.fsdp_plan.specs)
  state = dj.abstract_worker_state(
    program.tx, program.abstract, program.mesh, "replica", param_specs=program.fsdp_plan.specs
  )
  rows = jax.ShapeDtypeStruct((8, 32), jnp.int32, sharding=program.sharding(program.rows))
  closed = jax.make_jaxpr(program.train_step)(params, state, jnp.int32(1), rows, rows)
  return cfg, program, closed
