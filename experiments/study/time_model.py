"""What a step would cost over real links: compute, the exchange's transfer, and its latency.

The model is deliberately simple and stated in full, so that a reader can
check it:

- Two topologies. A **ring**, as gloo and NCCL run collectives: an
  all-reduce of ``B`` bytes moves ``2 (W-1)/W * B`` up and as much down on
  every worker's link, and an all-gather of a ``B``-byte message moves
  ``(W-1) * B`` up and down. A **relay** (a server, or peers that forward):
  each worker uploads its ``B`` bytes once and downloads the ``W-1`` other
  messages (all-gather) or one reduced result (all-reduce). The ring figures
  are the headline (``step_seconds``, ``hours_to_train``); asymmetric consumer
  links favour the relay.
- A step takes ``compute + max(up_bytes / up_rate, down_bytes / down_rate)``:
  no TCP overhead, and no overlap of communication with compute, except for
  an overlapped exchange (``delayed_apply``): the share ``f`` of the bytes
  that its all-gather moves while the next forward and backward pass runs
  costs ``max(compute, f * transfer) + (1 - f) * transfer``, the rest (a
  partial overlap's synchronous message) waits as before. Whether XLA does
  overlap them on a given backend is not modelled.
- Latency, when a link has a round trip (``Link.rtt_s``) and a loss rate
  (``Link.loss``), adds the time of the step's dependent hops
  (:func:`latency_seconds`): a hop is one step of a ring collective, which
  gloo sends at once, with no handshake, so it waits one one-way trip
  (``rtt / 2``); a chunk larger than TCP's initial window waits one more
  round trip per extra window (slow start restarts after an idle
  compute phase); and a hop any of whose segments is dropped waits a
  retransmission timeout (``rtt`` + Linux's 200 ms floor). The hops come from
  :mod:`experiments.netlab.round_trips`, which counts them in a compiled
  step. Every link in :data:`DEFAULT_LINKS` has neither, so the projections
  without hops are unchanged.
- A link may also let a burst through at line rate (``Link.burst_bytes``:
  netlab's ``tc tbf`` bucket is 64 KiB plus a frame); the bytes past it
  move at the rate. 0 by default.
- DiLoCo's all-reduce happens once every H steps; its time is amortized.

``compute`` is measured (the comparison's per-step time on this machine), or
for the DisTrO report's setting, taken from the report itself.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax

import distro_jax as dj
from experiments.run import checks

__all__ = [
  "DEFAULT_LINKS",
  "DUPACK_THRESHOLD",
  "INITIAL_WINDOW_SEGMENTS",
  "MSS_BYTES",
  "REPORT",
  "RTO_FLOOR_S",
  "Hop",
  "Link",
  "MeasuredCell",
  "collective_of",
  "comparison_markdown",
  "hop_seconds",
  "latency_seconds",
  "link_bytes",
  "markdown",
  "predicted_vs_measured",
  "project",
  "report_setting",
  "retransmission_timeout_s",
  "round_trips",
  "slow_start_flights",
  "step_seconds",
]

# TCP over Ethernet: 1,500-byte frames less 52 bytes of IP and TCP headers
# (with timestamps, as Linux sends them).
MSS_BYTES = 1448
# Linux's initial congestion window (RFC 6928), and the window it restarts
# from after an idle spell longer than the retransmission timeout
# (net.ipv4.tcp_slow_start_after_idle, on by default): a step's exchange
# follows its compute, which is longer than that.
INITIAL_WINDOW_SEGMENTS = 10
# Linux's TCP_RTO_MIN: the retransmission timeout is the smoothed round trip
# plus at least this much. A lone segment lost (a scalar's hop) has no
# duplicate ACKs behind it to trigger a fast retransmit, so it waits for a
# timer of about this length (the timeout, or a tail-loss probe near it).
RTO_FLOOR_S = 0.2
# Duplicate ACKs that make TCP resend a segment without waiting for a timeout.
DUPACK_THRESHOLD = 3


@dataclasses.dataclass(frozen=True)
class Link:
  """One worker's connection.

  Attributes:
    name: how tables show it.
    up_bits_per_s: upload rate.
    down_bits_per_s: download rate.
    rtt_s: the round trip between two workers, seconds (0: a path of zero
      length, the model without latency).
    loss: the probability that a packet is lost end to end, in [0, 1).
    burst_bytes: bytes a sender may put through at line rate after an idle
      spell before the rate applies (a token bucket's size; 0: none).
  """

  name: str
  up_bits_per_s: float
  down_bits_per_s: float
  rtt_s: float = 0.0
  loss: float = 0.0
  burst_bytes: float = 0.0

  def __post_init__(self):
    if self.rtt_s < 0 or not 0.0 <= self.loss < 1.0 or self.burst_bytes < 0:
      raise ValueError(
        f"link {self.name!r}: rtt_s must be >= 0, loss in [0, 1) and burst_bytes >= 0; got "
        f"rtt_s={self.rtt_s}, loss={self.loss}, burst_bytes={self.burst_bytes}."
      )


DEFAULT_LINKS = (
  Link("consumer 10 up / 100 down Mbit/s", 10e6, 100e6),
  Link("datacenter 1 Gbit/s", 1e9, 1e9),
  Link("datacenter 100 Gbit/s", 100e9, 100e9),
)


@dataclasses.dataclass(frozen=True)
class ReportSetting:
  """The DisTrO preliminary report's run (Nous Research, Aug 2024) and its figures."""

  preset: str = "report-1.2b"
  workers: int = 32
  steps: int = 25_000
  adamw_hours: float = 17.1
  distro_hours: float = 19.8
  adamw_bytes_per_step: float = 74.4e9
  distro_bytes_per_step: float = 86.8e6
  # (method name, row label) projected onto the links; payloads in bf16.
  methods: tuple[tuple[str, str], ...] = (
    ("adamw", "adamw"),
    ("demo", "demo (top-k 32, bf16 values)"),
    ("demo-k8-1bit", "demo-k8-1bit"),
    ("diloco", "diloco (H=50)"),
  )

  @property
  def published(self) -> dict[str, float | None]:
    """Published bytes per step where the report has a figure for that method."""
    return {"adamw": self.adamw_bytes_per_step, "diloco": None}

  @property
  def compute_seconds(self) -> float:
    """Per-step time of the report's AdamW run, used as the compute time per step.

    Its all-reduce ran over datacenter links, so this slightly overstates
    compute alone.
    """
    return self.adamw_hours * 3600 / self.steps


REPORT = ReportSetting()


def link_bytes(
  collective: str, operand_bytes: float, workers: int, topology: str = "ring"
) -> tuple[float, float]:
  """Bytes up and down one worker's link for one collective.

  Args:
    collective: ``"all-gather"``, ``"all-reduce"`` or ``"all-to-all"`` (the
      ``-a2a`` exchange: every pair at once, whatever the topology).
    operand_bytes: what the worker puts in (the message, the gradient, or
      the all-to-all's W copies of the message).
    workers: W.
    topology: ``"ring"`` or ``"relay"`` (see the module docstring).

  Returns:
    ``(up_bytes, down_bytes)``.
  """
  if collective not in ("all-gather", "all-reduce", "all-to-all"):
    raise ValueError(
      f"unknown collective {collective!r}; use 'all-gather', 'all-reduce' or 'all-to-all'."
    )
  if collective == "all-to-all":
    # Its operand holds one chunk per worker; all but this worker's own cross the link.
    return (workers - 1) / workers * operand_bytes, (workers - 1) / workers * operand_bytes
  if topology == "ring":
    factor = workers - 1 if collective == "all-gather" else dj.wire.ring_allreduce_factor(workers)
    return factor * operand_bytes, factor * operand_bytes
  if topology == "relay":
    down = (workers - 1) if collective == "all-gather" else 1
    return operand_bytes, down * operand_bytes
  raise ValueError(f"unknown topology {topology!r}; use 'ring' or 'relay'.")


@dataclasses.dataclass(frozen=True)
class Hop:
  """One dependent transfer of a step: nothing after it starts before it ends.

  A ring collective over W workers is a chain of them (W - 1 for an
  all-gather, 2 (W - 1) for an all-reduce): in each, every worker sends a
  chunk to its neighbour and waits for its other neighbour's.

  Attributes:
    segments: TCP segments sent during the hop, every sender together: the
      hop is late if any of them is lost.
    flights: congestion windows the largest sender's chunk takes
      (:func:`slow_start_flights`); each one past the first waits a round trip
      for the ACKs that open the next.
    senders: how many processes send in the hop, each its share of
      ``segments``: a loss among a sender's last :data:`DUPACK_THRESHOLD`
      segments waits for a timeout, one before them only a round trip.
  """

  segments: int = 1
  flights: int = 1
  senders: int = 1


def slow_start_flights(segments: int, initial_window: int = INITIAL_WINDOW_SEGMENTS) -> int:
  """Windows TCP takes to send ``segments`` from its initial window, doubling each round trip.

  Example:
    >>> [slow_start_flights(n) for n in (2, 10, 16, 31)]
    [1, 1, 2, 3]
  """
  if segments <= initial_window:
    return 1
  # After f windows, initial_window * (2**f - 1) segments have left.
  return math.ceil(math.log2(segments / initial_window + 1))


def retransmission_timeout_s(rtt_s: float) -> float:
  """What a lost segment with nothing behind it costs: the round trip plus Linux's floor."""
  return rtt_s + RTO_FLOOR_S


def hop_seconds(hop: Hop, link: Link) -> float:
  """Expected time of one hop over ``link``, less its bytes' transfer time.

  ``rtt / 2`` (gloo sends a ring step's chunk as soon as it has it, with no
  handshake, so a step waits one one-way trip), plus a round trip per extra
  slow-start window, plus what a loss costs. A lost segment with fewer than
  :data:`DUPACK_THRESHOLD` segments behind it from its sender (every segment
  of a small message) waits for a retransmission timeout; one with more is
  resent on their duplicate ACKs, a round trip late (TCP's fast retransmit).
  So with ``tail`` such last segments and ``body`` the rest, the loss term is
  ``P(tail lost) * timeout + P(tail whole) * P(body lost) * rtt``.

  Example:
    >>> link = Link("far", 10e6, 10e6, rtt_s=0.1, loss=0.01)
    >>> round(hop_seconds(Hop(segments=1), link), 4)  # 0.05 + 0.01 * 0.3
    0.053
  """
  if link.rtt_s == 0 and link.loss == 0:
    return 0.0
  per_sender = math.ceil(hop.segments / max(1, hop.senders))
  tail = min(hop.segments, max(1, hop.senders) * min(DUPACK_THRESHOLD, per_sender))
  tail_late = 1.0 - (1.0 - link.loss) ** tail
  body_late = 1.0 - (1.0 - link.loss) ** (hop.segments - tail)
  recovery = tail_late * retransmission_timeout_s(link.rtt_s)
  recovery += (1.0 - tail_late) * body_late * link.rtt_s
  return link.rtt_s / 2 + (hop.flights - 1) * link.rtt_s + recovery


def round_trips(hops: Sequence[Hop]) -> float:
  """The round trips a chain of hops waits for: half one per hop, one per extra window."""
  return sum(0.5 + h.flights - 1 for h in hops)


def latency_seconds(hops: Sequence[Hop], link: Link) -> float:
  """The expected time of a chain of dependent hops over ``link`` (0 on a link without latency)."""
  return sum(hop_seconds(h, link) for h in hops)


def step_seconds(
  compute_seconds: float,
  up_bytes: float,
  down_bytes: float,
  link: Link,
  overlapped_share: float = 0.0,
  *,
  hops: Sequence[Hop] = (),
  hidden_hops: Sequence[Hop] = (),
) -> float:
  """One step's time: compute, then the transfer, except its overlapped share, then latency.

  Args:
    compute_seconds: the step's compute.
    up_bytes: bytes up the worker's link.
    down_bytes: bytes down it.
    link: the link.
    overlapped_share: the share of the bytes that moves during the next
      step's compute (1 for ``delayed_apply``, the overlapped message's share
      for a partial overlap, 0 otherwise).
    hops: the dependent hops the step waits for (its collectives and its
      host's cross-process calls; :mod:`experiments.netlab.round_trips`).
    hidden_hops: the hops of the overlapped exchange, which run beside the
      compute.

  Returns:
    ``max(compute, f * transfer + hidden latency) + (1 - f) * transfer +
    latency`` seconds, with ``transfer = max(up / up_rate, down / down_rate)``
    (the bytes past ``link.burst_bytes``, or past what the link's rate
    refills during the compute when that is less) and the latencies of
    :func:`latency_seconds`. On a link without latency (``rtt_s`` and
    ``loss`` 0) this is the model without latency, to the bit.
  """
  if not 0.0 <= overlapped_share <= 1.0:
    raise ValueError(f"overlapped_share must be in [0, 1], got {overlapped_share}.")
  if link.burst_bytes:
    # The bucket refills only while the link is idle, during the compute: on a
    # slow link a step's burst is what the compute's seconds refill. An
    # overlapped transfer keeps the link busy for its share of the compute.
    raw = max(up_bytes * 8 / link.up_bits_per_s, down_bytes * 8 / link.down_bits_per_s)
    idle = max(0.0, compute_seconds - overlapped_share * raw)
    up_bytes = max(0.0, up_bytes - min(link.burst_bytes, link.up_bits_per_s / 8 * idle))
    down_bytes = max(0.0, down_bytes - min(link.burst_bytes, link.down_bits_per_s / 8 * idle))
  transfer = max(up_bytes * 8 / link.up_bits_per_s, down_bytes * 8 / link.down_bits_per_s)
  hidden = overlapped_share * transfer
  exposed_latency = latency_seconds(hops, link)
  hidden_latency = latency_seconds(hidden_hops, link)
  return max(compute_seconds, hidden + hidden_latency) + transfer - hidden + exposed_latency


@dataclasses.dataclass(frozen=True)
class MeasuredCell:
  """A step time measured over real links, with what the model needs to predict it.

  Attributes:
    label: how the table names it (method, message, links).
    link: the link, with its round trip and loss.
    workers: W.
    collective: ``"all-gather"`` or ``"all-reduce"``.
    operand_bytes: what a worker puts into it (the message, or the gradient).
    compute_s: the same step measured on clean links (no shaping, no delay),
      used as the compute.
    measured_s: the step measured on ``link``.
    overlapped_share: as in :func:`step_seconds`.
    hops: the dependent hops the step waits for.
    hidden_hops: the overlapped exchange's hops.
    source: where the measurement is recorded.
  """

  label: str
  link: Link
  workers: int
  collective: str
  operand_bytes: float
  compute_s: float
  measured_s: float
  overlapped_share: float = 0.0
  hops: tuple[Hop, ...] = ()
  hidden_hops: tuple[Hop, ...] = ()
  source: str = ""


def predicted_vs_measured(cells: Sequence[MeasuredCell]) -> list[dict[str, Any]]:
  """The model's step next to the measured one, for each cell.

  Args:
    cells: measured cells.

  Returns:
    One dict per cell: ``label``, ``rtt_s``, ``loss``, ``round_trips`` (of
    the exposed hops, :func:`round_trips`; None where the cell gives no
    hops), ``compute_s``, ``transfer_s`` (the part not overlapped),
    ``latency_s`` (exposed), ``predicted_s``, ``measured_s``, ``error``
    (``predicted / measured - 1``) and ``source``.
  """
  rows = []
  for c in cells:
    up, down = link_bytes(c.collective, c.operand_bytes, c.workers, "ring")
    predicted = step_seconds(
      c.compute_s, up, down, c.link, c.overlapped_share, hops=c.hops, hidden_hops=c.hidden_hops
    )
    no_latency = dataclasses.replace(c.link, rtt_s=0.0, loss=0.0)
    transfer = step_seconds(c.compute_s, up, down, no_latency, 0.0) - c.compute_s
    rows.append(
      {
        "label": c.label,
        "rtt_s": c.link.rtt_s,
        "loss": c.link.loss,
        "round_trips": round_trips(c.hops) if c.hops else None,
        "compute_s": c.compute_s,
        "transfer_s": transfer * (1 - c.overlapped_share),
        "latency_s": latency_seconds(c.hops, c.link),
        "predicted_s": predicted,
        "measured_s": c.measured_s,
        "error": predicted / c.measured_s - 1,
        "source": c.source,
      }
    )
  return rows


def comparison_markdown(rows: Sequence[dict[str, Any]]) -> str:
  """A markdown table of :func:`predicted_vs_measured` rows."""
  lines = [
    "| cell | round trip | loss | exposed round trips | clean (compute) | transfer "
    "| latency | predicted | measured | error |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for r in rows:
    trips = "" if r["round_trips"] is None else f"{r['round_trips']:g}"
    lines.append(
      f"| {r['label']} | {r['rtt_s'] * 1e3:.0f} ms | {r['loss']:.0%} | {trips} | "
      f"{r['compute_s']:.3f} s | {r['transfer_s']:.3f} s | {r['latency_s']:.3f} s | "
      f"{r['predicted_s']:.3f} s | {r['measured_s']:.3f} s | {r['error']:+.1%} |"
    )
  return "\n".join(lines)


def _projection(
  name, collective, operand, compute, workers, steps, link, overlapped=0.0
) -> dict[str, Any]:
  ring = link_bytes(collective, operand, workers, "ring")
  relay = link_bytes(collective, operand, workers, "relay")
  t_ring = step_seconds(compute, *ring, link, overlapped)
  t_relay = step_seconds(compute, *relay, link, overlapped)
  return {
    "method": name,
    "link": link.name,
    "link_bytes_per_step": ring[0],
    "step_seconds": t_ring,
    "hours_to_train": t_ring * steps / 3600,
    "step_seconds_relay": t_relay,
    "hours_to_train_relay": t_relay * steps / 3600,
  }


def collective_of(optimizer: str) -> str:
  """The collective a method family exchanges with, from the registry.

  Raises:
    ConfigError: for a name that is not registered.
  """
  from experiments.run import methods

  return methods.get(optimizer).collective


def project(
  rows: Sequence[dict[str, Any]], links: Sequence[Link], steps: int, workers: int
) -> list[dict[str, Any]]:
  """Projected step time and time to train for each compared method on each link.

  Args:
    rows: the comparison's rows; each needs ``method``, ``optimizer``,
      ``payload_bytes_per_step`` and ``step_seconds`` (measured compute),
      and may have ``overlapped_share`` (see :func:`step_seconds`; 0 if absent).
    links: the links to project onto.
    steps: steps in the run being projected.
    workers: W.

  Returns:
    One dict per (method, link): ``method``, ``link``, ``link_bytes_per_step``
    (up, ring), ``step_seconds`` and ``hours_to_train`` (ring), and
    ``step_seconds_relay`` and ``hours_to_train_relay``.
  """
  return [
    _projection(
      row["method"],
      collective_of(row["optimizer"]),
      row["payload_bytes_per_step"],
      row["step_seconds"],
      workers,
      steps,
      link,
      row.get("overlapped_share", 0.0),
    )
    for row in rows
    for link in links
  ]


def report_setting(
  links: Sequence[Link] = DEFAULT_LINKS, setting: ReportSetting = REPORT
) -> list[dict[str, Any]]:
  """Projects the DisTrO report's 1.2B, 32-worker, 25k-step run onto ``links``.

  Payloads come from this library's byte accounting on the ``report-1.2b``
  preset (shapes only, under ``jax.eval_shape``); the gradient is bf16 as in
  the report. Each row also carries the report's way of counting bytes per
  step (a worker's message times the W-1 peers it reaches) next to the
  published figure.

  Args:
    links: the links to project onto.
    setting: the run to project.

  Returns:
    One dict per (method, link), with the keys of :func:`project` plus
    ``report_style_bytes_per_step`` and ``published_bytes_per_step``.
  """
  from experiments.run import config, methods, presets
  from experiments.run import model as model_lib

  params = model_lib.abstract_params(presets.get_preset(setting.preset))
  bf16 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, "bfloat16"), params)
  out = []
  for spec, label in setting.methods:
    method, overrides = methods.parse(spec)
    cfg = checks.resolve(
      config.TrainConfig(
        preset=setting.preset, workers=setting.workers, batch_size=setting.workers, **overrides
      )
    )
    payload = method.payload(cfg, bf16)
    # The report measured its own AdamW run; everything else compares with its DisTrO figure.
    published = setting.published.get(spec, setting.distro_bytes_per_step)
    for link in links:
      row = _projection(
        label,
        method.collective,
        payload.per_step,
        setting.compute_seconds,
        setting.workers,
        setting.steps,
        link,
      )
      row["report_style_bytes_per_step"] = payload.per_step * (setting.workers - 1)
      row["published_bytes_per_step"] = published
      out.append(row)
  return out


def _human_time(hours: float) -> str:
  if hours < 1 / 60:
    return f"{hours * 3600:.0f} s"
  if hours < 1:
    return f"{hours * 60:.1f} min"
  if hours < 48:
    return f"{hours:.1f} h"
  if hours < 24 * 365:
    return f"{hours / 24:.1f} days"
  return f"{hours / 24 / 365:.1f} years"


def markdown(projection: Sequence[dict[str, Any]]) -> str:
  """A markdown table of :func:`project` or :func:`report_setting` rows."""
  from experiments.run.reporting import human_bytes

  extra = "report_style_bytes_per_step" in projection[0] if projection else False
  head = (
    "| method | link | up per step (ring) | step (ring) | time to train (ring) "
    "| step (relay) | time to train (relay) |"
  )
  rule = "| --- | --- | ---: | ---: | ---: | ---: | ---: |"
  if extra:
    head += " bytes/step, report's count | published |"
    rule += " ---: | ---: |"
  lines = [head, rule]
  for r in projection:
    line = (
      f"| {r['method']} | {r['link']} | {human_bytes(r['link_bytes_per_step'])} | "
      f"{r['step_seconds']:.2f} s | {_human_time(r['hours_to_train'])} | "
      f"{r['step_seconds_relay']:.2f} s | {_human_time(r['hours_to_train_relay'])} |"
    )
    if extra:
      line += (
        f" {human_bytes(r['report_style_bytes_per_step'])} |"
        f" {human_bytes(p) if (p := r['published_bytes_per_step']) else ''} |"
      )
    lines.append(line)
  return "\n".join(lines)
