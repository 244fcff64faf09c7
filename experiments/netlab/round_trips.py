"""The round trips a training step makes across processes, counted from its compiled programs.

On a far link a step's time is not only its bytes: every collective that
crosses processes is a chain of dependent transfers, and each waits for the
distance. This counts them, for a method's fused train step and for the
overlapped exchange's three programs (:mod:`experiments.run.threaded_step`),
from the compiled HLO (:func:`distro_jax.collective_bytes_by_axes` finds the
collectives that cross the workers' axis). The calls the driver makes outside
the HLO are listed in :data:`HOST_CALLS`, read from the trainer: since issue
69 none crosses processes on the step's path (before, the step number's
check did, :data:`STEP_CHECK`, and the step all-reduced its loss), so a DeMo
step's only collective on the path is its message's all-gather.

The model (``docs/netlab.md``, "Round trips per step"):

- gloo runs XLA's CPU collectives as rings. An all-gather over W processes
  is W - 1 hops; an all-reduce is a reduce-scatter and an all-gather, 2 (W - 1)
  hops. In a hop every process sends a chunk to one neighbour and waits for
  its other neighbour's; gloo sends at once, with no handshake, so a hop
  waits one one-way trip, half a round trip. A chunk larger than TCP's initial
  window waits a round trip more per extra window.
- XLA's CPU runtime all-reduces a tuple one operand after the other, so an
  all-reduce of n arrays is n chains.
- What runs in the overlapped exchange's own program runs beside the
  gradient's program: hidden while it is shorter than that compute.

:func:`count` compiles (no training) on CPU devices of this process, one per
simulated worker. The time model (:mod:`experiments.study.time_model`) takes
the hops and prices them on a link with a round trip and a loss rate.

Example:
  python -m experiments.netlab.round_trips --workers=4 demo-k8-1bit demo-k8-1bit-delayed
  python -m experiments.netlab.round_trips --recorded   # the model against netlab's cells
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Sequence
from typing import Any

from experiments.study import time_model
from experiments.study.time_model import Hop, Link, MeasuredCell

__all__ = [
  "HOST_CALLS",
  "NETLAB_BURST_BYTES",
  "STEP_CHECK",
  "Collective",
  "HostCall",
  "StepCount",
  "collectives_in",
  "count",
  "demo_step",
  "hops_of",
  "markdown",
  "recorded_cells",
  "ring_hops",
  "step_check_collectives",
]

# netlab's tc tbf bucket (experiments/netlab/links.py, Lab._tbf): 64 KiB and a frame.
NETLAB_BURST_BYTES = 65536 + 1514
# The all-reduces counted here sum f32 arrays: gloo splits an operand by element.
_ELEMENT_BYTES = 4
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"(?:true|false)_computation=%?([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective a step runs across processes.

  Attributes:
    kind: ``"all-gather"``, ``"all-reduce"``, ``"reduce-scatter"``,
      ``"collective-permute"`` or ``"all-to-all"``.
    operands: arrays it moves; XLA's CPU runtime runs one collective per
      operand, one after the other.
    operand_bytes: bytes one process puts in per operand (the mean, where
      the operands differ).
    program: the program it is in (``"train_step"``, ``"exchange"``,
      ``"apply"``, ``"host"`` for a driver's call).
    hidden: whether it runs beside the compute (the overlapped exchange's
      program) rather than on the step's critical path.
    every: it runs once every this many steps (a collective in a branch of
      a method that exchanges every H steps).
    where: the HLO instruction, or the file and line of a driver's call.
  """

  kind: str
  operands: int
  operand_bytes: int
  program: str
  hidden: bool = False
  every: int = 1
  where: str = ""


@dataclasses.dataclass(frozen=True)
class HostCall:
  """A call the driver makes per step outside the compiled programs.

  Attributes:
    what: what it does.
    where: ``file::function`` (or two, comma-separated).
    crosses: whether it talks to another process.
    on_path: whether the step waits for it.
    note: how often, and why it is or is not on the path.
  """

  what: str
  where: str
  crosses: bool
  on_path: bool
  note: str


# Read from the trainer's loop and what it calls, each named by its file and
# function. None crosses processes on the step's path: the step number's
# check (STEP_CHECK) and the loss's psums are gone since issue 69.
HOST_CALLS = (
  HostCall(
    "the step number placed on the mesh: jax.make_array_from_single_device_arrays",
    "experiments/run/trainer.py::step_number",
    False,
    False,
    "every step; each process puts the number on its own devices, with no check "
    "across processes (jax.device_put of a host value checks that every process "
    "passed the same one, an all-gather of 4 bytes waited for before the step: "
    "STEP_CHECK). The processes agree by construction: one start, checked once a "
    "run (trainer.py::_check_start_agreed), and the same loop",
  ),
  HostCall(
    "the batch placed: jax.make_array_from_process_local_data",
    "experiments/run/trainer.py::place",
    False,
    False,
    "every step; each process places its own rows, nothing is exchanged",
  ),
  HostCall(
    "the previous step's losses read: this process's devices' shards of metrics['loss']",
    "experiments/run/trainer.py::_read",
    False,
    True,
    "every step, one step late; the step returns each device's loss unreduced, so "
    "a process reads its own workers' losses alone",
  ),
  HostCall(
    "the workers' losses gathered for the log: multihost_utils.process_allgather",
    "experiments/run/trainer.py::_write",
    True,
    False,
    "in a multi-process run, once every --log_every steps (10 by default) and before "
    "an evaluation, a checkpoint and the end: one all-gather of the losses read since "
    "(4 bytes per worker and step); the log's mean is taken on the host "
    "(records.logged_loss). In one process nothing is exchanged",
  ),
  HostCall(
    "the preemption check: multihost_utils.reached_preemption_sync_point",
    "experiments/run/trainer.py::_run_claimed, experiments/run/preemption.py::reached",
    False,
    False,
    "every step; compares the step with a sync point the coordination service "
    "sets only after a SIGTERM (tsl's PreemptionSyncManager): no call per step",
  ),
  HostCall(
    "the watchdog's beat: key_value_set and key_value_dir_get",
    "experiments/run/peers.py::beat",
    True,
    False,
    "two calls to the coordination service (process 0) every min(5, "
    "max(0.5, --peer_timeout_s / 12)) s, 5 s at the default 60, on a thread of "
    "its own: bytes on the links, no wait in the step",
  ),
  HostCall(
    "the overlapped exchange's thread started and joined",
    "experiments/run/threaded_step.py::__call__",
    False,
    True,
    "every overlapped step; its all-gather is in the exchange program's HLO",
  ),
  HostCall(
    "validation: eval_step's pmean",
    "experiments/run/trainer.py::_run_claimed",
    True,
    False,
    "every --eval_every steps (10 in netlab), one all-reduce per batch; the lab "
    "leaves those steps out of its median",
  ),
  HostCall(
    "the replicas' check: replica_mismatches' pmax and pmin",
    "experiments/run/trainer.py::_run_claimed",
    True,
    False,
    "every --log_every steps with --check_replicas, off by default",
  ),
  HostCall(
    "a checkpoint: orbax's barriers through the coordination service",
    "experiments/run/trainer.py::_run_claimed",
    True,
    False,
    "every --checkpoint_every steps only",
  ),
)

# What the step did before issue 69, where the recorded cells ran it: the step
# number placed with jax.device_put, checked across processes every step.
STEP_CHECK = HostCall(
  "the step number placed on the mesh: jax.device_put(np.int32(step), replicated)",
  "experiments/run/trainer.py::_run_claimed (before issue 69)",
  True,
  True,
  "every step. In a multi-process run JAX checks that every process passed the "
  "same value (jax/_src/dispatch.py: multihost_utils.assert_equal), which "
  "all-gathers it with a program of its own (process_allgather) and waits for "
  "the result before the step is dispatched: one all-gather of 4 bytes",
)


def ring_hops(kind: str, workers: int) -> int:
  """Dependent hops of one operand's collective over ``workers`` processes.

  A ring all-gather is W - 1 hops, a ring all-reduce 2 (W - 1) (gloo's ring:
  reduce-scatter, then all-gather). A reduce-scatter is counted as the ring's
  W - 1; a permute or an all-to-all as one hop, every pair at once.

  Example:
    >>> ring_hops("all-gather", 4), ring_hops("all-reduce", 4)
    (3, 6)
  """
  if workers < 2:
    return 0
  if kind in ("all-gather", "reduce-scatter"):
    return workers - 1
  if kind == "all-reduce":
    return 2 * (workers - 1)
  if kind in ("collective-permute", "all-to-all"):
    return 1
  raise ValueError(f"unknown collective kind {kind!r}")


def _segments(nbytes: float) -> int:
  return max(1, math.ceil(nbytes / time_model.MSS_BYTES))


def hops_of(collective: Collective, workers: int) -> list[Hop]:
  """The hops of one collective, per step (a periodic one is left to its caller).

  In an all-gather hop every process forwards one message; in an all-reduce
  hop each process with data sends a chunk of 1/W of the operand (gloo's ring
  splits it into 2W segments, so a scalar is one segment carried by one
  process at a time); in an all-to-all's one hop every process sends 1/W of
  its operand to each peer, W (W - 1) connections at once.
  """
  hops = ring_hops(collective.kind, workers) * collective.operands
  if collective.kind == "all-reduce":
    elements = max(1, collective.operand_bytes // _ELEMENT_BYTES)
    segment = math.ceil(elements / (2 * workers))
    senders = min(workers, math.ceil(math.ceil(elements / segment) / 2))
    chunk = 2 * segment * _ELEMENT_BYTES
  elif collective.kind == "all-to-all":
    # One chunk per peer (one operand each, or one operand cut W ways), every
    # pair's connection carrying one at once: one hop however many operands.
    hops = min(hops, 1)
    senders = workers * (workers - 1)
    chunk = collective.operands * collective.operand_bytes // max(workers, 1)
  else:
    senders, chunk = workers, collective.operand_bytes
  one = Hop(
    segments=senders * _segments(chunk),
    flights=time_model.slow_start_flights(_segments(chunk)),
    senders=senders,
  )
  return [one] * hops


def _structure(hlo_text: str) -> tuple[dict[str, tuple[str, int]], set[str], str]:
  """Per instruction: its computation and operand count; the branch computations; ENTRY's name."""
  where: dict[str, tuple[str, int]] = {}
  branches: set[str] = set()
  computation, entry = "", ""
  for line in hlo_text.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      m = _HEADER.match(line)
      if m:
        computation = m.group(2)
        entry = computation if m.group(1) else entry
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    name, rest = m.groups()
    for group in _BRANCHES.findall(rest):
      branches.update(b.strip().lstrip("%") for b in group.split(","))
    branches.update(_TRUE_FALSE.findall(rest))
    # The operands of a tuple collective are its top-level commas plus one.
    call = rest.split("(", 1)[1] if "(" in rest else ""
    if rest.startswith("("):  # a tuple result: skip the shape
      depth = 0
      for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
          call = rest[i + 1 :].split("(", 1)[1] if "(" in rest[i + 1 :] else ""
          break
    depth, operands = 0, 1
    for ch in call:
      if ch in "([{":
        depth += 1
      elif ch in ")]}":
        if depth == 0:
          break
        depth -= 1
      elif ch == "," and depth == 0:
        operands += 1
    where[name] = (computation, operands)
  return where, branches, entry


def collectives_in(
  hlo_text: str,
  mesh: Any,
  *,
  program: str,
  axis: str = "replica",
  hidden: bool = False,
  every: int = 1,
) -> list[Collective]:
  """The collectives of one compiled program that cross ``axis``: the processes.

  Args:
    hlo_text: ``compiled.as_text()``.
    mesh: the mesh it was compiled for; one device per process along ``axis``.
    program: its name in the count.
    axis: the mesh axis whose devices are processes.
    hidden: whether the program runs beside the compute.
    every: for a collective in a conditional branch: it runs once every this
      many steps (the method's ``exchange_every``).

  Returns:
    One :class:`Collective` per HLO collective crossing ``axis``.
  """
  import distro_jax as dj

  where, branches, entry = _structure(hlo_text)
  found = []
  for axes, measured in dj.collective_bytes_by_axes(hlo_text, mesh).items():
    if axis not in axes:
      continue
    for kind, name, nbytes in measured.ops:
      computation, operands = where.get(name, (entry, 1))
      # A collective in a called computation other than a branch (a loop
      # body) would run more than once a step; none of the steps counted
      # here has one, so it is counted once and the name says where it is.
      found.append(
        Collective(
          kind,
          operands,
          nbytes // operands,
          program,
          hidden=hidden,
          every=every if computation in branches else 1,
          where=name if computation in (entry, *branches) else f"{name} in {computation}",
        )
      )
  return found


def step_check_collectives(workers: int) -> list[Collective]:
  """The step number's check as the recorded cells ran it (:data:`STEP_CHECK`), as JAX compiles it.

  ``multihost_utils.process_allgather`` of a scalar makes an ``int32[W]``
  split over a ``("processes", "local_devices")`` mesh and jits an identity
  to a replicated result; with one device per process this is that program.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  devices = np.array(jax.devices()[:workers]).reshape(workers, 1)
  mesh = jax.sharding.Mesh(devices, ("processes", "local_devices"))
  arg = jax.ShapeDtypeStruct((workers,), jnp.int32, sharding=NamedSharding(mesh, P("processes")))
  identity = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))
  text = identity.lower(arg).compile().as_text()
  return [
    dataclasses.replace(c, where=f"{STEP_CHECK.where} ({c.where})")
    for c in collectives_in(text, mesh, program="host", axis="processes")
  ]


@dataclasses.dataclass(frozen=True)
class StepCount:
  """What one step sends across processes, collective by collective.

  Attributes:
    method: the method's name with its options.
    workers: W, one process each.
    collectives: every collective of the step's programs and the driver's
      calls that crosses processes.
  """

  method: str
  workers: int
  collectives: tuple[Collective, ...]

  def hops(self, hidden: bool = False) -> list[Hop]:
    """The step's dependent hops on its critical path, or (``hidden``) beside its compute."""
    out: list[Hop] = []
    for c in self.collectives:
      if c.hidden == hidden and c.every == 1:
        out.extend(hops_of(c, self.workers))
    return out

  @property
  def round_trips(self) -> float:
    """Dependent round trips on the critical path (:func:`time_model.round_trips`)."""
    return time_model.round_trips(self.hops())

  @property
  def hidden_round_trips(self) -> float:
    """Round trips of the overlapped exchange, beside the compute."""
    return time_model.round_trips(self.hops(hidden=True))

  def with_message(self, message_bytes: int) -> StepCount:
    """The same step with another message (a larger model's): the exchange's all-gathers resized."""
    resized = tuple(
      dataclasses.replace(c, operand_bytes=message_bytes)
      if c.kind == "all-gather" and c.program != "host"
      else c
      for c in self.collectives
    )
    return dataclasses.replace(self, collectives=resized)


def demo_step(
  message_bytes: int,
  workers: int = 4,
  *,
  overlapped: bool = False,
  as_recorded: bool = False,
  kind: str = "all-gather",
) -> StepCount:
  """The count of a DeMo step as :func:`count` finds it (checked in ``tests/test_round_trips.py``).

  The message's all-gather (in the exchange's own program when overlapped)
  and nothing else. ``as_recorded`` gives the step as the recorded cells ran
  it, before issue 69: the loss's two f32 ``psum``\\ s as well (one tuple
  all-reduce: two chains, in the apply program when overlapped) and the step
  number's check (:data:`STEP_CHECK`). For the recorded cells, whose models
  are larger than what a unit test compiles. ``kind="all-to-all"`` is the
  ``-a2a`` exchange, whose operand holds the message once per worker.

  Example:
    >>> demo_step(1800).round_trips  # 3 hops, half a round trip each
    1.5
    >>> demo_step(1800, as_recorded=True).round_trips  # + 2 x 6 hops + 3 hops
    9.0
  """
  operand = message_bytes * (workers if kind == "all-to-all" else 1)
  program = "exchange" if overlapped else "train_step"
  collectives = [Collective(kind, 1, operand, program, overlapped)]
  if as_recorded:
    collectives += [
      Collective("all-reduce", 2, 4, "apply" if overlapped else "train_step"),
      Collective("all-gather", 1, 4, "host", where=STEP_CHECK.where),
    ]
  suffix = (", overlapped" if overlapped else "") + (", all-to-all" if kind == "all-to-all" else "")
  if as_recorded:
    suffix += ", as recorded"
  return StepCount(f"demo ({message_bytes} B message{suffix})", workers, tuple(collectives))


def count(
  method: str = "demo-k8-1bit", workers: int = 4, *, preset: str = "tiny", seq_len: int = 32
) -> StepCount:
  """Compiles one step of ``method`` (nothing runs) and counts what crosses processes.

  A method with ``-delayed`` is compiled as the overlapped exchange's three
  programs, as a multi-process CPU run runs it (``--overlap_exchange=thread``).
  Needs ``workers`` devices in this process (``--xla_force_host_platform_device_count``
  or ``jax_num_cpu_devices``); on ``tiny`` it takes seconds.

  Args:
    method: a method name with its options (``python -m experiments.methods``).
    workers: W.
    preset: the model; the count's structure does not depend on it, the
      message's size does.
    seq_len: tokens per sequence.

  Returns:
    A :class:`StepCount`: the collectives of the step's programs (no host
    call crosses processes on the step's path, :data:`HOST_CALLS`).
  """
  import jax
  import jax.numpy as jnp

  from experiments.run import checks, methods, trainer
  from experiments.run.launch import REPLICA

  spec, overrides = methods.parse(method)
  if overrides.get("delayed_apply"):
    overrides["overlap_exchange"] = "thread"
  cfg = checks.resolve(
    trainer.TrainConfig(
      preset=preset,
      workers=workers,
      batch_size=workers,
      seq_len=seq_len,
      scan_layers=True,
      progress=False,
      out_dir="unused",
      **overrides,
    )
  )
  program = trainer.build(cfg)
  state = program.abstract_state()
  step = jax.ShapeDtypeStruct((), jnp.int32, sharding=program.sharding())
  batch = jax.ShapeDtypeStruct(
    (cfg.batch_size, cfg.seq_len), jnp.int32, sharding=program.sharding(program.rows)
  )
  args = (state["params"], state["opt_state"], step, batch, batch)
  every = spec.exchange_every(cfg)
  if program.threaded_step is not None:
    texts = program.threaded_step.compile(*args).hlo_texts()
    named = zip(("exchange", "gradient", "apply"), texts, (True, False, False))
  else:
    named = [("train_step", program.train_step.lower(*args).compile().as_text(), False)]
  found = []
  for name, text, hidden in named:
    found += collectives_in(
      text, program.mesh, program=name, axis=REPLICA, hidden=hidden, every=every
    )
  return StepCount(method, workers, tuple(found))


def markdown(counts: Sequence[StepCount]) -> str:
  """A markdown table: each counted collective's hops and round trips, per step count."""
  lines = [
    "| step | program | collective | operands x bytes | hops | on the path | round trips |",
    "| --- | --- | --- | ---: | ---: | --- | ---: |",
  ]
  for sc in counts:
    for c in sc.collectives:
      hops = hops_of(c, sc.workers)
      path = "beside compute" if c.hidden else "yes"
      if c.every > 1:
        path = f"once every {c.every} steps"
      lines.append(
        f"| {sc.method} | {c.program} | {c.kind} | {c.operands} x {c.operand_bytes:,} | "
        f"{len(hops)} | {path} | {time_model.round_trips(hops):g} |"
      )
    lines.append(
      f"| **{sc.method}** | | | | | **on the path** | **{sc.round_trips:g}** "
      f"(beside compute: {sc.hidden_round_trips:g}) |"
    )
  return "\n".join(lines)


def _netlab_link(rate_mbit: float, rtt_s: float = 0.0, loss: float = 0.0) -> Link:
  return Link(
    f"{rate_mbit:g} Mbit/s", rate_mbit * 1e6, rate_mbit * 1e6, rtt_s, loss, NETLAB_BURST_BYTES
  )


def _demo_cell(
  label,
  link,
  workers,
  message,
  compute,
  measured,
  source,
  overlapped=False,
  as_recorded=True,
  kind="all-gather",
):
  step = demo_step(message, workers, overlapped=overlapped, as_recorded=as_recorded, kind=kind)
  return MeasuredCell(
    label,
    link,
    workers,
    kind,
    step.collectives[0].operand_bytes,
    compute,
    measured,
    overlapped_share=1.0 if overlapped else 0.0,
    hops=tuple(step.hops()),
    hidden_hops=tuple(step.hops(hidden=True)),
    source=source,
  )


def recorded_cells() -> list[MeasuredCell]:
  """netlab's recorded cells: the step on clean links (the compute) and on shaped ones.

  Sources: the sections of ``docs/netlab.md`` named in each cell, its page
  on the overlapped exchange (``docs/overlapped.md``), and issue 69, which
  recorded the 1.8 KB message's runs. A message's size is the one the page
  gives for that run's commit. AdamW's cells have no delay, so their hops
  do not matter and none are given.
  """
  far = _netlab_link(10, rtt_s=0.100, loss=0.01)
  ten = _netlab_link(10)
  faults = "netlab.md, Measured: 100 ms round trips, 1% loss (546c9c5)"
  issue = "issue 69, its table (demo-k1-c8-1bit-rand-fb1-orth, 40 steps)"
  mini = "netlab.md, Measured: 4 processes, 10 Mbit/s (43fb408)"
  reference = "netlab.md, The reference's message (43fb408)"
  mixed = "netlab.md, Heterogeneous links (69716fe; the 10 Mbit/s link bounds)"
  tiny = "netlab.md, Its tests (275af82)"
  overlapped = "overlapped.md, Does it overlap (8c7f229)"
  cut = "netlab.md, Far links after the cut (40 steps)"
  larms = "netlab.md, The overlapped step's clean cost, taken apart (40 steps)"
  floor = "netlab.md, The bandwidth floor (20 steps a cell)"
  direct = "netlab.md, Fewer dependent hops: a direct all-to-all (40 steps, one call)"
  floor_a2a = "netlab.md, The bandwidth floor, by all-to-all (20 steps a cell)"
  early = "netlab.md, The overlapped exchange sent as soon as it is made (40 steps a call)"
  early_near = "netlab.md, The overlapped exchange sent as soon as it is made (near, 30 steps)"
  return [
    _demo_cell("mini, Psyche's message, far", far, 4, 22_567, 0.915, 2.407, faults),
    _demo_cell("mini, 1.8 KB message, plain, far", far, 4, 1_811, 2.547, 3.631, issue),
    _demo_cell("mini, 1.8 KB message, overlapped, far", far, 4, 1_811, 4.620, 5.624, issue, True),
    MeasuredCell("mini, adamw", ten, 4, "all-reduce", 29.1e6, 1.13, 38.90, source=mini),
    _demo_cell("mini, demo top-k 8 1-bit", ten, 4, 30_679, 1.23, 1.26, mini),
    _demo_cell("mini, demo top-k 32 fp32", ten, 4, 350_000, 1.44, 2.10, reference),
    MeasuredCell("small, adamw", ten, 4, "all-reduce", 5.5e6 / 1.5, 0.47, 4.81, source=mixed),
    _demo_cell("small, demo top-k 8 1-bit", ten, 4, 3_971, 0.163, 0.166, mixed),
    MeasuredCell(
      "tiny, 2 processes, adamw", ten, 2, "all-reduce", 525.6e3, 0.060, 0.462, source=tiny
    ),
    _demo_cell("tiny, 2 processes, demo-k32", ten, 2, 6_728, 0.026, 0.026, tiny),
    _demo_cell("mini, demo-k32, plain", ten, 4, 320_784, 0.621, 1.413, overlapped),
    _demo_cell("mini, demo-k32, overlapped", ten, 4, 320_784, 0.673, 0.998, overlapped, True),
    # After the cut to the message's all-gather: the lab's unshaped run is the compute.
    _demo_cell(
      "mini, the 1,020x message (14.3 KB), plain, far, after",
      far,
      4,
      14_263,
      1.552,
      1.968,
      cut,
      False,
      False,
    ),
    _demo_cell(
      "mini, the 1,020x message (14.3 KB), overlapped, far, after",
      far,
      4,
      14_263,
      2.942,
      2.880,
      cut,
      True,
      False,
    ),
    _demo_cell(
      "mini, the 1,020x message (14.3 KB), plain, far, beside -larms",
      far,
      4,
      14_263,
      1.383,
      1.748,
      larms,
      False,
      False,
    ),
    _demo_cell(
      "mini, the 1,020x message (14.3 KB), overlapped, the guess at unit RMS, far",
      far,
      4,
      14_263,
      1.478,
      1.709,
      larms,
      True,
      False,
    ),
    *(
      _demo_cell(
        f"mini, the 1,020x message, plain, {rate:g} Mbit/s far, floor",
        _netlab_link(rate, rtt_s=0.100, loss=0.01),
        4,
        14_263,
        1.615,
        measured,
        floor,
        False,
        False,
      )
      for rate, measured in ((10, 1.879), (1, 1.937), (0.5, 1.911), (0.1, 3.901))
    ),
    # The -a2a call: the ring again beside the all-to-all, plain and overlapped (-larms).
    _demo_cell(
      "mini, 1,020x, ring, far, a2a call", far, 4, 14_263, 0.976, 1.321, direct, False, False
    ),
    _demo_cell(
      "mini, 1,020x, all-to-all, far",
      far,
      4,
      14_263,
      0.946,
      1.084,
      direct,
      False,
      False,
      "all-to-all",
    ),
    *(
      _demo_cell(
        f"mini, 1,020x, all-to-all, {form}, {rate:g} Mbit/s far, floor",
        _netlab_link(rate, rtt_s=0.100, loss=0.01),
        4,
        14_263,
        compute,
        measured,
        floor_a2a,
        overlapped,
        False,
        "all-to-all",
      )
      for form, compute, overlapped, steps in (
        ("plain", 1.000, False, ((10, 1.058), (1, 1.006), (0.5, 1.032), (0.1, 3.931))),
        # Its clean cell ran twice, 1.242 s and 1.036 s: the compute is their mean.
        ("overlapped -larms", 1.139, True, ((10, 1.043), (1, 1.035), (0.5, 1.060), (0.1, 3.955))),
      )
      for rate, measured in steps
    ),
    _demo_cell(
      "mini, 1,020x, all-to-all, far, again",
      far,
      4,
      14_263,
      0.918,
      1.130,
      direct,
      False,
      False,
      "all-to-all",
    ),
    _demo_cell(
      "mini, 1,020x, all-to-all, overlapped -larms, far, again",
      far,
      4,
      14_263,
      0.952,
      1.070,
      direct,
      True,
      False,
      "all-to-all",
    ),
    *(
      _demo_cell(
        f"mini, 4,012x (3.6 KB), all-to-all, plain, {rate:g} Mbit/s far, floor",
        _netlab_link(rate, rtt_s=0.100, loss=0.01),
        4,
        3_580,
        1.001,
        measured,
        floor_a2a,
        False,
        False,
        "all-to-all",
      )
      for rate, measured in ((0.5, 1.012), (0.1, 1.001))
    ),
    _demo_cell(
      "mini, 1,020x, all-to-all, overlapped -larms, far",
      far,
      4,
      14_263,
      0.992,
      1.056,
      direct,
      True,
      False,
      "all-to-all",
    ),
    # Three calls of the far cell: the threaded step before 065ee41, then twice after it.
    *(
      _demo_cell(
        f"mini, 1,020x, all-to-all, {form}, far, {call}",
        far,
        4,
        14_263,
        compute,
        measured,
        early,
        overlapped,
        False,
        "all-to-all",
      )
      for call, cells in (
        ("before 065ee41", ((1.102, 1.232), (1.130, 1.224))),
        ("065ee41, first", ((1.192, 1.166), (1.069, 1.106))),
        ("065ee41, second", ((1.208, 1.189), (1.116, 1.092))),
      )
      for form, overlapped, (compute, measured) in zip(
        ("plain", "overlapped -larms"), (False, True), cells
      )
    ),
    _demo_cell(
      "mini, demo-k32, plain, 065ee41", ten, 4, 320_784, 0.270, 1.009, early_near, False, False
    ),
    _demo_cell(
      "mini, demo-k32, overlapped, 065ee41", ten, 4, 320_784, 0.311, 0.832, early_near, True, False
    ),
  ]


def main(argv: Sequence[str]) -> int:
  """The command: ``[--workers=W] [--preset=P] METHOD...`` counts; ``--recorded`` compares."""
  workers, preset, specs, recorded = 4, "tiny", [], False
  for arg in argv:
    if arg.startswith("--workers="):
      workers = int(arg.split("=", 1)[1])
    elif arg.startswith("--preset="):
      preset = arg.split("=", 1)[1]
    elif arg == "--recorded":
      recorded = True
    elif arg.startswith("-"):
      print(
        f"error: unknown flag {arg}; use --workers=W, --preset=P or --recorded", file=sys.stderr
      )
      return 2
    else:
      specs.append(arg)
  if recorded:
    print(time_model.comparison_markdown(time_model.predicted_vs_measured(recorded_cells())))
  if specs:
    import jax

    # One CPU device per simulated process, before anything starts a backend.
    jax.config.update("jax_num_cpu_devices", max(workers, 1))
    print(markdown([count(s, workers, preset=preset) for s in specs]))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
