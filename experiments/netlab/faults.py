"""What goes wrong on the lab's shaped links, on purpose: impairments and a blackout.

The lab's flags name them (:class:`experiments.netlab.lab.LabConfig`):
``--delay_ms``, ``--jitter_ms`` and ``--loss_pct`` per link
(:func:`impairments`), applied by :meth:`experiments.netlab.links.Lab.impair`;
and ``--blackout_s`` of one link once process 0 has logged
``--blackout_step`` (:class:`Blackout`), which the lab's wait loop drives.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from experiments.netlab.impair import Impairment
from experiments.netlab.links import Lab, NetlabError
from experiments.run import records

__all__ = ["Blackout", "check_blackout", "describe", "impairments", "per_process"]


def per_process(flag: str, text: str, processes: int, *, low: float, high: float) -> list[float]:
  """``"10"`` or ``"10,20,30,40"`` -> one value per process, each in ``[low, high)``.

  Args:
    flag: the flag's name, for the message.
    text: its value.
    processes: N.
    low: the least value allowed.
    high: the first value not allowed.

  Raises:
    NetlabError: not numbers, out of range, or neither one nor N of them.
  """
  try:
    values = [float(x) for x in text.split(",")]
  except ValueError:
    raise NetlabError(
      f"--{flag}={text!r} is not a number or a comma-separated list of numbers "
      f"(one for every link, or one per process)."
    ) from None
  if any(not low <= v < high for v in values):
    raise NetlabError(f"--{flag}={text!r}: every value must be in [{low:g}, {high:g}).")
  if len(values) == 1:
    return values * processes
  if len(values) != processes:
    raise NetlabError(
      f"--{flag} lists {len(values)} values for --processes={processes}; give one for all "
      "or exactly one per process."
    )
  return values


def impairments(
  delay_ms: str, jitter_ms: str, loss_pct: str, processes: int
) -> list[Impairment] | None:
  """Each process's link impairment from the flags, or None when none is asked for."""
  delay = per_process("delay_ms", delay_ms, processes, low=0, high=60_000)
  jitter = per_process("jitter_ms", jitter_ms, processes, low=0, high=60_000)
  loss = per_process("loss_pct", loss_pct, processes, low=0, high=100)
  links = [Impairment(d, j, p) for d, j, p in zip(delay, jitter, loss)]
  return links if any(links) else None


class Blackout:
  """One link dark for a while, once process 0 has logged a step; driven by :meth:`tick`.

  Args:
    lab: the built lab.
    process: whose link goes dark.
    step: it goes dark once process 0 has logged this step.
    seconds: for how long.
  """

  def __init__(self, lab: Lab, process: int, step: int, seconds: float):
    self.lab, self.process, self.step, self.seconds = lab, process, step, seconds
    self.dark_from: float | None = None  # time.time()
    self.dark_until: float | None = None
    self.after_step: int | None = None

  @property
  def dark(self) -> bool:
    return self.dark_from is not None and self.dark_until is None

  def tick(self, run_dir: str) -> None:
    """Takes the link down when its step has come, and back up when its time is over."""
    now = time.time()
    if self.dark_from is None:
      path = os.path.join(run_dir, "metrics.jsonl")
      logged = records.read_metrics(run_dir) if os.path.exists(path) else []
      if logged and logged[-1].step >= self.step:
        self.lab.set_link(self.process, up=False)
        self.dark_from, self.after_step = now, logged[-1].step
        print(
          f"netlab: link of process {self.process} dark for {self.seconds:g} s after step "
          f"{self.after_step}",
          flush=True,
        )
    elif self.dark and now >= self.dark_from + self.seconds:
      self.end()

  def end(self) -> None:
    """Brings the link back now (at the latest when the run ends)."""
    if self.dark:
      self.lab.set_link(self.process, up=True)
      self.dark_until = time.time()
      print(f"netlab: link of process {self.process} back up", flush=True)

  def wait_over(self) -> None:
    """Waits out the blackout: a restarted run needs the link (the machine) back first."""
    while self.dark:
      time.sleep(max(0.0, min(0.5, self.dark_from + self.seconds - time.time())))
      if time.time() >= self.dark_from + self.seconds:
        self.end()

  def summary(self) -> dict[str, Any]:
    return {
      "process": self.process,
      "seconds": self.seconds,
      "asked_at_step": self.step,
      "after_step": self.after_step,
      "dark_from": self.dark_from,
      "dark_until": self.dark_until,
    }


def check_blackout(process: int, step: int, seconds: float, processes: int, steps: int) -> None:
  """Refuses a blackout that cannot happen: a process that is not there, a step outside the run."""
  if seconds < 0:
    raise NetlabError(f"--blackout_s={seconds:g} must be 0 (none) or more.")
  if not seconds:
    return
  if not -processes <= process < processes:
    raise NetlabError(f"--blackout_process={process} is not one of the {processes} processes.")
  if not 0 < step < steps:
    raise NetlabError(f"--blackout_step={step} must be in [1, --steps={steps}).")


def describe(links: Sequence[Impairment] | None) -> str:
  """``"25 ms delay, 5 ms jitter, 0.5% loss per link"`` (or per process when they differ)."""
  if not links:
    return "no delay or loss"
  parts = []
  for name, unit, values in (
    ("delay", " ms", [x.delay_ms for x in links]),
    ("jitter", " ms", [x.jitter_ms for x in links]),
    ("loss", "%", [x.loss_pct for x in links]),
  ):
    if any(values):
      text = f"{values[0]:g}" if len(set(values)) == 1 else "/".join(f"{v:g}" for v in values)
      parts.append(f"{text}{unit} {name}")
  return ", ".join(parts) + " per link"
