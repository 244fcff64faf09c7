"""What a run shows and leaves behind: progress line, metrics.jsonl, summary, plots.

Only process 0 writes. Values are fetched one step late, so the host never
waits on the step it just dispatched.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TextIO

from experiments.run.records import ResizeEvent, StepRecord, read_jsonl

__all__ = ["MetricsWriter", "Progress", "StepTimer", "human_bytes", "plot_losses"]


def human_bytes(n: float) -> str:
  """1234567 -> '1.2 MB' (decimal units, as link rates are quoted)."""
  for unit in ("B", "KB", "MB", "GB", "TB"):
    if abs(n) < 1000 or unit == "TB":
      return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
    n /= 1000
  return f"{n:.1f} TB"


class Progress:
  """A one-line progress bar: step, loss, tokens/s, bytes sent per step.

  On a terminal it redraws in place; elsewhere (CI, log files) it prints a
  line every ``every`` steps.
  """

  def __init__(self, total: int, *, enabled: bool, every: int = 10, stream: TextIO | None = None):
    self.total = total
    self.enabled = enabled
    self.every = max(1, every)
    self.stream = stream or sys.stderr
    self.tty = self.stream.isatty()

  def update(self, step: int, loss: float, tokens_per_s: float, bytes_sent: int) -> None:
    if not self.enabled or not (self.tty or step % self.every == 0 or step == self.total):
      return
    width = 24
    filled = int(width * step / max(self.total, 1))
    bar = "=" * filled + (">" if filled < width else "") + " " * max(0, width - filled - 1)
    line = (
      f"step {step:>6}/{self.total} [{bar}] loss {loss:7.4f} | "
      f"{tokens_per_s / 1e3:8.1f}k tok/s | {human_bytes(bytes_sent)}/step sent"
    )
    if self.tty:
      self.stream.write("\r" + line)
      if step == self.total:
        self.stream.write("\n")
    else:
      self.stream.write(line + "\n")
    self.stream.flush()

  def message(self, text: str) -> None:
    if self.enabled:
      self.stream.write(("\n" if self.tty else "") + text + "\n")
      self.stream.flush()


class MetricsWriter:
  """Appends one :class:`~experiments.run.records.StepRecord` per step to ``OUT_DIR/metrics.jsonl``.

  Only process 0 writes (``enabled``); the others keep nothing.
  """

  def __init__(self, out_dir: str, *, enabled: bool, truncate_after: int | None = None):
    self.path = os.path.join(out_dir, "metrics.jsonl")
    self.enabled = enabled
    self.records: list[StepRecord] = []
    if not enabled:
      return
    os.makedirs(out_dir, exist_ok=True)
    if truncate_after is not None and os.path.exists(self.path):
      # On resume, drop lines past the checkpoint: those steps are replayed.
      # A process killed mid-write can leave a torn last line; it is dropped.
      # An event line (an elastic resume) stays if it came before the checkpoint;
      # one at the checkpoint's step belongs to the attempt being replaced.
      lines = read_jsonl(self.path)
      kept = [
        r
        for r in lines
        if r.get("step", 0) < truncate_after or r.get("step") == truncate_after and "event" not in r
      ]
      self.records = [StepRecord.from_json(r) for r in kept if "event" not in r]
      with open(self.path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    elif truncate_after is None and os.path.exists(self.path):
      os.remove(self.path)
    self._file = open(self.path, "a")  # noqa: SIM115 - lives as long as the run

  def write(self, record: StepRecord) -> None:
    self.records.append(record)
    if self.enabled:
      self._file.write(json.dumps(record.to_json()) + "\n")
      self._file.flush()

  def write_event(self, event: ResizeEvent) -> None:
    """Appends an event line, not a step (``records.read_metrics`` skips it)."""
    if self.enabled:
      self._file.write(json.dumps(event.to_json()) + "\n")
      self._file.flush()

  def close(self) -> None:
    if self.enabled:
      self._file.close()


class StepTimer:
  """Tokens per second over the steps since the last call."""

  def __init__(self):
    self._t = time.perf_counter()

  def lap(self) -> float:
    now = time.perf_counter()
    dt, self._t = now - self._t, now
    return dt


def plot_losses(records: list[StepRecord], path: str, title: str) -> None:
  """Loss against step, and loss against cumulative bytes sent per worker (log x)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  steps = [r.step for r in records]
  losses = [r.loss for r in records]
  cum, total = [], 0.0
  for r in records:
    total += r.bytes_sent
    cum.append(total)
  val = [(r.step, r.val_loss, c) for r, c in zip(records, cum) if r.val_loss is not None]

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  ax1.plot(steps, losses, label="train")
  ax2.plot(cum, losses, label="train")
  if val:
    ax1.plot([v[0] for v in val], [v[1] for v in val], "o-", label="validation")
    ax2.plot([v[2] for v in val], [v[1] for v in val], "o-", label="validation")
  ax1.set_xlabel("step")
  ax2.set_xlabel("cumulative bytes sent per worker")
  ax2.set_xscale("log")
  for ax in (ax1, ax2):
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
