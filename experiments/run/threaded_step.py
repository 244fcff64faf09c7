"""An overlapped train step as three programs, its all-gather on a thread of its own.

With ``--delayed_apply`` the all-gather of step t reads only the optimizer
state. In one fused program XLA's CPU runtime still ran it and the forward and
backward pass one after the other: it runs a collective on the thread that
reaches it, blocked until the transfer ends, and in our step the gradient's
work waited on that thread (on 10 Mbit/s links the fused delayed step took as
long as the plain one, docs/overlapped.md). Dispatching a program whose
collective blocks also blocks the Python thread that dispatched it. So the
step runs here as

1. :func:`experiments.run.steps.exchange_step`, the all-gather, launched from a
   thread of its own;
2. :func:`experiments.run.steps.gradient_and_message`, the loss and gradient
   and their compression into the momentum and the next message, launched
   from the main thread meanwhile (it has no collective);
3. :func:`experiments.run.steps.apply_step`, the decode of what was gathered and
   the update, once both are done.

It runs the fused step's arithmetic. Compiled apart, XLA may round it
differently, so the two are held to agree to float rounding
(``tests/test_threaded_step.py``); in the runs of docs/overlapped.md they
agreed to the bit.
"""

import dataclasses
import threading
from typing import Any

import jax

from experiments.run import steps


@dataclasses.dataclass(frozen=True)
class ThreadedStep:
  """``(params, opt_state, step, inputs, targets) -> (params, opt_state, metrics)``.

  Called like the fused train step. Build it with jitted programs, then
  :meth:`compile` it for the run's shapes.

  Attributes:
    exchange: ``opt_state -> gathered``.
    gradient: ``(params, opt_state, step, inputs, targets) -> (loss, grads,
      compressed)``.
    apply: ``(params, opt_state, step, loss, grads, gathered) -> (params,
      opt_state, metrics)``, donating the params and state, given a state
      that already holds ``compressed``.
  """

  exchange: Any
  gradient: Any
  apply: Any

  def compile(
    self, params: Any, opt_state: Any, step: Any, inputs: Any, targets: Any
  ) -> "ThreadedStep":
    """The three programs compiled for these (abstract or concrete) arguments."""
    loss, grads, _ = jax.eval_shape(self.gradient, params, opt_state, step, inputs, targets)
    gathered = jax.eval_shape(self.exchange, opt_state)
    return ThreadedStep(
      exchange=self.exchange.lower(opt_state).compile(),
      gradient=self.gradient.lower(params, opt_state, step, inputs, targets).compile(),
      apply=self.apply.lower(params, opt_state, step, loss, grads, gathered).compile(),
    )

  def hlo_texts(self) -> list[str]:
    """The compiled programs' HLO, for counting what goes into collectives."""
    return [p.as_text() for p in (self.exchange, self.gradient, self.apply)]

  def __call__(
    self, params: Any, opt_state: Any, step: Any, inputs: Any, targets: Any
  ) -> tuple[Any, Any, Any]:
    box: dict[str, Any] = {}

    def exchange() -> None:
      try:
        box["gathered"] = self.exchange(opt_state)
      except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
        box["error"] = e

    # A daemon, so that a peer that never joins the collective cannot hold the
    # interpreter open at exit once the caller has given up.
    thread = threading.Thread(target=exchange, name="distro-exchange", daemon=True)
    thread.start()
    loss, grads, compressed = self.gradient(params, opt_state, step, inputs, targets)
    thread.join()
    if "error" in box:
      raise box["error"]
    # The new momentum and message go in as the state's own, so the update
    # passes them through in place (donated) rather than copying them.
    opt_state = steps.with_compressed_part(opt_state, compressed)
    return self.apply(params, opt_state, step, loss, grads, box["gathered"])
