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

from distro_jax.worker_state import abstract_worker_state, init_worker_state, spec_axes

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


def _under(path: tuple[Any, ...], fields: Sequence[str]) -> bool:
  """Whether a leaf sits under a field or dict key named in ``fields``."""
  names = (getattr(entry, "name", getattr(entry, "key", None)) for entry in path)
  return any(isinstance(name, str) and name in fields for name in names)


class _Leaf:
  """One state leaf: its place in the new layout, and for a per-worker one its axis-0 split."""

  def __init__(self, path, new: jax.ShapeDtypeStruct, axis_name, mesh: Mesh, residual_fields):
    axes = spec_axes(new.sharding.spec)  # a per-worker leaf is split on axis 0 only
    self.new = new
    self.per_worker = axis_name in axes
    self.position = axes.index(axis_name) if self.per_worker else None
    self.sizes = [mesh.shape[a] for a in axes]
    # Rows of axis 0 that one worker holds (all its devices' pieces together).
    self.rows = new.shape[0] // self.sizes[self.position] if self.per_worker else None
    self.residual = self.per_worker and _under(path, residual_fields)
    self.in_flight = self.per_worker and _under(path, IN_FLIGHT_FIELDS)

  def split(self, x: jax.Array, workers: int) -> jax.Array:
    """``(rows, ...)`` -> ``(workers, block, ...)``, whatever the axis order of the split."""
    sizes = [workers if i == self.position else s for i, s in enumerate(self.sizes)]
    x = x.reshape(*sizes, x.shape[0] // math.prod(sizes), *x.shape[1:])
    x = jnp.moveaxis(x, self.position, 0)
    return x.reshape(workers, -1, *x.shape[len(sizes) + 1 :])

  def join(self, x: jax.Array, workers: int) -> jax.Array:
    """Inverse of :meth:`split`."""
    others = self.sizes[: self.position] + self.sizes[self.position + 1 :]
    x = x.reshape(workers, *others, -1, *x.shape[2:])
    x = jnp.moveaxis(x, 0, self.position)
    return x.reshape(-1, *x.shape[len(self.sizes) + 1 :])


def _layout(tx, params, mesh, axis_name, param_specs, residual_fields=()):
  """The state's treedef, and a :class:`_Leaf` per leaf for the layout on ``mesh``."""
  abstract = abstract_worker_state(tx, params, mesh, axis_name, param_specs=param_specs)
  flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  return [_Leaf(p, x, axis_name, mesh, residual_fields) for p, x in flat], treedef


def _count_from(leaves: list[_Leaf], shapes: list[tuple[int, ...]]) -> int | None:
  """The worker count that per-worker leaves of ``shapes`` were laid out for."""
  counts = set()
  for leaf, shape in zip(leaves, shapes):
    shape, new = tuple(shape), leaf.new.shape
    if not leaf.per_worker:
      if shape != new:
        raise ValueError(
          f"a shared state leaf has shape {shape}, but this optimizer's has {new}; the "
          "state is from another optimizer or model."
        )
      continue
    if len(shape) != len(new) or shape[1:] != new[1:] or not shape[0] or shape[0] % leaf.rows:
      raise ValueError(
        f"a per-worker state leaf has shape {shape}, which is no whole number of workers' "
        f"blocks of {leaf.rows} rows (this optimizer's layout: {new}); the state is from another "
        "optimizer, model or FSDP layout."
      )
    counts.add(shape[0] // leaf.rows)
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
  leaves, treedef = _layout(tx, params, mesh, axis_name, param_specs)
  return _count_from(leaves, [np.shape(x) for x in treedef.flatten_up_to(state)])


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
  leaves, treedef = _layout(tx, params, mesh, axis_name, param_specs)
  replicated = NamedSharding(mesh, P())
  out = []
  for leaf in leaves:
    x = leaf.new
    if leaf.per_worker:
      x = jax.ShapeDtypeStruct(
        (leaf.rows * num_workers, *x.shape[1:]), x.dtype, sharding=replicated
      )
    out.append(x)
  return treedef.unflatten(out)


def _on(mesh: Mesh, x: Any) -> Any:
  """``x`` as it is if it lives on ``mesh``, else fetched to the host."""
  if not isinstance(x, jax.Array) or getattr(x.sharding, "mesh", None) == mesh:
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
  leaves, treedef = _layout(tx, params, mesh, axis_name, param_specs, residual_fields)
  old = [_on(mesh, x) for x in treedef.flatten_up_to(state)]
  before = _count_from(leaves, [np.shape(x) for x in old])
  after = mesh.shape[axis_name]
  shardings = [leaf.new.sharding for leaf in leaves]
  if before is None:  # nothing per worker: every leaf carries over
    return treedef.unflatten(jax.jit(lambda xs: xs, out_shardings=shardings)(old))
  keep = _check_keep(keep, before, after)
  left = tuple(w for w in range(before) if w not in keep)
  if leaving == "fold" and left and not keep and any(leaf.residual for leaf in leaves):
    raise ValueError(
      "leaving='fold' needs a worker that stays to take the residual; keep one, or use "
      "leaving='drop'."
    )
  fresh = jax.tree.leaves(init_worker_state(tx, params, mesh, axis_name, param_specs=param_specs))
  # Stayers that take another index: their message in flight is marked invalid.
  moved = np.asarray(keep) != np.arange(len(keep))

  @functools.partial(jax.jit, out_shardings=shardings)
  def rearrange(old, fresh):
    """The kept workers' blocks, then the joiners'."""
    old, fresh = jax.sharding.reshard((old, fresh), NamedSharding(mesh, P()))
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
      if leaf.residual and leaving == "fold" and left:
        # Every process runs this same program on the same replicated inputs,
        # so the fold is bit-identical everywhere.
        shift = jnp.mean(o_w, axis=0) - jnp.mean(kept, axis=0)
        kept = kept + shift.astype(kept.dtype)
      out.append(leaf.join(jnp.concatenate([kept, f_w[len(keep) :]]), after))
    return out

  return treedef.unflatten(rearrange(old, fresh))
