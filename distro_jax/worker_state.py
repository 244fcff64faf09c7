"""Per-worker optimizer state: which leaves differ by worker, and their placement.

Under DeMo each worker keeps its own momentum, while counts and anything
computed from the shared aggregate (DisTrO-AdamW's moments, say) stay identical
on every worker. The helpers here find out which leaves are which by tracing
one update under ``jax.shard_map`` and reading each output's varying-axes type,
so they work for any optax chain, including wrappers such as
``optax.MultiSteps`` whose accumulators are per worker.

Layout: a per-worker leaf of local shape ``(d0, ...)`` is one global array of
shape ``(W * d0, ...)`` sharded over the data axis, so that inside the
shard_map every worker sees exactly its own ``(d0, ...)`` and the train step
needs no reshaping. A replicated leaf is stored once, ``P()``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from distro_jax.exchange import varies_over

__all__ = ["abstract_worker_state", "init_worker_state", "worker_state_specs"]


def _as_varying(x: jax.Array, axis_name: Hashable) -> jax.Array:
  if varies_over(x, axis_name):
    return x
  return jax.lax.pcast(x, axis_name, to="varying")


def worker_state_specs(
  tx: optax.GradientTransformation,
  params: Any,
  mesh: Mesh,
  axis_name: Hashable = "data",
) -> Any:
  """PartitionSpecs of ``tx``'s state: ``P(axis_name)`` per worker, ``P()`` shared.

  Use them as the state's ``in_specs`` and ``out_specs`` in ``jax.shard_map``.

  Args:
    tx: the optimizer, built with ``axis_name``.
    params: the params tree (arrays or ``jax.ShapeDtypeStruct``).
    mesh: the device mesh, with an axis ``axis_name``.
    axis_name: the data-parallel axis.

  Returns:
    A tree of ``PartitionSpec`` with the structure of ``tx.init(params)``.

  Raises:
    ValueError: if a per-worker leaf is a scalar, which this layout cannot
      shard.
  """
  if axis_name not in mesh.axis_names:
    raise ValueError(
      f"axis_name={axis_name!r} is not an axis of the mesh {mesh.axis_names}; "
      "build the mesh with it, e.g. jax.make_mesh((n,), ('data',))."
    )
  abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), params)
  state_shape = jax.eval_shape(tx.init, abstract_params)
  leaves, treedef = jax.tree.flatten(state_shape)

  def trace(marks: list[bool]) -> list[bool]:
    """Which state leaves come out of one update varying, given which go in varying."""
    seen: list[bool] = []

    def body(p, state_leaves):
      state_leaves = [
        _as_varying(x, axis_name) if mark else x for x, mark in zip(state_leaves, marks)
      ]
      grads = jax.tree.map(lambda x: _as_varying(x, axis_name), p)
      _, new_state = tx.update(grads, treedef.unflatten(state_leaves), p)
      seen.extend(varies_over(x, axis_name) for x in jax.tree.leaves(new_state))
      return jnp.zeros(())

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P())
    jax.eval_shape(fn, abstract_params, leaves)
    return seen

  try:
    # Least fixpoint: start with every leaf shared, mark what the update makes varying.
    varying = [False] * len(leaves)
    while (now := [a or b for a, b in zip(varying, trace(varying))]) != varying:
      varying = now
  except TypeError:
    # Some wrappers (optax.MultiSteps' lax.cond) cannot even be traced with a
    # per-worker leaf passed in as shared. Come from the other side instead:
    # everything per worker, then share each leaf that stays shared.
    varying = [True] * len(leaves)
    for i in range(len(leaves)):
      trial = varying[:i] + [False] + varying[i + 1 :]
      try:
        if not trace(trial)[i]:
          varying = trial
      except TypeError:
        pass
    if any(a and not b for a, b in zip(trace(varying), varying)):
      raise ValueError(
        "Could not tell which optimizer state leaves are per worker; pass the "
        "state's PartitionSpecs to jax.shard_map by hand."
      ) from None

  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state_shape)[0]]
  for path, leaf, mark in zip(paths, leaves, varying):
    if mark and leaf.ndim == 0:
      raise ValueError(
        f"Optimizer state leaf {path} is a per-worker scalar; the per-worker layout "
        "concatenates leaves along axis 0 and cannot hold it. It comes from a "
        "stateful wrapper fed each worker's own gradient (optax.apply_if_finite, or "
        "optax.MultiSteps around a scalar param): apply it after the exchange or "
        "all-reduce, where the state is shared, or give scalar params shape (1,)."
      )
  return treedef.unflatten([P(axis_name) if mark else P() for mark in varying])


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


def _stacked_init(tx, params, specs, num_workers):
  leaves, treedef = jax.tree.flatten(tx.init(params))
  marks = [s != P() for s in jax.tree.leaves(specs, is_leaf=_is_spec)]
  return treedef.unflatten(
    [jnp.concatenate([x] * num_workers) if mark else x for x, mark in zip(leaves, marks)]
  )


def _state_shardings(mesh: Mesh, specs: Any) -> Any:
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def init_worker_state(
  tx: optax.GradientTransformation,
  params: Any,
  mesh: Mesh,
  axis_name: Hashable = "data",
) -> Any:
  """``tx.init(params)`` for every worker, placed on the mesh.

  Per-worker leaves are laid out as :mod:`distro_jax.worker_state` describes;
  shared leaves are replicated. Works across processes (the params must be
  global arrays).

  Args:
    tx: the optimizer.
    params: the params tree.
    mesh: the device mesh.
    axis_name: the data-parallel axis.

  Returns:
    The global optimizer state. ``jax.tree.map(lambda x: x.sharding.spec, state)``
    equals :func:`worker_state_specs`.

  Example:
    >>> import jax, jax.numpy as jnp, distro_jax as dj
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> tx = dj.demo(1e-3)
    >>> state = dj.init_worker_state(tx, {"w": jnp.zeros((64, 64))}, mesh)
  """
  specs = worker_state_specs(tx, params, mesh, axis_name)
  num_workers = mesh.shape[axis_name]
  fn = jax.jit(
    lambda p: _stacked_init(tx, p, specs, num_workers),
    out_shardings=_state_shardings(mesh, specs),
  )
  return fn(params)


def abstract_worker_state(
  tx: optax.GradientTransformation,
  params: Any,
  mesh: Mesh,
  axis_name: Hashable = "data",
) -> Any:
  """Shapes, dtypes and shardings of :func:`init_worker_state`, allocating nothing.

  This is the restore target for a checkpoint (e.g. ``orbax``'s
  ``StandardRestore``).
  """
  specs = worker_state_specs(tx, params, mesh, axis_name)
  num_workers = mesh.shape[axis_name]
  shapes = jax.eval_shape(lambda p: _stacked_init(tx, p, specs, num_workers), params)
  return jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
    shapes,
    _state_shardings(mesh, specs),
  )
