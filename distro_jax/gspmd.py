"""DisTrO in a ``jax.jit`` train step: per-worker values stacked on a leading axis.

Most JAX trainers are one ``jax.jit`` with ``in_shardings`` and
``out_shardings``, partitioned by GSPMD, not a ``jax.shard_map``. They adopt
DisTrO by changing two lines: the gradient and the optimizer.

- :func:`worker_value_and_grad` splits the batch into one slice per worker and
  returns every worker's own gradient, stacked on a leading axis of size W
  that is sharded over the workers' mesh axis (the per-replica style of
  drjax): ``grads["w"]`` has shape ``(W, *w.shape)``. Nothing crosses the
  workers to compute it.
- :func:`per_worker` wraps an optimizer built with that ``axis_name``. Its
  state is the inner optimizer's, with every per-worker leaf (DeMo's momentum,
  ``optax.MultiSteps``' accumulated gradients) stacked the same way and every
  shared leaf (counts, DisTrO-AdamW's moments) as it is. Its update runs the
  inner update for each worker inside a ``jax.shard_map`` of its own, so the
  DisTrO exchange is the only collective across the workers' axis, and
  returns the shared update, shaped like the params.

Only the workers' axis is manual inside that ``shard_map``. Any other mesh
axis (FSDP or tensor parallelism within a worker) stays with GSPMD, so the
params keep whatever sharding the trainer gives them, and each worker
computes the update of an unsharded worker (chunks planned on whole tensors),
up to the rounding of its partitioned sums. Each of a worker's devices then
sends the whole message, where the ``shard_map`` FSDP path
(:mod:`distro_jax.fsdp`) sends each device's shards' message once.

**Placement.** A per-worker value comes boxed as
``flax.linen.Partitioned(value, names=(axis_name, *names))``, where ``names``
are the param's own partition names (``None`` for an unboxed param), so
``flax.linen.get_sharding(jax.eval_shape(init, ...), mesh)`` places it on
the workers' axis as linen trainers place everything else. In Flax NNX state
it stays in its ``nnx.Variable``, whose ``out_sharding`` metadata, if any,
gains the workers' axis first.
"""

import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.core import meta
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from distro_jax import dense_step, elastic, exchange, worker_state

__all__ = [
  "PerWorker",
  "abstract_per_worker",
  "per_worker",
  "resize_per_worker",
  "worker_value_and_grad",
]


def _variable_type() -> type | None:
  """``flax.nnx.Variable`` if NNX is in use (imported), else ``None``; NNX is slow to import."""
  nnx = sys.modules.get("flax.nnx")
  return None if nnx is None else nnx.Variable


def _is_unit(x: Any) -> bool:
  """A linen box or an NNX variable: one array with its metadata."""
  variable = _variable_type()
  return isinstance(x, meta.AxisMetadata) or (variable is not None and isinstance(x, variable))


def _units(tree: Any) -> tuple[list[Any], Any]:
  return jax.tree.flatten(tree, is_leaf=_is_unit)


def _value(unit: Any) -> Any:
  if isinstance(unit, meta.AxisMetadata):
    return unit.unbox()
  variable = _variable_type()
  if variable is not None and isinstance(unit, variable):
    return unit.get_value()
  return unit


def _plain(tree: Any) -> Any:
  """``tree`` with its boxes and variables replaced by the arrays they hold."""
  return jax.tree.map(_value, tree, is_leaf=_is_unit)


def _names(unit: Any, ndim: int) -> tuple[Any, ...]:
  """The mesh axes a box or variable partitions its array over, one entry per dimension."""
  names: Any = ()
  if isinstance(unit, meta.Partitioned):
    names = unit.names
  else:
    variable = _variable_type()
    if variable is not None and isinstance(unit, variable):
      names = unit.get_metadata().get("out_sharding") or ()
  names = tuple(names)
  return names + (None,) * (ndim - len(names))


def _axes_of(names: Sequence[Any]) -> set[Hashable]:
  out = set()
  for entry in names:
    out |= set(entry) if isinstance(entry, tuple) else {entry}
  return out - {None}


def _stacked_unit(unit: Any, value: jax.Array, axis_name: Hashable) -> Any:
  """``value``, a stack of one value per worker, boxed as ``unit`` is with ``axis_name`` first."""
  names = (axis_name, *_names(unit, np.ndim(value) - 1))
  if isinstance(unit, meta.Partitioned):
    return unit.replace(value=value, names=names)
  if isinstance(unit, meta.AxisMetadata):
    return unit.replace_boxed(value)
  variable = _variable_type()
  if variable is not None and isinstance(unit, variable):
    if unit.get_metadata().get("out_sharding") is None:
      return unit.replace(value)
    return unit.replace(value, out_sharding=names)
  return meta.Partitioned(value, names=names)


def _check_no_clash(params: Any, axis_name: Hashable) -> None:
  """Refuses params already partitioned over the workers' axis, naming the fix."""
  units = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_unit)[0]
  for path, unit in units:
    names = _names(unit, np.ndim(_value(unit)))
    sharding = getattr(unit, "sharding", None)
    if isinstance(unit, jax.Array) and isinstance(sharding, NamedSharding):
      names = tuple(sharding.spec)
    if axis_name in _axes_of(names):
      raise ValueError(
        f"params{jax.tree_util.keystr(path)} is partitioned as {names}, over {axis_name!r}, "
        "which is the workers' axis. Every DisTrO worker holds a whole replica of the params "
        "and sends only its message, so FSDP over the workers' axis would all-gather the "
        "params across the workers' links every step. Give FSDP an axis of its own: a 2-D "
        f"mesh whose other axis carries the params' partitioning, e.g. "
        f"Mesh(devices.reshape(workers, fsdp), ('workers', {axis_name!r})) with "
        "dj.per_worker(tx, mesh, 'workers') and dj.worker_value_and_grad(..., 'workers'), "
        "keeps the model's names; dj.plan_fsdp(params, fsdp) plans a partitioning whose "
        "shards hold whole DeMo chunks (docs/porting.md, docs/fsdp.md)."
      )


def _num_workers(mesh: Mesh, axis_name: Hashable) -> int:
  if axis_name not in mesh.axis_names:
    raise ValueError(
      f"axis_name={axis_name!r} is not an axis of the mesh {mesh.axis_names}; name the "
      "workers' axis, e.g. jax.sharding.Mesh(jax.devices(), ('data',))."
    )
  explicit = [a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit]
  if explicit:
    raise ValueError(
      f"The mesh's axes {explicit} are Explicit (jax.make_mesh's default), but the jit path "
      "works with GSPMD's automatic partitioning, as jit trainers do. Build the mesh with "
      "Auto axes: jax.sharding.Mesh(devices, names), or jax.make_mesh(shape, names, "
      "axis_types=(jax.sharding.AxisType.Auto,) * len(names))."
    )
  return mesh.shape[axis_name]


def _constrain(x: jax.Array, mesh: Mesh, names: Sequence[Any]) -> jax.Array:
  """``x`` placed as ``names`` say; ``P.UNCONSTRAINED`` entries are left to GSPMD in a trace."""
  if isinstance(x, jax.core.Tracer):
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*names)))
  names = [None if n is P.UNCONSTRAINED else n for n in names]
  return jax.device_put(x, NamedSharding(mesh, P(*names)))


def _placed_stack(unit: Any, value: jax.Array, mesh: Mesh, axis_name: Hashable) -> Any:
  """A stack of one value per worker, split over the workers and boxed as ``unit`` is.

  Along the other axes it keeps ``unit``'s own partitioning, or where that
  names none, whatever GSPMD propagates (the params' FSDP sharding, say).
  """
  names = _names(unit, np.ndim(value) - 1)
  value = _constrain(
    value, mesh, (axis_name, *(P.UNCONSTRAINED if n is None else n for n in names))
  )
  return _stacked_unit(unit, value, axis_name)


def worker_value_and_grad(
  fun: Callable[..., Any],
  mesh: Mesh,
  axis_name: Hashable = "data",
  *,
  has_aux: bool = False,
) -> Callable[..., Any]:
  """Every worker's own loss and gradient, in a ``jax.jit`` step: no shard_map needed.

  ``fun(params, batch, *args)`` is a loss over the rows of ``batch``. The
  batch is cut along its leading axis into W equal slices, one per worker of
  ``axis_name`` (worker ``i`` takes rows ``i * B / W`` onwards), and each
  worker differentiates its own slice's loss: a ``jax.vmap`` over the slices
  with ``spmd_axis_name=axis_name``, so GSPMD runs worker ``i``'s slice on
  worker ``i``'s devices and nothing crosses the workers. The params are
  shared (unmapped); their partitioning over other mesh axes (FSDP) is left
  to GSPMD.

  Args:
    fun: ``fun(params, batch, *args, **kwargs)``, the loss of ``batch``'s rows
      (with ``has_aux``, a pair ``(loss, aux)``). ``args`` and ``kwargs`` are
      the same for every worker.
    mesh: the device mesh.
    axis_name: the workers' axis of ``mesh``.
    has_aux: as in ``jax.value_and_grad``.

  Returns:
    A function of ``(params, batch, *args, **kwargs)`` returning
    ``(value, grads)``, or ``((value, aux), grads)`` with ``has_aux``:

    - ``value``: the mean of the workers' losses (with equal slices, the
      loss of the whole batch when ``fun`` is a mean over rows);
    - ``aux``: each worker's, stacked on a leading axis (reduce it as the
      metric needs: a sum of counts, a mean of rates);
    - ``grads``: each worker's gradient, ``(W, *param.shape)``, sharded over
      ``axis_name``; boxed as :mod:`distro_jax.gspmd` describes. Pass it to
      the update of :func:`per_worker`.

  Raises:
    ValueError: a batch leaf's leading axis does not split into W slices, or
      a param is partitioned over ``axis_name``.

  Example:
    >>> import jax, jax.numpy as jnp, distro_jax as dj
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    >>> loss = lambda p, b: jnp.mean((b @ p["w"]) ** 2)
    >>> value, grads = dj.worker_value_and_grad(loss, mesh)({"w": jnp.ones((3,))}, jnp.ones((4, 3)))
    >>> grads["w"].value.shape  # (workers, 3), boxed with its partition names
    (1, 3)
  """
  num_workers = _num_workers(mesh, axis_name)
  value_and_grad = jax.value_and_grad(fun, has_aux=has_aux)

  def split(path: Any, x: Any) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim == 0 or x.shape[0] % num_workers:
      raise ValueError(
        f"batch{jax.tree_util.keystr(path)} has shape {x.shape}, whose leading axis does not "
        f"split into {num_workers} equal slices, one per worker of {axis_name!r}; make the "
        f"batch size a multiple of {num_workers}."
      )
    x = x.reshape(num_workers, x.shape[0] // num_workers, *x.shape[1:])
    return _constrain(x, mesh, (axis_name, *[P.UNCONSTRAINED] * (x.ndim - 1)))

  def wrapped(params: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    _check_no_clash(params, axis_name)
    slices = jax.tree_util.tree_map_with_path(split, batch)
    per_slice = lambda rows: value_and_grad(params, rows, *args, **kwargs)
    out, grads = jax.vmap(per_slice, spmd_axis_name=axis_name)(slices)
    units, treedef = _units(grads)
    grads = treedef.unflatten([_placed_stack(u, _value(u), mesh, axis_name) for u in units])
    if has_aux:
      value, aux = out
      return (jnp.mean(value), aux), grads
    return jnp.mean(out), grads

  return wrapped


def _shapes(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


class PerWorker(optax.GradientTransformationExtraArgs):
  """The transformation :func:`per_worker` returns: ``init`` and ``update``, plus what it wraps.

  Attributes:
    inner: the wrapped optimizer.
    mesh: the device mesh.
    axis_name: the workers' axis.
  """

  inner: optax.GradientTransformation
  mesh: Mesh
  axis_name: Hashable

  def value_and_grad(self, fun: Callable[..., Any], *, has_aux: bool = False) -> Callable[..., Any]:
    """:func:`worker_value_and_grad` on this optimizer's mesh and workers' axis."""
    return worker_value_and_grad(fun, self.mesh, self.axis_name, has_aux=has_aux)

  def per_worker_leaves(self, params: Any) -> list[bool]:
    """For each array of ``inner``'s state, whether it differs by worker (cached per shape).

    Found by tracing one update (:func:`distro_jax.worker_state_specs`).
    """
    shapes = _shapes(_plain(params))
    key = (jax.tree.structure(shapes), tuple((s.shape, s.dtype) for s in jax.tree.leaves(shapes)))
    if key not in self._flags:
      specs = worker_state.worker_state_specs(self.inner, shapes, self.mesh, self.axis_name)
      self._flags[key] = [
        self.axis_name in _axes_of(tuple(s)) for s in jax.tree.leaves(specs, is_leaf=_is_spec)
      ]
    return self._flags[key]


def per_worker(
  tx: optax.GradientTransformation, mesh: Mesh, axis_name: Hashable = "data"
) -> PerWorker:
  """``tx`` for the stacked per-worker gradients of :func:`worker_value_and_grad`, in a jit step.

  ``tx`` is a DisTrO optimizer built with ``axis_name`` (``dj.demo(lr,
  axis_name=...)``), alone or inside ``optax`` wrappers (``MultiSteps``,
  ``inject_hyperparams``, ``chain``, ``masked``). The wrapper's update takes
  the gradients with their leading worker axis, runs ``tx.update`` for every
  worker at once inside a ``jax.shard_map`` over ``axis_name`` (manual over
  that axis only), and returns the update that every worker computed alike,
  shaped like the params. The only collectives across ``axis_name`` are the
  ones ``tx`` makes: DisTrO's message.

  Its state is ``tx``'s, leaf for leaf: a leaf that differs by worker is
  stacked on a leading axis of size W and boxed to be placed over
  ``axis_name`` (see :mod:`distro_jax.gspmd`); a shared leaf is as ``tx``
  makes it, so ``state.gradient_step`` of a ``MultiSteps`` still reads. Which
  leaves differ is found by tracing one update
  (:func:`distro_jax.worker_state_specs`), once per params shape.

  Args:
    tx: the optimizer, built with ``axis_name``.
    mesh: the device mesh; ``axis_name`` is one of its axes.
    axis_name: the workers' axis.

  Returns:
    A :class:`PerWorker`, an ``optax.GradientTransformationExtraArgs``. Its
    ``update`` needs ``params``; extra keyword arguments are passed to
    ``tx.update``, the same for every worker.

  Raises:
    ValueError: at ``update``, gradients without the worker axis (the
      gradient of the whole batch), a state built for another worker count,
      or a ``tx`` whose update differs between workers (built without
      ``axis_name``); at ``init`` and ``update``, params partitioned over
      ``axis_name``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, distro_jax as dj
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    >>> tx = dj.per_worker(optax.MultiSteps(dj.demo(0.1, compression_chunk=4), 2), mesh)
    >>> params = {"w": jnp.ones((4,))}
    >>> state = tx.init(params)
    >>> state.acc_grads["w"].value.shape, state.gradient_step.shape  # per worker, shared
    ((1, 4), ())
    >>> loss = lambda p, b: jnp.sum(b @ p["w"])
    >>> _, grads = dj.worker_value_and_grad(loss, mesh)(params, jnp.ones((2, 4)))
    >>> updates, state = tx.update(grads, state, params)
  """
  num_workers = _num_workers(mesh, axis_name)

  def init_fn(params):
    _check_no_clash(params, axis_name)
    flags = wrapper.per_worker_leaves(params)
    units, treedef = _units(tx.init(params))
    if len(units) != len(flags):
      raise ValueError(
        "The optimizer state holds a box or variable with more than one array; "
        "dj.per_worker lays out one array per box."
      )
    out = []
    for unit, stacked in zip(units, flags):
      value = jnp.asarray(_value(unit))
      if stacked:
        value = jnp.broadcast_to(value[None], (num_workers, *value.shape))
        out.append(_placed_stack(unit, value, mesh, axis_name))
      elif isinstance(value, jax.core.Tracer):
        out.append(unit)  # placed by the caller's out_shardings, or by GSPMD
      else:
        out.append(_rebox(unit, jax.device_put(value, _unit_sharding(unit, mesh, value.ndim))))
    return treedef.unflatten(out)

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(
        "dj.per_worker needs the params in update (tx.update(grads, state, params)), to tell "
        "the per-worker state from the shared."
      )
    _check_no_clash(params, axis_name)
    plain_params = _plain(params)
    p_leaves, p_def = jax.tree.flatten(plain_params)
    g_leaves = jax.tree.leaves(_plain(updates))
    if len(g_leaves) != len(p_leaves):
      raise ValueError(
        f"The gradient has {len(g_leaves)} leaves, the params {len(p_leaves)}; pass the "
        "gradients of dj.worker_value_and_grad with respect to exactly these params."
      )
    paths = [
      jax.tree_util.keystr(p)
      for p, _ in jax.tree_util.tree_flatten_with_path(p_def.unflatten(p_leaves))[0]
    ]
    for path, g, p in zip(paths, g_leaves, p_leaves):
      if np.shape(g) != (num_workers, *np.shape(p)):
        hint = (
          "That is the gradient of the whole batch, which GSPMD all-reduces across the "
          "workers (a dense step). "
          if np.shape(g) == np.shape(p)
          else ""
        )
        raise ValueError(
          f"Gradient leaf {path} has shape {np.shape(g)}; dj.per_worker needs each worker's "
          f"own gradient stacked on a leading axis, {(num_workers, *np.shape(p))}. {hint}"
          f"Take it with dj.worker_value_and_grad(loss, mesh, {axis_name!r})."
        )
    flags = wrapper.per_worker_leaves(plain_params)
    s_leaves, s_def = jax.tree.flatten(state)
    template, t_def = jax.tree.flatten(jax.eval_shape(tx.init, _shapes(plain_params)))
    if len(s_leaves) != len(template):
      raise ValueError(
        "The optimizer state does not match this optimizer's: build it with this "
        "dj.per_worker(...).init(params)."
      )
    for x, t, stacked in zip(s_leaves, template, flags):
      want = (num_workers, *t.shape) if stacked else t.shape
      if np.shape(x) != want:
        raise ValueError(
          f"An optimizer state leaf has shape {np.shape(x)}, but this optimizer's layout on "
          f"{num_workers} workers has {want}: the state was built for another worker count or "
          "other params. Resize a state of another worker count with dj.resize_per_worker."
        )
    dense_step.warn_if_replicated_per_worker(
      [x for x, f in zip(s_leaves, flags) if f], axis_name, num_workers
    )

    def body(g_leaves, s_leaves, p_leaves):
      grads = p_def.unflatten([g[0] for g in g_leaves])
      inner = t_def.unflatten([x[0] if f else x for x, f in zip(s_leaves, flags)])
      new_updates, new_state = tx.update(grads, inner, p_def.unflatten(p_leaves), **extra_args)
      u_leaves = p_def.flatten_up_to(new_updates)
      differing = [path for path, u in zip(paths, u_leaves) if exchange.varies_over(u, axis_name)]
      if differing:
        raise ValueError(
          f"The update of {', '.join(differing[:3])} differs from worker to worker, so the "
          "replicas would drift apart: the optimizer exchanges nothing over "
          f"{axis_name!r}. Build it with axis_name={axis_name!r} (dj.demo(lr, "
          f"axis_name={axis_name!r})), or chain dj.pmean_gradients({axis_name!r}) before a "
          "dense optimizer for the all-reduce baseline."
        )
      n_leaves = t_def.flatten_up_to(new_state)
      shared_but_varying = [
        i
        for i, (x, f) in enumerate(zip(n_leaves, flags))
        if not f and exchange.varies_over(x, axis_name)
      ]
      if shared_but_varying:
        raise ValueError(
          f"State leaves {shared_but_varying} were laid out as shared but differ between "
          "workers after an update; the optimizer's state does not keep the types "
          "dj.worker_state_specs found."
        )
      n_leaves = [
        exchange.as_varying(x, (axis_name,))[None] if f else x for x, f in zip(n_leaves, flags)
      ]
      return u_leaves, n_leaves

    s_specs = [P(axis_name) if f else P() for f in flags]
    run = jax.shard_map(
      body,
      mesh=mesh,
      in_specs=([P(axis_name)] * len(g_leaves), s_specs, [P()] * len(p_leaves)),
      out_specs=([P()] * len(p_leaves), s_specs),
      axis_names={axis_name},
    )
    u_leaves, n_leaves = run(g_leaves, s_leaves, p_leaves)
    return jax.tree.structure(params).unflatten(u_leaves), s_def.unflatten(n_leaves)

  wrapper = PerWorker(init_fn, update_fn)
  wrapper.inner, wrapper.mesh, wrapper.axis_name = tx, mesh, axis_name
  wrapper._flags = {}
  return wrapper


def _unit_sharding(unit: Any, mesh: Mesh, ndim: int) -> NamedSharding:
  return NamedSharding(mesh, P(*_names(unit, ndim)))


def _rebox(unit: Any, value: Any) -> Any:
  """``value`` in ``unit``'s box or variable, metadata unchanged."""
  if isinstance(unit, meta.AxisMetadata):
    return unit.replace_boxed(value)
  variable = _variable_type()
  if variable is not None and isinstance(unit, variable):
    return unit.replace(value)
  return value


def _check_wrapper(tx: Any) -> PerWorker:
  if not isinstance(tx, PerWorker):
    raise TypeError(
      f"expected the optimizer dj.per_worker returned, got {type(tx).__name__}; with a "
      "TrainState, pass state.tx."
    )
  return tx


def abstract_per_worker(tx: PerWorker, params: Any) -> Any:
  """The restore target of a :func:`per_worker` state saved on any number of workers.

  Shared leaves are ``jax.ShapeDtypeStruct`` placed as their boxes say;
  per-worker leaves are empty host NumPy arrays, for which a checkpointer
  such as ``orbax``'s ``StandardRestore`` restores the saved array whole, on
  the host, whatever worker count saved it. :func:`resize_per_worker` then
  rearranges it for this run's workers and places it. Each process holds
  every saved worker's state on its host until then.

  Args:
    tx: the :class:`PerWorker` of this run (with a ``TrainState``, ``state.tx``).
    params: the params (arrays or ``jax.ShapeDtypeStruct``, boxed or not).

  Returns:
    A tree with the structure of ``tx.init(params)``.
  """
  tx = _check_wrapper(tx)
  units, treedef = _units(jax.eval_shape(tx.init, params))
  out = []
  for unit, stacked in zip(units, tx.per_worker_leaves(params)):
    x = _value(unit)
    if stacked:
      x = np.zeros((0, *x.shape[1:]), x.dtype)
    else:
      x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_unit_sharding(unit, tx.mesh, x.ndim))
    out.append(_rebox(unit, x))
  return treedef.unflatten(out)


def resize_per_worker(
  tx: PerWorker,
  state: Any,
  params: Any,
  *,
  keep: Sequence[int] | None = None,
  leaving: str = "drop",
) -> Any:
  """A :func:`per_worker` state of W workers, rearranged for ``tx``'s W' workers.

  The rules of :func:`distro_jax.resize_worker_state`: new worker ``i``
  continues old worker ``keep[i]`` (default: the first ``min(W, W')``), the
  others join with ``tx.init`` of the shared params (zero momentum), and a
  leaving worker's unsent residual is dropped or folded into the stayers
  (``leaving``). Shared leaves carry over; W is read from the state's shapes.

  Args:
    tx: the :class:`PerWorker` of this run, built on the new mesh (with a
      ``TrainState``, ``state.tx``).
    state: the state of W workers (as :func:`abstract_per_worker` restores
      it, or on devices).
    params: the shared params of this run.
    keep: the old workers that stay, in their new order.
    leaving: ``"drop"`` or ``"fold"``, for a leaving worker's residual.

  Returns:
    The state in the layout of ``tx.init(params)``, placed as its boxes say.

  Example:
    >>> import jax, jax.numpy as jnp, distro_jax as dj
    >>> from jax.sharding import Mesh
    >>> params = {"w": jnp.zeros((8, 8))}
    >>> on_2 = dj.per_worker(dj.demo(0.1), Mesh(jax.devices()[:2], ("data",)))
    >>> on_1 = dj.per_worker(dj.demo(0.1), Mesh(jax.devices()[:1], ("data",)))
    >>> state = dj.resize_per_worker(on_1, on_2.init(params), params)
    >>> state[0].momentum["w"].value.shape
    (1, 8, 8)
  """
  tx = _check_wrapper(tx)
  plain_params = _plain(params)
  flags = tx.per_worker_leaves(plain_params)
  s_leaves = jax.tree.leaves(state)
  template, t_def = jax.tree.flatten(jax.eval_shape(tx.inner.init, _shapes(plain_params)))
  if len(s_leaves) != len(template):
    raise ValueError("the state is not this optimizer's: its leaves do not match tx.init's.")
  # dj.resize_worker_state works on the per-worker layout of dj.worker_state,
  # the W workers' blocks concatenated along axis 0, which a reshape gives.
  host = [elastic._on(tx.mesh, x) for x in s_leaves]
  flat = [jnp.reshape(x, (-1, *np.shape(x)[2:])) if f else x for x, f in zip(host, flags)]
  placed = jax.device_put(plain_params, NamedSharding(tx.mesh, P()))
  resized = elastic.resize_worker_state(
    tx.inner,
    t_def.unflatten(flat),
    placed,
    tx.mesh,
    tx.axis_name,
    keep=keep,
    leaving=leaving,
  )
  num_workers = tx.mesh.shape[tx.axis_name]
  units, treedef = _units(jax.eval_shape(tx.init, params))
  out = []
  for unit, x, t, stacked in zip(units, t_def.flatten_up_to(resized), template, flags):
    if stacked:
      x = jnp.reshape(x, (num_workers, *t.shape))
    x = jax.device_put(x, _unit_sharding(unit, tx.mesh, np.ndim(x)))
    out.append(_rebox(unit, x))
  return treedef.unflatten(out)
