"""Muon's momentum as a stage of its own, for the aggregate every worker decodes."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["MuonMomentumState", "scale_by_muon_momentum"]


class MuonMomentumState(NamedTuple):
  """State of :func:`scale_by_muon_momentum`.

  Attributes:
    count: updates made, int32 scalar.
    mu: the moving average of the inputs, float32, shaped like them.
  """

  count: jax.Array
  mu: Any


def scale_by_muon_momentum(decay: float = 0.95) -> optax.GradientTransformation:
  """Nesterov momentum in the form ``optax.contrib.muon`` steps with, bias corrected.

  ``mu <- decay * mu + (1 - decay) * g``; the output at update ``t`` (from 1)
  is ``decay * mu / (1 - decay**(t+1)) + (1 - decay) * g / (1 - decay**t)``,
  what Muon orthogonalizes. Chained after the exchange, its state is the same
  on every worker.

  Args:
    decay: the moving average's decay, in ``[0, 1)``.

  Returns:
    An ``optax.GradientTransformation`` whose state is a :class:`MuonMomentumState`.

  References:
    Jordan et al., "Muon: An optimizer for hidden layers in neural networks",
    2024, https://kellerjordan.github.io/posts/muon/.

  Example:
    >>> import jax.numpy as jnp, distro_jax as dj
    >>> tx = dj.scale_by_muon_momentum(0.5)
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> out, state = tx.update({"w": jnp.ones(2)}, state)
    >>> print(out["w"], state.mu["w"])
    [1.3333334 1.3333334] [0.5 0.5]
  """

  def init_fn(params: Any) -> MuonMomentumState:
    # zeros_like keeps each param's sharding (an explicit mesh would refuse to
    # mix a replicated buffer with a sharded update).
    mu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=jnp.float32), params)
    return MuonMomentumState(count=jnp.zeros([], jnp.int32), mu=mu)

  def update_fn(updates: Any, state: MuonMomentumState, params: Any = None) -> tuple:
    del params
    count = state.count + 1
    mu = jax.tree.map(lambda m, g: decay * m + (1 - decay) * g, state.mu, updates)
    t = count.astype(jnp.float32)
    now, ahead = 1 - decay**t, 1 - decay ** (t + 1)
    out = jax.tree.map(
      lambda m, g: (decay * m / ahead + (1 - decay) * g / now).astype(g.dtype), mu, updates
    )
    return out, MuonMomentumState(count=count, mu=mu)

  return optax.GradientTransformation(init_fn, update_fn)
