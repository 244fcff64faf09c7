"""Warnings when a step moves more than the message across the workers (docs/porting.md).

Under ``jax.jit`` the checks run once per compile and keep the step out of
XLA's persistent compilation cache; :func:`quiet` leaves them out.
"""

import contextlib
import contextvars
import math
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from distro_jax import exchange

__all__ = ["DenseStepWarning", "quiet", "warn_if_dense", "warn_if_replicated_per_worker"]

_QUIET = contextvars.ContextVar("distro_jax_dense_step_quiet", default=False)


class DenseStepWarning(UserWarning):
  """A train step all-reduces the whole gradient, or all-gathers per-worker state.

  Make it an error with ``warnings.simplefilter("error", dj.DenseStepWarning)``.
  """


@contextlib.contextmanager
def quiet() -> Iterator[None]:
  """Traces made while it is open hold none of these checks.

  For a step whose placement is known good, and for traces that only read
  types (:func:`distro_jax.worker_state_specs`).

  Example:
    >>> import jax, jax.numpy as jnp, distro_jax as dj
    >>> tx = dj.demo(0.1, axis_name=None)
    >>> params = {"w": jnp.ones((8, 8))}
    >>> with dj.dense_step.quiet():
    ...   step = jax.jit(tx.update).lower(params, tx.init(params), params)
  """
  token = _QUIET.set(True)
  try:
    yield
  finally:
    _QUIET.reset(token)


def _when_placed(arrays: Sequence[Any], decide: Callable[[list[Any]], None]) -> None:
  """Calls ``decide`` with the shardings of ``arrays`` (``None`` for a host value), once known.

  A traced array's sharding is known only when XLA compiles the step
  (``jax.debug.inspect_array_sharding``), so ``decide`` runs once per compile.
  """
  traced = [i for i, x in enumerate(arrays) if isinstance(x, jax.core.Tracer)]
  known = [
    x.sharding if isinstance(x, jax.Array) and i not in traced else None
    for i, x in enumerate(arrays)
  ]
  compiled: dict[int, Any] = {}

  def record(i: int, sharding: Any) -> None:
    compiled[i] = sharding
    if len(compiled) == len(traced):
      decide([compiled.get(j, s) for j, s in enumerate(known)])
      compiled.clear()

  if not traced:
    decide(known)
  for i in traced:
    jax.debug.inspect_array_sharding(arrays[i], callback=lambda s, i=i: record(i, s))


def _tree_bytes(arrays: Sequence[Any]) -> int:
  return sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in arrays)


def warn_if_dense(grads: Sequence[Any], axis_name: Hashable | None) -> None:
  """Warns if the gradients reaching a DisTrO update were all-reduced in full.

  It warns for ``axis_name=None`` in a step over several devices (replicated
  or FSDP-partitioned gradients alike), and inside ``jax.shard_map`` for a
  gradient typed as identical on every worker of ``axis_name``.

  Args:
    grads: the gradient's leaves.
    axis_name: the transformation's ``axis_name``.

  Example:
    >>> import jax.numpy as jnp, distro_jax as dj
    >>> dj.dense_step.warn_if_dense([jnp.ones(3)], None)  # one device: nothing to say
  """
  grads = list(grads)
  if not grads or _QUIET.get():
    return
  manual = frozenset(jax.sharding.get_abstract_mesh().manual_axes)  # shard_map's axes
  if axis_name is None:
    if manual:
      return  # one device's own worker inside shard_map: nothing crosses
    nbytes = _tree_bytes(grads)

    def decide(shardings: list[Any]) -> None:
      placed = [s for s in shardings if s is not None]
      devices = max((len(s.device_set) for s in placed), default=1)
      if devices < 2:
        return
      # A partitioned gradient (FSDP) was reduce-scattered: as dense as an all-reduce.
      if len(placed) == len(shardings) and all(s.is_fully_replicated for s in placed):
        how = f"each holding the whole gradient ({nbytes:,} bytes): XLA all-reduced it"
      else:
        how = (
          f"with the gradient ({nbytes:,} bytes) partitioned over them, as FSDP does: XLA "
          "reduce-scattered it across devices that hold different rows"
        )
      warnings.warn(
        f"A DisTrO update with axis_name=None runs in a step over {devices} devices, {how}, "
        "a dense data-parallel step in which no compressed message is exchanged. For DisTrO "
        "between the workers of a jax.jit step, take per-worker gradients with "
        "dj.worker_value_and_grad(loss, mesh, axis_name) and wrap the optimizer, built with that "
        "axis_name, in dj.per_worker(tx, mesh, axis_name) (docs/porting.md); inside "
        "jax.shard_map, pass axis_name and take gradients with dj.local_value_and_grad. For one "
        "worker spread over these devices (a site's FSDP, or tensor parallelism), trace the step "
        "under dj.dense_step.quiet(), or filter out dj.DenseStepWarning.",
        DenseStepWarning,
        stacklevel=2,
      )

    _when_placed(grads, decide)
  elif (
    axis_name in manual
    and exchange.types_checked(axis_name)  # check_vma=False types nothing by worker
    and not any(exchange.varies_over(g, axis_name) for g in grads)
  ):
    warnings.warn(
      f"The gradient reaching this DisTrO update is typed as identical on every worker of "
      f"{axis_name!r}: jax.grad with respect to params replicated over {axis_name!r} "
      f"all-reduces the whole gradient ({_tree_bytes(grads):,} bytes) before the exchange. "
      f"Take each worker's own gradient with dj.local_value_and_grad(loss, {axis_name!r}).",
      DenseStepWarning,
      stacklevel=2,
    )


def warn_if_replicated_per_worker(
  stacked: Sequence[Any], axis_name: Hashable, num_workers: int
) -> None:
  """Warns if per-worker leaves ``(num_workers, ...)`` are not split over ``axis_name``."""
  stacked = list(stacked)
  if not stacked or num_workers < 2 or _QUIET.get():
    return
  nbytes = _tree_bytes(stacked)

  def decide(shardings: list[Any]) -> None:
    whole = [
      x
      for x, s in zip(stacked, shardings)
      if s is not None and s.shard_shape(np.shape(x))[0] == num_workers
    ]
    if whole:
      warnings.warn(
        f"{len(whole)} of the {len(stacked)} per-worker optimizer state leaves enter this step "
        f"replicated over {axis_name!r}: every device holds all {num_workers} workers' state "
        f"({nbytes:,} bytes), and an output sharding like it all-gathers each worker's new "
        "state across the workers' links every step. Give the state the shardings its boxes "
        "name: flax.linen.get_sharding(jax.eval_shape(tx.init, params), mesh), or "
        f"NamedSharding(mesh, P({axis_name!r})) for each per-worker leaf (docs/porting.md).",
        DenseStepWarning,
        stacklevel=2,
      )

  _when_placed(stacked, decide)
