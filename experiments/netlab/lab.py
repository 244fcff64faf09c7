"""Running methods over the lab's links: unshaped first, then shaped, then the report.

:func:`run` is what ``python -m experiments.netlab`` does, as a library
function: it takes a :class:`LabConfig` (the command's flags, one field each)
and the flags for the ``experiments.train`` drivers, builds the lab
(:mod:`experiments.netlab.links`), starts the counter sampler
(:mod:`experiments.netlab.counters`), runs every method on unshaped links and
then on shaped ones (:func:`run_once`), tears everything down, and writes the
report (:mod:`experiments.netlab.report`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from experiments.netlab import drivers, faults, links, report
from experiments.netlab.impair import Impairment
from experiments.netlab.links import NetlabError
from experiments.netlab.results import RunResult
from experiments.run import config, methods, presets, records
from experiments.run.launch import LaunchConfig

__all__ = [
  "LabConfig",
  "driver_flags",
  "method_flags",
  "parse_methods",
  "parse_rates",
  "run",
  "run_once",
  "settings_line",
]


def _field(default: Any, help: str) -> Any:  # noqa: A002 - absl's word
  return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class LabConfig:
  """What one lab run does; each field is a flag of ``python -m experiments.netlab``.

  ``rate_mbit`` and ``methods`` keep the flags' text; :func:`parse_rates` and
  :func:`parse_methods` read them.
  """

  processes: int = _field(4, "Training processes, one namespace each.")
  rate_mbit: str = _field(
    "10", "Link rate in Mbit/s, in both directions: one for all, or one per process."
  )
  latency_ms: float = _field(
    100.0, "tbf latency: the longest a packet may queue on a link before it is dropped."
  )
  methods: str = _field(
    "adamw,demo",
    "Comma-separated methods to compare, registry names with options (demo-k8-1bit, "
    "diloco-h20; python -m experiments.methods lists them). The first is the baseline "
    "the others' shaped step is compared with.",
  )
  preset: str = _field("mini", "Model preset (experiments/run/presets.py).")
  steps: int = _field(60, "Training steps per run.")
  out_dir: str = _field("runs/netlab", "Where the runs and the report go.")
  skip_steps: int = _field(
    3, "Warm-up steps left out of the step-time medians and the byte counts."
  )
  run_time_limit_s: float = _field(
    900.0,
    "A run still going after this many seconds is stopped and reported with the steps it "
    "finished (0: no limit).",
  )
  target_loss: float | None = _field(
    None,
    "Validation loss for the time-to-target figure (default: the worst final validation "
    "loss of the unshaped runs).",
  )
  kill_step: int = _field(
    0,
    "Once process 0 has logged this step, kill one training process (SIGKILL) and continue "
    "from the last checkpoint on the survivors, one process fewer; run after the shaped "
    "runs and reported against them (0: never).",
  )
  kill_process: int = _field(-1, "Which process --kill_step kills (-1: the last).")
  rejoin_step: int = _field(
    0,
    "After --kill_step, the survivors stop at this step and all processes continue from "
    "it, the killed one back (0: it never returns).",
  )
  delay_ms: str = _field(
    "0",
    "Shaped runs: one-way delay each link adds, in both directions, one for all or one per "
    "process; a packet between two processes crosses both their links, so 25 gives a "
    "100 ms round trip. Added in user space (experiments/netlab/impair.py).",
  )
  jitter_ms: str = _field(
    "0",
    "Shaped runs: each link's delay varies uniformly by up to this much either way, one for "
    "all or one per process; packets between two processes keep their order.",
  )
  loss_pct: str = _field(
    "0",
    "Shaped runs: percent of packets each link drops, one for all or one per process; a "
    "packet crosses two links, so 0.5 loses about 1% end to end.",
  )
  blackout_s: float = _field(
    0.0,
    "Shaped runs: once process 0 has logged --blackout_step, take one process's link down "
    "(ip link set down) for this many seconds, then up again (0: never).",
  )
  blackout_process: int = _field(-1, "Whose link --blackout_s takes down (-1: the last).")
  blackout_step: int = _field(
    0, "The step after which the blackout starts (0: the middle of the run)."
  )
  max_restarts: int = _field(
    3,
    "A run whose drivers stop with status 75 (preempted) or 76 (a peer lost) is restarted "
    "with --resume on all processes, as a scheduler would, at most this many times.",
  )


_PORT = 12355  # each namespace is fresh, so a fixed port cannot clash
# Driver defaults for a lab run, unless passed. One 128-token sequence per
# process (the batch is set from --processes) keeps the compute per step small
# next to a slow link. DisTrO methods send what Psyche sends over the
# internet, top-k 8 with 1-bit values; the reference's top-k 32 in fp32 is
# --compression_topk=32 --noquantize_1bit, or the method demo-k32 (AdamW
# ignores both).
_DRIVER_DEFAULTS: Mapping[str, Any] = {
  "seq_len": 128,
  "eval_every": 10,
  "eval_batches": 2,
  "log_every": 10,
  "compression_topk": 8,
  "quantize_1bit": True,
}


def _reserved() -> dict[str, str]:
  """Driver flags the lab sets for each run, each with what to use instead.

  Passing one would break the lab's wiring: one process per namespace, one
  device each and each its own site, a fresh run directory per method.
  """
  use_instead = {name: f"use netlab's own --{name}." for name in _SHARED_WITH_DRIVER}
  use_instead["optimizer"] = "use --methods."
  wiring = "netlab runs one process per namespace with one device each; use --processes."
  launch = [f.name for f in dataclasses.fields(LaunchConfig) if f.name != "peer_timeout_s"]
  for name in ("workers", "replicas", "fsdp", *launch):
    use_instead[name] = wiring
  use_instead["resume"] = "every run starts afresh in its own directory."
  return use_instead


# netlab's flags that are also the driver's, passed on to every run.
_SHARED_WITH_DRIVER = tuple(
  f.name
  for f in dataclasses.fields(LabConfig)
  if f.name in {g.name for g in dataclasses.fields(config.TrainConfig)}
)


def _flag(name: str, value: Any) -> str:
  """``--name=value``, or ``--name``/``--noname`` for a bool, as absl reads them."""
  if isinstance(value, bool):
    return f"--{name}" if value else f"--no{name}"
  return f"--{name}={value}"


def parse_rates(text: str, processes: int) -> list[float]:
  """``"10"`` or ``"10,100,100,1000"`` -> one rate in Mbit/s per process.

  Args:
    text: the ``--rate_mbit`` value.
    processes: N.

  Returns:
    N rates.

  Raises:
    NetlabError: not a positive number, or not one rate per process.
  """
  try:
    rates = [float(x) for x in text.split(",")]
  except ValueError:
    raise NetlabError(
      f"--rate_mbit={text!r} is not a number or a comma-separated list of numbers "
      "(e.g. 10, or 10,100,100,1000)."
    ) from None
  if any(not r > 0 for r in rates):
    raise NetlabError(f"--rate_mbit={text!r}: every rate must be positive.")
  if len(rates) == 1:
    return rates * processes
  if len(rates) != processes:
    raise NetlabError(
      f"--rate_mbit lists {len(rates)} rates for --processes={processes}; give one rate "
      "for all or exactly one per process."
    )
  return rates


def method_flags(spec: str) -> list[str]:
  """The driver flags that make a run the method ``spec`` names.

  Args:
    spec: a registry name with options, e.g. ``"demo-k8-1bit"``.

  Returns:
    ``--optimizer=`` and one flag per option, e.g. ``["--optimizer=demo",
    "--compression_topk=8", "--quantize_1bit"]``.

  Raises:
    ConfigError: ``spec`` is not a registered family followed by its options.
  """
  _, overrides = methods.parse(spec)
  return [_flag(name, value) for name, value in overrides.items()]


def parse_methods(text: str) -> dict[str, list[str]]:
  """``"adamw,demo-k8-1bit"`` -> each method, as named, with its driver flags.

  Args:
    text: the ``--methods`` value.

  Returns:
    ``{name: method_flags(name)}``, in the given order.

  Raises:
    NetlabError: an unknown or repeated name, or none.
  """
  specs = [m.strip() for m in text.split(",") if m.strip()]
  problem = "give at least one" if not specs else None
  if len(set(specs)) != len(specs):
    problem = "a method is listed twice"
  out = {}
  for spec in specs if problem is None else ():
    try:
      out[spec] = method_flags(spec)
    except config.ConfigError:
      problem = f"unknown method {spec!r}"
      break
  if problem:
    raise NetlabError(
      f"--methods={text!r}: {problem}; give distinct names among {', '.join(methods.names())}, "
      "each optionally with options (demo-k8-1bit, diloco-h20; `python -m experiments.methods` "
      "lists them)."
    )
  return out


def _flag_name(arg: str, fields: set[str]) -> str:
  """The field a driver flag sets: ``--seq_len=64`` -> seq_len, ``--nouse_dct`` -> use_dct."""
  if not arg.startswith("--"):
    raise NetlabError(f"unexpected argument {arg!r}; pass driver flags as --name=value.")
  name = arg[2:].split("=", 1)[0]
  if name not in fields and name.startswith("no") and "=" not in arg and name[2:] in fields:
    name = name[2:]
  if name not in fields:
    raise NetlabError(
      f"{arg.split('=', 1)[0]} is neither a netlab flag nor a flag of experiments.train "
      "(python -m experiments.netlab --helpfull lists netlab's)."
    )
  return name


def driver_flags(
  passthrough: Sequence[str], processes: int, *, kill: bool = False, blackout: bool = False
) -> list[str]:
  """The driver flags for every process: the lab's defaults, then the passed-through ones.

  Args:
    passthrough: the command-line arguments netlab does not define.
    processes: N; the default batch is one sequence per process.
    kill: a process will be killed (``--kill_step``): the default batch is
      ``N (N - 1)`` so that the survivors divide it too, checkpoints are
      written every 10 steps unless ``--checkpoint_every`` says otherwise, and
      a peer counts as lost after 20 s (``--peer_timeout_s``), so that the
      survivors stop soon after the kill.
    blackout: a link will go dark (``--blackout_s``): checkpoints every 10
      steps unless ``--checkpoint_every`` says otherwise, in case the run must
      be restarted.

  Returns:
    The flags, defaults first, so that a passed flag wins.

  Raises:
    NetlabError: a flag the driver does not have, one the lab sets itself, or
      an argument that is not a flag.
  """
  fields = {f.name for f in dataclasses.fields(config.TrainConfig)}
  fields |= {f.name for f in dataclasses.fields(LaunchConfig)}
  reserved = _reserved()
  names = set()
  for arg in passthrough:
    name = _flag_name(arg, fields)
    if name in reserved:
      raise NetlabError(f"--{name} is set by netlab for each run; {reserved[name]}")
    names.add(name)
  defaults = {**_DRIVER_DEFAULTS, "batch_size": processes}
  if kill or blackout:
    defaults.update(checkpoint_every=10)
  if kill:
    defaults.update(batch_size=processes * (processes - 1), peer_timeout_s=20)
  return [_flag(k, v) for k, v in defaults.items() if k not in names] + list(passthrough)


def _check(
  cfg: LabConfig, passthrough: Sequence[str]
) -> tuple[list[float], dict[str, list[str]], list[str], list[Impairment] | None]:
  """Reads and checks ``cfg`` before anything is built: rates, impairments, methods, driver flags.

  Raises:
    NetlabError: naming the flag and the fix.
  """
  if cfg.processes < 2:
    raise NetlabError(f"--processes must be at least 2, got {cfg.processes}.")
  rates = parse_rates(cfg.rate_mbit, cfg.processes)
  runs = parse_methods(cfg.methods)
  try:
    presets.get_preset(cfg.preset)
  except ValueError as e:
    raise NetlabError(str(e).replace("unknown preset", "unknown --preset")) from None
  if cfg.steps <= cfg.skip_steps:
    raise NetlabError(
      f"--steps={cfg.steps} leaves nothing to measure after --skip_steps={cfg.skip_steps}."
    )
  links = faults.impairments(cfg.delay_ms, cfg.jitter_ms, cfg.loss_pct, cfg.processes)
  faults.check_blackout(
    cfg.blackout_process, _blackout_step(cfg), cfg.blackout_s, cfg.processes, cfg.steps
  )
  if cfg.max_restarts < 0:
    raise NetlabError(f"--max_restarts={cfg.max_restarts} must be 0 or more.")
  flags = driver_flags(
    passthrough, cfg.processes, kill=bool(cfg.kill_step), blackout=bool(cfg.blackout_s)
  )
  if cfg.kill_step:
    _check_kill(cfg, flags)
  return rates, runs, flags, links


def _blackout_step(cfg: LabConfig) -> int:
  return cfg.blackout_step or cfg.steps // 2


def _last_value(flags: Sequence[str], name: str) -> str | None:
  values = [f.split("=", 1)[1] for f in flags if f.startswith(f"--{name}=")]
  return values[-1] if values else None


def _check_kill(cfg: LabConfig, flags: Sequence[str]) -> None:
  """Refuses a kill drill that cannot work: no step to kill at, no checkpoint, a batch."""
  n = cfg.processes
  if not 0 < cfg.kill_step < cfg.steps:
    raise NetlabError(f"--kill_step={cfg.kill_step} must be in [1, --steps={cfg.steps}).")
  if not -n <= cfg.kill_process < n:
    raise NetlabError(f"--kill_process={cfg.kill_process} is not one of the {n} processes.")
  if cfg.rejoin_step and not cfg.kill_step < cfg.rejoin_step < cfg.steps:
    raise NetlabError(
      f"--rejoin_step={cfg.rejoin_step} must be after --kill_step={cfg.kill_step} and "
      f"before --steps={cfg.steps}."
    )
  every = int(_last_value(flags, "checkpoint_every") or 0)
  if every <= 0 or every > cfg.kill_step:
    raise NetlabError(
      f"--kill_step={cfg.kill_step} needs a checkpoint before it; pass --checkpoint_every "
      f"between 1 and {cfg.kill_step}."
    )
  batch = int(_last_value(flags, "batch_size"))
  if batch % n or batch % (n - 1):
    raise NetlabError(
      f"--batch_size={batch} must divide over {n} processes and the {n - 1} that survive "
      f"--kill_step; use --batch_size={n * (n - 1)} or a multiple."
    )


def run_once(
  lab: links.Lab,
  cfg: LabConfig,
  method: str,
  shaped: bool,
  *,
  port: int,
  flags: Sequence[str],
  env: Mapping[str, str],
  blackout: faults.Blackout | None = None,
) -> RunResult:
  """One training run: a driver per namespace, waited on, and restarted as a scheduler would.

  When the drivers stop with status 75 (preempted) or 76 (a peer lost), the
  lab stops whatever of them still runs, waits for a dark link to come back,
  and starts all of them again with ``--resume`` (from step 0 if no
  checkpoint was saved yet), at most ``cfg.max_restarts`` times, each on
  the next coordinator port.

  Args:
    lab: the built lab, shaped or not.
    cfg: the lab's settings (preset, steps, out_dir, run_time_limit_s, max_restarts).
    method: the method as named in ``--methods``; it names the run's directory.
    shaped: whether ``lab`` is shaped now (names the run).
    port: the first coordinator port in namespace 0; a restart takes the next.
    flags: driver flags for every process, the method's last so they win.
    env: the drivers' environment.
    blackout: a link to take down during the run, if any.

  Returns:
    The run's records and summary, and one entry per attempt.

  Raises:
    NetlabError: a process failed (its log's tail is in the message), or the
      run was still interrupted after ``cfg.max_restarts`` restarts.
  """
  name = f"{method}-{'shaped' if shaped else 'unshaped'}"
  run_dir = os.path.join(cfg.out_dir, "runs", name)
  shutil.rmtree(run_dir, ignore_errors=True)
  os.makedirs(run_dir)
  n = lab.num_processes
  started = time.time()
  attempts: list[dict[str, Any]] = []
  outcome = "interrupted"
  tick = (lambda: blackout.tick(run_dir)) if blackout else None
  while outcome == "interrupted":
    if len(attempts) > cfg.max_restarts:
      raise NetlabError(
        f"{name}: still interrupted after --max_restarts={cfg.max_restarts} restarts; the "
        f"drivers' last lines: {attempts[-1]['lines']}"
      )
    if blackout is not None:
      blackout.wait_over()
    k = len(attempts)
    resume = ["--resume"] if k and _has_checkpoint(run_dir) else []
    procs, logs = [], []
    attempt_started = time.time()
    try:
      for i in range(n):
        logs.append(os.path.join(run_dir, f"{f'restart{k}.' if k else ''}process{i}.log"))
        argv = [
          sys.executable, "-m", "experiments.train",
          f"--preset={cfg.preset}", f"--steps={cfg.steps}", f"--out_dir={run_dir}",
          f"--workers={n}", f"--num_processes={n}", f"--process_id={i}",
          f"--coordinator_address={lab.address(0)}:{port + k}", *flags, *resume,
        ]  # fmt: skip
        with open(logs[i], "w") as log:
          procs.append(lab.popen(i, argv, stdout=log, stderr=subprocess.STDOUT, env=env))
      what = f", restart {k}{' with --resume' if resume else ''}" if k else ""
      print(f"netlab: {name}: {n} processes started{what} (logs in {run_dir})", flush=True)
      grace = float(_last_value(flags, "peer_timeout_s") or 60) + 30
      outcome = drivers.wait(name, procs, logs, cfg.run_time_limit_s, tick=tick, grace_s=grace)
    finally:
      drivers.stop(procs)
    attempts.append(
      {
        "started": attempt_started,
        "ended": time.time(),
        "resumed": bool(resume),
        "exit_codes": [p.returncode for p in procs],
        "lines": [drivers.last_line(log) for log in logs] if outcome == "interrupted" else [],
      }
    )
    if outcome == "interrupted":
      print(f"netlab: {name}: interrupted ({attempts[-1]['lines'][0]})", flush=True)
  if blackout is not None:
    blackout.end()
  # A run stopped at the limit may leave a torn last line and no summary.
  metrics = os.path.join(run_dir, "metrics.jsonl")
  steps = records.read_metrics(run_dir) if os.path.exists(metrics) else []
  summary_path = os.path.join(run_dir, "summary.json")
  summary = records.Summary.load(summary_path) if os.path.exists(summary_path) else None
  return RunResult(
    method,
    shaped,
    steps,
    summary,
    stopped_at_limit=outcome == "limit",
    started_at=started,
    attempts=attempts,
    run_dir=run_dir,
  )


def _has_checkpoint(run_dir: str) -> bool:
  ckpt = os.path.join(run_dir, "checkpoints")
  return os.path.isdir(ckpt) and any(n.isdigit() for n in os.listdir(ckpt))


def _raise_exit(signum: int, frame: Any) -> None:
  raise SystemExit(128 + signum)


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _signals(handlers: Sequence[Any]) -> Iterator[None]:
  """Installs a handler per signal of :data:`_SIGNALS` for the block, then restores the old."""
  old = [signal.getsignal(s) for s in _SIGNALS]
  for sig, handler in zip(_SIGNALS, handlers):
    signal.signal(sig, handler)
  try:
    yield
  finally:
    for sig, handler in zip(_SIGNALS, old):
      signal.signal(sig, handler)


def _driver_env() -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  # No persistent compile cache: only process 0 writes it, so on a rerun
  # process 0 starts training while the others still compile, and gloo gives
  # up on a context whose peers are more than 30 s late.
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  return env


def _run_all(
  lab: links.Lab,
  cfg: LabConfig,
  rates: Sequence[float],
  runs: Mapping[str, Sequence[str]],
  flags: Sequence[str],
  impairments: Sequence[Impairment] | None,
) -> tuple[list[RunResult], list[dict[str, Any]], list[Any]]:
  """In a built lab: the sampler, every method unshaped, then shaped (and impaired), then killed."""
  env = _driver_env()
  counters_path = os.path.join(cfg.out_dir, "link_counters.jsonl")
  ifaces = [lab.hub_interface(i) for i in range(lab.num_processes)]
  with open(counters_path, "w") as out:
    sampler = [sys.executable, "-m", "experiments.netlab.counters", "--interval_s=0.05", *ifaces]
    lab.popen_hub(sampler, stdout=out, env=env)
  results = []
  port = _PORT
  forwarder_stats = os.path.join(cfg.out_dir, "impairment_counts.json")
  for shaped in (False, True):
    if shaped:
      lab.shape(rates, cfg.latency_ms)
      if impairments:
        lab.impair(impairments, stats_path=forwarder_stats, env=env)
    for method, own in runs.items():
      flags_ = [*flags, *own]
      blackout = None
      if shaped and cfg.blackout_s:
        victim = cfg.blackout_process % lab.num_processes
        blackout = faults.Blackout(lab, victim, _blackout_step(cfg), cfg.blackout_s)
      before = _counts(forwarder_stats)
      result = run_once(
        lab, cfg, method, shaped, port=port, flags=flags_, env=env, blackout=blackout
      )
      if blackout is not None:
        result = dataclasses.replace(result, blackout=blackout.summary())
      if shaped and impairments:
        time.sleep(2.5)  # the forwarder writes its counts every 2 s
        after = _counts(forwarder_stats)
        counts = {
          a: {k: v - before.get(a, {}).get(k, 0) for k, v in c.items()} for a, c in after.items()
        }
        result = dataclasses.replace(result, impairment_counts=counts)
      results.append(result)
      port += cfg.max_restarts + 1
  interrupted = []
  if cfg.kill_step:
    from experiments.netlab import interrupt

    for method, own in runs.items():
      run = interrupt.run_interrupted(lab, cfg, method, port=port, flags=[*flags, *own], env=env)
      interrupted.append(run)
      port += 3
  return results, records.read_jsonl(counters_path), interrupted


def _counts(path: str) -> dict[str, dict[str, int]]:
  """The impairment forwarder's packet and drop counts per link so far (empty before it wrote)."""
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def settings_line(cfg: LabConfig, rates: Sequence[float], flags: Sequence[str]) -> str:
  """One line saying what was run, for the report's head."""
  rate_text = (
    f"{rates[0]:g} Mbit/s links"
    if len(set(rates)) == 1
    else f"links of {', '.join(f'{r:g}' for r in rates)} Mbit/s"
  )
  impaired = faults.impairments(cfg.delay_ms, cfg.jitter_ms, cfg.loss_pct, cfg.processes)
  extra = f", {faults.describe(impaired)}" if impaired else ""
  if cfg.blackout_s:
    extra += (
      f", the link of process {cfg.blackout_process % cfg.processes} dark for "
      f"{cfg.blackout_s:g} s after step {_blackout_step(cfg)}"
    )
  return (
    f"{cfg.processes} processes over {rate_text}{extra}: preset {cfg.preset}, {cfg.steps} "
    f"steps, tbf latency {cfg.latency_ms:g} ms; driver flags: {' '.join(flags)}"
  )


def run(cfg: LabConfig, passthrough: Sequence[str] = ()) -> report.Report:
  """Builds the lab, runs every method unshaped then shaped, tears down, reports.

  Teardown happens on success, failure, the time limit and Ctrl-C alike: while
  the lab stands, SIGINT raises ``KeyboardInterrupt`` and SIGTERM or SIGHUP
  ``SystemExit``, and neither can cut the teardown short.

  Args:
    cfg: the lab's settings.
    passthrough: flags for every ``experiments.train`` driver (``--seq_len=64``).

  Returns:
    What :func:`experiments.netlab.report.summarize` returned; also written,
    with ``netlab.md`` and ``netlab_loss.png``, to ``cfg.out_dir``.

  Raises:
    NetlabError: a setting, the machine or a driver failed; the message says
      which and what to do.
  """
  rates, runs, flags, impairments = _check(cfg, passthrough)
  links.check_prerequisites()
  os.makedirs(cfg.out_dir, exist_ok=True)
  links.sweep_stale()
  lab = links.Lab(cfg.processes)
  # Also when started from a shell that ignores SIGINT in background jobs.
  with _signals((signal.default_int_handler, _raise_exit, _raise_exit)):
    lab.create()
    try:
      results, samples, interrupted = _run_all(lab, cfg, rates, runs, flags, impairments)
    finally:
      with _signals([signal.SIG_IGN] * len(_SIGNALS)):
        lab.teardown()
  summary = report.summarize(
    results,
    samples=samples,
    ifaces=[lab.hub_interface(i) for i in range(cfg.processes)],
    rates_mbit=rates,
    skip=cfg.skip_steps,
    target_loss=cfg.target_loss,
    interrupted=interrupted,
  )
  settings = settings_line(cfg, rates, flags)
  report.write_report(cfg.out_dir, summary, results, settings)
  print(report.markdown(summary, settings), flush=True)
  return summary
