"""FSDP inside a site: which axis of each param is sharded, the gradient step, and the bytes.

On a 2-D mesh ``("replica", "fsdp")`` the params, the gradient and DeMo's
momentum are sharded over ``"fsdp"``, along an axis where every shard holds
whole DeMo chunks, and only the compressed message crosses ``"replica"``.
See docs/fsdp.md.
"""

import math
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from distro_jax import dct
from distro_jax.exchange import varies_over, worker_local

__all__ = [
  "DeviceBytes",
  "FsdpPlan",
  "clip_by_sharded_global_norm",
  "device_bytes",
  "fsdp_value_and_grad",
  "gather_params",
  "local_shapes",
  "plan_fsdp",
]


class FsdpPlan(NamedTuple):
  """How a params tree is sharded over the fsdp axis.

  Attributes:
    specs: a ``PartitionSpec`` per param: the fsdp axis at the split axis, or ``P()``.
    axes: per param, in tree order, the split axis or ``None``.
    whole: ``(param path, reason)`` for every param kept whole, in tree order.
    fsdp: the number of shards.
  """

  specs: Any
  axes: tuple[int | None, ...]
  whole: tuple[tuple[str, str], ...]
  fsdp: int

  def describe_whole(self) -> str:
    """One line per param kept whole, for logs; empty if every param is sharded."""
    return "\n".join(f"  {path}: {why}" for path, why in self.whole)


def _split_axis(shape: tuple[int, ...], fsdp: int, chunk: int) -> tuple[int | None, str]:
  """The axis to shard so that each shard holds whole chunks, or ``None`` and why not."""
  if fsdp == 1:
    return None, "fsdp=1"
  if not shape:
    return None, "a scalar has no axis to split"
  if not math.prod(shape):
    return None, "a zero-size tensor has nothing to split"
  plan = dct.plan_chunks(shape, chunk)
  # Units a shard boundary may fall between: entries on batch axes, chunks on the last two.
  units = {d: n for d, n in enumerate(shape[:-2])}
  units[len(shape) - 1] = plan.n2 // plan.c2
  if len(shape) >= 2:
    units[len(shape) - 2] = plan.n1 // plan.c1
  fits = [d for d, u in units.items() if u % fsdp == 0]
  if not fits:
    per_axis = ", ".join(f"axis {d}: {u}" for d, u in sorted(units.items()))
    return None, (
      f"shape {shape} with chunks ({plan.c1}, {plan.c2}) has ({per_axis}) whole chunks "
      f"per axis, none divisible by fsdp={fsdp}; it stays whole on every device of a "
      "site (choose an fsdp or compression_chunk that divides them to shard it)"
    )
  # The most units keeps the shards most even; ties go to the leading axis (contiguous rows).
  return max(fits, key=lambda d: (units[d], -d)), ""


def plan_fsdp(
  params: Any, fsdp: int, *, compression_chunk: int = 64, axis_name: Hashable = "fsdp"
) -> FsdpPlan:
  """Plans the fsdp sharding of ``params`` so that no DeMo chunk straddles two shards.

  Args:
    params: a tree of arrays or ``jax.ShapeDtypeStruct`` (global shapes).
    fsdp: devices per site, the size of the fsdp mesh axis.
    compression_chunk: DeMo's chunk target, as given to the optimizer.
    axis_name: the fsdp mesh axis.

  Returns:
    An :class:`FsdpPlan`.

  Example:
    >>> import jax.numpy as jnp, distro_jax as dj
    >>> plan = dj.plan_fsdp({"w": jnp.zeros((256, 128)), "s": jnp.zeros(())}, 4)
    >>> plan.axes, [path for path, _ in plan.whole]
    ((None, 0), ["['s']"])
  """
  if not isinstance(fsdp, int) or fsdp < 1:
    raise ValueError(f"fsdp must be a positive int, got {fsdp!r}.")
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  specs, axes, whole = [], [], []
  for path, x in flat:
    d, why = _split_axis(tuple(np.shape(x)), fsdp, compression_chunk)
    axes.append(d)
    specs.append(P() if d is None else P(*([None] * d), axis_name))
    if d is None and fsdp > 1:
      whole.append((jax.tree_util.keystr(path), why))
  return FsdpPlan(treedef.unflatten(specs), tuple(axes), tuple(whole), fsdp)


def local_shapes(params: Any, specs: Any, axis_sizes: dict[Hashable, int]) -> Any:
  """``jax.ShapeDtypeStruct`` of each param's shard on one device.

  Args:
    params: a tree of arrays or ``jax.ShapeDtypeStruct`` (global shapes).
    specs: a ``PartitionSpec`` per param.
    axis_sizes: the size of each mesh axis named in ``specs``.

  Returns:
    The per-device shapes and dtypes, with the tree structure of ``params``.
  """

  def one(x, spec):
    shape = list(np.shape(x))
    for d, entry in enumerate(spec):
      for name in entry if isinstance(entry, tuple) else (entry,):
        if name is not None:
          shape[d] //= axis_sizes[name]
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)

  return jax.tree.map(one, params, specs, is_leaf=lambda s: isinstance(s, P))


def gather_params(shards: Any, specs: Any, axis_name: Hashable = "fsdp") -> Any:
  """All-gathers each sharded param over ``axis_name``, inside ``jax.shard_map``.

  Its transpose under autodiff is the reduce-scatter of the gradient over the site.
  """

  def one(x, spec):
    for d, entry in enumerate(spec):
      if axis_name in (entry if isinstance(entry, tuple) else (entry,)):
        return jax.lax.all_gather(x, axis_name, axis=d, tiled=True)
    return x

  return jax.tree.map(one, shards, specs, is_leaf=lambda s: isinstance(s, P))


def fsdp_value_and_grad(
  fun: Callable[..., Any],
  specs: Any,
  *,
  replica_axis: Hashable = "replica",
  fsdp_axis: Hashable = "fsdp",
  has_aux: bool = False,
) -> Callable[..., Any]:
  """One device's loss and its shard of the site's mean gradient, under FSDP.

  The params are all-gathered over ``fsdp_axis``, and the gradient comes back
  reduce-scattered over it, averaged over the site; nothing crosses ``replica_axis``.

  Args:
    fun: the per-device loss, ``fun(params, *args)``, a mean over its rows.
    specs: the params' ``PartitionSpec`` tree (:attr:`FsdpPlan.specs`).
    replica_axis: the axis between sites.
    fsdp_axis: the axis within a site.
    has_aux: as in ``jax.value_and_grad``.

  Returns:
    A function of ``(shards, *args)`` returning this device's ``(value, grads)``.
  """

  def gathered(shards, *args, **kwargs):
    return fun(gather_params(shards, specs, fsdp_axis), *args, **kwargs)

  value_and_grad = jax.value_and_grad(gathered, has_aux=has_aux)

  def wrapped(shards, *args, **kwargs):
    # Differentiating with respect to replica-local shards keeps autodiff from
    # all-reducing the gradient across sites.
    value, grads = value_and_grad(worker_local(shards, replica_axis), *args, **kwargs)
    site = jax.lax.axis_size(fsdp_axis)
    return value, jax.tree.map(lambda g: g / site, grads)

  return wrapped


def clip_by_sharded_global_norm(
  max_norm: float, axis_name: Hashable = "fsdp"
) -> optax.GradientTransformation:
  """``optax.clip_by_global_norm`` for gradients sharded over ``axis_name``.

  The norm is the whole gradient's; a leaf kept whole counts once.

  Args:
    max_norm: the largest global norm let through.
    axis_name: the fsdp axis, bound by an enclosing ``jax.shard_map``.

  Returns:
    A stateless ``optax.GradientTransformation``.
  """

  def update_fn(updates, state, params=None):
    del params
    sharded = whole = jnp.zeros([], jnp.float32)
    for g in jax.tree.leaves(updates):
      sq = jnp.sum(jnp.square(g.astype(jnp.float32)))
      if varies_over(g, axis_name):
        sharded = sharded + sq
      else:
        whole = whole + sq
    g_norm = jnp.sqrt(jax.lax.psum(sharded, axis_name) + whole)
    trigger = g_norm < max_norm
    updates = jax.tree.map(
      lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm), updates
    )
    return updates, state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


class DeviceBytes(NamedTuple):
  """Bytes one device holds for training, by kind.

  Attributes:
    params: its params (shards, and whole params).
    opt_state: its optimizer state.
  """

  params: int
  opt_state: int

  @property
  def total(self) -> int:
    return self.params + self.opt_state


def _tree_bytes(tree: Any) -> int:
  return sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def device_bytes(
  tx: optax.GradientTransformation, params: Any, specs: Any, axis_sizes: dict[Hashable, int]
) -> DeviceBytes:
  """Per-device bytes of params plus optimizer state (``tx.init`` of its shards), under eval_shape.

  Args:
    tx: the optimizer, as each device runs it.
    params: a tree of arrays or ``jax.ShapeDtypeStruct`` (global shapes).
    specs: the params' ``PartitionSpec`` tree.
    axis_sizes: the size of each mesh axis named in ``specs``.

  Returns:
    A :class:`DeviceBytes`.
  """
  local = local_shapes(params, specs, axis_sizes)
  return DeviceBytes(_tree_bytes(local), _tree_bytes(jax.eval_shape(tx.init, local)))
