r"""Dependent hops of a small exchange: gloo's ring all-gather against a direct all-to-all.

  sudo python -m experiments.netlab.hops --processes=4 --message_bytes=14263 \
      --rate_mbit=10 --delay_ms=25 --loss_pct=0.5

A message of a few KB crosses a far link in the time of its round trips, not
of its bytes. gloo's all-gather is a ring: W - 1 hops, each waiting on the
one before, so W - 1 one-way delays on the path. An all-to-all in which each
process sends its own message to every peer at once moves the same bytes up
each link, (W - 1) x the message, in one hop. This command times both in a
lab of :mod:`experiments.netlab.links`, on clean links and then on the
shaped ones, and prints each median with the all-to-all over the ring. Both
give every process every message in the same order (checked); the
all-to-all's operand is the message repeated W times, one copy per peer.

Each of the ``--processes`` processes runs ``--iters`` timed, blocked calls
of each collective (after one untimed call that compiles it), the ring
twice (before and after the all-to-all) so that a drift in the link shows.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from absl import app, flags

from experiments.netlab import links
from experiments.netlab.impair import Impairment
from experiments.netlab.links import Lab, NetlabError
from experiments.run import cli

__all__ = ["COLLECTIVES", "HopsConfig", "main", "measure", "summary_table"]

# What each process times, in order; the ring runs twice to show drift.
COLLECTIVES = ("all_gather", "all_to_all", "all_gather_again")
_PORT = 12431


def _field(default: Any, help: str) -> Any:  # noqa: A002 - absl's word
  return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class HopsConfig:
  """The probe's settings (each one a flag)."""

  processes: int = _field(4, "Processes, one per namespace of the lab.")
  message_bytes: int = _field(
    14263, "Bytes of each process's message (the 1,020x message on mini)."
  )
  iters: int = _field(15, "Timed calls of each collective.")
  rate_mbit: float = _field(10.0, "Each link's rate, both ways, Mbit/s.")
  delay_ms: float = _field(25.0, "One-way delay per link (a packet crosses two: 25 is 100 ms RTT).")
  loss_pct: float = _field(0.5, "Loss per link, percent (crossing two: 0.5 is about 1%).")


def _worker(argv: Sequence[str]) -> None:
  """One process: the medians of its timed calls, as one JSON line."""
  pid, n, coordinator, nbytes, iters = argv[0], int(argv[1]), argv[2], int(argv[3]), int(argv[4])
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_num_cpu_devices", 1)
  jax.distributed.initialize(coordinator, num_processes=n, process_id=int(pid))
  mesh = jax.make_mesh((n,), ("w",), devices=jax.devices())

  def ring(x_1xN):
    return jax.lax.all_gather(x_1xN[0], "w")[None]

  def direct(x_1xN):
    # Row j of the operand goes to process j: every row is this process's message.
    copies_WxN = jnp.broadcast_to(x_1xN, (n, x_1xN.shape[1]))
    return jax.lax.all_to_all(copies_WxN, "w", 0, 0, tiled=True)[None]

  local = np.full((1, nbytes), int(pid), np.uint8)
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("w")), local)
  medians = {}
  for name, fn in zip(COLLECTIVES, (ring, direct, ring)):
    step = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("w"), out_specs=P("w")))
    got = np.asarray(step(x).addressable_data(0))[0]
    if got[:, 0].tolist() != list(range(n)):
      raise AssertionError(f"{name} delivered the messages as {got[:, 0].tolist()}")
    seconds = []
    for _ in range(iters):
      start = time.perf_counter()
      step(x).block_until_ready()
      seconds.append(time.perf_counter() - start)
    medians[name] = float(np.median(seconds))
  print("HOPS " + json.dumps({"process": int(pid), **medians}), flush=True)


def measure(cfg: HopsConfig, impairment: Impairment | None) -> list[dict[str, float]]:
  """Each process's medians, on clean links (``None``) or on shaped and impaired ones."""
  lab = Lab(cfg.processes)
  lab.create()
  try:
    if impairment is not None:
      lab.shape([cfg.rate_mbit] * cfg.processes, 100.0)
      if impairment:
        lab.impair([impairment] * cfg.processes)
    coordinator = f"{lab.address(0)}:{_PORT}"
    # One device per process, whatever device count the caller simulates.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    argv = [str(cfg.processes), coordinator, str(cfg.message_bytes), str(cfg.iters)]
    procs = [
      lab.popen(
        i,
        [sys.executable, "-m", "experiments.netlab.hops", f"--worker={i}", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
      )
      for i in range(cfg.processes)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
  finally:
    lab.teardown()
  rows = [
    json.loads(line[5:]) for out in outs for line in out.splitlines() if line.startswith("HOPS ")
  ]
  if len(rows) != cfg.processes:
    raise NetlabError(
      f"{len(rows)} of {cfg.processes} processes reported; the first said:\n{outs[0][-2000:]}"
    )
  return rows


def summary_table(results: Mapping[str, list[dict[str, float]]]) -> str:
  """A markdown table: per link setting, the medians over processes and the direct/ring ratio."""
  lines = [
    "| links | ring all-gather | direct all-to-all | ring, again | all-to-all / ring |",
    "| --- | ---: | ---: | ---: | ---: |",
  ]
  for label, rows in results.items():
    med = {c: float(np.median([r[c] for r in rows])) for c in COLLECTIVES}
    ring = (med["all_gather"] + med["all_gather_again"]) / 2
    lines.append(
      f"| {label} | {med['all_gather']:.3f} s | {med['all_to_all']:.3f} s | "
      f"{med['all_gather_again']:.3f} s | {med['all_to_all'] / ring:.2f}x |"
    )
  return "\n".join(lines)


def _main(holders: Mapping[str, flags.FlagHolder], argv: Sequence[str]) -> None:
  del argv
  cfg = cli.config_from_flags(holders, HopsConfig)
  try:
    links.check_prerequisites()
    shaped = Impairment(delay_ms=cfg.delay_ms, loss_pct=cfg.loss_pct)
    label = f"{cfg.rate_mbit:g} Mbit/s, {cfg.delay_ms:g} ms and {cfg.loss_pct:g}% per link"
    results = {"clean": measure(cfg, None), label: measure(cfg, shaped)}
  except NetlabError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(f"{cfg.processes} processes, {cfg.message_bytes:,} B each, medians of {cfg.iters} calls")
  print(summary_table(results))


def main(argv: Sequence[str] | None = None) -> None:
  """The command (or, with ``--worker=I``, one of the processes it starts)."""
  args = sys.argv if argv is None else list(argv)
  worker = [a for a in args[1:] if a.startswith("--worker=")]
  if worker:
    rest = [a for a in args[1:] if not a.startswith("--worker=")]
    _worker([worker[0].split("=", 1)[1], *rest])
    return
  holders = cli.define_flags(HopsConfig)
  app.run(functools.partial(_main, holders), argv=argv)


if __name__ == "__main__":
  main()
