"""What a run measures besides its loss: bytes on the wire, step timing, param digests.

The bytes an optimizer sends are computed from the registry
(``experiments.methods``) and measured in the compiled train step's HLO;
the two must agree. Timing interleaves full steps with gradient-only steps
so that the optimizer's share of a step comes out as a ratio of medians.
"""

from __future__ import annotations

import collections
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

import distro_jax as dj
from experiments.run.launch import REPLICA

__all__ = ["HloBytes", "hlo_bytes", "params_digest", "time_step_parts"]


class HloBytes(NamedTuple):
  """Bytes entering collectives per device per step, read from a compiled step.

  Attributes:
    total: every collective's operands.
    by_kind: by collective kind (``"all-gather"``, ``"all-reduce"``, ...).
    by_axes: by the mesh axes a collective crosses, ``"replica"``,
      ``"fsdp"``, ``"replica+fsdp"``, or ``"none"``.
    crossing: the collectives that cross ``"replica"``: the slow links.
    exchange: ``crossing`` per step (a collective that runs once every H
      steps is divided by H): what the optimizer sends, since the step
      averages no loss across the workers (the host does,
      ``records.logged_loss``).
  """

  total: int
  by_kind: dict[str, int]
  by_axes: dict[str, int]
  crossing: int
  exchange: float


def hlo_bytes(
  hlo_text: str | Sequence[str], mesh: jax.sharding.Mesh, exchange_every: int = 1
) -> HloBytes:
  """The collective bytes of a compiled train step, split as :class:`HloBytes` says.

  Args:
    hlo_text: ``compiled.as_text()`` of the train step, or the texts of the
      programs one step runs (an overlapped step on a thread of its own,
      :mod:`experiments.run.threaded_step`), counted together.
    mesh: the ``("replica", "fsdp")`` mesh it runs on.
    exchange_every: steps between the optimizer's exchanges (the registry's
      ``exchange_every``); its collective sits in a branch taken that often.

  Returns:
    An :class:`HloBytes`.
  """
  texts = [hlo_text] if isinstance(hlo_text, str) else list(hlo_text)
  total, by_kind, by_axes = 0, collections.Counter(), collections.Counter()
  for text in texts:
    measured = dj.parse_collective_bytes(text)
    total += measured.total
    by_kind.update({k: v for k, v in measured.by_kind.items() if v})
    for k, v in dj.collective_bytes_by_axes(text, mesh).items():
      by_axes["+".join(k) or "none"] += v.total
  crossing = sum(v for k, v in by_axes.items() if REPLICA in k.split("+"))
  # An all-to-all exchange's operand holds the message once per worker; each
  # worker's message is one of those copies, as an all-gather's operand is.
  copies = by_kind.get("all-to-all", 0)
  message = crossing - copies + copies / mesh.shape[REPLICA]
  # The step's loss leaves it unreduced, so all that crosses is the optimizer's.
  exchange = message / exchange_every
  return HloBytes(total, dict(by_kind), dict(by_axes), crossing, exchange)


def params_digest(params: Any) -> str:
  """SHA-256 of this process's copy of every param, in tree order."""
  h = hashlib.sha256()
  for x in jax.tree.leaves(params):
    # A sharded param is whole only as the full array.
    h.update(np.asarray(x if x.is_fully_addressable else x.addressable_shards[0].data).tobytes())
  return h.hexdigest()


def time_step_parts(
  full_step: Callable[[Any, Any, int], tuple[Any, Any]],
  gradient_only: Callable[[Any, Any], Any],
  params: Any,
  opt_state: Any,
  *,
  first_step: int,
  block: int,
  rounds: int,
) -> dict[str, float]:
  """Seconds per full step and per gradient-only step, timed in alternation.

  Each round times ``block`` consecutive steps, then ``block`` gradient-only
  calls; the medians over rounds of the per-call means are reported. A block
  should span whatever an optimizer does only now and then (DiLoCo's
  synchronization), so that its cost is amortized as in training.

  Args:
    full_step: ``(params, opt_state, step) -> (params, opt_state)``, donating.
    gradient_only: ``(params, opt_state) -> array``.
    params: params to start from.
    opt_state: optimizer state to start from.
    first_step: the step number before the first timed step.
    block: calls per timed block.
    rounds: blocks of each kind.

  Returns:
    ``step_seconds``, ``gradient_seconds`` and ``optimizer_time_fraction``
    (``1 - gradient_seconds / step_seconds``, floored at 0).
  """
  jax.block_until_ready(gradient_only(params, opt_state))  # compile outside the timing
  step_s, grad_s = [], []
  step = first_step
  for _ in range(rounds):
    t0 = time.perf_counter()
    # Waiting on every call keeps one step in flight, as in training; queuing
    # dozens of collective steps can outlast XLA's rendezvous timeout on a busy host.
    for _ in range(block):
      step += 1
      params, opt_state = jax.block_until_ready(full_step(params, opt_state, step))
    step_s.append((time.perf_counter() - t0) / block)
    t0 = time.perf_counter()
    for _ in range(block):
      jax.block_until_ready(gradient_only(params, opt_state))
    grad_s.append((time.perf_counter() - t0) / block)
  step_med, grad_med = float(np.median(step_s)), float(np.median(grad_s))
  return {
    "step_seconds": step_med,
    "gradient_seconds": grad_med,
    "optimizer_time_fraction": max(step_med - grad_med, 0.0) / step_med,
  }
