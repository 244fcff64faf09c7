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
from typing import Any, NamedTuple

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


def _variable_type() -> type | None:
  """``flax.nnx.Variable`` if NNX is already imported (it is slow to import), else ``None``."""
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
  return jax.tree.map(_value, tree, is_leaf=_is_unit)


def _names(unit: Any, ndim: int) -> tuple[Any, ...]:
  """The mesh axes a box or variable partitions its array over, one per dimension."""
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


def _rebox(unit: Any, value: Any, names: Any = None) -> Any:
  """``value`` in ``unit``'s box or variable; with ``names``, partitioned over those."""
  if names is not None and isinstance(unit, meta.Partitioned):
    return unit.replace(value=value, names=names)
  if isinstance(unit, meta.AxisMetadata):
    return unit.replace_boxed(value)
  variable = _variable_type()
  if variable is not None and isinstance(unit, variable):
    if names is None or unit.get_metadata().get("out_sharding") is None:
      return unit.replace(value)
    return unit.replace(value, out_sharding=names)
  return value


def _check_no_clash(params: Any, axis_name: Hashable) -> None:
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
        f"dj.workers_mesh(workers, names=({axis_name!r},)), which is "
        f"Mesh(devices.reshape(workers, fsdp), ('workers', {axis_name!r})), with "
        "dj.per_worker(tx, mesh, 'workers') and dj.worker_value_and_grad(..., 'workers'), "
        "keeps the model's names; dj.plan_fsdp(params, fsdp) plans a partitioning whose "
        "shards hold whole DeMo chunks (docs/porting.md, docs/fsdp.md)."
      )


def _divisors(n: int) -> list[int]:
  return [d for d in range(2, n + 1) if n % d == 0]


def _num_workers(mesh: Mesh, axis_name: Hashable) -> int:
  if axis_name not in mesh.axis_names:
    n, first = mesh.devices.size, mesh.devices.shape[0]
    raise ValueError(
      f"axis_name={axis_name!r} is not an axis of the mesh {mesh.axis_names} ({n} devices). "
      "DisTrO needs a workers' axis beside the mesh's own: dj.workers_mesh(W, mesh) splits "
      f"the mesh's first axis into W workers, Mesh(mesh.devices.reshape(W, {first} // W, "
      f"...), ({axis_name!r}, *mesh.axis_names)), so that the params' partitioning over "
      f"{mesh.axis_names[0]!r} becomes FSDP within each worker. W is how many sites "
      f"(hosts, slices) the slow links join, a divisor of {first}: one of "
      f"{_divisors(first) or [1]} (docs/porting.md)."
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
  """A stack of one value per worker, split over the workers; other axes as ``unit`` says."""
  names = _names(unit, np.ndim(value) - 1)
  value = _constrain(
    value, mesh, (axis_name, *(P.UNCONSTRAINED if n is None else n for n in names))
  )
  if not _is_unit(unit):
    return meta.Partitioned(value, names=(axis_name, *names))
  return _rebox(unit, value, (axis_name, *names))


def workers_mesh(
  num_workers: int,
  devices: Mesh | Sequence[Any] | np.ndarray | None = None,
  axis_name: Hashable = "workers",
  names: Sequence[Hashable] = ("data",),
) -> Mesh:
  """A mesh with a workers' axis in front: the devices split into ``num_workers`` sites.

  Each worker is a block of consecutive devices; the other axes stay within
  each worker. The axes are ``Auto``, as GSPMD's jit path needs.

  Args:
    num_workers: W, how many sites the slow links join (hosts, TPU slices).
    devices: the devices (default ``jax.devices()``), or a trainer's ``Mesh``,
      whose first axis is split into W blocks and whose names are kept.
    axis_name: the workers' axis.
    names: the axes within a worker, one per axis of ``devices`` (not a ``Mesh``).

  Returns:
    A ``jax.sharding.Mesh`` of shape ``(W, ...)``.

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
        "per axis of devices (a flat list of devices takes one, e.g. ('data',))."
      )
  if axis_name in names:
    raise ValueError(
      f"{axis_name!r} is already an axis of the mesh {tuple(names)}; dj.workers_mesh adds the "
      "workers' axis, so pass the mesh without it, or name the workers' axis otherwise."
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

  The batch is cut along its leading axis into W equal slices, and worker
  ``i`` differentiates the loss of the ``i``-th; nothing crosses the workers.

  Args:
    fun: ``fun(params, batch, *args, **kwargs)``, the loss of ``batch``'s rows.
    mesh: the device mesh.
    axis_name: the workers' axis of ``mesh``.
    has_aux: as in ``jax.value_and_grad``.

  Returns:
    A function of ``(params, batch, *args, **kwargs)`` returning ``(value, grads)``
    (``((value, aux), grads)`` with ``has_aux``): the mean of the workers' losses,
    and each worker's aux and gradient stacked on a leading axis.

  Raises:
    ValueError: the batch does not split into W slices, or a param is
      partitioned over ``axis_name``.

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


def _key_name(key: Any) -> Any:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return getattr(key, attr)
  return key


def reduce_over_workers(tree: Any, summed: Sequence[str] = ()) -> Any:
  """Per-worker values stacked on a leading axis, reduced to the whole batch's.

  For the ``aux`` of :func:`worker_value_and_grad`: a leaf is averaged over
  the workers, or summed where a key or attribute on its path is in ``summed``.

  Args:
    tree: a pytree whose every leaf has the workers on its axis 0.
    summed: dict keys or attributes (counts) whose leaves are summed.

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
    names = {_key_name(k) for k in path} & set(summed)
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

    With ``all_reduce``, the gradients come averaged over the workers, shaped
    and boxed like the params.
    """
    value_and_grad = worker_value_and_grad(fun, self.mesh, self.axis_name, has_aux=has_aux)
    if not self.all_reduce:
      return value_and_grad

    def averaged(params: Any, *args: Any, **kwargs: Any) -> Any:
      out, grads = value_and_grad(params, *args, **kwargs)
      units, treedef = _units(grads)
      # Boxed as the params are: a param without a box gets a plain gradient.
      boxed = [_is_unit(p) for p in _units(params)[0]]
      means = [_worker_mean(u) if b else jnp.mean(_value(u), axis=0) for u, b in zip(units, boxed)]
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


def _worker_mean(unit: Any) -> Any:
  """A stack of one value per worker, averaged and boxed as its param is."""
  value = jnp.mean(_value(unit), axis=0)
  if isinstance(unit, meta.Partitioned):
    return _rebox(unit, value, tuple(unit.names)[1:])
  variable = _variable_type()
  if variable is not None and isinstance(unit, variable):
    names = unit.get_metadata().get("out_sharding")
    return _rebox(unit, value, None if names is None else names[1:])
  return _rebox(unit, value)


def _differs_error(paths: Sequence[str], axis_name: Hashable) -> ValueError:
  return ValueError(
    f"The update of {', '.join(paths[:3])} differs from worker to worker, so the replicas "
    f"would drift apart: the optimizer exchanges nothing over {axis_name!r}. Build it with "
    f"axis_name={axis_name!r} (dj.demo(lr, axis_name={axis_name!r})), or, for the all-reduce "
    f"baseline with a dense optimizer (AdamW), pass all_reduce=True to dj.per_worker, or "
    f"chain dj.pmean_gradients({axis_name!r}) before it."
  )


class _Step(NamedTuple):
  """What one traced update of :func:`per_worker` runs, for every worker at once."""

  tx: optax.GradientTransformation
  mesh: Mesh
  axis_name: Hashable
  all_reduce: bool
  p_def: Any
  t_def: Any
  flags: list[bool]
  paths: list[str]
  extra_args: dict[str, Any]

  def inner(self, g_leaves: list[Any], s_leaves: list[Any], p_leaves: list[Any]) -> Any:
    """One worker's update: its own gradient and state (the stacks' one block), shared params."""
    grads = self.p_def.unflatten([g[0] for g in g_leaves])
    if self.all_reduce:
      grads = jax.tree.map(lambda g: jax.lax.pmean(g, self.axis_name), grads)
    state = self.t_def.unflatten([x[0] if f else x for x, f in zip(s_leaves, self.flags)])
    params = self.p_def.unflatten(p_leaves)
    updates, state = self.tx.update(grads, state, params, **self.extra_args)
    return self.p_def.flatten_up_to(updates), self.t_def.flatten_up_to(state)

  def differing(self, u_leaves: list[Any]) -> list[str]:
    return [p for p, u in zip(self.paths, u_leaves) if exchange.varies_over(u, self.axis_name)]

  def body(self, g_leaves: list[Any], s_leaves: list[Any], p_leaves: list[Any]) -> Any:
    u_leaves, n_leaves = self.inner(g_leaves, s_leaves, p_leaves)
    differing = self.differing(u_leaves)
    if differing:
      raise _differs_error(differing, self.axis_name)
    shared_but_varying = [
      i
      for i, (x, f) in enumerate(zip(n_leaves, self.flags))
      if not f and exchange.varies_over(x, self.axis_name)
    ]
    if shared_but_varying:
      raise ValueError(
        f"State leaves {shared_but_varying} were laid out as shared but differ between "
        "workers after an update; the optimizer's state does not keep the types "
        "dj.worker_state_specs found."
      )
    n_leaves = [
      exchange.as_varying(x, (self.axis_name,))[None] if f else x
      for x, f in zip(n_leaves, self.flags)
    ]
    return u_leaves, n_leaves

  def in_specs(self, num_grads: int, num_params: int) -> tuple[Any, ...]:
    s_specs = [P(self.axis_name) if f else P() for f in self.flags]
    return [P(self.axis_name)] * num_grads, s_specs, [P()] * num_params

  def run(self, g_leaves: list[Any], s_leaves: list[Any], p_leaves: list[Any]) -> Any:
    """The update inside a ``jax.shard_map`` manual over the workers' axis only."""
    specs = self.in_specs(len(g_leaves), len(p_leaves))
    return jax.shard_map(
      self.body,
      mesh=self.mesh,
      in_specs=specs,
      out_specs=([P()] * len(p_leaves), specs[1]),
      axis_names={self.axis_name},
    )(g_leaves, s_leaves, p_leaves)

  def diagnose(self, g_leaves: list[Any], s_leaves: list[Any], p_leaves: list[Any]) -> list[str]:
    """The params whose update differs by worker, traced with every mesh axis manual.

    ``MultiSteps``' ``lax.cond`` can fail in :meth:`run` before :meth:`body` checks.
    """
    found: list[str] = []

    def probe(g_leaves, s_leaves, p_leaves):
      found.extend(self.differing(self.inner(g_leaves, s_leaves, p_leaves)[0]))
      return jnp.zeros(())

    specs = self.in_specs(len(g_leaves), len(p_leaves))
    probe_all = jax.shard_map(probe, mesh=self.mesh, in_specs=specs, out_specs=P())
    args = _shapes((g_leaves, s_leaves, p_leaves))
    try:
      with dense_step.quiet():
        jax.eval_shape(probe_all, *args)
    except Exception:  # noqa: BLE001 - the caller re-raises the update's own error
      return []
    return found


def _stack_init(
  tx: optax.GradientTransformation, wrapper: PerWorker, params: Any, num_workers: int
) -> Any:
  """``tx.init(params)`` with every per-worker leaf stacked W times, boxed over the workers."""
  mesh, axis_name = wrapper.mesh, wrapper.axis_name
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


def per_worker(
  tx: optax.GradientTransformation,
  mesh: Mesh,
  axis_name: Hashable = "data",
  *,
  all_reduce: bool = False,
) -> PerWorker:
  """``tx`` for the stacked per-worker gradients of :func:`worker_value_and_grad`, in a jit step.

  Put optax wrappers (``MultiSteps``, ``masked``, ...) inside, not around it.
  The state is ``tx``'s, with every per-worker leaf stacked on a leading axis.

  Args:
    tx: a DisTrO optimizer built with ``axis_name``; dense with ``all_reduce``.
    mesh: the device mesh, with an axis ``axis_name`` (see :func:`workers_mesh`).
    axis_name: the workers' axis.
    all_reduce: average the gradients over the workers before ``tx`` (the dense baseline).

  Returns:
    A :class:`PerWorker`, whose ``update`` needs ``params`` and passes extra
    keyword arguments to ``tx.update``.

  Raises:
    ValueError: gradients without the workers' axis, a state of another
      worker count, an update that differs by worker, or params partitioned
      over ``axis_name``.

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
    plain_params, g_leaves, paths = _gradient_leaves(updates, params, axis_name)
    p_leaves, p_def = jax.tree.flatten(plain_params)
    # With all_reduce, the averaged gradients of value_and_grad are the dense step's own.
    averaged = all_reduce and all(np.shape(g) == np.shape(p) for g, p in zip(g_leaves, p_leaves))
    if not averaged:
      _check_gradient_shapes(paths, g_leaves, p_leaves, num_workers, axis_name)
    flags = wrapper.per_worker_leaves(plain_params)
    s_leaves, s_def = jax.tree.flatten(state)
    t_def = _check_state(tx, s_leaves, plain_params, flags, num_workers, axis_name)
    if averaged:
      new_updates, new_state = tx.update(
        p_def.unflatten(g_leaves), t_def.unflatten(s_leaves), plain_params, **extra_args
      )
      u_leaves, n_leaves = p_def.flatten_up_to(new_updates), t_def.flatten_up_to(new_state)
      return jax.tree.structure(params).unflatten(u_leaves), s_def.unflatten(n_leaves)
    step = _Step(tx, mesh, axis_name, all_reduce, p_def, t_def, flags, paths, extra_args)
    try:
      u_leaves, n_leaves = step.run(g_leaves, s_leaves, p_leaves)
    except ValueError:
      raise
    except Exception as e:
      differing = step.diagnose(g_leaves, s_leaves, p_leaves)
      if differing:
        raise _differs_error(differing, axis_name) from e
      raise
    return jax.tree.structure(params).unflatten(u_leaves), s_def.unflatten(n_leaves)

  def init_fn(params):
    # optax.MultiSteps around this wrapper would accumulate the stacked gradients
    # into zeros shaped like the params and fail inside optax: name the fix first.
    if isinstance(sys._getframe(1).f_locals.get("self"), optax.MultiSteps):
      raise ValueError(
        "optax.MultiSteps is wrapped around dj.per_worker, so it would accumulate every "
        "worker's stacked gradients into zeros shaped like the params. Put it inside, where "
        "it accumulates each worker's own gradient: dj.per_worker(optax.MultiSteps(tx, k), "
        f"mesh, {axis_name!r}); its gradient_step and mini_step still read from the state."
      )
    return _stack_init(tx, wrapper, params, num_workers)

  wrapper = PerWorker(init_fn, update_fn)
  wrapper.inner, wrapper.mesh, wrapper.axis_name = tx, mesh, axis_name
  wrapper.all_reduce = bool(all_reduce)
  wrapper._flags = {}
  return wrapper


def _gradient_leaves(updates: Any, params: Any, axis_name: Hashable) -> tuple[Any, list, list]:
  """The params unboxed, the gradient's leaves and the params' paths, checked."""
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
  return plain_params, g_leaves, [jax.tree_util.keystr(p) for p, _ in p_paths]


def _check_state(
  tx: optax.GradientTransformation,
  s_leaves: list,
  plain_params: Any,
  flags: list[bool],
  num_workers: int,
  axis_name: Hashable,
) -> Any:
  """The treedef of ``tx``'s own state, once the stacked state's leaves are checked."""
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
  return t_def


def _check_gradient_shapes(
  paths: list[str], g_leaves: list[Any], p_leaves: list[Any], num_workers: int, axis_name: Hashable
) -> None:
  for path, g, p in zip(paths, g_leaves, p_leaves):
    if np.shape(g) != (num_workers, *np.shape(p)):
      hint = (
        "That is the gradient of the whole batch, which GSPMD all-reduces across the "
        "workers (a dense step), or an optax wrapper around dj.per_worker fed it values "
        "shaped like the params (optax.MultiSteps' accumulator): put such wrappers inside, "
        f"dj.per_worker(optax.MultiSteps(tx, k), mesh, {axis_name!r}). "
        if np.shape(g) == np.shape(p)
        else ""
      )
      raise ValueError(
        f"Gradient leaf {path} has shape {np.shape(g)}; dj.per_worker needs each worker's "
        f"own gradient stacked on a leading axis, {(num_workers, *np.shape(p))}. {hint}"
        f"Take it with dj.worker_value_and_grad(loss, mesh, {axis_name!r})."
      )


def _unit_sharding(unit: Any, mesh: Mesh, ndim: int) -> NamedSharding:
  return NamedSharding(mesh, P(*_names(unit, ndim)))


def _is_train_state(x: Any) -> bool:
  """A flax ``TrainState`` (or alike) whose optimizer is a :class:`PerWorker`."""
  return isinstance(getattr(x, "tx", None), PerWorker) and all(
    hasattr(x, a) for a in ("params", "opt_state", "replace")
  )


def _check_wrapper(tx: Any) -> PerWorker:
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
  if params is None:
    raise TypeError(
      "dj.abstract_per_worker takes (tx, params), or a TrainState whose tx is the optimizer "
      "dj.per_worker returned, alone."
    )
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
  if state is None or params is None:
    raise TypeError(
      "dj.resize_per_worker takes (tx, state, params), or a TrainState whose tx is the "
      "optimizer dj.per_worker returned, alone."
    )
  tx = _check_wrapper(tx)
  plain_params = _plain(params)
  flags = tx.per_worker_leaves(plain_params)
  s_leaves = jax.tree.leaves(state)
  template, t_def = jax.tree.flatten(jax.eval_shape(tx.inner.init, _shapes(plain_params)))
  if len(s_leaves) != len(template):
    raise ValueError("the state is not this optimizer's: its leaves do not match tx.init's.")
  units, treedef = _units(jax.eval_shape(tx.init, params))
  host = [elastic._on(tx.mesh, x) for x in s_leaves]
  if not any(flags):
    # All shared (all_reduce, or a stateless inner): nothing depends on the worker count.
    out = [jax.device_put(x, _unit_sharding(u, tx.mesh, np.ndim(x))) for u, x in zip(units, host)]
    return treedef.unflatten([_rebox(u, x) for u, x in zip(units, out)])
  # dj.resize_worker_state works on the per-worker layout of dj.worker_state,
  # the W workers' blocks concatenated along axis 0, which a reshape gives.
  flat = [jnp.reshape(x, (-1, *np.shape(x)[2:])) if f else x for x, f in zip(host, flags)]
  placed = jax.device_put(plain_params, NamedSharding(tx.mesh, P()))
  resized = elastic.resize_worker_state(
    tx.inner, t_def.unflatten(flat), placed, tx.mesh, tx.axis_name, keep=keep, leaving=leaving
  )
  num_workers = tx.mesh.shape[tx.axis_name]
  out = []
  for unit, x, t, stacked in zip(units, t_def.flatten_up_to(resized), template, flags):
    if stacked:
      x = jnp.reshape(x, (num_workers, *t.shape))
    x = jax.device_put(x, _unit_sharding(unit, tx.mesh, np.ndim(x)))
    out.append(_rebox(unit, x))
  return treedef.unflatten(out)
