"""Where a worker takes its gradient: the overlapped exchange's lookahead, and local steps.

With ``delayed_apply``, step t's gradient, taken at the params as they are,
misses the update still in flight, and a sign-momentum method run one step
late oscillates. Psyche's correction, :func:`gradient_point`, takes the
gradient where the params will be once that update lands, as the worker
guesses it from its optimizer state alone, so the all-gather still depends on
nothing computed from this step's gradient (docs/design.md, section 4).
"""

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from distro_jax import codec, dct, decode, exchange, message, unit_rms, wire
from distro_jax.compression import Compression, takes_compression
from distro_jax.diloco import inner_params
from distro_jax.transforms import DemoState, delayed_states

__all__ = ["gradient_point", "lookahead_update"]


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _selected(momentum: Any, params: Any) -> Any:
  """``params`` with ``optax.MaskedNode`` where ``momentum`` (masked or partial) has one."""
  return jax.tree.map(lambda m, p: m if _is_masked(m) else p, momentum, params, is_leaf=_is_masked)


@takes_compression
def lookahead_update(
  state: DemoState,
  params: Any,
  learning_rate: optax.ScalarOrSchedule,
  *,
  weight_decay: float = 0.0,
  normalize: Any = "sign",
  guess: str = "momentum",
  scale: float = 1.0,
  axis_name: Hashable | None = None,
  **compression: Any,
) -> Any:
  """This worker's guess of the update in flight, from a ``delayed_apply`` :class:`DemoState`.

  Args:
    state: the :class:`~distro_jax.DemoState` of a ``delayed_apply=True``
      :func:`distro_jax.demo`, as the train step receives it.
    params: the params, as the train step holds them.
    learning_rate: the ``learning_rate`` given to :func:`distro_jax.demo`.
    weight_decay: as given to :func:`distro_jax.demo`.
    normalize: as given to :func:`distro_jax.demo`, or another mode for a
      cheaper guess (``"rms"`` skips the orthogonalization).
    guess: ``"momentum"`` (Psyche's: the momentum before error feedback) or
      ``"message"`` (this worker's own message, as sent; not with
      ``random_positions``).
    scale: a factor on the whole guess.
    axis_name: the workers' axis, as given to :func:`distro_jax.demo`;
      needed only under FSDP within a site.
    **compression: the :class:`~distro_jax.Compression` options given to
      :func:`distro_jax.demo` (its decay and frequency bias play no part).

  Returns:
    A tree like ``params``: zero before the first message (or after one
    marked invalid), else ``-scale * lr_prev * (step(IDCT(c)) + wd * p)``,
    ``step`` the ``normalize`` mode's and ``c`` the momentum of the previous
    step before error feedback, or with ``guess="message"`` this worker's
    pending message decoded as every receiver decodes it.
  """
  unit_rms.check_normalize(normalize)
  c = Compression.of(compression).checked()
  if guess not in ("momentum", "message"):
    raise ValueError(f"guess={guess!r}; use guess='momentum' or guess='message'.")
  if c.random_positions and guess == "message":
    raise ValueError(
      'guess="message" decodes the pending message at its sent positions, which '
      'random_positions=True does not keep; use the default guess="momentum".'
    )
  all_leaves, treedef = jax.tree.flatten(params)
  all_momenta = treedef.flatten_up_to(state.momentum)
  # A zero-size param has no part in the message, and no guess to move it by.
  carried = wire.CarriedLeaves(all_leaves)
  leaves = carried.pick(all_leaves)
  layout = c.layout(leaves)
  if state.pending.shape != (layout.num_bytes,):
    raise ValueError(
      f"The pending message holds {state.pending.shape[-1]} bytes, but these options give "
      f"{layout.num_bytes}; pass gradient_point the compression options of the dj.demo "
      "that made the state."
    )
  plans = wire.plan_tree(leaves, c.compression_chunk)
  basis = c.basis
  momenta = [dct.to_blocks(m, plan) for m, plan in zip(carried.pick(all_momenta), plans)]
  if guess == "message":
    tensors, valid = codec.decode_message(state.pending[None], layout)
    received = message.Received(tensors, valid)
    q_blocks = decode.aggregate(received, momenta, plans, basis, axis_name=None)
    valid = valid[0]
  else:
    q_blocks = [basis.inverse(m, plan) for m, plan in zip(momenta, plans)]
    valid = codec.message_valid(state.pending, layout)
  # The update in flight is applied with the rate of the step that made it.
  lr = learning_rate(jnp.maximum(state.count - 1, 0)) if callable(learning_rate) else learning_rate
  step = jnp.where(valid, scale * jnp.asarray(lr, jnp.float32), 0.0)
  out = []
  modes = carried.pick(unit_rms.normalize_modes(normalize, params))
  for q_block, plan, x, mode in zip(q_blocks, plans, leaves, modes):
    q = dct.from_blocks(q_block, plan)
    # With axis_name, the param's other axes hold other blocks of it (FSDP). The
    # param's typing decides, not q's, which the message types as differing
    # across a site's devices even where the param is whole on each.
    blocks = () if axis_name is None else exchange.varying_axes(x) - {axis_name}
    direction = unit_rms.normalized_step(q, mode, blocks).astype(x.dtype)
    if weight_decay:
      direction = direction + weight_decay * x
    delta = (-step * direction).astype(x.dtype)
    if axis_name is not None:
      # A param kept whole across a site has the same guess on each device;
      # typed as the param is (a max over equal values changes none), its
      # gradient is taken as of a whole param.
      site = exchange.varying_axes(delta) - exchange.varying_axes(x) - {axis_name}
      if site:
        delta = jax.lax.pmax(delta, tuple(sorted(site, key=str)))
    out.append(delta)
  return treedef.unflatten(carried.with_empty(out, all_leaves, jnp.zeros_like))


def gradient_point(
  opt_state: Any,
  params: Any,
  learning_rate: optax.ScalarOrSchedule | None = None,
  **lookahead: Any,
) -> Any:
  """The params at which this worker should take its gradient.

  * A ``delayed_apply`` :func:`distro_jax.demo` state: the params moved by
    :func:`lookahead_update` (the guess of the update in flight). With
    ``synchronous`` (a partial overlap), or under ``optax.masked``, only the
    params that the overlapped exchange covers move.
  * A :func:`distro_jax.diloco` or :func:`distro_jax.sparseloco` state: the
    worker's inner params (:func:`distro_jax.inner_params`).
  * Anything else: ``params`` itself.

  Compute the loss and gradient at this point, then pass the gradient to
  ``tx.update(grads, opt_state, params)`` with the params themselves: the
  lookahead is never applied, only looked from.

  Args:
    opt_state: this worker's optimizer state.
    params: the params, as the train step holds them.
    learning_rate: the ``learning_rate`` given to :func:`distro_jax.demo`;
      needed for a ``delayed_apply`` state only (DiLoCo's, SparseLoCo's and
      any other state take none).
    **lookahead: the keyword options of :func:`lookahead_update` (the
      compression options of the :func:`distro_jax.demo` that made the state).

  Returns:
    A tree like ``params``.

  Raises:
    ValueError: a ``delayed_apply`` state and no ``learning_rate``, which
      would leave the lookahead out without a word.

  Example:
    >>> import jax.numpy as jnp, optax, distro_jax as dj
    >>> opts = dict(compression_topk=8)
    >>> tx = dj.demo(1e-2, delayed_apply=True, axis_name=None, **opts)
    >>> params = {"w": jnp.zeros((16, 16))}
    >>> state = tx.init(params)
    >>> for _ in range(2):
    ...   at = dj.gradient_point(state, params, 1e-2, **opts)
    ...   grads = {"w": at["w"] - 1.0}  # in training: the gradient of the loss at ``at``
    ...   updates, state = tx.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> moved = dj.gradient_point(state, params, 1e-2, **opts)["w"] - params["w"]
    >>> bool(jnp.allclose(jnp.abs(moved), 1e-2))  # every entry, by the rate: a sign step
    True
  """
  states = delayed_states(opt_state)
  if not states:
    return inner_params(opt_state, params)
  if learning_rate is None:
    raise ValueError(
      "gradient_point needs learning_rate for a delayed_apply DemoState: the lookahead "
      "moves the params by the update in flight, at the rate that made it. Pass the "
      "learning_rate (or schedule) given to dj.demo, e.g. "
      "dj.gradient_point(opt_state, params, 1e-3, **compression_options)."
    )
  point = params
  for demo_state in states:
    delta = lookahead_update(
      demo_state, _selected(demo_state.momentum, params), learning_rate, **lookahead
    )
    point = jax.tree.map(
      lambda d, p: p if _is_masked(d) else optax.apply_updates(p, d),
      delta,
      point,
      is_leaf=_is_masked,
    )
  return point
