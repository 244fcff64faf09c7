"""DisTrO in a ``jax.jit`` train step: per-worker values stacked on a leading axis.

:func:`worker_value_and_grad` returns every worker's own gradient, shaped
``(W, *param.shape)`` and sharded over the workers' mesh axis; :func:`per_worker`
wraps a DisTrO optimizer whose per-worker state is stacked the same way. Other
mesh axes (FSDP within a worker) stay with GSPMD. A per-worker value is boxed as
``flax.linen.Partitioned(value, names=(axis_name, *param_names))``, or in NNX
stays in its ``nnx.Variable``. See docs/porting.md.
"""

import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from distro_jax import dense_step, elastic, exchange, worker_state


class _FlaxMeta:
  """``flax.core.meta``, imported on first use: the core installs without flax."""

  def __getattr__(self, name: str) -> Any:
    try:
      from flax.core import meta as flax_meta
    except ImportError as e:
      raise ImportError(
        "dj.per_worker boxes each param's stack of worker copies as flax does, so it "
        "needs flax: pip install 'distro_jax[experiments]' (or flax itself)."
      ) from e
    return getattr(flax_meta, name)


meta = _FlaxMeta()

__all__ = [
  "PerWorker",
  "abstract_per_worker",
  "per_worker",
  "reduce_over_workers",
  "resize_per_worker",
  "worker_value_and_grad",
  "workers_mesh",
]


def _is_variable(x: Any) -> bool:
  """Whether ``x`` is a ``flax.nnx.Variable``; NNX is not imported here, as it is slow to import."""
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(x, nnx.Variable)


def _is_unit(x: Any) -> bool:
  """A linen box or an NNX variable: one array with its metadata."""
  return isinstance(x, meta.AxisMetadata) or _is_variable(x)


def _units(tree: Any) -> tuple[list[Any], Any]:
  return jax.tree.flatten(tree, is_leaf=_is_unit)


def _value(unit: Any) -> Any:
  if isinstance(unit, meta.AxisMetadata):
    return unit.unbox()
  return unit.get_value() if _is_variable(unit) else unit


def _plain(tree: Any) -> Any:
  return jax.tree.map(_value, tree, is_leaf=_is_unit)


def _box_names(unit: Any) -> Any:
  """A ``Partitioned`` box's names or an NNX variable's ``out_sharding``; else ``None``."""
  if isinstance(unit, meta.Partitioned):
    return unit.names
  return unit.get_metadata().get("out_sharding") if _is_variable(unit) else None


def _names(unit: Any, ndim: int) -> tuple[Any, ...]:
  """The mesh axes a box or variable partitions its array over, one per dimension."""
  names = tuple(_box_names(unit) or ())
  return names + (None,) * (ndim - len(names))


def _axes_of(names: Sequence[Any]) -> set[Hashable]:
  return {a for entry in names for a in (entry if isinstance(entry, tuple) else (entry,))} - {None}


def _rebox(unit: Any, value: Any, names: Any = None) -> Any:
  """``value`` in ``unit``'s box or variable; with ``names``, partitioned so (boxed if plain)."""
  if names is not None and isinstance(unit, meta.Partitioned):
    return unit.replace(value=value, names=names)
  if isinstance(unit, meta.AxisMetadata):
    return unit.replace_boxed(value)
  if not _is_variable(unit):
    return value if names is None else meta.Partitioned(value, names=names)
  if names is None or _box_names(unit) is None:
    return unit.replace(value)
  return unit.replace(value, out_sharding=names)


def _check_no_clash(params: Any, axis_name: Hashable) -> None:
  for path, unit in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_unit)[0]:
    names = _names(unit, np.ndim(_value(unit)))
    sharding = getattr(unit, "sharding", None)
    if isinstance(unit, jax.Array) and isinstance(sharding, NamedSharding):
      names = tuple(sharding.spec)
    if axis_name in _axes_of(names):
      raise ValueError(
        f"params{jax.tree_util.keystr(path)} is partitioned as {names}, over {axis_name!r}, "
        "the workers' axis, so every step would all-gather each worker's replica. Give FSDP "
        f"an axis of its own: dj.workers_mesh(workers, names=({axis_name!r},)), with 'workers' "
        "as the workers' axis; dj.plan_fsdp(params, fsdp) plans it (docs/fsdp.md)."
      )


def _divisors(n: int) -> list[int]:
  return [d for d in range(2, n + 1) if n % d == 0]


def _num_workers(mesh: Mesh, axis_name: Hashable) -> int:
  if axis_name not in mesh.axis_names:
    first = mesh.devices.shape[0]
    raise ValueError(
      f"axis_name={axis_name!r} is not an axis of the mesh {mesh.axis_names}. Add one: "
      "dj.workers_mesh(W, mesh) splits the mesh's first axis into W workers, "
      f"Mesh(mesh.devices.reshape(W, {first} // W, ...), ({axis_name!r}, *mesh.axis_names)), "
      "its partitioning becoming FSDP within each; W, how many sites the slow links join, "
      f"is one of {_divisors(first) or [1]} (docs/porting.md)."
    )
  explicit = [a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit]
  if explicit:
    raise ValueError(
      f"The mesh's axes {explicit} are Explicit (jax.make_mesh's default); GSPMD's jit path "
      "needs Auto axes: jax.sharding.Mesh(devices, names), or jax.make_mesh(shape, names, "
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
  """A stack of one value per worker, split over the workers; other axes as ``unit`` says."""
  names = (axis_name, *_names(unit, np.ndim(value) - 1))
  value = _constrain(value, mesh, [P.UNCONSTRAINED if n is None else n for n in names])
  return _rebox(unit, value, names)


def workers_mesh(
  num_workers: int,
  devices: Mesh | Sequence[Any] | np.ndarray | None = None,
  axis_name: Hashable = "workers",
  names: Sequence[Hashable] = ("data",),
) -> Mesh:
  """A mesh with a workers' axis in front: the devices split into ``num_workers`` sites.

  Args:
    num_workers: W, how many sites the slow links join (hosts, TPU slices).
    devices: the devices (default ``jax.devices()``), or a trainer's ``Mesh``,
      whose first axis is split into W blocks and whose names are kept.
    axis_name: the workers' axis.
    names: the axes within a worker, one per axis of ``devices`` (not a ``Mesh``).

  Returns:
    A ``jax.sharding.Mesh`` of shape ``(W, ...)``, each worker a block of consecutive
    devices, and its axes ``Auto``, as GSPMD's jit path needs.

  Raises:
    ValueError: W does not divide the first axis, or ``axis_name`` is taken.

  Example:
    >>> import jax, distro_jax as dj
    >>> mesh = dj.workers_mesh(1)
    >>> mesh.axis_names, mesh.devices.shape == (1, jax.device_count())
    (('workers', 'data'), True)
  """
  if isinstance(devices, Mesh):
    array, names = devices.devices, devices.axis_names
  else:
    array = np.asarray(jax.devices() if devices is None else devices, dtype=object)
    names = tuple(names)
    if array.ndim != len(names):
      raise ValueError(
        f"devices has {array.ndim} axes but names {names} names {len(names)}; give one name "
        "per axis (a flat list of devices takes one, e.g. ('data',))."
      )
  if axis_name in names:
    raise ValueError(
      f"{axis_name!r} is already an axis of the mesh {tuple(names)}; pass the mesh without "
      "it, or give the workers' axis another axis_name."
    )
  first = array.shape[0]
  if not isinstance(num_workers, int | np.integer) or num_workers < 1 or first % num_workers:
    raise ValueError(
      f"num_workers={num_workers!r} does not split the {first} devices along the mesh's first "
      f"axis into equal workers; use one of {[1, *_divisors(first)]}."
    )
  shape = (int(num_workers), first // int(num_workers), *array.shape[1:])
  return Mesh(array.reshape(shape), (axis_name, *names))


def worker_value_and_grad(
  fun: Callable[..., Any], mesh: Mesh, axis_name: Hashable = "data", *, has_aux: bool = False
) -> Callable[..., Any]:
  """Every worker's own loss and gradient, in a ``jax.jit`` step: no shard_map needed.

  Args:
    fun: ``fun(params, batch, *args, **kwargs)``, the loss of ``batch``'s rows; worker ``i``
      differentiates it on the ``i``-th of W equal slices of the batch's leading axis.
    mesh: the device mesh.
    axis_name: the workers' axis of ``mesh``.
    has_aux: as in ``jax.value_and_grad``.

  Returns:
    A function of ``(params, batch, *args, **kwargs)`` returning ``(value, grads)``
    (``((value, aux), grads)`` with ``has_aux``): the mean of the workers' losses,
    and each worker's aux and gradient stacked on a leading axis.

  Raises:
    ValueError: the batch does not split into W slices, or a param is split over the workers' axis.

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
        f"split into one slice per worker of {axis_name!r}: make it a multiple of {num_workers}."
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


def reduce_over_workers(tree: Any, summed: Sequence[str] = ()) -> Any:
  """Per-worker values stacked on axis 0 (:func:`worker_value_and_grad`'s aux), reduced.

  Args:
    tree: a pytree whose every leaf has the workers on its axis 0.
    summed: dict keys or attributes (counts) on a leaf's path that make it summed, not averaged.

  Returns:
    ``tree`` with axis 0 of every leaf reduced.

  Raises:
    ValueError: a leaf is a scalar, or a name in ``summed`` is on no leaf's path.

  Example:
    >>> import jax.numpy as jnp, distro_jax as dj
    >>> aux = {"ntokens": jnp.array([8.0, 8.0]), "perplexity": jnp.array([3.0, 5.0])}
    >>> dj.reduce_over_workers(aux, summed=("ntokens",))
    {'ntokens': Array(16., dtype=float32), 'perplexity': Array(4., dtype=float32)}
  """
  if isinstance(summed, str):
    summed = (summed,)
  seen: set[str] = set()

  def reduce(path: Any, x: Any) -> Any:
    if np.ndim(x) == 0:
      raise ValueError(
        f"aux{jax.tree_util.keystr(path)} is a scalar; dj.reduce_over_workers reduces values "
        "stacked one per worker on axis 0, as dj.worker_value_and_grad returns its aux."
      )
    # A path's keys hold their names as DictKey.key, GetAttrKey.name or SequenceKey.idx.
    keys = {getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path}
    names = keys & set(summed)
    seen.update(names)
    return jnp.sum(x, axis=0) if names else jnp.mean(x, axis=0)

  out = jax.tree_util.tree_map_with_path(reduce, tree)
  missing = [name for name in summed if name not in seen]
  if missing:
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    raise ValueError(
      f"summed names {missing}, on no leaf's path; the leaves are {paths}. Name the dict "
      "keys or attributes of the counts to sum."
    )
  return out


def _shapes(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


class PerWorker(optax.GradientTransformationExtraArgs):
  """The transformation :func:`per_worker` returns: ``init`` and ``update``, plus what it wraps.

  Attributes:
    inner: the wrapped optimizer.
    mesh: the device mesh.
    axis_name: the workers' axis.
    all_reduce: whether the gradients are averaged over the workers before ``inner``.
  """

  inner: optax.GradientTransformation
  mesh: Mesh
  axis_name: Hashable
  all_reduce: bool

  def value_and_grad(self, fun: Callable[..., Any], *, has_aux: bool = False) -> Callable[..., Any]:
    """:func:`worker_value_and_grad` on this optimizer's mesh and workers' axis.

    With ``all_reduce``, the gradients come averaged, shaped and boxed like the params.
    """
    value_and_grad = worker_value_and_grad(fun, self.mesh, self.axis_name, has_aux=has_aux)
    if not self.all_reduce:
      return value_and_grad

    def averaged(params: Any, *args: Any, **kwargs: Any) -> Any:
      out, grads = value_and_grad(params, *args, **kwargs)
      units, treedef = _units(grads)
      means = []
      for unit, param in zip(units, _units(params)[0]):
        mean = jnp.mean(_value(unit), axis=0)
        # Boxed as the param is, over its names: a param without a box gets a plain gradient.
        names = tuple(_box_names(unit) or ())[1:]
        means.append(_rebox(unit, mean, names) if _is_unit(param) else mean)
      return out, treedef.unflatten(means)

    return averaged

  def per_worker_leaves(self, params: Any) -> list[bool]:
    """For each array of ``inner``'s state, whether it differs by worker (cached per shape)."""
    shapes = _shapes(_plain(params))
    key = (jax.tree.structure(shapes), tuple((s.shape, s.dtype) for s in jax.tree.leaves(shapes)))
    if key not in self._flags:
      if self.all_reduce:
        flags = [False] * len(jax.tree.leaves(jax.eval_shape(self.inner.init, shapes)))
      else:
        specs = worker_state.worker_state_specs(self.inner, shapes, self.mesh, self.axis_name)
        leaves = jax.tree.leaves(specs, is_leaf=worker_state.is_spec)
        flags = [self.axis_name in _axes_of(tuple(s)) for s in leaves]
      self._flags[key] = flags
    return self._flags[key]


def _differs_error(paths: Sequence[str], axis_name: Hashable) -> ValueError:
  return ValueError(
    f"The update of {', '.join(paths[:3])} differs from worker to worker: the optimizer "
    f"exchanges nothing over {axis_name!r}. Build it with axis_name={axis_name!r}, or, for "
    "the all-reduce baseline with a dense optimizer (AdamW), pass all_reduce=True to "
    f"dj.per_worker or chain dj.pmean_gradients({axis_name!r}) before it."
  )


def _update(wrapper: PerWorker, updates: Any, state: Any, params: Any, extra_args: dict) -> Any:
  """``wrapper.update``: every worker's update by ``inner``, in a ``shard_map`` over the workers."""
  tx, mesh, axis_name = wrapper.inner, wrapper.mesh, wrapper.axis_name
  plain_params, g_leaves, paths, averaged = _gradient_leaves(wrapper, updates, params)
  p_leaves, p_def = jax.tree.flatten(plain_params)
  s_leaves, s_def = jax.tree.flatten(state)
  flags, t_def = _check_state(wrapper, s_leaves, plain_params)
  leaves = (g_leaves, s_leaves, p_leaves)
  s_specs = [P(axis_name) if f else P() for f in flags]
  specs = ([P(axis_name)] * len(g_leaves), s_specs, [P()] * len(p_leaves))

  def update(grads, s_leaves, p_leaves):
    state, params = t_def.unflatten(s_leaves), p_def.unflatten(p_leaves)
    updates, state = tx.update(grads, state, params, **extra_args)
    return p_def.flatten_up_to(updates), t_def.flatten_up_to(state)

  def one_worker(g_leaves, s_leaves, p_leaves):
    """One worker's update: its own gradient and state (the stacks' one block), shared params."""
    grads = p_def.unflatten([g[0] for g in g_leaves])
    if wrapper.all_reduce:
      grads = jax.tree.map(lambda g: jax.lax.pmean(g, axis_name), grads)
    return update(grads, [x[0] if f else x for x, f in zip(s_leaves, flags)], p_leaves)

  def differing(u_leaves):
    return [p for p, u in zip(paths, u_leaves) if exchange.varies_over(u, axis_name)]

  def body(g_leaves, s_leaves, p_leaves):
    u_leaves, n_leaves = one_worker(g_leaves, s_leaves, p_leaves)
    differs = differing(u_leaves)
    if differs:
      raise _differs_error(differs, axis_name)
    varying = [
      i
      for i, (x, f) in enumerate(zip(n_leaves, flags))
      if not f and exchange.varies_over(x, axis_name)
    ]
    if varying:
      raise ValueError(
        f"State leaves {varying} were laid out as shared but differ between workers after an "
        "update; the optimizer's state does not keep the types dj.worker_state_specs found."
      )
    return u_leaves, [
      exchange.as_varying(x, (axis_name,))[None] if f else x for x, f in zip(n_leaves, flags)
    ]

  def diagnose():
    """The params whose update differs by worker, traced with every mesh axis manual."""
    found: list[str] = []

    def probe(*leaves):
      found.extend(differing(one_worker(*leaves)[0]))
      return jnp.zeros(())

    probe_all = jax.shard_map(probe, mesh=mesh, in_specs=specs, out_specs=P())
    try:
      with dense_step.quiet():
        jax.eval_shape(probe_all, *_shapes(leaves))
    except Exception:  # noqa: BLE001 - the caller re-raises the update's own error
      return []
    return found

  if averaged:  # all_reduce's gradients, averaged by value_and_grad: the dense step's own
    u_leaves, n_leaves = update(p_def.unflatten(g_leaves), s_leaves, p_leaves)
    return jax.tree.structure(params).unflatten(u_leaves), s_def.unflatten(n_leaves)
  out_specs = ([P()] * len(p_leaves), s_specs)
  step = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs, axis_names={axis_name})
  try:
    u_leaves, n_leaves = step(*leaves)
  except ValueError:
    raise
  except Exception as e:
    # MultiSteps' lax.cond can fail here, before body checks the updates.
    differs = diagnose()
    if differs:
      raise _differs_error(differs, axis_name) from e
    raise
  return jax.tree.structure(params).unflatten(u_leaves), s_def.unflatten(n_leaves)


def per_worker(
  tx: optax.GradientTransformation,
  mesh: Mesh,
  axis_name: Hashable = "data",
  *,
  all_reduce: bool = False,
) -> PerWorker:
  """``tx`` for the stacked per-worker gradients of :func:`worker_value_and_grad`, in a jit step.

  Put optax wrappers (``MultiSteps``, ``masked``, ...) inside, not around it.

  Args:
    tx: a DisTrO optimizer built with ``axis_name``; dense with ``all_reduce``.
    mesh: the device mesh, with an axis ``axis_name`` (see :func:`workers_mesh`).
    axis_name: the workers' axis.
    all_reduce: average the gradients over the workers before ``tx`` (the dense baseline).

  Returns:
    A :class:`PerWorker`, whose ``update`` needs ``params`` and passes extra
    keyword arguments to ``tx.update``.

  Raises:
    ValueError: gradients without the workers' axis, a state of another worker count,
      an update that differs by worker, or params partitioned over ``axis_name``.

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

  def update_fn(updates, state, params=None, **extra_args):
    return _update(wrapper, updates, state, params, extra_args)

  def init_fn(params):
    # Around this wrapper, MultiSteps would fail inside optax at the first update.
    if isinstance(sys._getframe(1).f_locals.get("self"), optax.MultiSteps):
      raise ValueError(
        "optax.MultiSteps is wrapped around dj.per_worker, so it would accumulate every "
        "worker's stacked gradients into zeros shaped like the params. Put it inside: "
        f"dj.per_worker(optax.MultiSteps(tx, k), mesh, {axis_name!r})."
      )
    _check_no_clash(params, axis_name)
    flags = wrapper.per_worker_leaves(params)
    units, treedef = _units(tx.init(params))
    if len(units) != len(flags):
      raise ValueError(
        "The optimizer state holds a box or variable with more than one array; "
        "dj.per_worker lays out one array per box."
      )
    out = []  # tx.init(params), every per-worker leaf stacked W times and boxed over the workers
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

  wrapper = PerWorker(init_fn, update_fn)
  wrapper.inner, wrapper.mesh, wrapper.axis_name = tx, mesh, axis_name
  wrapper.all_reduce = bool(all_reduce)
  wrapper._flags = {}
  return wrapper


def _gradient_leaves(wrapper: PerWorker, updates: Any, params: Any) -> tuple[Any, list, list, bool]:
  """The params unboxed, the gradient's leaves, the params' paths, and whether all-reduced."""
  axis_name, num_workers = wrapper.axis_name, wrapper.mesh.shape[wrapper.axis_name]
  if params is None:
    raise ValueError(
      "dj.per_worker needs the params in update (tx.update(grads, state, params)), to tell "
      "the per-worker state from the shared."
    )
  _check_no_clash(params, axis_name)
  plain_params = _plain(params)
  g_leaves = jax.tree.leaves(_plain(updates))
  p_paths = jax.tree_util.tree_flatten_with_path(plain_params)[0]
  if len(g_leaves) != len(p_paths):
    raise ValueError(
      f"The gradient has {len(g_leaves)} leaves, the params {len(p_paths)}; pass the "
      "gradients of dj.worker_value_and_grad with respect to exactly these params."
    )
  paths = [jax.tree_util.keystr(p) for p, _ in p_paths]
  p_shapes = [np.shape(p) for _, p in p_paths]
  averaged = wrapper.all_reduce and all(np.shape(g) == p for g, p in zip(g_leaves, p_shapes))
  for path, g, p in zip(paths, g_leaves, p_shapes):
    if not averaged and np.shape(g) != (num_workers, *p):
      hint = (
        "That is the gradient of the whole batch, or values of a wrapper around dj.per_worker: "
        f"put it inside, dj.per_worker(optax.MultiSteps(tx, k), mesh, {axis_name!r}). "
        if np.shape(g) == p
        else ""
      )
      raise ValueError(
        f"Gradient leaf {path} has shape {np.shape(g)}; dj.per_worker needs each worker's "
        f"own gradient stacked on a leading axis, {(num_workers, *p)}. {hint}"
        f"Take it with dj.worker_value_and_grad(loss, mesh, {axis_name!r})."
      )
  return plain_params, g_leaves, paths, averaged


def _check_state(wrapper: PerWorker, s_leaves: list, plain_params: Any) -> tuple[list, Any]:
  """Which state leaves are per worker, and the treedef of ``inner``'s state, once checked."""
  axis_name, num_workers = wrapper.axis_name, wrapper.mesh.shape[wrapper.axis_name]
  flags = wrapper.per_worker_leaves(plain_params)
  template, t_def = jax.tree.flatten(jax.eval_shape(wrapper.inner.init, _shapes(plain_params)))
  if len(s_leaves) != len(template):
    raise ValueError(
      "The optimizer state is not this optimizer's; build it with dj.per_worker(...).init(params)."
    )
  for x, t, stacked in zip(s_leaves, template, flags):
    want = (num_workers, *t.shape) if stacked else t.shape
    if np.shape(x) != want:
      raise ValueError(
        f"An optimizer state leaf has shape {np.shape(x)}, not {want} as on {num_workers} "
        "workers: it is of other params, or of another worker count (see dj.resize_per_worker)."
      )
  dense_step.warn_if_replicated_per_worker(
    [x for x, f in zip(s_leaves, flags) if f], axis_name, num_workers
  )
  return flags, t_def


def _unit_sharding(unit: Any, mesh: Mesh, ndim: int) -> NamedSharding:
  return NamedSharding(mesh, P(*_names(unit, ndim)))


def _is_train_state(x: Any) -> bool:
  """A flax ``TrainState`` (or alike) whose optimizer is a :class:`PerWorker`."""
  return isinstance(getattr(x, "tx", None), PerWorker) and all(
    hasattr(x, a) for a in ("params", "opt_state", "replace")
  )


def _check_wrapper(tx: Any, missing: bool, usage: str) -> PerWorker:
  """``tx``, checked to be a :class:`PerWorker`; ``missing``: arguments of ``usage`` are none."""
  if missing:
    raise TypeError(f"{usage}, or a TrainState whose tx is dj.per_worker's optimizer, alone.")
  if not isinstance(tx, PerWorker):
    raise TypeError(
      f"expected the optimizer dj.per_worker returned, got {type(tx).__name__}; with a "
      "TrainState, pass state.tx."
    )
  return tx


def abstract_per_worker(tx: Any, params: Any = None) -> Any:
  """The restore target of a :func:`per_worker` state saved on any number of workers.

  Per-worker leaves are empty host NumPy arrays, so a checkpointer (``orbax``'s
  ``StandardRestore``) restores them whole on the host; shared leaves are
  placed ``jax.ShapeDtypeStruct``. Pass the restored state to :func:`resize_per_worker`.

  Args:
    tx: the :class:`PerWorker` of this run, or a flax ``TrainState`` whose ``tx`` is one.
    params: the params (arrays or ``jax.ShapeDtypeStruct``); none with a ``TrainState``.

  Returns:
    A tree shaped as ``tx.init(params)``; for a ``TrainState``, the state with it as ``opt_state``.
  """
  if params is None and _is_train_state(tx):
    return tx.replace(opt_state=abstract_per_worker(tx.tx, tx.params))
  tx = _check_wrapper(tx, params is None, "dj.abstract_per_worker takes (tx, params)")
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
  tx: Any,
  state: Any = None,
  params: Any = None,
  *,
  keep: Sequence[int] | None = None,
  leaving: str = "drop",
) -> Any:
  """A :func:`per_worker` state of W workers, rearranged for ``tx``'s W' workers.

  The rules are :func:`distro_jax.resize_worker_state`'s; W is read from the state's shapes.

  Args:
    tx: the :class:`PerWorker` of this run, or a flax ``TrainState`` whose ``tx``
      is one and whose ``opt_state`` is the state of W workers.
    state: the state of W workers; none with a ``TrainState``.
    params: the shared params of this run; none with a ``TrainState``.
    keep: the old workers that stay, in their new order.
    leaving: ``"drop"`` or ``"fold"``, for a leaving worker's residual.

  Returns:
    The state laid out as ``tx.init(params)``; for a ``TrainState``, the train state.

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
  if state is None and params is None and _is_train_state(tx):
    opt_state = resize_per_worker(tx.tx, tx.opt_state, tx.params, keep=keep, leaving=leaving)
    return tx.replace(opt_state=opt_state)
  missing = state is None or params is None
  tx = _check_wrapper(tx, missing, "dj.resize_per_worker takes (tx, state, params)")
  plain_params = _plain(params)
  flags = tx.per_worker_leaves(plain_params)
  s_leaves = jax.tree.leaves(state)
  template, t_def = jax.tree.flatten(jax.eval_shape(tx.inner.init, _shapes(plain_params)))
  if len(s_leaves) != len(template):
    raise ValueError("the state is not this optimizer's: its leaves do not match tx.init's.")
  units, treedef = _units(jax.eval_shape(tx.init, params))
  leaves = [elastic._on(tx.mesh, x) for x in s_leaves]
  if any(flags):  # else all shared: nothing depends on the worker count
    # dj.resize_worker_state takes dj.worker_state's layout: the W workers' blocks concatenated.
    flat = [jnp.reshape(x, (-1, *np.shape(x)[2:])) if f else x for x, f in zip(leaves, flags)]
    placed = jax.device_put(plain_params, NamedSharding(tx.mesh, P()))
    resized = elastic.resize_worker_state(
      tx.inner, t_def.unflatten(flat), placed, tx.mesh, tx.axis_name, keep=keep, leaving=leaving
    )
    leaves = t_def.flatten_up_to(resized)
  num_workers = tx.mesh.shape[tx.axis_name]
  out = []
  for unit, x, t, stacked in zip(units, leaves, template, flags):
    if stacked:
      x = jnp.reshape(x, (num_workers, *t.shape))
    out.append(_rebox(unit, jax.device_put(x, _unit_sharding(unit, tx.mesh, np.ndim(x)))))
  return treedef.unflatten(out)
