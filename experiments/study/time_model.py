"""What a step would cost over real links: compute time plus the exchange's transfer time.

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
  no latency, no TCP overhead, and no overlap of communication with compute,
  except for an overlapped exchange (``delayed_apply``): the share ``f`` of
  the bytes that its all-gather moves while the next forward and backward
  pass runs costs ``max(compute, f * transfer) + (1 - f) * transfer``, the
  rest (a partial overlap's synchronous message) waits as before. Whether
  XLA does overlap them on a given backend is not modelled.
- DiLoCo's all-reduce happens once every H steps; its time is amortized.

``compute`` is measured (the comparison's per-step time on this machine), or
for the DisTrO report's setting, taken from the report itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

import distro_jax as dj
from experiments.run import checks

__all__ = [
  "DEFAULT_LINKS",
  "REPORT",
  "Link",
  "collective_of",
  "link_bytes",
  "markdown",
  "project",
  "report_setting",
  "step_seconds",
]


@dataclasses.dataclass(frozen=True)
class Link:
  """One worker's connection.

  Attributes:
    name: how tables show it.
    up_bits_per_s: upload rate.
    down_bits_per_s: download rate.
  """

  name: str
  up_bits_per_s: float
  down_bits_per_s: float


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
    collective: ``"all-gather"`` or ``"all-reduce"``.
    operand_bytes: what the worker puts in (the message, or the gradient).
    workers: W.
    topology: ``"ring"`` or ``"relay"`` (see the module docstring).

  Returns:
    ``(up_bytes, down_bytes)``.
  """
  if collective not in ("all-gather", "all-reduce"):
    raise ValueError(f"unknown collective {collective!r}; use 'all-gather' or 'all-reduce'.")
  if topology == "ring":
    factor = workers - 1 if collective == "all-gather" else dj.wire.ring_allreduce_factor(workers)
    return factor * operand_bytes, factor * operand_bytes
  if topology == "relay":
    down = (workers - 1) if collective == "all-gather" else 1
    return operand_bytes, down * operand_bytes
  raise ValueError(f"unknown topology {topology!r}; use 'ring' or 'relay'.")


def step_seconds(
  compute_seconds: float,
  up_bytes: float,
  down_bytes: float,
  link: Link,
  overlapped_share: float = 0.0,
) -> float:
  """One step's time: compute, then the transfer, except its overlapped share.

  Args:
    compute_seconds: the step's compute.
    up_bytes: bytes up the worker's link.
    down_bytes: bytes down it.
    link: the link.
    overlapped_share: the share of the bytes that moves during the next
      step's compute (1 for ``delayed_apply``, the overlapped message's share
      for a partial overlap, 0 otherwise).

  Returns:
    ``max(compute, f * transfer) + (1 - f) * transfer`` seconds, with
    ``transfer = max(up / up_rate, down / down_rate)``.
  """
  if not 0.0 <= overlapped_share <= 1.0:
    raise ValueError(f"overlapped_share must be in [0, 1], got {overlapped_share}.")
  transfer = max(up_bytes * 8 / link.up_bits_per_s, down_bytes * 8 / link.down_bits_per_s)
  hidden = overlapped_share * transfer
  return max(compute_seconds, hidden) + transfer - hidden


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
