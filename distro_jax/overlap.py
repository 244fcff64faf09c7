"""The overlapped exchange as a program of its own, for runtimes that run one program at a time.

With ``delayed_apply`` the all-gather of step t reads only the optimizer
state, so nothing in it waits on step t's forward and backward pass. Whether
the two then run together is the runtime's choice. XLA's CPU runtime, as
measured here with gloo between processes, blocks the thread that reaches a
collective until the transfer ends (the Python thread that dispatched its
program, too), and in a fused train step the forward and backward pass
waited for it (docs/overlapped.md). Launched as its own program from a
thread of its own, the all-gather runs while the gradient's program computes.

:func:`gather_pending` is that program's body. Its result goes back into the
update as ``tx.update(grads, opt_state, params, gathered=...)``, which then
decodes it instead of all-gathering; the arithmetic is the same, so the
result is the same to the bit (``tests/test_overlap.py``).
"""

from collections.abc import Hashable
from typing import Any

import jax

from distro_jax import exchange
from distro_jax.transforms import delayed_states

__all__ = ["gather_pending"]


def gather_pending(opt_state: Any, axis_name: Hashable | None = "data") -> jax.Array:
  """All-gathers the message in flight of a ``delayed_apply`` exchange.

  Call it inside ``jax.shard_map`` (a program of its own, launched before the
  gradient's), and pass the result to the update as ``gathered=``. It reads
  only ``DemoState.pending``, so it can start before the step's batch exists.

  Args:
    opt_state: a worker's optimizer state holding exactly one ``delayed_apply``
      :class:`~distro_jax.DemoState` (at any depth: ``optax.chain``,
      ``optax.multi_transform`` with a synchronous group, ...).
    axis_name: the workers' mapped axis; ``None`` for one worker, with no
      collective.

  Returns:
    ``uint8[W, message bytes]``, every worker's pending message in the order
    of their indices on ``axis_name``, the same on every worker.

  Raises:
    ValueError: if ``opt_state`` holds no ``delayed_apply`` exchange, or
      more than one.

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
  return exchange.all_gather_messages(states[0].pending, axis_name)
