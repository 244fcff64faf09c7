r"""Interface byte counters from ``/sys/class/net/*/statistics``, sampled over time.

netlab runs this as a process of its own inside the hub namespace
(``/sys/class/net`` shows the namespace a process runs in), where every
process's veth end sits:

  python -m experiments.netlab.counters --interval_s=0.2 v0 v1 > link_counters.jsonl

Each line is ``{"t": unix_time, "bytes": {iface: [rx, tx]}}``; read them back
with :func:`experiments.run.records.read_jsonl`. Between samples,
:func:`bytes_between` interpolates linearly.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["bytes_between", "read_counters"]

_SYS_NET = "/sys/class/net"


def read_counters(ifaces: Sequence[str]) -> dict[str, list[int]]:
  """The kernel's byte counters of ``ifaces`` now.

  Args:
    ifaces: interface names in the caller's network namespace.

  Returns:
    ``{iface: [rx_bytes, tx_bytes]}``.
  """
  out = {}
  for iface in ifaces:
    stats = os.path.join(_SYS_NET, iface, "statistics")
    with open(os.path.join(stats, "rx_bytes")) as rx, open(os.path.join(stats, "tx_bytes")) as tx:
      out[iface] = [int(rx.read()), int(tx.read())]
  return out


def bytes_between(
  samples: Sequence[Mapping[str, Any]], iface: str, t0: float, t1: float
) -> tuple[float, float]:
  """(rx, tx) bytes that crossed ``iface`` between unix times ``t0`` and ``t1``.

  Args:
    samples: the sampler's lines, in time order.
    iface: one of the sampled interfaces.
    t0: start of the window, unix seconds.
    t1: end of the window.

  Returns:
    ``(rx_bytes, tx_bytes)``, interpolated linearly between samples.

  Raises:
    ValueError: the samples do not cover ``[t0, t1]``.
  """
  ts = np.array([s["t"] for s in samples])
  if not len(ts) or t0 < ts[0] or t1 > ts[-1]:
    span = f"[{ts[0]:.1f}, {ts[-1]:.1f}]" if len(ts) else "nothing"
    raise ValueError(f"counter samples cover {span}, not [{t0:.1f}, {t1:.1f}]")
  counts = np.array([s["bytes"][iface] for s in samples], dtype=np.float64)
  rx = np.interp([t0, t1], ts, counts[:, 0])
  tx = np.interp([t0, t1], ts, counts[:, 1])
  return float(rx[1] - rx[0]), float(tx[1] - tx[0])


def _sample_forever(argv: Sequence[str]) -> None:
  """The sampler: one line on stdout every ``--interval_s`` until it is killed."""
  interval, ifaces = 0.2, []
  for arg in argv:
    if arg.startswith("--interval_s="):
      interval = float(arg.split("=", 1)[1])
    else:
      ifaces.append(arg)
  if not ifaces:
    sys.exit("usage: python -m experiments.netlab.counters [--interval_s=S] IFACE...")
  while True:
    sys.stdout.write(json.dumps({"t": time.time(), "bytes": read_counters(ifaces)}) + "\n")
    sys.stdout.flush()
    time.sleep(interval)


if __name__ == "__main__":
  _sample_forever(sys.argv[1:])
