"""How DeMo turns its decoded aggregate into a step: its sign, unit RMS, or orthogonalized.

The ``normalize`` modes of :func:`distro_jax.demo`: ``"sign"`` (DeMo's), ``"rms"`` (each
tensor at a root mean square of one), ``"orth"`` (each matrix orthogonalized, then at unit RMS).
"""

import dataclasses
from collections.abc import Hashable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from distro_jax import exchange
from distro_jax.orthogonal import orthogonalize

__all__ = ["NORMALIZE", "PerLayer", "Split", "scale_to_unit_rms", "to_unit_rms"]

NORMALIZE = ("sign", "rms", "orth")
_MODES = ", ".join(map(repr, NORMALIZE))


@dataclasses.dataclass(frozen=True)
class PerLayer:
  """A normalize mode for a param whose leading axes stack layers: each layer on its own.

  ``PerLayer(mode)`` applies ``mode`` to each ``x[i]`` of an ``(n_layers, ...)``
  stack, as separate params would get it. ``"orth"`` scales a layer of shape
  ``(1, n)``, a vector's row layout, to unit RMS.

  Attributes:
    mode: one of :data:`NORMALIZE`.
    axes: how many leading axes index the layers.

  Example:
    >>> import jax.numpy as jnp, distro_jax as dj
    >>> modes = {"blocks": dj.PerLayer("orth"), "embedding": "rms"}
    >>> tx = dj.demo(1e-3, axis_name=None, normalize=modes)
    >>> params = {"blocks": jnp.ones((2, 8, 8)), "embedding": jnp.ones((16, 8))}
    >>> updates, _ = tx.update(params, tx.init(params), params)
    >>> updates["blocks"].shape
    (2, 8, 8)
  """

  mode: str
  axes: int = 1

  def __post_init__(self) -> None:
    if self.mode not in NORMALIZE:
      raise ValueError(f"PerLayer(mode={self.mode!r}); use one of {_MODES}.")
    if not isinstance(self.axes, int) or isinstance(self.axes, bool) or self.axes < 1:
      raise ValueError(
        f"PerLayer(axes={self.axes!r}) counts the leading axes that index the layers; "
        "use an int of 1 or more (1 for a (n_layers, ...) stack)."
      )


@dataclasses.dataclass(frozen=True)
class Split:
  """A normalize mode for a param split across a worker's devices: each takes its block.

  Inside ``jax.shard_map``, all-gathers the decoded aggregate over ``over``,
  applies ``mode`` to the whole tensor and keeps this device's block
  (docs/fsdp.md). :func:`distro_jax.plan_fsdp` gives ``axis`` and ``over``.

  Attributes:
    mode: one of :data:`NORMALIZE`, or a :class:`PerLayer` of one.
    axis: the param's axis that is cut into blocks.
    over: the mesh axis (or tuple of axes) whose devices hold the blocks.

  Example:
    >>> import distro_jax as dj
    >>> modes = {"w": dj.Split("orth", axis=1, over="fsdp"), "b": "rms"}
  """

  mode: Any
  axis: int
  over: Hashable = "fsdp"

  def __post_init__(self) -> None:
    inner = self.mode.mode if isinstance(self.mode, PerLayer) else self.mode
    if not isinstance(inner, str) or inner not in NORMALIZE:
      raise ValueError(f"Split(mode={self.mode!r}); use one of {_MODES} or a dj.PerLayer of one.")
    if not isinstance(self.axis, int) or isinstance(self.axis, bool) or self.axis < 0:
      raise ValueError(
        f"Split(axis={self.axis!r}) names the param's axis that is cut into blocks; use a "
        "non-negative int, the position of the mesh axis in the param's PartitionSpec."
      )


def check_normalize(normalize: Any) -> Any:
  """``normalize``, refused unless it is a mode, a tree of them, or a function (checked later)."""
  if callable(normalize):
    return normalize
  for mode in [normalize] if isinstance(normalize, str) else jax.tree.leaves(normalize):
    if isinstance(mode, PerLayer | Split):
      continue
    if not isinstance(mode, str) or mode not in NORMALIZE:
      raise ValueError(
        f"normalize={mode!r}; use normalize='sign' (DeMo's), normalize='rms' (each tensor's "
        "step at unit RMS) or normalize='orth' (each matrix orthogonalized, then at unit RMS), "
        "or a tree of these (or of dj.PerLayer(mode) for stacked layers) like the params."
      )
  return normalize


def normalize_modes(normalize: Any, params: Any) -> list[str]:
  """One checked mode per leaf of ``params``, from a mode, a tree of them, or a function."""
  spec = check_normalize(normalize(params) if callable(normalize) else normalize)
  leaves, treedef = jax.tree.flatten(params)
  if isinstance(spec, str):
    return [spec] * len(leaves)
  try:
    per_leaf = jax.tree.map(lambda mode, sub: jax.tree.map(lambda _: mode, sub), spec, params)
  except ValueError as e:
    raise ValueError(
      "normalize= must be one of 'sign', 'rms' and 'orth', a tree of them with the "
      f"params' structure or a prefix of it, or a function of the params that returns one: {e}"
    ) from None
  return treedef.flatten_up_to(per_leaf)


def normalized_step(
  q: jax.Array, mode: str | PerLayer, sharded_over: Iterable[Hashable] = ()
) -> jax.Array:
  """The step along ``q`` (or this device's block of it) that ``mode`` gives, in ``q``'s dtype.

  ``"orth"`` scales a tensor that is not a matrix to unit RMS. ``sharded_over``:
  the mesh axes holding the other blocks of ``q``.
  """
  sharded_over = tuple(sharded_over)
  inner = mode.mode if isinstance(mode, Split) else mode
  inner = inner.mode if isinstance(inner, PerLayer) else inner
  # The sign is elementwise: no layer or block of q needs the rest of it.
  if inner == "sign":
    return jnp.sign(q)
  if isinstance(mode, Split):
    return _split_step(q, mode)
  if isinstance(mode, PerLayer):
    return _per_layer_step(q, mode, sharded_over)
  if mode == "orth" and q.ndim == 2:
    if sharded_over:
      raise ValueError(
        f"normalize='orth' orthogonalizes each matrix whole, but this {q.shape} block is one "
        f"of a matrix split over the mesh axes {sharded_over} (FSDP). Mark it dj.Split('orth', "
        "axis=..., over=...), use normalize='rms', or keep the params whole on each worker."
      )
    q = orthogonalize(q)
  return to_unit_rms(q, sharded_over)


def _per_layer_step(q: jax.Array, mode: PerLayer, sharded_over: tuple[Hashable, ...]) -> jax.Array:
  if q.ndim <= mode.axes:
    raise ValueError(
      f"PerLayer(axes={mode.axes}) marks a tensor of shape {q.shape}, which has no axes "
      "left for a layer; mark only the stacked params, with axes= the number of layer axes."
    )
  if sharded_over:
    raise ValueError(
      f"PerLayer({mode.mode!r}) normalizes each layer whole, but this {q.shape} block is one "
      f"of a stack split over the mesh axes {sharded_over} (FSDP). Mark it "
      "dj.Split(dj.PerLayer(...), axis=..., over=...), keep stacked params whole on each "
      "worker, or use normalize='sign'."
    )
  layer_shape = q.shape[mode.axes :]
  matrix = mode.mode == "orth" and len(layer_shape) == 2 and min(layer_shape) > 1
  per_layer = "orth" if matrix else "rms"
  layers = q.reshape(-1, *layer_shape)
  return jax.vmap(lambda x: normalized_step(x, per_layer))(layers).reshape(q.shape)


def _split_step(q: jax.Array, mode: Split) -> jax.Array:
  if mode.axis >= q.ndim:
    raise ValueError(
      f"Split(axis={mode.axis}) marks a block of shape {q.shape}, which has no axis "
      f"{mode.axis}; give the axis the param's PartitionSpec cuts."
    )
  whole = jax.lax.all_gather(q, mode.over, axis=mode.axis, tiled=True)
  step = normalized_step(whole, mode.mode)
  n = q.shape[mode.axis]
  return jax.lax.dynamic_slice_in_dim(step, jax.lax.axis_index(mode.over) * n, n, mode.axis)


def to_unit_rms(x: jax.Array, sharded_over: Iterable[Hashable] = ()) -> jax.Array:
  """``x`` divided by its root mean square (zero stays zero), in ``x``'s dtype.

  Args:
    x: one tensor, or under ``shard_map`` this device's block of it.
    sharded_over: the mesh axes holding the tensor's other blocks.
  """
  axes = tuple(sorted(sharded_over, key=str))
  sq = jnp.sum(jnp.square(x.astype(jnp.float32)))
  size = jnp.asarray(x.size, jnp.float32)
  if axes:
    # Gathered and summed in index order, not psum'd: an all-reduce may add the blocks
    # in another order on another group of devices, and every worker must get the same bits.
    sq = jnp.sum(jax.lax.all_gather(sq, axes, to="invarying"))
    size = size * jax.lax.psum(1, axes)
  mean_sq = sq / size
  rms = jnp.sqrt(jnp.where(mean_sq > 0, mean_sq, 1.0))
  return jnp.where(mean_sq > 0, x.astype(jnp.float32) / rms, 0.0).astype(x.dtype)


def scale_to_unit_rms(axis_name: Hashable | None = None) -> optax.GradientTransformation:
  """Scales each tensor of the updates to a root mean square of one.

  A tensor split over mesh axes other than ``axis_name`` (FSDP) is scaled by
  the whole tensor's RMS.

  Args:
    axis_name: the workers' axis; ``None`` when there is none.

  Returns:
    An ``optax.GradientTransformation`` with no state.

  Example:
    >>> import jax.numpy as jnp, distro_jax as dj
    >>> tx = dj.scale_to_unit_rms()
    >>> updates, _ = tx.update({"w": jnp.array([3.0, -1.0, 1.0, 1.0])}, tx.init(None))
    >>> print(*(round(float(u), 3) for u in updates["w"]))
    1.732 -0.577 0.577 0.577
  """
  return scale_by_normalize("rms", axis_name)


def scale_by_normalize(
  normalize: Any, axis_name: Hashable | None = None
) -> optax.GradientTransformation:
  """Turns each tensor of the updates into a step as ``normalize`` (of ``dj.demo``) says."""
  check_normalize(normalize)

  def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
    del params
    leaves, treedef = jax.tree.flatten(updates)
    steps = [
      normalized_step(u, mode, exchange.varying_axes(u) - {axis_name})
      for u, mode in zip(leaves, normalize_modes(normalize, updates))
    ]
    return treedef.unflatten(steps), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)
