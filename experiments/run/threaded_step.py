"""An overlapped train step as three programs, its all-gather on a thread of its own.

With ``--delayed_apply`` the all-gather of step t's message is needed only by
step t+1's update. In one fused program XLA's CPU runtime still ran it and the
forward and backward pass one after the other: it runs a collective on the
thread that reaches it, blocked until the transfer ends, and in our step the
gradient's work waited on that thread (on 10 Mbit/s links the fused delayed
step took as long as the plain one, docs/overlapped.md). Dispatching a program
whose collective blocks also blocks the Python thread that dispatched it. So
the step runs here as

1. :func:`experiments.run.steps.gradient_and_message`, the loss and gradient
   and their compression into the momentum and the next message (it has no
   collective);
2. :func:`experiments.run.steps.apply_step`, the decode of the messages
   gathered and the update;
3. :func:`experiments.run.steps.exchange_step`, the all-gather of the message
   step 1 made, launched from a thread of its own as soon as step 1 made it,
   and waited for by the next call, before its own update: the transfer runs
   behind this step's decode and update and the next step's gradient, a
   whole step of compute. The first call, and any call given a state other
   than the one the last call returned, gathers that state's ``pending``.

Two collectives must not run at once (their processes could pair them
differently), so a message is sent early only when the update's program has
no collective of its own (not with ``--synchronous_params``, whose group is
exchanged inside it); and the caller waits for the exchange in flight
(:meth:`~ThreadedStep.settle`) before anything else crosses processes (the
log's gather, an evaluation, a checkpoint, the replicas' check, the end).

It runs the fused step's arithmetic. Compiled apart, XLA may round it
differently, so the two are held to agree to float rounding
(``tests/test_threaded_step.py``); in the runs of docs/overlapped.md they
agreed to the bit.
"""

import dataclasses
import re
import threading
from typing import Any

import jax

from experiments.run import steps

# An HLO op that crosses devices (and, between processes, the network).
_COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)")


class _Flight:
  """One all-gather running on a thread of its own; :meth:`result` waits for it."""

  def __init__(self, exchange: Any, message: jax.Array):
    self._box: dict[str, Any] = {}

    def run() -> None:
      try:
        self._box["gathered"] = exchange(message)
      except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
        self._box["error"] = e

    # A daemon, so that a peer that never joins the collective cannot hold the
    # interpreter open at exit once the caller has given up.
    self._thread = threading.Thread(target=run, name="distro-exchange", daemon=True)
    self._thread.start()

  def result(self) -> jax.Array:
    self._thread.join()
    if "error" in self._box:
      raise self._box["error"]
    return self._box["gathered"]


@dataclasses.dataclass
class ThreadedStep:
  """``(params, opt_state, step, inputs, targets) -> (params, opt_state, metrics)``.

  Called like the fused train step. Build it with jitted programs, then
  :meth:`compile` it for the run's shapes; call :meth:`settle` before any
  other program that crosses processes.

  Attributes:
    exchange: ``message -> gathered``.
    gradient: ``(params, opt_state, step, inputs, targets) -> (loss, grads,
      compressed, message)``.
    apply: ``(params, opt_state, step, loss, grads, gathered) -> (params,
      opt_state, metrics)``, donating the params and state, given a state
      that already holds ``compressed``.
    early: whether a message's all-gather starts as soon as it is made (the
      update's program has no collective), rather than with the next call.
  """

  exchange: Any
  gradient: Any
  apply: Any
  early: bool = False
  _flight: _Flight | None = dataclasses.field(default=None, repr=False)
  # The message the last call's state holds: the one the flight gathers.
  _sent: jax.Array | None = dataclasses.field(default=None, repr=False)

  def compile(
    self, params: Any, opt_state: Any, step: Any, inputs: Any, targets: Any
  ) -> "ThreadedStep":
    """The three programs compiled for these (abstract or concrete) arguments."""
    loss, grads, _, message = jax.eval_shape(
      self.gradient, params, opt_state, step, inputs, targets
    )
    gathered = jax.eval_shape(self.exchange, message)
    apply = self.apply.lower(params, opt_state, step, loss, grads, gathered).compile()
    return ThreadedStep(
      exchange=self.exchange.lower(message).compile(),
      gradient=self.gradient.lower(params, opt_state, step, inputs, targets).compile(),
      apply=apply,
      early=not _COLLECTIVE.search(apply.as_text()),
    )

  def hlo_texts(self) -> list[str]:
    """The compiled programs' HLO, for counting what goes into collectives."""
    return [p.as_text() for p in (self.exchange, self.gradient, self.apply)]

  def settle(self) -> None:
    """Waits for the all-gather in flight, if any; its result is kept for the next call."""
    if self._flight is not None:
      self._flight.result()

  def __call__(
    self, params: Any, opt_state: Any, step: Any, inputs: Any, targets: Any
  ) -> tuple[Any, Any, Any]:
    ((_, pending),) = steps.compressed_part(opt_state)
    if self._flight is not None and pending is not self._sent:
      # Not the state the last call returned (a timing loop's, a restored
      # one): its own message is the one to decode.
      self._flight.result()
      self._flight = None
    if self._flight is None:
      self._flight = _Flight(self.exchange, pending)
    loss, grads, compressed, message = self.gradient(params, opt_state, step, inputs, targets)
    gathered = self._flight.result()
    self._flight = _Flight(self.exchange, message) if self.early else None
    # The new momentum and message go in as the state's own, so the update
    # passes them through in place (donated) rather than copying them.
    opt_state = steps.with_compressed_part(opt_state, compressed)
    params, opt_state, metrics = self.apply(params, opt_state, step, loss, grads, gathered)
    ((_, self._sent),) = steps.compressed_part(opt_state)
    return params, opt_state, metrics
