"""The pure steps of a run, each one device's view inside ``jax.shard_map``.

The mesh is ``("replica", "fsdp")`` (``experiments.run.launch``): a replica is
a site of ``fsdp`` devices sharing one data-parallel worker's work. The
params arrive as this device's shards (whole params when ``fsdp`` is 1),
laid out by ``param_specs``. Only the optimizer's exchange crosses
``"replica"``; the gradient's reduce-scatter and the params' all-gather stay
within a site.

:func:`shard_step` wraps any of them for a mesh, once, with ``jax.jit``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import distro_jax as dj
from distro_jax.exchange import varying_axes
from distro_jax.transforms import delayed_states, is_delayed_state
from experiments.run import model as model_lib
from experiments.run.launch import FSDP, MESH_AXES, REPLICA

# Where a worker takes its gradient, from its optimizer state and the params.
GradientPoint = Callable[[Any, Any], Any]

__all__ = [
  "GradientPoint",
  "apply_step",
  "compressed_part",
  "eval_step",
  "exchange_step",
  "gradient_and_message",
  "gradient_step",
  "replica_mismatches",
  "rows_spec",
  "shard_step",
  "train_step",
  "with_compressed_part",
]


def rows_spec(fsdp: int) -> P:
  """How a global batch's rows are split: over every device of the mesh.

  With one device per site the rows are typed as split over ``"replica"``
  alone: the ``"fsdp"`` axis has size 1, and a batch typed as varying over
  it would make autodiff sum the gradient over it, a no-op all-reduce of the
  whole gradient in the compiled step.
  """
  return P(MESH_AXES) if fsdp > 1 else P(REPLICA)


def _mesh_order(axes: frozenset[str]) -> tuple[str, ...]:
  return tuple(a for a in MESH_AXES if a in axes)


def _loss(params, graphdef, inputs_BxL, targets_BxL):
  logits_BxLxV = nnx.merge(graphdef, params)(inputs_BxL)
  return model_lib.next_token_loss(logits_BxLxV, targets_BxL)


def _value_and_grad(params, opt_state, inputs_BxL, targets_BxL, graphdef, param_specs, point):
  """This device's loss and its site's gradient, taken where the optimizer says.

  ``point(opt_state, params)`` is the method's gradient point
  (``Method.gradient_point``): DiLoCo's inner params, the overlapped DeMo's
  lookahead, or the shared params themselves.
  """
  at = point(opt_state, params)
  grad_fn = dj.fsdp_value_and_grad(_loss, param_specs, replica_axis=REPLICA, fsdp_axis=FSDP)
  return grad_fn(at, graphdef, inputs_BxL, targets_BxL)


def _inject_fault(grads, step, fault):
  """NaN in one worker's gradient at one step, to exercise the failure path."""
  fault_step, fault_worker = fault
  hit = (step == fault_step) & (jax.lax.axis_index(REPLICA) == fault_worker)
  return jax.tree.map(lambda g: jnp.where(hit, jnp.nan, g), grads)


def train_step(
  params: Any,
  opt_state: Any,
  step: jax.Array,
  inputs_BxL: jax.Array,
  targets_BxL: jax.Array,
  *,
  graphdef: nnx.GraphDef,
  tx: optax.GradientTransformation,
  param_specs: Any,
  point: GradientPoint = dj.inner_params,
  fault: tuple[int, int] | None = None,
  cold_until: tuple[int, ...] | None = None,
) -> tuple[Any, Any, dict[str, jax.Array]]:
  """One device's step: its loss and gradient, then the optimizer's exchange.

  Args:
    params: this device's shards of the params, identical across replicas.
    opt_state: this device's optimizer state.
    step: the 1-based step number, an int32 scalar.
    inputs_BxL: this device's input tokens.
    targets_BxL: this device's next tokens.
    graphdef: the model's static structure.
    tx: the optimizer, exchanging over ``"replica"``.
    param_specs: the params' ``PartitionSpec`` tree over ``"fsdp"``.
    point: ``point(opt_state, params)``, where the gradient is taken.
    fault: ``(step, worker)`` whose gradient becomes NaN, or None.
    cold_until: per worker, the last step its DisTrO message is marked
      invalid (a worker that joined an elastic resume, in its cold start), or
      None. Passed to the optimizer as ``contribute``.

  Returns:
    ``(params, opt_state, metrics)``. ``metrics["loss"]`` is this device's
    loss with a leading axis of 1, so that every worker's own lies in one
    global array split over the devices as the batch is: the host averages
    it one step late (``records.logged_loss``), so no collective of the
    step's waits on it. ``metrics["excluded"]`` counts messages the
    optimizer left out this step (0 for one that leaves none out).
  """
  loss, grads = _value_and_grad(
    params, opt_state, inputs_BxL, targets_BxL, graphdef, param_specs, point
  )
  return _apply(params, opt_state, step, loss, grads, tx=tx, fault=fault, cold_until=cold_until)


def _optimizer_inputs(grads, step, fault, cold_until):
  """The gradient and the update's extra arguments, as every program of a step gives them."""
  if fault is not None:
    grads = _inject_fault(grads, step, fault)
  extra = {}
  if cold_until is not None:
    until = jnp.asarray(cold_until, jnp.int32)[jax.lax.axis_index(REPLICA)]
    extra["contribute"] = step > until
  return grads, extra


def _apply(params, opt_state, step, loss, grads, *, tx, fault, cold_until, gathered=None):
  """The optimizer's half of a step: its exchange, the update, and the step's metrics."""
  grads, extra = _optimizer_inputs(grads, step, fault, cold_until)
  if gathered is not None:
    extra["gathered"] = gathered
  updates, opt_state = tx.update(grads, opt_state, params, **extra)
  params = optax.apply_updates(params, updates)
  # Optimizers whose state counts no contributors count every worker; with two
  # exchanges (a partial overlap) a worker left out of either counts.
  workers = jax.lax.axis_size(REPLICA)
  counts = [c for _, c in optax.tree_utils.tree_get_all_with_path(opt_state, "contributors")]
  contributors = functools.reduce(jnp.minimum, counts, jnp.int32(workers))
  # The loss leaves unreduced: averaging it here was two all-reduces on the
  # step's path, each a ring of round trips on a far link (docs/netlab.md).
  return params, opt_state, {"loss": loss[None], "excluded": workers - contributors}


def compressed_part(opt_state: Any) -> list[tuple[Any, jax.Array]]:
  """The overlapped exchange's ``(momentum, pending)``: what compressing a gradient changes.

  With ``delayed_apply`` the update's two halves share nothing: compressing
  this step's gradient writes the momentum and the next message, and decoding
  the message in flight reads only what was gathered. Works on a state or on
  its ``PartitionSpec`` tree.
  """
  return [(s.momentum, s.pending) for s in delayed_states(opt_state)]


def with_compressed_part(opt_state: Any, part: list[tuple[Any, jax.Array]]) -> Any:
  """``opt_state`` with the overlapped exchange's momentum and message taken from ``part``."""
  parts = iter(part)

  def take(x):
    if is_delayed_state(x):
      momentum, pending = next(parts)
      return x._replace(momentum=momentum, pending=pending)
    return x

  return jax.tree.map(take, opt_state, is_leaf=is_delayed_state)


def exchange_step(message: jax.Array, *, collective: str = "all_gather") -> jax.Array:
  """An overlapped step's first program: the all-gather of a worker's message in flight.

  It reads only the message (the state's ``pending``, or the copy that
  :func:`gradient_and_message` returns), so it runs on a thread of its own
  (:mod:`experiments.run.threaded_step`) while the other two programs compute.
  """
  return dj.exchange.all_gather_messages(message, REPLICA, collective)


def gradient_and_message(
  params: Any,
  opt_state: Any,
  step: jax.Array,
  inputs_BxL: jax.Array,
  targets_BxL: jax.Array,
  *,
  graphdef: nnx.GraphDef,
  param_specs: Any,
  tx: optax.GradientTransformation,
  point: GradientPoint = dj.inner_params,
  fault: tuple[int, int] | None = None,
  cold_until: tuple[int, ...] | None = None,
) -> tuple[jax.Array, Any, list[tuple[Any, jax.Array]], jax.Array]:
  """An overlapped step's second program: the loss and gradient, then their compression.

  Nothing here crosses the workers, so it runs while :func:`exchange_step`
  waits on the link. Compressing the gradient (the DCT, the top-k, the next
  message) needs nothing gathered either, so it is done here too, and only
  the decode of what was gathered is left for :func:`apply_step`.

  Returns:
    ``(loss, grads, compressed, message)``: the loss and gradient, each with a
    leading axis of 1 so that every worker's own lies in one global array,
    split over the devices as the batch is; :func:`compressed_part` of the
    updated state; and the next message again, in a buffer of its own, which
    :func:`exchange_step` may read while :func:`apply_step` takes the state's.
  """
  loss, grads = _value_and_grad(
    params, opt_state, inputs_BxL, targets_BxL, graphdef, param_specs, point
  )
  sent, extra = _optimizer_inputs(grads, step, fault, cold_until)
  (pending,) = [p for _, p in compressed_part(opt_state)]
  # A stand-in for the messages in flight: what is kept of this update does
  # not read them, and XLA drops the decode (and any synchronous group's
  # exchange, whose results are not kept) from this program.
  unused = jnp.zeros((jax.lax.axis_size(REPLICA), pending.size), jnp.uint8)
  _, new_state = tx.update(sent, opt_state, params, gathered=unused, **extra)
  compressed = compressed_part(new_state)
  (message,) = [p for _, p in compressed]
  return loss[None], jax.tree.map(lambda g: g[None], grads), compressed, message


def apply_step(
  params: Any,
  opt_state: Any,
  step: jax.Array,
  loss_1: jax.Array,
  grads_1: Any,
  gathered: jax.Array,
  *,
  tx: optax.GradientTransformation,
  fault: tuple[int, int] | None = None,
  cold_until: tuple[int, ...] | None = None,
) -> tuple[Any, Any, dict[str, jax.Array]]:
  """An overlapped step's last program: :func:`train_step`'s update, given what was gathered.

  With the loss and gradient of :func:`gradient_and_message` and the
  messages of :func:`exchange_step`, it runs the arithmetic of
  :func:`train_step`; compiled apart, XLA may round it differently.
  ``opt_state`` already holds the overlapped exchange's new momentum and
  next message (:func:`with_compressed_part` of what
  :func:`gradient_and_message` returned), and they pass through unchanged,
  so XLA drops their computation here and what is left is the decode (and
  a synchronous group's whole exchange, which needs this step's gradient).
  """
  grads = jax.tree.map(lambda g: g[0], grads_1)
  compressed = compressed_part(opt_state)
  params, opt_state, metrics = _apply(
    params,
    opt_state,
    step,
    loss_1[0],
    grads,
    tx=tx,
    fault=fault,
    cold_until=cold_until,
    gathered=gathered,
  )
  return params, with_compressed_part(opt_state, compressed), metrics


def eval_step(
  params: Any,
  inputs_BxL: jax.Array,
  targets_BxL: jax.Array,
  *,
  graphdef: nnx.GraphDef,
  param_specs: Any,
) -> jax.Array:
  """The mean loss of the whole batch, with the params gathered within each site."""
  full = dj.gather_params(params, param_specs, FSDP)
  loss = _loss(full, graphdef, inputs_BxL, targets_BxL)
  return jax.lax.pmean(loss, _mesh_order(varying_axes(loss)))


def gradient_step(
  params: Any,
  opt_state: Any,
  inputs_BxL: jax.Array,
  targets_BxL: jax.Array,
  *,
  graphdef: nnx.GraphDef,
  param_specs: Any,
  point: GradientPoint = dj.inner_params,
) -> jax.Array:
  """The train step without the optimizer: loss and gradient, no exchange.

  Returns this device's squared gradient norm, shape ``(1,)``, so that the
  gradient is computed in full. Timing it against :func:`train_step` gives
  the optimizer's share of the step (exchange and update together).
  """
  _, grads = _value_and_grad(
    params, opt_state, inputs_BxL, targets_BxL, graphdef, param_specs, point
  )
  return optax.tree_utils.tree_sum(jax.tree.map(lambda g: jnp.sum(jnp.square(g)), grads))[None]


def replica_mismatches(params: Any, *, param_specs: Any) -> jax.Array:
  """How many param entries differ, bit for bit, between replicas.

  A shard is compared across the replicas that hold it; a param kept whole,
  across every device.
  """

  def count(x, spec):
    sharded = spec != P()
    axes = (REPLICA,) if sharded else MESH_AXES
    bits = jax.lax.bitcast_convert_type(
      x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    )
    n = jnp.sum(jax.lax.pmax(bits, axes) != jax.lax.pmin(bits, axes), dtype=jnp.int32)
    # Each device of a site counted its own shard.
    return jax.lax.psum(n, FSDP) if sharded else n

  specs = jax.tree.leaves(param_specs, is_leaf=lambda s: isinstance(s, P))
  return sum(count(x, s) for x, s in zip(jax.tree.leaves(params), specs))


def shard_step(
  fn: Callable[..., Any],
  mesh: jax.sharding.Mesh,
  in_specs: tuple[Any, ...],
  out_specs: Any,
  *,
  donate: tuple[int, ...] = (),
  check_vma: bool = True,
  **static: Any,
) -> Callable[..., Any]:
  """``jax.jit(jax.shard_map(partial(fn, **static)))`` over ``mesh``, built once.

  Args:
    fn: one device's step.
    mesh: the ``("replica", "fsdp")`` mesh.
    in_specs: ``PartitionSpec`` (trees) of the positional arguments.
    out_specs: ``PartitionSpec`` (trees) of the results.
    donate: positional arguments whose buffers the step may reuse.
    check_vma: ``shard_map``'s check of what is typed as the same on every
      device; off for an all-to-all exchange, whose result JAX types by worker.
    **static: keyword arguments bound into ``fn`` (the model, the optimizer).

  Returns:
    The jitted step over global arrays.
  """
  mapped = jax.shard_map(
    functools.partial(fn, **static),
    mesh=mesh,
    in_specs=in_specs,
    out_specs=out_specs,
    check_vma=check_vma,
  )
  return jax.jit(mapped, donate_argnums=donate)
