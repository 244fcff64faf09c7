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

With params sharded over more mesh axes (``param_specs``, e.g. FSDP on a
``("replica", "fsdp")`` mesh), each device's state is ``tx.init`` of its own
shards, and a leaf that differs over several axes is laid out the same way,
its axis 0 split over all of them in mesh order: ``P(("replica", "fsdp"))``.
"""

import collections
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from distro_jax import dense_step
from distro_jax.exchange import as_varying, varies_over

__all__ = ["abstract_worker_state", "init_worker_state", "worker_state_specs"]


_PER_WORKER_SCALAR_FIX = (
  "It comes from a stateful wrapper fed each worker's own gradient (optax.apply_if_finite, "
  "or optax.MultiSteps around a scalar param): apply it after the exchange or all-reduce, "
  "where the state is shared, or give scalar params shape (1,)."
)


def is_spec(x: Any) -> bool:
  """Whether ``x`` is a ``PartitionSpec``: the leaf of a tree of specs (a tuple, to jax.tree)."""
  return isinstance(x, P)


def _spec_axes(spec: P) -> tuple[Hashable, ...]:
  names = []
  for entry in spec:
    names += [n for n in (entry if isinstance(entry, tuple) else (entry,)) if n is not None]
  return tuple(names)


def _leaf_spec(axes: tuple[Hashable, ...]) -> P:
  if not axes:
    return P()
  return P(axes[0]) if len(axes) == 1 else P(axes)


def _local_params(params: Any, mesh: Mesh, param_specs: Any) -> Any:
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(NamedSharding(mesh, s).shard_shape(jnp.shape(x)), x.dtype),
    params,
    param_specs,
    is_leaf=is_spec,
  )


def _abstract(params: Any, mesh: Mesh, param_specs: Any) -> Any:
  """Global shapes of the params, placed as ``param_specs`` says."""
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype, sharding=NamedSharding(mesh, s)),
    params,
    param_specs,
  )


def _default_param_specs(params: Any) -> Any:
  return jax.tree.map(lambda _: P(), params)


def _multi_steps(tx: Any) -> optax.MultiSteps | None:
  """The ``optax.MultiSteps`` that ``tx`` is, or whose ``gradient_transformation()`` it is."""
  if isinstance(tx, optax.MultiSteps):
    return tx
  owner = getattr(getattr(tx, "update", None), "__self__", None)
  return owner if isinstance(owner, optax.MultiSteps) else None


Marks = list[tuple[Hashable, ...]]


def _update_tracer(
  tx: Any,
  abstract_params: Any,
  mesh: Mesh,
  axis_name: Hashable,
  param_specs: Any,
  candidates: tuple[Hashable, ...],
) -> tuple[Any, Callable[[Marks], Marks]]:
  """``tx``'s state shape, and a function of the state leaves' varying axes, traced once.

  The function traces one update with per-worker gradients and the state
  leaves typed as varying over the axes given, and returns the axes over
  which each new state leaf varies.
  """
  state_shape = jax.eval_shape(tx.init, _local_params(abstract_params, mesh, param_specs))
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
    with dense_step.quiet():
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
  """Where the least fixpoint of ``optax.MultiSteps``' state can start; ``None`` for other ``tx``.

  Its update is a ``lax.cond`` whose branches must agree on every output's
  varying axes, so the search cannot start from "all shared": with a
  per-worker leaf passed in as shared, the cond does not trace at all, and
  the search from the other side traces one full update per leaf and axis
  (tens of seconds for a small model). It can start from what is known to
  vary anyway: the accumulated gradients, as the gradients do, and what one
  update of the inner optimizer makes vary from an all-shared state. That is
  below the least fixpoint, so the search from there ends at it, usually
  after one trace.
  """
  multi = _multi_steps(tx)
  if (
    multi is None
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
    lambda s: _leaf_spec(tuple(a for a in candidates if a == axis_name or a in _spec_axes(s))),
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
  return [_spec_axes(s) for s in flat]


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
  Finding them traces one update at least twice; the answers for the last few
  (``tx``, params' shapes and dtypes, mesh, specs) are kept, so that
  :func:`init_worker_state` and :func:`abstract_worker_state` ask again for free.

  Args:
    tx: the optimizer, built with ``axis_name``.
    params: the params tree (arrays or ``jax.ShapeDtypeStruct``), global shapes.
    mesh: the device mesh, with an axis ``axis_name``.
    axis_name: the data-parallel axis (``"replica"`` on a 2-D FSDP mesh).
    param_specs: the params' ``PartitionSpec`` tree, when they are sharded
      (e.g. :attr:`distro_jax.FsdpPlan.specs`); default: replicated. A state
      leaf that differs over the sharded axes too gets them in its spec.

  Returns:
    A tree of ``PartitionSpec`` with the structure of ``tx.init`` of one
    device's params.

  Raises:
    ValueError: if a per-worker leaf is a scalar, which this layout cannot
      shard, or one update cannot be traced with per-worker gradients.
  """
  if param_specs is None:
    param_specs = _default_param_specs(params)
  return _found(tx, params, mesh, axis_name, param_specs).specs


class _Found(NamedTuple):
  """What one key of :data:`_FOUND` holds."""

  specs: Any  # worker_state_specs
  init: Callable[[Any], Any]  # init_worker_state's jitted function, compiled at its first call


# Finding the specs traces one update at least twice (0.8 CPU-s a trace for
# the tiny preset's DeMo), and a train step's setup asks for the same specs
# three times: for the step, and through init_worker_state and
# abstract_worker_state. They depend only on the optimizer, the params'
# shapes and dtypes, the mesh and the specs, so the last few are kept, each
# with its jitted init (a run started again in the same process compiles no
# init).
_FOUND: collections.OrderedDict = collections.OrderedDict()
_FOUND_SIZE = 8


def _found(tx: Any, params: Any, mesh: Mesh, axis_name: Hashable, param_specs: Any) -> _Found:
  """The state's specs and jitted init for these arguments, kept for the last few keys."""
  if axis_name not in mesh.axis_names:
    raise ValueError(
      f"axis_name={axis_name!r} is not an axis of the mesh {mesh.axis_names}; "
      "build the mesh with it, e.g. jax.make_mesh((n,), ('data',))."
    )

  def make() -> _Found:
    specs = _find_specs(tx, params, mesh, axis_name, param_specs)
    init = jax.jit(
      _init_on_mesh(tx, mesh, param_specs, specs), out_shardings=_state_shardings(mesh, specs)
    )
    return _Found(specs, init)

  key = _memo_key(tx, params, mesh, axis_name, param_specs)
  if key is None:
    return make()
  if key not in _FOUND:
    _FOUND[key] = make()
    while len(_FOUND) > _FOUND_SIZE:
      _FOUND.popitem(last=False)
  _FOUND.move_to_end(key)
  return _FOUND[key]


def _memo_key(tx: Any, params: Any, mesh: Mesh, axis_name: Hashable, param_specs: Any) -> Any:
  """What the specs depend on, hashable; ``None`` when some part cannot be hashed."""
  leaves, treedef = jax.tree.flatten(params)
  spec_leaves, spec_def = jax.tree.flatten(param_specs, is_leaf=is_spec)
  key = (
    tx,
    treedef,
    tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves),
    mesh,
    axis_name,
    spec_def,
    tuple(spec_leaves),
  )
  try:
    hash(key)
  except TypeError:
    return None
  return key


def _find_specs(tx: Any, params: Any, mesh: Mesh, axis_name: Hashable, param_specs: Any) -> Any:
  """:func:`worker_state_specs`, computed: the least fixpoint of one update's varying axes."""
  abstract_params = _abstract(params, mesh, param_specs)
  candidates = tuple(
    a
    for a in mesh.axis_names
    if a == axis_name
    or any(a in _spec_axes(s) for s in jax.tree.leaves(param_specs, is_leaf=is_spec))
  )
  state_shape, trace = _update_tracer(tx, abstract_params, mesh, axis_name, param_specs, candidates)
  leaves, treedef = jax.tree.flatten(state_shape)

  def union(a: tuple[Hashable, ...], b: tuple[Hashable, ...]) -> tuple[Hashable, ...]:
    return tuple(x for x in candidates if x in a or x in b)

  start = _multi_steps_start(
    tx, state_shape, abstract_params, mesh, axis_name, param_specs, candidates
  )
  try:
    # Least fixpoint: start with every leaf shared (or, for MultiSteps, with what
    # must vary anyway), mark what the update makes varying.
    varying: Marks = start or [()] * len(leaves)
    while (now := [union(a, b) for a, b in zip(varying, trace(varying))]) != varying:
      varying = now
  except TypeError:
    # Some wrappers (optax.MultiSteps' lax.cond) cannot even be traced with a
    # per-worker leaf passed in as shared. Come from the other side instead:
    # everything varying, then drop each axis over which a leaf stays shared.
    varying = [candidates] * len(leaves)
    for i in range(len(leaves)):
      for a in candidates:
        trial = list(varying)
        trial[i] = tuple(x for x in varying[i] if x != a)
        try:
          if a not in trace(trial)[i]:
            varying = trial
        except TypeError:
          pass
    try:
      traced = trace(varying)
    except TypeError as e:
      # No marking lets the update trace. The known cause: a wrapper that
      # decides per worker, on each worker's own gradient, between branches
      # of different types (optax.apply_if_finite around the exchange); its
      # state would be a per-worker scalar.
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

  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state_shape)[0]]
  for path, leaf, mark in zip(paths, leaves, varying):
    if mark and leaf.ndim == 0:
      raise ValueError(
        f"Optimizer state leaf {path} is a per-worker scalar; the per-worker layout "
        f"concatenates leaves along axis 0 and cannot hold it. {_PER_WORKER_SCALAR_FIX}"
      )
  return treedef.unflatten([_leaf_spec(mark) for mark in varying])


def _init_on_mesh(tx, mesh, param_specs, specs):
  """``tx.init`` on every device's own params, assembled into the layout of ``specs``."""
  spec_leaves = jax.tree.leaves(specs, is_leaf=is_spec)

  def local_init(p):
    leaves, treedef = jax.tree.flatten(tx.init(p))
    return treedef.unflatten([as_varying(x, _spec_axes(s)) for x, s in zip(leaves, spec_leaves)])

  return jax.shard_map(local_init, mesh=mesh, in_specs=(param_specs,), out_specs=specs)


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
  """``tx.init(params)`` for every worker, placed on the mesh.

  Per-worker leaves are laid out as :mod:`distro_jax.worker_state` describes;
  shared leaves are replicated. Works across processes (the params must be
  global arrays).

  Args:
    tx: the optimizer.
    params: the params tree, placed as ``param_specs`` says.
    mesh: the device mesh.
    axis_name: the data-parallel axis.
    param_specs: the params' ``PartitionSpec`` tree when they are sharded;
      default: replicated.

  Returns:
    The global optimizer state. ``jax.tree.map(lambda x: x.sharding.spec, state)``
    equals :func:`worker_state_specs`.

  Example:
    >>> import jax, jax.numpy as jnp, distro_jax as dj
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> tx = dj.demo(1e-3)
    >>> state = dj.init_worker_state(tx, {"w": jnp.zeros((64, 64))}, mesh)
  """
  if param_specs is None:
    param_specs = _default_param_specs(params)
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
  """Shapes, dtypes and shardings of :func:`init_worker_state`, allocating nothing.

  This is the restore target for a checkpoint (e.g. ``orbax``'s
  ``StandardRestore``).
  """
  if param_specs is None:
    param_specs = _default_param_specs(params)
  specs = worker_state_specs(tx, params, mesh, axis_name, param_specs=param_specs)
  abstract_params = _abstract(params, mesh, param_specs)
  shapes = jax.eval_shape(_init_on_mesh(tx, mesh, param_specs, specs), abstract_params)
  return jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
    shapes,
    _state_shardings(mesh, specs),
  )
