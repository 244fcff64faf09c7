r"""Delay, jitter and loss on the lab's links, from user space: a forwarder on a TUN device.

This kernel has neither the ``netem`` qdisc nor tc's ``gact`` action, so the
lab routes its traffic through a process instead. With impairments on
(:meth:`experiments.netlab.links.Lab.impair`), the hub namespace stops
bridging: it routes every packet that arrives from a process's link into a
TUN device, this forwarder reads it there, holds it for the link's delay (or
drops it), and writes it back, and the hub routes it on to its destination's
link. A packet from process i to process j crosses two links, i's (its
upload) and j's (its download), and meets both links' impairments:

- **delay**: each link's one-way delay, so the round trip between i and j
  is ``2 (delay_i + delay_j)``; ``--delay_ms=25`` everywhere gives 100 ms;
- **jitter**: each link adds a uniform draw in ``[-jitter, +jitter]`` to its
  delay (the total is never below 0). Packets between the same two processes
  leave in the order they came, as on a real path: a packet that drew a
  shorter delay than the one before it waits for it, so a burst leaves
  behind its slowest packet, as it would behind a queue;
- **loss**: each link drops a packet with its probability, independently,
  so ``--loss_pct=0.5`` everywhere loses 1 - 0.995^2 = 0.9975% end to end.

The rate stays with ``tc tbf`` on the veths (:meth:`experiments.netlab.links.Lab.shape`).

  python -m experiments.netlab.impair --tun=tun0 --seed=0 --stats=stats.json \
      10.77.0.1=25,5,0.5 10.77.0.2=25,5,0.5   # address=delay_ms,jitter_ms,loss_pct
"""

from __future__ import annotations

import dataclasses
import fcntl
import heapq
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Forwarder", "Impairment", "endpoints", "parse_link", "run"]

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000


@dataclasses.dataclass(frozen=True)
class Impairment:
  """One link's impairments, the same in both directions.

  Attributes:
    delay_ms: one-way delay the link adds.
    jitter_ms: half-width of the uniform variation of that delay.
    loss_pct: percent of packets the link drops.
  """

  delay_ms: float = 0.0
  jitter_ms: float = 0.0
  loss_pct: float = 0.0

  def __bool__(self) -> bool:
    return bool(self.delay_ms or self.jitter_ms or self.loss_pct)


def parse_link(text: str) -> tuple[str, Impairment]:
  """``"10.77.0.1=25,5,0.5"`` -> the address and its :class:`Impairment`."""
  address, _, values = text.partition("=")
  delay, jitter, loss = (float(v) for v in values.split(","))
  return address, Impairment(delay, jitter, loss)


def endpoints(packet: bytes) -> tuple[bytes, bytes] | None:
  """The IPv4 source and destination of a packet as the TUN device hands it, or None."""
  if len(packet) < 20 or packet[0] >> 4 != 4:
    return None
  return packet[12:16], packet[16:20]


class Forwarder:
  """Decides, per packet, when it leaves or whether it is dropped (no I/O: testable).

  Args:
    links: impairment per IPv4 address (the process behind each link).
    seed: seeds the draws of jitter and loss.
  """

  def __init__(self, links: Mapping[str, Impairment], seed: int = 0):
    self.links = {socket.inet_aton(a): imp for a, imp in links.items()}
    self.rng = random.Random(seed)
    self._last: dict[tuple[bytes, bytes], float] = {}
    self._queue: list[tuple[float, int, bytes]] = []
    self._seq = 0
    self.stats = {a: {"packets": 0, "dropped": 0} for a in links}

  def _crossing(self, address: bytes) -> tuple[float, bool]:
    """One link's delay in seconds for this packet, and whether it drops it."""
    imp = self.links.get(address)
    if imp is None:
      return 0.0, False
    entry = self.stats[socket.inet_ntoa(address)]
    entry["packets"] += 1
    if imp.loss_pct and self.rng.random() * 100 < imp.loss_pct:
      entry["dropped"] += 1
      return 0.0, True
    jitter = self.rng.uniform(-imp.jitter_ms, imp.jitter_ms) if imp.jitter_ms else 0.0
    return (imp.delay_ms + jitter) / 1000, False

  def admit(self, packet: bytes, now: float) -> float | None:
    """Queues ``packet``; returns when it leaves, or None if a link dropped it."""
    ends = endpoints(packet)
    if ends is None:
      release = now
    else:
      up, lost = self._crossing(ends[0])
      if lost:
        return None  # it never reaches the second link
      down, lost = self._crossing(ends[1])
      if lost:
        return None
      # Never ahead of the packet before it on the same path.
      release = max(now + max(0.0, up + down), self._last.get(ends, 0.0))
      self._last[ends] = release
    self._seq += 1
    heapq.heappush(self._queue, (release, self._seq, packet))
    return release

  def due(self, now: float) -> list[bytes]:
    """The packets whose time has come, in the order they leave."""
    out = []
    while self._queue and self._queue[0][0] <= now:
      out.append(heapq.heappop(self._queue)[2])
    return out

  def next_release(self) -> float | None:
    return self._queue[0][0] if self._queue else None


def _open_tun(name: str) -> int:
  """Attaches to the (persistent) TUN device ``name`` that the lab created."""
  fd = os.open("/dev/net/tun", os.O_RDWR)
  fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
  return fd


def _write_stats(path: str | None, forwarder: Forwarder) -> None:
  if path:
    with open(path + ".tmp", "w") as f:
      json.dump(forwarder.stats, f)
    os.replace(path + ".tmp", path)


def run(tun: str, links: Mapping[str, Impairment], *, seed: int, stats: str | None) -> None:
  """Forwards packets through ``tun`` until SIGTERM (or the lab's teardown kills it)."""
  forwarder = Forwarder(links, seed)
  fd = _open_tun(tun)
  stopping = []
  signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
  last_stats = time.monotonic()
  while not stopping:
    now = time.monotonic()
    nxt = forwarder.next_release()
    timeout = 0.5 if nxt is None else min(0.5, max(0.0, nxt - now))
    try:
      readable, _, _ = select.select([fd], [], [], timeout)
    except InterruptedError:
      continue
    if readable:
      # Take everything waiting, so one slow wake-up does not delay a burst.
      while True:
        try:
          packet = os.read(fd, 65536)
        except BlockingIOError:
          break
        forwarder.admit(packet, time.monotonic())
        if not select.select([fd], [], [], 0)[0]:
          break
    for packet in forwarder.due(time.monotonic()):
      os.write(fd, packet)
    if time.monotonic() - last_stats > 2:
      _write_stats(stats, forwarder)
      last_stats = time.monotonic()
  _write_stats(stats, forwarder)


def _main(argv: Sequence[str]) -> None:
  options: dict[str, Any] = {"tun": "tun0", "seed": 0, "stats": None}
  links = {}
  for arg in argv:
    if arg.startswith("--"):
      key, _, value = arg[2:].partition("=")
      options[key] = int(value) if key == "seed" else value
    else:
      address, imp = parse_link(arg)
      links[address] = imp
  if not links:
    sys.exit("usage: python -m experiments.netlab.impair --tun=NAME ADDRESS=DELAY,JITTER,LOSS...")
  run(options["tun"], links, seed=options["seed"], stats=options["stats"])


if __name__ == "__main__":
  _main(sys.argv[1:])
