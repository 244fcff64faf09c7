"""What crosses the workers' axis: the message's all-gather, and nothing autodiff adds."""

import contextlib
import contextvars
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = [
  "COLLECTIVES",
  "all_gather_messages",
  "bound_axis_size",
  "local_value_and_grad",
  "pmean_gradients",
  "worker_local",
]


def bound_axis_size(axis_name: Hashable | None) -> int:
  """Size of the mapped axis ``axis_name`` (1 for ``None``); a ValueError if it is not bound."""
  if axis_name is None:
    return 1
  try:
    return jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
      f"axis_name={axis_name!r} is not bound here. Call the update inside "
      f"jax.shard_map over a mesh with an axis named {axis_name!r} (for example "
      f"jax.make_mesh((n,), ({axis_name!r},))); in a jax.jit step without "
      f"shard_map, wrap the optimizer in dj.per_worker(tx, mesh, {axis_name!r}) and "
      "take per-worker gradients with dj.worker_value_and_grad (docs/porting.md). "
      "axis_name=None is a single worker with no collective: over several devices, "
      "XLA would all-reduce the whole gradient instead."
    ) from e


COLLECTIVES = ("all_gather", "all_to_all")


def all_gather_messages(
  message: jax.Array, axis_name: Hashable | None, collective: str = "all_gather"
) -> jax.Array:
  """Gathers each worker's ``uint8[N]`` message into ``uint8[W, N]``, in worker order.

  ``"all_gather"`` is typed as the same on every worker. ``"all_to_all"``
  sends this worker's message straight to every peer, one dependent hop where
  a ring all-gather (gloo's, on CPU) takes ``W - 1``, for the same bytes on
  each link; its result is typed as differing by worker, so it needs a
  ``jax.shard_map`` built with ``check_vma=False``.
  """
  check_collective(collective)
  if axis_name is None:
    return message[None]
  if collective == "all_gather" or _TYPES_ONLY.get():
    return jax.lax.all_gather(message, axis_name, to="invarying")
  _check_direct(axis_name)
  num_workers = jax.lax.axis_size(axis_name)
  copies_WxN = jnp.broadcast_to(message[None], (num_workers, *message.shape))
  return jax.lax.all_to_all(copies_WxN, axis_name, 0, 0, tiled=True)


_TYPES_ONLY = contextvars.ContextVar("distro_jax_types_only", default=False)


@contextlib.contextmanager
def types_only() -> Iterator[None]:
  """Traces every exchange as the ring all-gather: for traces read only for their types.

  :func:`distro_jax.worker_state_specs` reads which state differs by worker
  from ``shard_map``'s types, which an all-to-all exchange runs without; the
  ring gives the same values the types describe.
  """
  token = _TYPES_ONLY.set(True)
  try:
    yield
  finally:
    _TYPES_ONLY.reset(token)


def check_collective(collective: str) -> str:
  """``collective`` if it is one of :data:`COLLECTIVES`, else a ValueError naming them."""
  if collective not in COLLECTIVES:
    raise ValueError(f"collective={collective!r} is not one of {COLLECTIVES}.")
  return collective


def types_checked(axis_name: Hashable) -> bool:
  """Whether the enclosing ``shard_map`` types values by worker (``check_vma=True``)."""
  return varies_over(jax.lax.axis_index(axis_name), axis_name)


def _check_direct(axis_name: Hashable) -> None:
  if types_checked(axis_name):
    raise ValueError(
      "collective='all_to_all' returns every worker's message typed as differing by worker "
      "(JAX has no cast to 'the same on all'), which a shard_map that checks replication "
      "cannot return as replicated. Build the step with jax.shard_map(..., check_vma=False), "
      "or use collective='all_gather'."
    )
  mesh = jax.sharding.get_abstract_mesh()
  others = [a for a in mesh.manual_axes if a != axis_name and mesh.shape[a] > 1]
  if others:
    raise ValueError(
      f"collective='all_to_all' runs without shard_map's types, which say how a worker is "
      f"split over the other axes {others} (FSDP); use collective='all_gather' there."
    )


def pmean_gradients(axis_name: Hashable | None = "data") -> optax.GradientTransformation:
  """The all-reduce baseline as a transformation: average gradients over ``axis_name``.

  ``optax.chain(dj.pmean_gradients("data"), optax.adamw(lr))`` takes the same
  local gradients as :func:`distro_jax.demo`, so the two swap in one train step.

  Args:
    axis_name: the data-parallel axis of ``jax.shard_map``; ``None``: the identity.

  Returns:
    A stateless ``optax.GradientTransformation``.

  Example:
    >>> import jax.numpy as jnp, optax, distro_jax as dj
    >>> tx = optax.chain(dj.pmean_gradients(None), optax.adamw(1e-3))
    >>> state = tx.init({"w": jnp.ones(3)})
  """

  def update_fn(updates, state, params=None):
    del params
    bound_axis_size(axis_name)
    if axis_name is None:
      return updates, state
    return jax.lax.pmean(updates, axis_name), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def worker_local(tree: Any, axis_name: Hashable | None = "data") -> Any:
  """Marks a replicated tree (the params) as varying over ``axis_name``.

  Inside ``jax.shard_map`` autodiff all-reduces the gradient of a replicated
  value (the transpose of replication is a psum); the gradient with respect
  to ``worker_local(params)`` is each worker's own, with no collective.
  """
  if axis_name is None:
    return tree
  return jax.tree.map(lambda x: as_varying(x, (axis_name,)), tree)


def varying_axes(x: jax.Array) -> frozenset[Hashable]:
  """The mesh axes across which ``x`` is typed as differing inside ``shard_map``."""
  aval = jax.typeof(x)
  # JAX 0.10 keeps the varying axes on ``manual_axis_type``; earlier ones on ``vma``.
  vma = aval.manual_axis_type.varying if hasattr(aval, "manual_axis_type") else aval.vma
  return frozenset(vma)


def as_varying(x: jax.Array, axes: Iterable[Hashable]) -> jax.Array:
  """``x`` typed as varying over ``axes`` too, inside ``shard_map`` (no value changes)."""
  missing = tuple(sorted(frozenset(axes) - varying_axes(x), key=str))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def varies_over(x: jax.Array, axis_name: Hashable) -> bool:
  """Whether ``x`` is typed as differing across ``axis_name`` inside ``shard_map``."""
  return axis_name in varying_axes(x)


def is_shared(x: jax.Array, axis_name: Hashable | None) -> bool:
  """Whether ``x`` is typed as the same on every worker of ``axis_name`` (never for ``None``)."""
  return axis_name is not None and not varies_over(x, axis_name)


def all_finite(arrays: list[jax.Array]) -> jax.Array:
  """Whether every entry of every array is finite, as one bool (``True`` for none)."""
  if not arrays:
    return jnp.asarray(True)
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in arrays]))


def local_value_and_grad(
  fun: Callable[..., Any], axis_name: Hashable | None = "data", **kwargs: Any
) -> Callable[..., Any]:
  """``jax.value_and_grad(fun)`` for one worker: its own loss and gradient.

  Use it inside ``jax.shard_map`` in place of ``jax.value_and_grad``, which
  would all-reduce the gradient (:func:`worker_local`).

  Args:
    fun: ``fun(params, *args)``; differentiated with respect to ``params``.
    axis_name: the data-parallel axis.
    **kwargs: passed to ``jax.value_and_grad`` (e.g. ``has_aux=True``).

  Returns:
    A function with the signature of ``fun`` returning ``(value, grads)``.
  """
  value_and_grad = jax.value_and_grad(fun, **kwargs)

  def wrapped(params, *args, **kw):
    return value_and_grad(worker_local(params, axis_name), *args, **kw)

  return wrapped
