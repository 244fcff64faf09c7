"""Per-worker optimizer state: which leaves differ by worker, and their placement.

Which leaves differ by worker (DeMo's momentum) and which are shared (counts,
DisTrO-AdamW's moments) is found by tracing one update under ``jax.shard_map``,
so any optax chain works. A per-worker leaf of local shape ``(d0, ...)`` is one
global array ``(W * d0, ...)`` sharded over the data axis (with ``param_specs``,
over every axis it differs on: ``P(("replica", "fsdp"))``); a shared leaf is
replicated. See docs/elastic.md and docs/fsdp.md.
"""

import collections
import contextlib
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from distro_jax import dense_step, exchange
from distro_jax.exchange import as_varying, varies_over

__all__ = ["abstract_worker_state", "init_worker_state", "worker_state_specs"]


_PER_WORKER_SCALAR_FIX = (
  "It comes from a stateful wrapper fed each worker's own gradient (optax.apply_if_finite, "
  "or optax.MultiSteps around a scalar param): apply it after the exchange or all-reduce, "
  "where the state is shared, or give scalar params shape (1,)."
)


def is_spec(x: Any) -> bool:
  """Whether ``x`` is a ``PartitionSpec``, the leaf of a tree of specs."""
  return isinstance(x, P)


def spec_axes(spec: P) -> tuple[Hashable, ...]:
  """The mesh axes that ``spec`` names, in order."""
  return tuple(n for e in spec for n in (e if isinstance(e, tuple) else (e,)) if n is not None)


def _leaf_spec(axes: tuple[Hashable, ...]) -> P:
  if not axes:
    return P()
  return P(axes[0]) if len(axes) == 1 else P(axes)


def _abstract(params: Any, mesh: Mesh, param_specs: Any) -> Any:
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype, sharding=NamedSharding(mesh, s)),
    params,
    param_specs,
  )


def _or_replicated(params: Any, param_specs: Any) -> Any:
  """``param_specs``, by default every param replicated."""
  return jax.tree.map(lambda _: P(), params) if param_specs is None else param_specs


Marks = list[tuple[Hashable, ...]]


def _update_tracer(
  tx: Any,
  abstract_params: Any,
  mesh: Mesh,
  axis_name: Hashable,
  param_specs: Any,
  candidates: tuple[Hashable, ...],
) -> tuple[Any, Callable[[Marks], Marks]]:
  """``tx``'s state shape, and ``trace``: the axes each leaf varies over, after one update."""
  local = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.sharding.shard_shape(x.shape), x.dtype), abstract_params
  )
  state_shape = jax.eval_shape(tx.init, local)
  leaves, treedef = jax.tree.flatten(state_shape)

  def trace(marks: Marks) -> Marks:
    seen: Marks = []

    def body(p, state_leaves):
      state_leaves = [as_varying(x, mark) for x, mark in zip(state_leaves, marks)]
      grads = jax.tree.map(lambda x: as_varying(x, (axis_name,)), p)
      _, new_state = tx.update(grads, treedef.unflatten(state_leaves), p)
      seen.extend(
        tuple(a for a in candidates if varies_over(x, a)) for x in jax.tree.leaves(new_state)
      )
      return jnp.zeros(())

    fn = jax.shard_map(body, mesh=mesh, in_specs=(param_specs, P()), out_specs=P())
    with dense_step.quiet(), exchange.types_only():
      jax.eval_shape(fn, abstract_params, leaves)
    return seen

  return state_shape, trace


def _multi_steps_start(
  tx: Any,
  state_shape: Any,
  abstract_params: Any,
  mesh: Mesh,
  axis_name: Hashable,
  param_specs: Any,
  candidates: tuple[Hashable, ...],
) -> Marks | None:
  """Where the fixpoint search on ``optax.MultiSteps``' state starts; ``None`` for other ``tx``."""
  # Its lax.cond does not trace with a per-worker leaf marked shared: start from what
  # varies anyway, the accumulated gradients and what one inner update varies.
  multi = getattr(getattr(tx, "update", None), "__self__", None)  # MultiSteps.update's owner
  if (
    not isinstance(multi, optax.MultiSteps)
    or not isinstance(state_shape, optax.MultiStepsState)
    or jax.tree.leaves(state_shape.skip_state)
  ):
    return None
  inner_shape, inner_trace = _update_tracer(
    multi.inner_opt, abstract_params, mesh, axis_name, param_specs, candidates
  )
  try:
    inner = inner_trace([()] * len(jax.tree.leaves(inner_shape)))
  except TypeError:
    return None
  grad_like = jax.tree.map(
    lambda s: _leaf_spec(tuple(a for a in candidates if a == axis_name or a in spec_axes(s))),
    param_specs,
    is_leaf=is_spec,
  )
  start = optax.MultiStepsState(
    mini_step=P(),
    gradient_step=P(),
    inner_opt_state=jax.tree.structure(inner_shape).unflatten([_leaf_spec(m) for m in inner]),
    acc_grads=grad_like,
    skip_state=state_shape.skip_state,
  )
  flat, treedef = jax.tree.flatten(start, is_leaf=is_spec)
  if treedef != jax.tree.structure(state_shape):
    return None
  return [spec_axes(s) for s in flat]


def worker_state_specs(
  tx: optax.GradientTransformation,
  params: Any,
  mesh: Mesh,
  axis_name: Hashable = "data",
  *,
  param_specs: Any = None,
) -> Any:
  """PartitionSpecs of ``tx``'s state: ``P(axis_name)`` per worker, ``P()`` shared.

  Use them as the state's ``in_specs`` and ``out_specs`` in ``jax.shard_map``.
  The answers for the last few arguments are kept.

  Args:
    tx: the optimizer, built with ``axis_name``.
    params: the params tree (arrays or ``jax.ShapeDtypeStruct``), global shapes.
    mesh: the device mesh, with an axis ``axis_name``.
    axis_name: the data-parallel axis (``"replica"`` on a 2-D FSDP mesh).
    param_specs: the params' ``PartitionSpec`` tree when they are sharded
      (:attr:`distro_jax.FsdpPlan.specs`); default: replicated.

  Returns:
    A tree of ``PartitionSpec`` shaped as ``tx.init`` of one device's params.

  Raises:
    ValueError: a per-worker leaf is a scalar, or one update cannot be traced
      with per-worker gradients.
  """
  return _found(tx, params, mesh, axis_name, _or_replicated(params, param_specs)).specs


class _Found(NamedTuple):
  specs: Any  # worker_state_specs
  init: Callable[[Any], Any]  # init_worker_state's jitted function


# A train step's setup asks for the same specs three times, and each answer
# traces one update at least twice: keep the last few, each with its jitted init.
_FOUND: collections.OrderedDict = collections.OrderedDict()
_FOUND_SIZE = 8


def _found(tx: Any, params: Any, mesh: Mesh, axis_name: Hashable, param_specs: Any) -> _Found:
  """The state's specs and jitted init for these arguments, kept for the last few."""
  if axis_name not in mesh.axis_names:
    raise ValueError(
      f"axis_name={axis_name!r} is not an axis of the mesh {mesh.axis_names}; "
      "build the mesh with it, e.g. jax.make_mesh((n,), ('data',))."
    )
  leaves, treedef = jax.tree.flatten(params)
  spec_leaves, spec_def = jax.tree.flatten(param_specs, is_leaf=is_spec)
  shapes = tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves)
  key = (tx, treedef, shapes, mesh, axis_name, spec_def, tuple(spec_leaves))
  try:
    found = _FOUND.pop(key, None)
  except TypeError:  # some part cannot be hashed: keep nothing
    key = found = None
  if found is None:
    specs = _find_specs(tx, params, mesh, axis_name, param_specs)
    found = _Found(specs, _init_on_mesh(tx, mesh, param_specs, specs))
  if key is not None:
    _FOUND[key] = found  # last: the most recently used
    if len(_FOUND) > _FOUND_SIZE:
      _FOUND.popitem(last=False)
  return found


def _find_specs(tx: Any, params: Any, mesh: Mesh, axis_name: Hashable, param_specs: Any) -> Any:
  """:func:`worker_state_specs`, computed: the least fixpoint of one update's varying axes."""
  abstract_params = _abstract(params, mesh, param_specs)
  sharded = {a for s in jax.tree.leaves(param_specs, is_leaf=is_spec) for a in spec_axes(s)}
  candidates = tuple(a for a in mesh.axis_names if a == axis_name or a in sharded)
  state_shape, trace = _update_tracer(tx, abstract_params, mesh, axis_name, param_specs, candidates)
  leaves, treedef = jax.tree.flatten(state_shape)

  def union(a: tuple[Hashable, ...], b: tuple[Hashable, ...]) -> tuple[Hashable, ...]:
    return tuple(x for x in candidates if x in a or x in b)

  start = _multi_steps_start(
    tx, state_shape, abstract_params, mesh, axis_name, param_specs, candidates
  )
  try:
    # Least fixpoint: from every leaf shared (or MultiSteps' start), add what the update varies.
    varying: Marks = start or [()] * len(leaves)
    while (now := [union(a, b) for a, b in zip(varying, trace(varying))]) != varying:
      varying = now
  except TypeError:
    # Some wrappers (a lax.cond) do not trace with a per-worker leaf marked shared:
    # start from everything varying, and drop each axis over which a leaf stays shared.
    varying = [candidates] * len(leaves)
    for i in range(len(leaves)):
      for a in candidates:
        trial = list(varying)
        trial[i] = tuple(x for x in varying[i] if x != a)
        with contextlib.suppress(TypeError):
          if a not in trace(trial)[i]:
            varying = trial
    try:
      traced = trace(varying)
    except TypeError as e:
      # No marking traces: a wrapper that branches per worker (optax.apply_if_finite
      # around the exchange) between types, whose state would be a per-worker scalar.
      reason = str(e).split("\n", 1)[0].rstrip(".")
      raise ValueError(
        f"One update of the optimizer cannot be traced with per-worker gradients ({reason}); "
        "the usual cause is a per-worker scalar in its state, which the per-worker layout "
        f"cannot hold. {_PER_WORKER_SCALAR_FIX}"
      ) from e
    if any(set(out) - set(mark) for out, mark in zip(traced, varying)):
      raise ValueError(
        "Could not tell which optimizer state leaves are per worker; pass the "
        "state's PartitionSpecs to jax.shard_map by hand."
      ) from None

  for (path, leaf), mark in zip(jax.tree_util.tree_flatten_with_path(state_shape)[0], varying):
    if mark and leaf.ndim == 0:
      raise ValueError(
        f"Optimizer state leaf {jax.tree_util.keystr(path)} is a per-worker scalar, which the "
        f"per-worker layout (leaves joined on axis 0) cannot hold. {_PER_WORKER_SCALAR_FIX}"
      )
  return treedef.unflatten([_leaf_spec(mark) for mark in varying])


def _init_on_mesh(tx, mesh, param_specs, specs):
  """``tx.init`` on every device's own params, jitted into the layout of ``specs``."""
  spec_leaves = jax.tree.leaves(specs, is_leaf=is_spec)

  def local_init(p):
    leaves, treedef = jax.tree.flatten(tx.init(p))
    return treedef.unflatten([as_varying(x, spec_axes(s)) for x, s in zip(leaves, spec_leaves)])

  fn = jax.shard_map(local_init, mesh=mesh, in_specs=(param_specs,), out_specs=specs)
  return jax.jit(fn, out_shardings=_state_shardings(mesh, specs))


def _state_shardings(mesh: Mesh, specs: Any) -> Any:
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)


def init_worker_state(
  tx: optax.GradientTransformation,
  params: Any,
  mesh: Mesh,
  axis_name: Hashable = "data",
  *,
  param_specs: Any = None,
) -> Any:
  """``tx.init(params)`` for every worker, placed on the mesh as :func:`worker_state_specs` say.

  Works across processes, with the params as global arrays.

  Args:
    tx: the optimizer.
    params: the params tree, placed as ``param_specs`` says.
    mesh: the device mesh.
    axis_name: the data-parallel axis.
    param_specs: the params' ``PartitionSpec`` tree when they are sharded.

  Returns:
    The global optimizer state.

  Example:
    >>> import jax, jax.numpy as jnp, distro_jax as dj
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> tx = dj.demo(1e-3)
    >>> state = dj.init_worker_state(tx, {"w": jnp.zeros((64, 64))}, mesh)
  """
  param_specs = _or_replicated(params, param_specs)
  init = _found(tx, params, mesh, axis_name, param_specs).init
  params = jax.tree.map(
    lambda x, s: x if getattr(x, "sharding", None) == s else jax.device_put(x, s),
    params,
    _state_shardings(mesh, param_specs),
  )
  return init(params)


def abstract_worker_state(
  tx: optax.GradientTransformation,
  params: Any,
  mesh: Mesh,
  axis_name: Hashable = "data",
  *,
  param_specs: Any = None,
) -> Any:
  """Shapes, dtypes and shardings of :func:`init_worker_state`: a checkpoint's restore target."""
  param_specs = _or_replicated(params, param_specs)
  init = _found(tx, params, mesh, axis_name, param_specs).init
  shapes = jax.eval_shape(init, _abstract(params, mesh, param_specs))
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding), shapes)
