"""The records a run leaves behind, typed: one :class:`StepRecord` per line of
``metrics.jsonl`` (and a :class:`ResizeEvent` line where an elastic resume
changed the worker count) and one :class:`Summary` in ``summary.json``.

Readers (``compare``, ``sweep``, ``netlab``, the notebooks, the tests) load
them through :func:`read_metrics` and :meth:`Summary.load` and use their
attributes, so the keys are written down once, here.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

__all__ = [
  "ResizeEvent",
  "StepRecord",
  "Summary",
  "logged_loss",
  "read_events",
  "read_jsonl",
  "read_metrics",
]


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
  """The JSON objects of a JSON-lines file, one per line.

  A line that does not parse (a process killed mid-write leaves a torn last
  line) or is not an object is skipped.
  """
  out = []
  with open(path) as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(record, dict):
        out.append(record)
  return out


def logged_loss(losses: Sequence[float] | np.ndarray) -> float:
  """A step's logged loss: the mean of the workers' finite losses; NaN if none is finite.

  ``losses`` are every device's, in the mesh's order (the train step's
  ``metrics["loss"]``). The sums are float32 and run in that order, which is
  how the step's own ``psum`` summed them in one process when the step
  averaged them itself, so the log holds the numbers it held then.

  Example:
    >>> logged_loss([2.0, float("nan"), 4.0])
    3.0
  """
  total, count = np.float32(0.0), np.float32(0.0)
  for loss in np.asarray(losses, np.float32).reshape(-1):
    if np.isfinite(loss):
      total, count = np.float32(total + loss), np.float32(count + 1)
  return float(total / count) if count > 0 else float("nan")


@dataclasses.dataclass(frozen=True)
class StepRecord:
  """One line of ``metrics.jsonl``: a step, written by process 0 one step late.

  Attributes:
    step: the 1-based step.
    loss: mean training loss over the workers whose loss was finite.
    wall_time: ``time.time()`` when the step had finished.
    bytes_sent: bytes one worker sent for this step (``Payload.sent``).
    lr: the learning rate the optimizer used at this step.
    tokens_per_s: training tokens per second over this step.
    excluded_contributions: messages left out as non-finite, for methods
      that leave workers out (``None`` otherwise, and not written).
    val_loss: validation loss after this step, where one was taken.
  """

  step: int
  loss: float
  wall_time: float
  bytes_sent: float
  lr: float
  tokens_per_s: float
  excluded_contributions: int | None = None
  val_loss: float | None = None

  def to_json(self) -> dict[str, Any]:
    """The line's object; optional fields appear only when set."""
    return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

  @classmethod
  def from_json(cls, record: dict[str, Any]) -> StepRecord:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in record.items() if k in names})


@dataclasses.dataclass(frozen=True)
class ResizeEvent:
  """A line of ``metrics.jsonl`` that is no step: the run continued on another worker count.

  Written by an elastic resume (``--resume`` with another ``--workers`` or
  ``--num_processes``) before its first step; its line carries
  ``"event": "resize"``. :func:`read_metrics` skips it; :func:`read_events`
  returns it.

  Attributes:
    step: the checkpoint's step; steps after it ran on the new count.
    wall_time: ``time.time()`` when the resized state was ready.
    workers_before: data-parallel workers (sites) that saved the checkpoint.
    workers_after: data-parallel workers from here on.
    processes_before: processes that saved the checkpoint.
    processes_after: processes from here on.
    left: the old workers that left, by their old index.
    joined: the new workers that joined, by their new index.
    leaving: what became of the leavers' unsent momentum: ``"fold"`` or ``"drop"``.
    cold_start_steps: steps each joiner's message was marked invalid.
  """

  step: int
  wall_time: float
  workers_before: int
  workers_after: int
  processes_before: int
  processes_after: int
  left: list[int]
  joined: list[int]
  leaving: str
  cold_start_steps: int

  kind: ClassVar[str] = "resize"

  def to_json(self) -> dict[str, Any]:
    return {"event": self.kind, **dataclasses.asdict(self)}

  @classmethod
  def from_json(cls, record: dict[str, Any]) -> ResizeEvent:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in record.items() if k in names})


def _metrics_lines(out_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
  return read_jsonl(os.path.join(out_dir, "metrics.jsonl"))


def read_metrics(out_dir: str | os.PathLike[str]) -> list[StepRecord]:
  """The step records of ``OUT_DIR/metrics.jsonl``, in order; event lines are skipped."""
  return [StepRecord.from_json(r) for r in _metrics_lines(out_dir) if "event" not in r]


def read_events(out_dir: str | os.PathLike[str]) -> list[ResizeEvent]:
  """The events of ``OUT_DIR/metrics.jsonl`` (elastic resumes), in order."""
  return [
    ResizeEvent.from_json(r) for r in _metrics_lines(out_dir) if r.get("event") == ResizeEvent.kind
  ]


@dataclasses.dataclass(frozen=True)
class Summary:
  """``summary.json``: what a run did, what it sent, and what it measured.

  Attributes:
    optimizer: the method's family.
    preset: the model preset.
    num_params: parameters in the model.
    steps: the last step trained.
    workers: devices in the mesh.
    final_train_loss: training loss at the last step.
    final_train_loss_avg10: its mean over the last 10 logged steps.
    final_val_loss: the last validation loss, if any was taken.
    bytes_sent_per_step: what one worker's link carries up per step.
    payload_bytes_per_step: what one worker puts into the collective per
      step (a message sent every H steps counts 1/H per step).
    measured_collective_bytes_per_step: every collective's operand bytes in
      the compiled step, per device.
    measured_by_kind: the same, by collective kind.
    measured_exchange_bytes_per_step: the optimizer's collective bytes across
      ``"replica"`` per step, read from the HLO; equals the payload.
    measured_by_axes: collective bytes by the mesh axes they cross.
    measured_crossing_replicas_per_step: collective bytes across ``"replica"``.
    params_kept_whole: params FSDP could not shard, by path.
    total_bytes_sent_per_worker: ``bytes_sent_per_step`` times the steps.
    ratio_vs_ring_allreduce: a ring all-reduce's bytes over the payload.
    ratio_vs_bf16_grad: a bf16 gradient's bytes over the payload (the DisTrO
      report's ratio).
    params_digest: SHA-256 of the final params on process 0.
    config: the resolved ``TrainConfig``, as a dict.
    step_seconds: with ``--time_optimizer``, median seconds per step.
    gradient_seconds: with ``--time_optimizer``, median seconds per
      gradient-only step.
    optimizer_time_fraction: with ``--time_optimizer``, the optimizer's share
      of a step, ``1 - gradient_seconds / step_seconds``.
    train_epochs: how much of the training split the run read: windows drawn
      over windows in the split (2.0: every window twice;
      ``experiments.run.data.Reading``). ``None`` in a summary written before
      it was recorded.
    train_windows: windows of ``seq_len + 1`` tokens in the training split.
    rereads_data: the run read some window, so some byte, more than once.
  """

  optimizer: str
  preset: str
  num_params: int
  steps: int
  workers: int
  final_train_loss: float | None
  final_train_loss_avg10: float | None
  final_val_loss: float | None
  bytes_sent_per_step: float
  payload_bytes_per_step: float
  measured_collective_bytes_per_step: int
  measured_by_kind: dict[str, int]
  measured_exchange_bytes_per_step: float
  measured_by_axes: dict[str, int]
  measured_crossing_replicas_per_step: int
  params_kept_whole: list[str]
  total_bytes_sent_per_worker: float
  ratio_vs_ring_allreduce: float
  ratio_vs_bf16_grad: float
  params_digest: str
  config: dict[str, Any]
  step_seconds: float | None = None
  gradient_seconds: float | None = None
  optimizer_time_fraction: float | None = None
  train_epochs: float | None = None
  train_windows: int | None = None
  rereads_data: bool | None = None

  def to_json(self) -> dict[str, Any]:
    """The file's object; the timing fields appear only when measured."""
    out = dataclasses.asdict(self)
    for k in ("step_seconds", "gradient_seconds", "optimizer_time_fraction"):
      if out[k] is None:
        del out[k]
    return out

  def save(self, path: str | os.PathLike[str]) -> None:
    with open(path, "w") as f:
      json.dump(self.to_json(), f, indent=2)

  @classmethod
  def load(cls, path: str | os.PathLike[str]) -> Summary:
    """Reads a ``summary.json`` (a file, or a run directory that holds one)."""
    if os.path.isdir(path):
      path = os.path.join(path, "summary.json")
    with open(path) as f:
      return cls(**json.load(f))
