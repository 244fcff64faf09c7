r"""Train over real bandwidth-limited links: N processes in shaped network namespaces.

Needs root and iproute2 (``ip``, ``tc``) with the kernel's tbf qdisc.

  python -m experiments.netlab --processes=4 --rate_mbit=10 --methods=adamw,demo \
      --preset=mini --steps=60 --out_dir=runs/netlab
  python -m experiments.netlab --processes=4 --rate_mbit=10,100,100,1000   # one rate each

It builds N namespaces joined by veth pairs to a bridge (experiments/netlab_links.py),
and for each method runs ``experiments.train`` once per namespace over gloo,
with the coordinator in namespace 0: first on unshaped links (the
compute-only reference), then with each process's link limited to its rate in
both directions. It reads the bytes that crossed each link from
``/sys/class/net/*/statistics`` and writes ``netlab.md``, ``netlab_loss.png``
and ``netlab.json`` to ``--out_dir``. Flags it does not know go to every
``experiments.train`` process. Teardown (processes, namespaces, interfaces)
happens on success, failure, ``--run_time_limit_s`` and Ctrl-C alike; if
the launcher itself is killed, a guardian process does it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from absl import app, flags

from experiments import link_counters, netlab_links, netlab_report
from experiments.netlab_report import RunResult

_PROCESSES = flags.DEFINE_integer("processes", 4, "Training processes, one namespace each.")
_RATE = flags.DEFINE_string(
  "rate_mbit", "10", "Link rate in Mbit/s, in both directions: one for all, or one per process."
)
_LATENCY = flags.DEFINE_float(
  "latency_ms", 100.0, "tbf latency: the longest a packet may queue on a link before it is dropped."
)
_METHODS = flags.DEFINE_string("methods", "adamw,demo", "Comma-separated optimizers to compare.")
_PRESET = flags.DEFINE_string("preset", "mini", "Model preset (experiments/presets.py).")
_STEPS = flags.DEFINE_integer("steps", 60, "Training steps per run.")
_OUT = flags.DEFINE_string("out_dir", "runs/netlab", "Where the runs and the report go.")
_SKIP = flags.DEFINE_integer(
  "skip_steps", 3, "Warm-up steps left out of the step-time medians and the byte counts."
)
_LIMIT = flags.DEFINE_float(
  "run_time_limit_s",
  900.0,
  "A run still going after this many seconds is stopped and reported with the steps it "
  "finished (0: no limit).",
)
_TARGET = flags.DEFINE_float(
  "target_loss",
  None,
  "Validation loss for the time-to-target figure (default: the worst final validation loss "
  "of the unshaped runs).",
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PORT = 12355  # each namespace is fresh, so a fixed port cannot clash
# Set by the launcher; passing them through would break the lab's wiring.
_RESERVED = ("optimizer", "preset", "steps", "out_dir", "workers", "num_processes",
             "process_id", "coordinator_address", "resume")  # fmt: skip
# Train-driver defaults for a lab run, unless passed. One 128-token sequence
# per process keeps the compute per step small next to a slow link. DisTrO
# methods send what Psyche sends over the internet, top-k 8 with 1-bit
# values; the reference's top-k 32 in fp32 is --compression_topk=32
# --noquantize_1bit (AdamW ignores both).
_TRAIN_DEFAULTS = {
  "seq_len": "128",
  "eval_every": "10",
  "eval_batches": "2",
  "log_every": "10",
  "compression_topk": "8",
  "quantize_1bit": "true",
}


def parse_rates(text: str, processes: int) -> list[float]:
  """``"10"`` or ``"10,100,100,1000"`` -> one rate in Mbit/s per process.

  Args:
    text: the ``--rate_mbit`` value.
    processes: N.

  Returns:
    N rates.

  Raises:
    netlab_links.NetlabError: not a positive number, or not one rate per process.
  """
  try:
    rates = [float(x) for x in text.split(",")]
  except ValueError:
    raise netlab_links.NetlabError(
      f"--rate_mbit={text!r} is not a number or a comma-separated list of numbers "
      "(e.g. 10, or 10,100,100,1000)."
    ) from None
  if any(not r > 0 for r in rates):
    raise netlab_links.NetlabError(f"--rate_mbit={text!r}: every rate must be positive.")
  if len(rates) == 1:
    return rates * processes
  if len(rates) != processes:
    raise netlab_links.NetlabError(
      f"--rate_mbit lists {len(rates)} rates for --processes={processes}; give one rate "
      "for all or exactly one per process."
    )
  return rates


def parse_methods(text: str) -> list[str]:
  """``"adamw,demo"`` -> the optimizer names, checked against the driver's.

  Args:
    text: the ``--methods`` value.

  Returns:
    The names, in the given order.

  Raises:
    netlab_links.NetlabError: an unknown or repeated name.
  """
  from experiments.trainer import OPTIMIZERS

  methods = [m.strip() for m in text.split(",") if m.strip()]
  bad = [m for m in methods if m not in OPTIMIZERS]
  if bad or not methods or len(set(methods)) != len(methods):
    raise netlab_links.NetlabError(
      f"--methods={text!r}: give distinct names among {', '.join(OPTIMIZERS)}."
    )
  return methods


def train_flags(passthrough: Sequence[str], processes: int) -> list[str]:
  """The driver flags for every process: the lab's defaults, then the passed-through ones.

  Args:
    passthrough: the command-line arguments netlab does not define.
    processes: N; the default batch is one sequence per process.

  Returns:
    The flags, defaults first, so that a passed flag wins.

  Raises:
    netlab_links.NetlabError: a passed-through flag that the lab sets itself,
      or an argument that is not a flag.
  """
  names = set()
  for arg in passthrough:
    if not arg.startswith("--"):
      raise netlab_links.NetlabError(f"unexpected argument {arg!r}; pass driver flags as --name=v.")
    name = arg[2:].split("=", 1)[0]
    name = name[2:] if name.startswith("no") and "=" not in arg else name
    if name in _RESERVED:
      raise netlab_links.NetlabError(
        f"--{name} is set by netlab for each run; "
        + (
          f"use netlab's own --{name}."
          if name in ("preset", "steps", "out_dir")
          else "use --methods/--processes instead."
        )
      )
    names.add(name)
  defaults = [f"--{k}={v}" for k, v in _TRAIN_DEFAULTS.items() if k not in names]
  if "batch_size" not in names:
    defaults.append(f"--batch_size={processes}")
  return defaults + list(passthrough)


def _stop(procs: Sequence[subprocess.Popen]) -> None:
  """SIGKILLs each process's session and waits for it.

  Not SIGTERM: JAX's distributed runtime installs a handler for it (its
  preemption service), and a driver so signalled kept running for seconds.
  Nothing is lost: the driver flushes every metrics line.
  """
  for p in procs:
    if p.poll() is None:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
  for p in procs:
    p.wait(timeout=30)


def _raised(log_path: str) -> bool:
  """Whether a driver's log shows an uncaught exception or the driver's error line."""
  text = _tail(log_path, 20000)
  return "Traceback (most recent call last)" in text or "\nerror: " in text


def _tail(path: str, chars: int = 2500) -> str:
  try:
    with open(path, errors="replace") as f:
      return f.read()[-chars:]
  except OSError:
    return ""


def run_once(
  lab: netlab_links.Lab,
  method: str,
  shaped: bool,
  *,
  port: int,
  extra: Sequence[str],
  env: dict[str, str],
) -> RunResult:
  """One training run: a driver process per namespace, waited on or stopped at the limit.

  Args:
    lab: the built lab, shaped or not.
    method: the optimizer.
    shaped: whether ``lab`` is shaped now (names the run).
    port: the coordinator's port in namespace 0.
    extra: driver flags for every process.
    env: the drivers' environment.

  Returns:
    The run's records and summary.

  Raises:
    netlab_links.NetlabError: a process failed (its log's tail is in the message).
  """
  name = f"{method}-{'shaped' if shaped else 'unshaped'}"
  run_dir = os.path.join(_OUT.value, "runs", name)
  shutil.rmtree(run_dir, ignore_errors=True)
  os.makedirs(run_dir)
  n = lab.num_processes
  procs, logs = [], []
  try:
    for i in range(n):
      log_path = os.path.join(run_dir, f"process{i}.log")
      logs.append(log_path)
      argv = [
        sys.executable, "-m", "experiments.train",
        f"--optimizer={method}", f"--preset={_PRESET.value}", f"--steps={_STEPS.value}",
        f"--out_dir={run_dir}", f"--workers={n}", f"--num_processes={n}", f"--process_id={i}",
        f"--coordinator_address={lab.address(0)}:{port}", *extra,
      ]  # fmt: skip
      with open(log_path, "w") as log:
        procs.append(lab.popen(i, argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env))
    start = time.monotonic()
    stopped = False
    print(f"netlab: {name}: {n} processes started (logs in {run_dir})", flush=True)
    while any(p.poll() is None for p in procs):
      # A driver that raised can hang at exit in JAX's shutdown barrier, waiting
      # for peers that wait for it; its traceback is the failure.
      failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0) or _raised(logs[i])]
      if failed:
        i = failed[0]
        raise netlab_links.NetlabError(
          f"{name}: process {i} failed"
          + ("" if procs[i].returncode is None else f" with exit status {procs[i].returncode}")
          + f"; the end of {logs[i]}:\n{_tail(logs[i])}"
        )
      if _LIMIT.value and time.monotonic() - start > _LIMIT.value:
        stopped = True
        print(f"netlab: {name}: stopped at --run_time_limit_s={_LIMIT.value:g}", flush=True)
        break
      time.sleep(0.2)
    failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
    if failed and not stopped:
      i = failed[0]
      raise netlab_links.NetlabError(
        f"{name}: process {i} exited with status {procs[i].returncode}; the end of "
        f"{logs[i]}:\n{_tail(logs[i])}"
      )
  finally:
    _stop(procs)
  metrics = os.path.join(run_dir, "metrics.jsonl")
  # A run stopped at the limit may leave a torn last line and no summary.
  records = link_counters.load_samples(metrics) if os.path.exists(metrics) else []
  summary_path = os.path.join(run_dir, "summary.json")
  summary = None
  if os.path.exists(summary_path):
    with open(summary_path) as f:
      summary = json.load(f)
  return RunResult(method, shaped, records, summary, stopped_at_limit=stopped)


def _raise_exit(signum, frame):
  raise SystemExit(128 + signum)


def lab_main(passthrough: Sequence[str]) -> dict:
  """Builds the lab, runs every method unshaped then shaped, reports, tears down."""
  netlab_links.check_prerequisites()
  processes = _PROCESSES.value
  if processes < 2:
    raise netlab_links.NetlabError(f"--processes must be at least 2, got {processes}.")
  rates = parse_rates(_RATE.value, processes)
  methods = parse_methods(_METHODS.value)
  from experiments import presets

  try:
    presets.get_preset(_PRESET.value)
  except ValueError as e:
    raise netlab_links.NetlabError(str(e).replace("unknown preset", "unknown --preset")) from None
  extra = train_flags(passthrough, processes)
  if _STEPS.value <= _SKIP.value:
    raise netlab_links.NetlabError(
      f"--steps={_STEPS.value} leaves nothing to measure after --skip_steps={_SKIP.value}."
    )
  os.makedirs(_OUT.value, exist_ok=True)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  # No persistent compile cache: only process 0 writes it, so on a rerun
  # process 0 starts training while the others still compile, and gloo gives
  # up on a context whose peers are more than 30 s late.
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  netlab_links.sweep_stale()
  lab = netlab_links.Lab(processes)
  # Also when started from a shell that ignores SIGINT in background jobs.
  signal.signal(signal.SIGINT, signal.default_int_handler)
  signal.signal(signal.SIGTERM, _raise_exit)
  signal.signal(signal.SIGHUP, _raise_exit)
  lab.create()
  try:
    counters_path = os.path.join(_OUT.value, "link_counters.jsonl")
    ifaces = [lab.hub_interface(i) for i in range(processes)]
    with open(counters_path, "w") as out:
      lab.popen_hub(
        [sys.executable, "-m", "experiments.link_counters", "--interval_s=0.05", *ifaces],
        stdout=out,
        cwd=ROOT,
        env=env,
      )
    runs = []
    port = _PORT
    for shaped in (False, True):
      if shaped:
        lab.shape(rates, _LATENCY.value)
      for method in methods:
        runs.append(run_once(lab, method, shaped, port=port, extra=extra, env=env))
        port += 1
    samples = link_counters.load_samples(counters_path)
  finally:
    # A second Ctrl-C must not cut the teardown short.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
      signal.signal(sig, signal.SIG_IGN)
    lab.teardown()
  report = netlab_report.summarize(
    runs,
    samples=samples,
    ifaces=ifaces,
    rates_mbit=rates,
    skip=_SKIP.value,
    target_loss=_TARGET.value,
  )
  rate_text = (
    f"{rates[0]:g} Mbit/s links"
    if len(set(rates)) == 1
    else f"links of {', '.join(f'{r:g}' for r in rates)} Mbit/s"
  )
  settings = (
    f"{processes} processes over {rate_text}: preset {_PRESET.value}, {_STEPS.value} steps, "
    f"tbf latency {_LATENCY.value:g} ms; driver flags: {' '.join(extra)}"
  )
  netlab_report.write_report(_OUT.value, report, runs, settings)
  print(netlab_report.markdown(report, settings), flush=True)
  return report


def main(argv: list[str]) -> None:
  try:
    lab_main(argv[1:])
  except netlab_links.NetlabError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except KeyboardInterrupt:
    print("netlab: interrupted; processes and links are torn down.", file=sys.stderr)
    sys.exit(130)


if __name__ == "__main__":
  # Flags netlab does not define are the driver's: keep them for the runs.
  app.run(main, flags_parser=lambda argv: flags.FLAGS(argv, known_only=True))
