"""Elastic runs: the per-worker optimizer state of W workers, resized for W'.

Which leaves are per worker is what :func:`distro_jax.worker_state_specs`
finds. A worker that stays keeps its block of each per-worker leaf, one that
joins gets ``tx.init`` of the shared params, and one that leaves takes its
state with it, or leaves its unsent residual folded into the stayers. Shared
leaves carry over. See docs/elastic.md.
"""

import functools
import math
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from distro_jax.worker_state import (
  abstract_worker_state,
  init_worker_state,
  is_spec,
  worker_state_specs,
)

__all__ = [
  "LEAVING",
  "RESIDUAL_FIELDS",
  "abstract_state_of_workers",
  "resize_worker_state",
  "worker_count",
]

# Fields of the library's states that hold a worker's unsent residual.
RESIDUAL_FIELDS = ("momentum", "error_feedback")
# Fields that hold a message in flight; a worker that moves to another index
# cannot send it, since drawn positions are keyed by the sender's index.
IN_FLIGHT_FIELDS = ("pending",)
# What happens to a leaving worker's residual.
LEAVING = ("drop", "fold")


def _axis0(spec: P) -> tuple[Hashable, ...]:
  """The mesh axes that split a leaf's axis 0, in order."""
  first = spec[0] if spec else None
  if first is None:
    return ()
  return tuple(first) if isinstance(first, tuple) else (first,)


def _is_residual(path: tuple[Any, ...], residual_fields: Sequence[str]) -> bool:
  """Whether a leaf sits under a field or dict key named in ``residual_fields``."""
  for entry in path:
    name = getattr(entry, "name", getattr(entry, "key", None))
    if isinstance(name, str) and name in residual_fields:
      return True
  return False


class _Leaf:
  """How one state leaf is laid out: shared, or per worker with its axis-0 split."""

  def __init__(
    self, spec: P, axis_name: Hashable, mesh: Mesh, residual: bool, in_flight: bool = False
  ):
    axes = _axis0(spec)
    others = [a for e in tuple(spec)[1:] for a in (e if isinstance(e, tuple) else (e,)) if a]
    if axis_name in others:
      raise ValueError(
        f"a per-worker state leaf is split over {axis_name!r} on an axis other than 0 "
        f"({spec}); the per-worker layout of distro_jax.worker_state puts it on axis 0."
      )
    self.per_worker = axis_name in axes
    self.position = axes.index(axis_name) if self.per_worker else None
    self.sizes = [mesh.shape[a] for a in axes]
    self.residual = residual and self.per_worker
    self.in_flight = in_flight and self.per_worker

  def block(self, new_rows: int) -> int:
    """Rows of axis 0 that one worker holds (all its devices' pieces together)."""
    return new_rows // self.sizes[self.position]

  def split(self, x: jax.Array, workers: int) -> jax.Array:
    """``(rows, ...)`` -> ``(workers, block, ...)``, whatever the axis order of the split."""
    sizes = list(self.sizes)
    sizes[self.position] = workers
    x = x.reshape(*sizes, x.shape[0] // math.prod(sizes), *x.shape[1:])
    x = jnp.moveaxis(x, self.position, 0)
    return x.reshape(workers, -1, *x.shape[len(sizes) + 1 :])

  def join(self, x: jax.Array, workers: int) -> jax.Array:
    """Inverse of :meth:`split`."""
    sizes = list(self.sizes)
    sizes[self.position] = workers
    others = [s for i, s in enumerate(sizes) if i != self.position]
    x = x.reshape(workers, *others, -1, *x.shape[2:])
    x = jnp.moveaxis(x, 0, self.position)
    return x.reshape(-1, *x.shape[len(sizes) + 1 :])


def _layout(tx, params, mesh, axis_name, param_specs, residual_fields):
  """Per leaf of the state, a :class:`_Leaf`, plus the new layout's abstract state."""
  specs = worker_state_specs(tx, params, mesh, axis_name, param_specs=param_specs)
  abstract = abstract_worker_state(tx, params, mesh, axis_name, param_specs=param_specs)
  flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
  leaves = [
    _Leaf(s, axis_name, mesh, _is_residual(p, residual_fields), _is_residual(p, IN_FLIGHT_FIELDS))
    for p, s in flat
  ]
  return leaves, treedef, abstract


def _count_from(leaves: list[_Leaf], shapes: list[tuple[int, ...]], new_shapes) -> int | None:
  """The worker count that per-worker leaves of ``shapes`` were laid out for."""
  counts = set()
  for leaf, shape, new in zip(leaves, shapes, new_shapes):
    shape, new = tuple(shape), tuple(new)
    if not leaf.per_worker:
      if shape != new:
        raise ValueError(
          f"a shared state leaf has shape {shape}, but this optimizer's has {new}; the "
          "state is from another optimizer or model."
        )
      continue
    rows = leaf.block(new[0])
    if len(shape) != len(new) or shape[1:] != new[1:] or not shape[0] or shape[0] % rows:
      raise ValueError(
        f"a per-worker state leaf has shape {shape}, which is no whole number of workers' "
        f"blocks of {rows} rows (this optimizer's layout: {new}); the state is from another "
        "optimizer, model or FSDP layout."
      )
    counts.add(shape[0] // rows)
  if len(counts) > 1:
    raise ValueError(f"the per-worker state leaves disagree on the worker count: {sorted(counts)}.")
  return counts.pop() if counts else None


def worker_count(
  tx: optax.GradientTransformation,
  state: Any,
  params: Any,
  mesh: Mesh,
  axis_name: Hashable = "data",
  *,
  param_specs: Any = None,
) -> int | None:
  """How many workers a per-worker state was laid out for, read from its shapes.

  Args:
    tx: the optimizer the state belongs to.
    state: the state, or a tree of its structure whose leaves have a ``shape``.
    params: the params tree (arrays or ``jax.ShapeDtypeStruct``), global shapes.
    mesh: a mesh with an axis ``axis_name``, of any size.
    axis_name: the data-parallel axis.
    param_specs: the params' ``PartitionSpec`` tree when they are sharded.

  Returns:
    W, or ``None`` when the state has no per-worker leaf.

  Raises:
    ValueError: the shapes are not this optimizer's state for any W.
  """
  leaves, treedef, abstract = _layout(tx, params, mesh, axis_name, param_specs, ())
  shapes = [tuple(np.shape(x)) for x in treedef.flatten_up_to(state)]
  return _count_from(leaves, shapes, [x.shape for x in jax.tree.leaves(abstract)])


def abstract_state_of_workers(
  tx: optax.GradientTransformation,
  params: Any,
  mesh: Mesh,
  num_workers: int,
  axis_name: Hashable = "data",
  *,
  param_specs: Any = None,
) -> Any:
  """Where to restore a state that ``num_workers`` workers saved, on another worker count.

  Per-worker leaves are replicated on ``mesh``; pass the restored state to
  :func:`resize_worker_state`.

  Args:
    tx: the optimizer.
    params: the params tree (arrays or ``jax.ShapeDtypeStruct``), global shapes.
    mesh: the mesh the run continues on.
    num_workers: W, the worker count the state was saved with.
    axis_name: the data-parallel axis.
    param_specs: the params' ``PartitionSpec`` tree when they are sharded.

  Returns:
    A tree of ``jax.ShapeDtypeStruct`` with shardings.
  """
  if num_workers < 1:
    raise ValueError(f"num_workers must be positive, got {num_workers}.")
  leaves, treedef, abstract = _layout(tx, params, mesh, axis_name, param_specs, ())
  replicated = NamedSharding(mesh, P())
  out = []
  for leaf, x in zip(leaves, jax.tree.leaves(abstract)):
    if leaf.per_worker:
      rows = leaf.block(x.shape[0]) * num_workers
      x = jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype, sharding=replicated)
    out.append(x)
  return treedef.unflatten(out)


def _on(mesh: Mesh, x: Any) -> Any:
  """``x`` as it is if it lives on ``mesh``, else fetched to the host."""
  sharding = getattr(x, "sharding", None)
  if not isinstance(x, jax.Array) or getattr(sharding, "mesh", None) == mesh:
    return x
  if not x.is_fully_addressable and not x.is_fully_replicated:
    raise ValueError(
      "the state lives on another mesh, across processes; restore it onto the new mesh "
      "with dj.abstract_state_of_workers(...) as the target, then resize it."
    )
  return np.asarray(x.addressable_data(0)) if x.is_fully_replicated else np.asarray(x)


def _check_keep(keep: Sequence[int] | None, before: int, after: int) -> tuple[int, ...]:
  if keep is None:
    return tuple(range(min(before, after)))
  keep = tuple(int(w) for w in keep)
  if len(set(keep)) != len(keep) or any(not 0 <= w < before for w in keep):
    raise ValueError(
      f"keep={keep} must name distinct workers of the {before} the state holds (0..{before - 1})."
    )
  if len(keep) > after:
    raise ValueError(f"keep names {len(keep)} workers, but the mesh has room for {after}.")
  return keep


def _rearrange(
  leaves: Sequence[Any],
  keep: tuple[int, ...],
  before: int,
  after: int,
  fold: bool,
  replicated: NamedSharding,
  old: list[jax.Array],
  fresh: list[jax.Array],
) -> list[jax.Array]:
  """:func:`resize_worker_state`'s program: the kept workers' blocks, then the joiners'."""
  old, fresh = jax.sharding.reshard((old, fresh), replicated)
  # Stayers that take another index: their message in flight is marked invalid.
  moved = np.asarray(keep) != np.arange(len(keep))
  out = []
  for leaf, o, f in zip(leaves, old, fresh):
    if not leaf.per_worker:
      out.append(o)
      continue
    o_w, f_w = leaf.split(o, before), leaf.split(f, after)
    kept = o_w[np.asarray(keep, np.int32)]
    if leaf.in_flight and moved.any():
      # A fresh message is all zeros, the invalid marker.
      rows = moved.reshape(-1, *[1] * (kept.ndim - 1))
      kept = jnp.where(rows, f_w[: len(keep)], kept)
    if leaf.residual and fold:
      # Every process runs this same program on the same replicated inputs,
      # so the fold is bit-identical everywhere.
      shift = jnp.mean(o_w, axis=0) - jnp.mean(kept, axis=0)
      kept = kept + shift.astype(kept.dtype)
    out.append(leaf.join(jnp.concatenate([kept, f_w[len(keep) :]]), after))
  return out


def resize_worker_state(
  tx: optax.GradientTransformation,
  state: Any,
  params: Any,
  mesh: Mesh,
  axis_name: Hashable = "data",
  *,
  keep: Sequence[int] | None = None,
  leaving: str = "drop",
  param_specs: Any = None,
  residual_fields: Sequence[str] = RESIDUAL_FIELDS,
) -> Any:
  """The per-worker state of W workers, rearranged for the W' workers of ``mesh``.

  New worker ``i`` continues old worker ``keep[i]``; the rest join with
  ``tx.init`` of ``params``. With ``leaving="fold"``, each stayer's residual
  ``r_s`` becomes ``r_s - mean(stayers) + mean(all W)``. A message in flight
  is marked invalid when its worker moves to another index.

  Args:
    tx: the optimizer, built for the new mesh with the old settings.
    state: the state of W workers, as global or host arrays.
    params: the shared params, placed on ``mesh`` as ``param_specs`` says.
    mesh: the mesh to continue on; W' is the size of its ``axis_name``.
    axis_name: the data-parallel axis.
    keep: the old workers that stay, in their new order; default the first ``min(W, W')``.
    leaving: ``"drop"`` or ``"fold"``, for a leaving worker's residual.
    param_specs: the params' ``PartitionSpec`` tree when they are sharded.
    residual_fields: the state fields that hold unsent residual.

  Returns:
    The state for W' workers, placed as :func:`distro_jax.init_worker_state` places it.

  Raises:
    ValueError: the state is not ``tx``'s for any W, ``keep`` is invalid, or
      ``leaving`` is unknown.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, distro_jax as dj
    >>> params = {"w": jnp.zeros((8, 8))}
    >>> tx = dj.demo(0.1, compression_topk=1)
    >>> two = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> state = dj.init_worker_state(tx, params, two)
    >>> momentum = state[0].momentum["w"]  # the 2 workers' (8, 8) blocks, stacked: (16, 8)
    >>> residual = jnp.repeat(jnp.array([1.0, 3.0]), 8)[:, None]  # worker 0 holds 1s, worker 1 3s
    >>> demo_state = state[0]._replace(momentum={"w": momentum + residual})
    >>> state = (demo_state, *state[1:])
    >>> one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    >>> tx1 = dj.demo(0.1, compression_topk=1)
    >>> folded = dj.resize_worker_state(tx1, state, params, one, leaving="fold")  # 1 leaves
    >>> float(folded[0].momentum["w"].max())  # the mean of 1 and 3: its residual stayed
    2.0
    >>> grown = dj.resize_worker_state(tx, folded, params, two)  # a worker joins
    >>> np.asarray(grown[0].momentum["w"]).reshape(2, -1).max(axis=1).tolist()  # the new one: zero
    [2.0, 0.0]
  """
  if leaving not in LEAVING:
    raise ValueError(f"leaving={leaving!r}; use one of {LEAVING}.")
  leaves, treedef, abstract = _layout(tx, params, mesh, axis_name, param_specs, residual_fields)
  old = treedef.flatten_up_to(state)
  new_abstract = jax.tree.leaves(abstract)
  before = _count_from(leaves, [np.shape(x) for x in old], [x.shape for x in new_abstract])
  after = mesh.shape[axis_name]
  shardings = [x.sharding for x in new_abstract]
  if before is None:  # nothing per worker: every leaf carries over
    carry = jax.jit(lambda xs: xs, out_shardings=shardings)
    return treedef.unflatten(carry([_on(mesh, x) for x in old]))
  keep = _check_keep(keep, before, after)
  left = tuple(w for w in range(before) if w not in keep)
  if leaving == "fold" and left and not keep and any(leaf.residual for leaf in leaves):
    raise ValueError(
      "leaving='fold' needs a worker that stays to take the residual; keep one, or use "
      "leaving='drop'."
    )
  fresh = jax.tree.leaves(init_worker_state(tx, params, mesh, axis_name, param_specs=param_specs))
  fold, replicated = leaving == "fold" and bool(left), NamedSharding(mesh, P())
  rearrange = functools.partial(_rearrange, leaves, keep, before, after, fold, replicated)
  fn = jax.jit(rearrange, out_shardings=shardings)
  return treedef.unflatten(fn([_on(mesh, x) for x in old], fresh))
