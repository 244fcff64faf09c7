"""The overlapped exchange's all-gather as a program of its own (docs/overlapped.md)."""

from collections.abc import Hashable
from typing import Any

import jax

from distro_jax import exchange
from distro_jax.transforms import delayed_states

__all__ = ["gather_pending"]


def gather_pending(
  opt_state: Any, axis_name: Hashable | None = "data", collective: str = "all_gather"
) -> jax.Array:
  """All-gathers the message in flight of a ``delayed_apply`` exchange.

  For runtimes that run one program at a time (XLA on CPU). Call it inside
  ``jax.shard_map``, as a program launched before the gradient's, and pass
  the result to ``tx.update(..., gathered=...)``, which then decodes it
  instead of all-gathering, to the same bits.

  Args:
    opt_state: a worker's optimizer state holding exactly one ``delayed_apply``
      :class:`~distro_jax.DemoState`, at any depth.
    axis_name: the workers' mapped axis; ``None`` for one worker.
    collective: ``"all_gather"`` or ``"all_to_all"``
      (:func:`distro_jax.exchange.all_gather_messages`); the exchange's own.

  Returns:
    ``uint8[W, message bytes]``: every worker's pending message, in worker order.

  Raises:
    ValueError: ``opt_state`` holds no ``delayed_apply`` exchange, or several.

  Example:
    >>> import jax, jax.numpy as jnp, distro_jax as dj
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> tx = dj.demo(0.1, delayed_apply=True)
    >>> params = {"w": jnp.ones((8, 8))}
    >>> state = dj.init_worker_state(tx, params, mesh)
    >>> specs = dj.worker_state_specs(tx, params, mesh)
    >>> exchange = jax.jit(jax.shard_map(
    ...     dj.gather_pending, mesh=mesh, in_specs=(specs,), out_specs=P()))
    >>> exchange(state).shape  # 1 worker x the message's bytes
    (1, 152)
  """
  states = delayed_states(opt_state)
  if len(states) != 1:
    raise ValueError(
      f"gather_pending needs an optimizer state with exactly one delayed_apply DeMo exchange, "
      f"and this one has {len(states)}. Build the optimizer with delayed_apply=True (e.g. "
      "dj.demo(lr, delayed_apply=True)); with several overlapped exchanges, let each update "
      "all-gather its own message (leave gathered out)."
    )
  return exchange.all_gather_messages(states[0].pending, axis_name, collective)
