r"""Bandwidth-shaped links between processes on one Linux machine, and their teardown.

A lab is N network namespaces, one per training process, each with a veth
pair whose other end sits on a bridge in a hub namespace of its own:

  p0:eth0 <-> hub:v0 --+
  p1:eth0 <-> hub:v1 --+-- hub:br0
  ...

Nothing is created in the caller's namespace, so host firewall rules (a
Docker host's ``FORWARD DROP``, ``br_netfilter``) never see the traffic, and
deleting the namespaces removes every interface. Shaping is ``tc qdisc tbf``
on both ends of a process's veth: ``eth0`` egress is its upload, ``v<i>``
egress its download, so each process's link runs at its rate both ways.

With impairments (:meth:`Lab.impair`) the hub routes instead of bridging:
what arrives on ``v<i>`` goes to a TUN device, where
:mod:`experiments.netlab.impair` delays or drops it, and what it writes back
goes out of its destination's ``v<j>``. :meth:`Lab.set_link` takes a link
down and up (a blackout).

Every name carries the tag ``nl<launcher pid>``. A guardian process, started
with the lab, tears it down if the launcher dies without doing so (SIGKILL),
and :func:`sweep_stale` removes labs whose launcher is gone.

  python -m experiments.netlab.links --guard=nl1234   # what Lab.create starts
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from experiments.netlab.impair import Impairment

__all__ = [
  "ROOT",
  "Lab",
  "NetlabError",
  "check_prerequisites",
  "leftovers",
  "missing_prerequisite",
  "sweep_stale",
  "teardown_tag",
]

_CLONE_NEWUTS = 0x04000000
_PR_SET_PDEATHSIG = 1
_SUBNET = "10.77.0"
_HUB_ADDRESS = "10.77.255.254"
_TUN = "tun0"
# Policy routing of a routed (impaired) lab: what arrives from a process's
# link goes to the TUN device, what the forwarder writes back goes to its
# destination's link.
_TO_FORWARDER, _FROM_FORWARDER = 101, 100
_TAG_RE = re.compile(r"^nl(\d+)-")
# The directory that holds ``experiments``: every process the lab starts runs
# there, so ``python -m experiments...`` imports this copy of the code.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class NetlabError(RuntimeError):
  """The lab cannot be built or run; the message says what is needed."""


def missing_prerequisite() -> str | None:
  """Why this machine cannot build a lab, or None if it can (as far as can be seen unbuilt)."""
  if sys.platform != "linux":
    return f"netlab needs Linux network namespaces; this is {sys.platform}."
  if os.geteuid() != 0:
    return (
      "netlab needs root: it creates network namespaces, veth pairs, a bridge and tc "
      "qdiscs (CAP_SYS_ADMIN and CAP_NET_ADMIN). Run it as root, e.g. "
      "`sudo -E python -m experiments.netlab ...`."
    )
  missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
  if missing:
    return (
      f"netlab needs iproute2's `ip` and `tc` on PATH; {' and '.join(missing)} not found. "
      "Install iproute2 (e.g. `apt-get install iproute2`)."
    )
  return None


def check_prerequisites() -> None:
  """Raises :class:`NetlabError` naming what is missing (root, ``ip``, ``tc``)."""
  reason = missing_prerequisite()
  if reason:
    raise NetlabError(reason)


# What a failing command's stderr means, and what fixes it.
_HINTS = (
  (
    ("tbf", "Unknown qdisc", "qdisc kind is unknown", "No such file"),
    "The kernel has no tbf qdisc: load it with `modprobe sch_tbf`, or use a kernel built "
    "with CONFIG_NET_SCH_TBF.",
  ),
  (
    ("type bridge", "Unknown device type", "not supported"),
    "The kernel lacks bridge or veth support: `modprobe bridge veth`, or use a kernel built "
    "with CONFIG_BRIDGE and CONFIG_VETH.",
  ),
  (
    ("netns add", "Operation not permitted", "Permission denied"),
    "Creating network namespaces needs root with CAP_SYS_ADMIN (a container may need "
    "--privileged or --cap-add=SYS_ADMIN,NET_ADMIN).",
  ),
)


def _hint(cmd: str, stderr: str) -> str:
  for needles, hint in _HINTS:
    if needles[0] in cmd and any(n in stderr for n in needles[1:]):
      return " " + hint
  return ""


def _run(*argv: str) -> str:
  """Runs one ``ip``/``tc`` command; a failure raises NetlabError with its stderr and a hint."""
  try:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
  except FileNotFoundError:
    raise NetlabError(
      f"`{argv[0]}` not found; netlab needs iproute2 (e.g. `apt-get install iproute2`)."
    ) from None
  if done.returncode:
    cmd = " ".join(argv)
    err = done.stderr.strip()
    raise NetlabError(f"`{cmd}` failed: {err}.{_hint(cmd, err)}")
  return done.stdout


def _namespaces() -> list[str]:
  out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids_in(namespace: str) -> list[int]:
  out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout
  return [int(p) for p in out.split()]


def leftovers(tag: str) -> dict[str, list]:
  """What of lab ``tag`` still exists.

  Args:
    tag: the lab's name prefix, ``nl<launcher pid>``.

  Returns:
    ``{"namespaces": [...], "pids": [...]}``: its namespaces and the processes inside them.
  """
  names = [n for n in _namespaces() if n.startswith(f"{tag}-")]
  return {"namespaces": names, "pids": [p for n in names for p in _pids_in(n)]}


def teardown_tag(tag: str) -> None:
  """Kills every process in lab ``tag``'s namespaces, then deletes the namespaces.

  Args:
    tag: the lab's name prefix, ``nl<launcher pid>``.

  Deleting a namespace destroys the interfaces in it (both ends of each veth,
  the bridge, their qdiscs). A namespace still held by a process would only
  vanish from ``ip netns list`` and linger, hence the kill first.
  """
  names = [n for n in _namespaces() if n.startswith(f"{tag}-")]
  for name in names:
    for pid in _pids_in(name):
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline and any(_pids_in(n) for n in names):
    time.sleep(0.05)
  for name in names:
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def sweep_stale() -> list[str]:
  """Tears down labs whose launcher process is gone; returns their tags."""
  stale = set()
  for name in _namespaces():
    m = _TAG_RE.match(name)
    if m and not _alive(int(m.group(1))):
      stale.add(f"nl{m.group(1)}")
  for tag in sorted(stale):
    teardown_tag(tag)
  return sorted(stale)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _enter_child_namespaces(hostname: str) -> None:
  """preexec_fn of a process in the lab: own UTS namespace, die with the launcher.

  Gloo (JAX's CPU collectives) advertises the address that ``gethostname()``
  resolves to, and JAX gives it no other choice. Naming the process's UTS
  namespace after its lab address makes that the address peers can reach.
  """
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.unshare(_CLONE_NEWUTS):
    raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS) failed")
  socket.sethostname(hostname)
  libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclasses.dataclass
class Lab:
  """N process namespaces on a bridge; see the module docstring.

  Attributes:
    num_processes: N.
    tag: the prefix of every name, ``nl<launcher pid>`` by default.
  """

  num_processes: int
  tag: str = dataclasses.field(default_factory=lambda: f"nl{os.getpid()}")

  def __post_init__(self) -> None:
    # Addresses .1 to .250 of one /24.
    if not 1 <= self.num_processes <= 250:
      raise NetlabError(f"--processes must be in [1, 250], got {self.num_processes}.")
    self._guardian: subprocess.Popen | None = None
    self._routed = False

  @property
  def hub(self) -> str:
    """The hub namespace, which holds the bridge and every process's far veth end."""
    return f"{self.tag}-hub"

  def namespace(self, i: int) -> str:
    """Process ``i``'s namespace."""
    return f"{self.tag}-p{i}"

  def address(self, i: int) -> str:
    """Process ``i``'s IPv4 address on the bridge."""
    return f"{_SUBNET}.{i + 1}"

  def hub_interface(self, i: int) -> str:
    """Process ``i``'s veth end on the bridge: its rx is the process's upload."""
    return f"v{i}"

  def create(self) -> None:
    """Builds the namespaces, veths and bridge, and checks that tbf is available.

    Raises:
      NetlabError: a prerequisite is missing or a command failed; nothing is left behind.
    """
    check_prerequisites()
    self._guardian = subprocess.Popen(
      [sys.executable, "-m", "experiments.netlab.links", f"--guard={self.tag}"],
      stdin=subprocess.PIPE,
      stdout=subprocess.DEVNULL,
      start_new_session=True,  # Ctrl-C at the terminal must not reach it
      cwd=ROOT,
    )
    try:
      _run("ip", "netns", "add", self.hub)
      # An address of the hub's own, so that its local routing table exists: a
      # routed lab (impair) resolves neighbours through it, and without it the
      # kernel takes every neighbour for a broadcast address.
      _run("ip", "-n", self.hub, "addr", "add", f"{_HUB_ADDRESS}/32", "dev", "lo")
      _run("ip", "-n", self.hub, "link", "set", "lo", "up")
      _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
      _run("ip", "-n", self.hub, "link", "set", "br0", "up")
      for i in range(self.num_processes):
        ns = self.namespace(i)
        _run("ip", "netns", "add", ns)
        _run(
          "ip", "link", "add", self.hub_interface(i), "netns", self.hub,
          "type", "veth", "peer", "name", "eth0", "netns", ns,
        )  # fmt: skip
        _run("ip", "-n", self.hub, "link", "set", self.hub_interface(i), "master", "br0", "up")
        _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
      # Probe the qdisc now, before any training starts.
      self._tbf(self.hub, self.hub_interface(0), 10.0, 100.0)
      _run("tc", "-n", self.hub, "qdisc", "del", "dev", self.hub_interface(0), "root")
    except BaseException:
      self.teardown()
      raise

  @staticmethod
  def _tbf(namespace: str, dev: str, rate_mbit: float, latency_ms: float) -> None:
    rate_bytes = rate_mbit * 1e6 / 8
    # A veth hands tbf whole GSO super-packets of up to 64 KiB; a smaller burst
    # would drop them. Above ~50 Mbit/s, 10 ms worth of rate is the larger.
    burst = max(65536 + 1514, int(rate_bytes * 0.01))
    _run(
      "tc", "-n", namespace, "qdisc", "replace", "dev", dev, "root", "tbf",
      "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", f"{latency_ms}ms",
    )  # fmt: skip

  def shape(self, rates_mbit: Sequence[float], latency_ms: float) -> None:
    """Limits process ``i``'s link to ``rates_mbit[i]`` in both directions.

    Args:
      rates_mbit: one rate in Mbit/s per process.
      latency_ms: tbf's queueing budget; a packet that would wait longer is dropped.
    """
    if len(rates_mbit) != self.num_processes:
      raise NetlabError(f"{len(rates_mbit)} rates for {self.num_processes} processes.")
    for i, rate in enumerate(rates_mbit):
      self._tbf(self.namespace(i), "eth0", rate, latency_ms)  # upload
      self._tbf(self.hub, self.hub_interface(i), rate, latency_ms)  # download

  def impair(
    self,
    impairments: Sequence[Impairment],
    *,
    seed: int = 0,
    stats_path: str | None = None,
    env: Mapping[str, str] | None = None,
  ) -> None:
    """Adds delay, jitter and loss to each process's link, through a user-space forwarder.

    The hub stops bridging and routes instead: every packet from a process's
    link goes into a TUN device, where :mod:`experiments.netlab.impair`
    delays or drops it as both links it crosses say, and back out to its
    destination's link (proxy ARP answers for the peers on each link). The
    rate shaping of :meth:`shape` stays as it is.

    Args:
      impairments: one per process.
      seed: seeds the forwarder's draws of jitter and loss.
      stats_path: where the forwarder writes its packet and drop counts.
      env: the forwarder's environment.

    Raises:
      NetlabError: a command failed, or the forwarder did not attach.
    """
    if len(impairments) != self.num_processes:
      raise NetlabError(f"{len(impairments)} impairments for {self.num_processes} processes.")
    hub = self.hub
    sysctl = ["net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0"]
    sysctl += ["net.ipv4.conf.default.rp_filter=0"]
    for i in range(self.num_processes):
      dev = self.hub_interface(i)
      sysctl += [f"net.ipv4.conf.{dev}.proxy_arp=1", f"net.ipv4.conf.{dev}.rp_filter=0"]
    _run("ip", "netns", "exec", hub, "sysctl", "-q", "-w", *sysctl)
    _run("ip", "-n", hub, "tuntap", "add", "dev", _TUN, "mode", "tun")
    _run("ip", "netns", "exec", hub, "sysctl", "-q", "-w", f"net.ipv4.conf.{_TUN}.rp_filter=0")
    _run("ip", "-n", hub, "link", "set", _TUN, "up")
    _run("ip", "-n", hub, "route", "add", "default", "dev", _TUN, "table", str(_TO_FORWARDER))
    _run("ip", "-n", hub, "rule", "add", "iif", _TUN, "lookup", str(_FROM_FORWARDER),
         "priority", str(_FROM_FORWARDER))  # fmt: skip
    for i in range(self.num_processes):
      dev = self.hub_interface(i)
      _run("ip", "-n", hub, "link", "set", dev, "nomaster")
      self._route_to(i)
      _run("ip", "-n", hub, "rule", "add", "iif", dev, "lookup", str(_TO_FORWARDER),
           "priority", str(_TO_FORWARDER))  # fmt: skip
      # The peers' addresses now answer with the hub's side of the link.
      _run("ip", "-n", self.namespace(i), "neigh", "flush", "all")
    self._routed = True
    links = [
      f"{self.address(i)}={imp.delay_ms:g},{imp.jitter_ms:g},{imp.loss_pct:g}"
      for i, imp in enumerate(impairments)
    ]
    argv = [sys.executable, "-m", "experiments.netlab.impair", f"--tun={_TUN}", f"--seed={seed}"]
    argv += [f"--stats={os.path.abspath(stats_path)}"] if stats_path else []
    forwarder = self.popen_hub([*argv, *links], env=env)
    deadline = time.monotonic() + 60
    while "LOWER_UP" not in _run("ip", "-n", hub, "link", "show", _TUN):
      if forwarder.poll() is not None or time.monotonic() > deadline:
        raise NetlabError(
          f"the impairment forwarder did not attach to {_TUN} (exit status "
          f"{forwarder.poll()}); is /dev/net/tun available (`modprobe tun`)?"
        )
      time.sleep(0.05)

  def _route_to(self, i: int) -> None:
    """The routed lab's way to process ``i``: out of its link (gone whenever the link went down)."""
    _run("ip", "-n", self.hub, "route", "replace", f"{self.address(i)}/32",
         "dev", self.hub_interface(i), "table", str(_FROM_FORWARDER))  # fmt: skip

  def set_link(self, i: int, up: bool) -> None:
    """Takes process ``i``'s link down (dark: nothing passes, either way) or back up.

    The hub's end of the veth goes down, so the process's end loses its
    carrier too; its qdiscs, and in a routed lab its route, come back with it.

    Args:
      i: the process.
      up: up or down.
    """
    _run("ip", "-n", self.hub, "link", "set", self.hub_interface(i), "up" if up else "down")
    if up and self._routed:
      self._route_to(i)

  def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """Starts ``argv`` in process ``i``'s namespace, in a session of its own.

    It dies with the launcher (``PR_SET_PDEATHSIG``), and its hostname is its
    lab address, which is what gloo advertises to its peers.

    Args:
      i: the process index.
      argv: the command.
      **kwargs: passed to ``subprocess.Popen`` (stdout, env, ...); ``cwd``
        defaults to :data:`ROOT`. ``ip netns exec`` keeps the environment,
        ``PYTHONPATH`` included.

    Returns:
      The started process; its pid leads its session.
    """
    address = self.address(i)
    return subprocess.Popen(
      ["ip", "netns", "exec", self.namespace(i), *argv],
      preexec_fn=lambda: _enter_child_namespaces(address),
      start_new_session=True,
      **{"cwd": ROOT, **kwargs},
    )

  def popen_hub(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """Starts ``argv`` in the hub namespace, where every process's link can be read.

    Args:
      argv: the command.
      **kwargs: passed to ``subprocess.Popen``; ``cwd`` defaults to :data:`ROOT`.

    Returns:
      The started process, which dies with the launcher.
    """
    return subprocess.Popen(
      ["ip", "netns", "exec", self.hub, *argv],
      preexec_fn=lambda: ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL),
      start_new_session=True,
      **{"cwd": ROOT, **kwargs},
    )

  def teardown(self) -> None:
    """Kills whatever runs in the lab and deletes it; idempotent.

    Raises:
      NetlabError: something of the lab survived (it is named).
    """
    teardown_tag(self.tag)
    if self._guardian is not None:
      self._guardian.stdin.close()  # the guardian finds nothing left and exits
      self._guardian.wait(timeout=30)
      self._guardian = None
    left = leftovers(self.tag)
    if left["namespaces"] or left["pids"]:
      raise NetlabError(f"teardown of {self.tag} left {left}; remove them with `ip netns del`.")


def _guard(argv: Sequence[str]) -> None:
  """The guardian: waits for the launcher to close (or lose) the pipe, then removes what it left."""
  arg = argv[0] if len(argv) == 1 else ""
  if not arg.startswith("--guard="):
    sys.exit("usage: python -m experiments.netlab.links --guard=TAG")
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  sys.stdin.buffer.read()
  teardown_tag(arg.removeprefix("--guard="))


if __name__ == "__main__":
  _guard(sys.argv[1:])
