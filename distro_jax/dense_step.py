"""Refusing a silent dense step: warnings when more than the message crosses the workers.

DisTrO's promise is that only the compressed message leaves a worker. Three
mistakes break it without an error of their own, and each is caught here:

- **``axis_name=None`` in a ``jax.jit`` step over several devices.** Under
  GSPMD, the gradient of a batch sharded over the devices is all-reduced (or,
  with FSDP-sharded params, reduce-scattered) in full before the optimizer
  sees it, and the optimizer then runs as one worker: a dense data-parallel
  step that exchanges no message at all.
- **The gradient of replicated params inside ``jax.shard_map``.** Autodiff's
  transpose of replication is a ``psum``, so ``jax.grad`` with respect to the
  params all-reduces the whole gradient before DisTrO compresses it.
- **Per-worker state placed replicated in a ``jax.jit`` step** (see
  :func:`distro_jax.per_worker`): every device holds every worker's state,
  and the step's output sharding all-gathers each worker's new state across
  the workers' links.

Under ``jax.jit`` the shardings are known only once XLA has propagated them,
so the checks read them with ``jax.debug.inspect_array_sharding``, whose
callback runs at compile time; the warning is then issued once per compiled
step. Outside ``jit`` the arrays' own shardings are read at once. The
callback lives in the compiled step, which XLA's persistent compilation cache
then cannot serve (a step over one device holds none); trace a step under
:func:`quiet` to leave the checks out.
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

_FIX = (
  "For DisTrO between the workers of a jax.jit step, take per-worker gradients with "
  "dj.worker_value_and_grad(loss, mesh, axis_name) and wrap the optimizer, built with that "
  "axis_name, in dj.per_worker(tx, mesh, axis_name) (docs/porting.md); inside jax.shard_map, "
  "pass axis_name and take gradients with dj.local_value_and_grad."
)


class DenseStepWarning(UserWarning):
  """A train step moves more than DisTrO's message across the workers.

  Raised for the uses that would all-reduce the whole gradient, or all-gather
  per-worker state, while the optimizer runs as if it exchanged only its
  message. Make it an error with
  ``warnings.simplefilter("error", dj.DenseStepWarning)``.
  """


@contextlib.contextmanager
def quiet() -> Iterator[None]:
  """Traces made while it is open hold none of these checks.

  For a step whose placement is known good and that should come from XLA's
  persistent compilation cache, and for traces that only read types:
  :func:`distro_jax.worker_state_specs` traces updates with state typed as
  shared on purpose (the start of its search), which would look like an
  all-reduced gradient to :func:`warn_if_dense`.

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


def _manual_axes() -> frozenset[Hashable]:
  """The mesh axes an enclosing ``jax.shard_map`` makes manual here (none outside one)."""
  return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def _when_placed(arrays: Sequence[Any], decide: Callable[[list[Any]], None]) -> None:
  """Calls ``decide`` with the shardings of ``arrays``, once all of them are known.

  Concrete arrays carry theirs; a traced one's is known only at compile
  time, when ``jax.debug.inspect_array_sharding`` calls back with the
  sharding XLA propagated to it. A traced step is compiled again for other
  input shardings without being traced again, so the callbacks come once per
  compile, and ``decide`` runs once per compile.
  """
  traced = [i for i, x in enumerate(arrays) if isinstance(x, jax.core.Tracer)]
  # A host value is on no device yet: None.
  known = {
    i: x.sharding if isinstance(x, jax.Array) and i not in traced else None
    for i, x in enumerate(arrays)
  }
  compiled: dict[int, Any] = {}

  def record(i: int, sharding: Any) -> None:
    compiled[i] = sharding
    if len(compiled) == len(traced):
      decide([compiled.get(j, known[j]) for j in range(len(arrays))])
      compiled.clear()

  if not traced:
    decide([known[j] for j in range(len(arrays))])
  for i in traced:
    jax.debug.inspect_array_sharding(arrays[i], callback=lambda s, i=i: record(i, s))


def _tree_bytes(arrays: Sequence[Any]) -> int:
  return sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in arrays)


def warn_if_dense(grads: Sequence[Any], axis_name: Hashable | None) -> None:
  """Warns if the gradients reaching a DisTrO update were all-reduced in full.

  Called by the update of :func:`distro_jax.scale_by_demo` with the leaves of
  its gradient. Two cases warn:

  - ``axis_name=None`` outside ``jax.shard_map``, in a step that spans more
    than one device. If every gradient leaf is replicated, each device holds
    the whole gradient, so XLA all-reduced it; if the gradient is partitioned
    over the devices (FSDP), XLA reduce-scattered it across devices holding
    different rows. Either way the step is dense data parallelism. The
    sharding alone cannot tell FSDP from tensor parallelism over the same
    rows, so one worker spread over several devices warns too; trace such a
    step under :func:`quiet`. A single-device step does not warn.
  - ``axis_name`` bound by ``jax.shard_map``, where every gradient leaf is
    typed as identical on all workers: autodiff all-reduced it.

  Args:
    grads: the gradient's leaves, as the update receives them.
    axis_name: the transformation's ``axis_name``.

  Example:
    >>> import jax.numpy as jnp, distro_jax as dj
    >>> dj.dense_step.warn_if_dense([jnp.ones(3)], None)  # one device: nothing to say
  """
  grads = list(grads)
  if not grads or _QUIET.get():
    return
  manual = _manual_axes()
  if axis_name is None:
    if manual:
      return  # one device's own worker inside shard_map: nothing crosses
    nbytes = _tree_bytes(grads)

    def decide(shardings: list[Any]) -> None:
      placed = [s for s in shardings if s is not None]
      devices = max((len(s.device_set) for s in placed), default=1)
      if devices < 2:
        return
      # A gradient partitioned over the devices (FSDP, nanodo's default) was
      # reduce-scattered across devices holding different rows: as dense as an
      # all-reduce, so it warns too.
      if len(placed) == len(shardings) and all(s.is_fully_replicated for s in placed):
        how = f"each holding the whole gradient ({nbytes:,} bytes): XLA all-reduced it"
      else:
        how = (
          f"with the gradient ({nbytes:,} bytes) partitioned over them, as FSDP does: XLA "
          "reduce-scattered it across devices that hold different rows"
        )
      warnings.warn(
        f"A DisTrO update with axis_name=None runs in a step over {devices} devices, {how}, "
        "a dense data-parallel step in which no compressed message is exchanged. "
        f"{_FIX} If one worker spread over these devices is what you mean (one site's "
        "FSDP, or tensor parallelism over the same rows), trace the step under "
        "dj.dense_step.quiet(), or silence this with "
        "warnings.filterwarnings('ignore', category=dj.DenseStepWarning).",
        DenseStepWarning,
        stacklevel=2,
      )

    _when_placed(grads, decide)
  elif axis_name in manual and not any(exchange.varies_over(g, axis_name) for g in grads):
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
  """Warns if per-worker state, stacked on a leading axis, is not split over the workers.

  Args:
    stacked: per-worker leaves of shape ``(num_workers, ...)`` entering a step.
    axis_name: the workers' mesh axis.
    num_workers: its size.
  """
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
