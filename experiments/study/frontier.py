r"""Loss against bytes, over several horizons: the frontier each method reaches.

  python -m experiments.frontier --data_path=nltk_corpus --horizons=1000,5000 \
      --methods=adamw,muon,demo-k8-1bit,demo-k1-c8-1bit-rand-fb1-orth --seeds=3

For every horizon (a number of steps) and every method (a registry name, so
one family at several budgets of bytes per step is several methods), each
point of the method's tuning grid (``Method.tuning`` in the registry, or
``--grid`` for all) is one full run of the driver; the point with the lowest
final validation loss is that method's result at that horizon. With
``--seeds=N`` that best setting then runs again at the next N-1 seeds, and
the result is the mean over the N, with its spread; a ``--grid`` over
``seed`` (``"learning_rate=1e-3,3e-3;seed=0,1"``) instead scores every
setting by its mean over the seeds. A run whose ``summary.json`` already
exists is read instead of trained, so the command picks up where it
stopped; one trained with other settings than this call's (another seed,
corpus or worker count in the same ``--out_dir``) is refused before
anything trains. Each call draws its own runs; ``--draw_only`` trains
nothing and draws every finished run under ``OUT_DIR`` as one frontier
(only the ``--methods`` and ``--horizons`` given, if any), so calls made
separately (one per horizon, one per family's grid, a method added later)
combine. A horizon whose runs would read their training data more than
once is warned about before anything trains.

It writes to ``OUT_DIR``: ``results.json`` (the best point of every method
at every horizon: its loss's mean and spread over seeds, its gap to AdamW
and to the best dense method, the epochs it read; :func:`results`),
``frontier.json`` (every run, and the same best points), ``frontier.md``,
and three figures:

* ``frontier_bytes.png``: final validation loss against payload bytes per
  step (log scale), the compressed methods' points of each horizon joined
  by the curve of those no other beats, the dense methods as horizontal
  lines in the horizon's colour;
* ``frontier_gap.png``: each method's gap to the best dense method of its
  horizon against the horizon (error bars: the gap's spread over seeds);
* ``frontier_time.png``: validation loss against the wall-clock time the time
  model gives on a ``--link_mbit`` link (measured compute per step plus the
  transfer of what the ring moves up each link), for the longest horizon.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import itertools
import json
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from absl import app, flags

from experiments.run import checks, cli, config, methods
from experiments.run.config import ConfigError, TrainConfig
from experiments.run.launch import LaunchConfig, setup_devices
from experiments.run.records import StepRecord, Summary, read_metrics
from experiments.study import gaps, time_model

# The command is experiments.frontier; its flags belong to it, so --helpshort lists them.
flags.disclaim_key_flags()

__all__ = [
  "DEFAULT_METHODS",
  "Point",
  "best_points",
  "grid_points",
  "parse_grid_flag",
  "parse_horizons_flag",
  "plan_cost",
  "ratio_text",
  "results",
  "run_frontier",
  "step_seconds",
]

DEFAULT_METHODS = methods.DEFAULT_COMPARISON


@dataclasses.dataclass(frozen=True)
class Point:
  """One run of the frontier: a method, a horizon, a grid point, and what it reached.

  Attributes:
    method: the method name (family and options).
    horizon: steps trained.
    settings: the tuned fields and their values.
    out_dir: where the run lives.
    summary: the run's summary.
    seed_losses: for a best point run at several seeds (:func:`best_points`),
      the final validation loss at each seed, in seed order; else empty.
    seeds: those seeds, in the same order.
  """

  method: str
  horizon: int
  settings: dict[str, Any]
  out_dir: str
  summary: Summary
  seed_losses: tuple[float, ...] = ()
  seeds: tuple[Any, ...] = ()

  @property
  def tuned(self) -> dict[str, Any]:
    """``settings``, less the seed when the loss is a mean over seeds."""
    return {k: v for k, v in self.settings.items() if not (self.seed_losses and k == "seed")}

  @property
  def val_loss(self) -> float:
    """The run's final validation loss (inf if none or not finite), or the mean over seeds."""
    if self.seed_losses:
      return sum(self.seed_losses) / len(self.seed_losses)
    v = self.summary.final_val_loss
    return v if v is not None and math.isfinite(v) else math.inf

  @property
  def val_loss_std(self) -> float | None:
    """The sample standard deviation of the loss over the seeds (``None`` under two)."""
    if len(self.seed_losses) < 2 or not math.isfinite(self.val_loss):
      return None
    return float(np.std(self.seed_losses, ddof=1))

  @property
  def by_seed(self) -> dict[Any, float]:
    """Each seed's final validation loss (the one run's, for a point of one seed)."""
    if self.seed_losses:
      return dict(zip(self.seeds, self.seed_losses))
    return {_seed(self): self.val_loss}


def grid_points(method: methods.Method, grid: Mapping[str, Sequence[Any]] | None) -> list[dict]:
  """Every combination of ``grid``, or of the method's own ``tuning`` when ``grid`` is None."""
  grid = dict(method.tuning if grid is None else grid)
  names = sorted(grid)
  return [dict(zip(names, values)) for values in itertools.product(*(grid[n] for n in names))]


def _point_dir(out_dir: str, horizon: int, method: str, settings: Mapping[str, Any]) -> str:
  tag = "_".join(f"{k}-{v:g}" if isinstance(v, float) else f"{k}-{v}" for k, v in settings.items())
  return os.path.join(out_dir, f"steps{horizon}", method, tag or "default")


def _plan(
  base: TrainConfig, method_names: Sequence[str], horizons: Sequence[int], grid: Any, out_dir: str
) -> list[tuple[str, int, dict, TrainConfig]]:
  """Every run to make, each checked before any trains."""
  runs = []
  for horizon in horizons:
    for name in method_names:
      method, overrides = methods.parse(name)
      for settings in grid_points(method, grid):
        cfg = dataclasses.replace(
          base,
          steps=horizon,
          eval_every=max(horizon // 10, 1),
          out_dir=_point_dir(out_dir, horizon, name, settings),
          progress=False,
          **{**overrides, **settings},
        )
        checks.validate(cfg)
        runs.append((name, horizon, settings, cfg))
  return runs


def run_frontier(
  base: TrainConfig,
  method_names: Sequence[str],
  horizons: Sequence[int],
  out_dir: str,
  *,
  grid: Mapping[str, Sequence[Any]] | None = None,
  link_mbit: float = 10.0,
  seeds: int = 1,
) -> list[Point]:
  """Trains (or reads back) every run of the frontier, then writes its tables and figures.

  Args:
    base: the model, data, workers and seed; ``steps``, ``out_dir`` and the
      tuned fields are set per run.
    method_names: registry method names, e.g. ``"demo-k8-1bit"``.
    horizons: the step counts to train for.
    out_dir: where the runs, tables and figures go.
    grid: fields to tune and their values, for every method; default: each
      method's ``tuning``.
    link_mbit: the link of the time figure, in Mbit/s both ways.
    seeds: the seeds each method's best setting at each horizon runs at:
      the grid is tuned at ``base.seed``, and the best setting runs again at
      the next ``seeds - 1`` seeds; the tables report the mean and spread.

  Returns:
    Every run as a :class:`Point`.

  Raises:
    ConfigError: a method, horizon or grid point that cannot run, or a
      finished run in ``out_dir`` that trained with other settings, before
      any trains.
  """
  from experiments.run import trainer

  if not method_names or not horizons or min(horizons) < 1:
    raise ConfigError("--methods and --horizons need at least one entry, horizons positive.")
  if seeds < 1:
    raise ConfigError(f"--seeds={seeds}: give 1 or more, e.g. --seeds=3.")
  if seeds > 1 and grid is not None and "seed" in grid:
    raise ConfigError(
      "--seeds runs each best setting again at more seeds, and a --grid over seed runs every "
      "setting at each seed: use one of the two."
    )
  plan = _plan(base, method_names, horizons, grid, out_dir)
  if seeds > 1:
    checks.validate(dataclasses.replace(base, seed=base.seed + seeds - 1))
  done = {}
  for *_, cfg in plan:  # every cached run checked before any trains
    if summary := _cached(cfg):
      done[cfg.out_dir] = summary
  _warn_if_rereading(base, horizons)
  print(f"[frontier] {plan_cost(plan, done, seeds, out_dir)}", file=sys.stderr, flush=True)
  points = []

  def run(name: str, horizon: int, settings: dict[str, Any], cfg: TrainConfig) -> None:
    summary = done.get(cfg.out_dir) or _cached(cfg)
    if summary is None:
      print(f"[frontier] {name} {horizon} steps {settings}", file=sys.stderr, flush=True)
      summary = trainer.run(cfg)
    points.append(Point(name, horizon, settings, cfg.out_dir, summary))
    if cfg.out_dir not in done:
      _write(points, out_dir, link_mbit)  # after each run trained: a long frontier shows progress

  for (name, horizon), group in itertools.groupby(plan, key=lambda r: (r[0], r[1])):
    group = list(group)
    for _, _, settings, cfg in group:
      run(name, horizon, settings, cfg)
    if seeds == 1:
      continue
    tuned = best_points([p for p in points if (p.method, p.horizon) == (name, horizon)])
    best = tuned[(name, horizon)].tuned
    cfg = next(c for _, _, s, c in group if s == best)
    for seed in range(base.seed + 1, base.seed + seeds):
      settings = dict(sorted({**best, "seed": seed}.items()))
      out = _point_dir(out_dir, horizon, name, settings)
      run(name, horizon, settings, dataclasses.replace(cfg, seed=seed, out_dir=out))
  _write(points, out_dir, link_mbit)
  return points


def step_seconds(run_dir: str) -> float | None:
  """The median seconds a step of the finished run in ``run_dir`` took (its metrics' rates)."""
  summary = Summary.load(os.path.join(run_dir, "summary.json"))
  cfg = summary.config or {}
  tokens = cfg.get("batch_size", 0) * cfg.get("seq_len", 0)
  rates = [r.tokens_per_s for r in read_metrics(run_dir) if r.tokens_per_s]
  return tokens / float(np.median(rates)) if tokens and rates else None


def plan_cost(
  plan: Sequence[tuple[str, int, dict, TrainConfig]],
  done: Mapping[str, Summary],
  seeds: int,
  out_dir: str,
) -> str:
  """One line: the runs and steps a plan still has to train, and the time they should take.

  A method's seconds per step are the median over its finished runs under
  ``out_dir``; a method with none takes the slowest median of the others
  (the plan's cost is then an estimate, and says so), and with no finished
  run at all the time is left unknown.
  """
  todo = [(name, cfg.steps) for name, _, _, cfg in plan if cfg.out_dir not in done]
  cached = len(plan) - len(todo)
  # Each (method, horizon) reruns its best setting at seeds - 1 more seeds, some
  # of them perhaps already finished: counted as to train, an upper bound.
  todo += list(dict.fromkeys((n, h) for n, h, _, _ in plan)) * (seeds - 1)
  rates: dict[str, list[float]] = {}
  for p in read_runs(out_dir):
    if (sec := step_seconds(p.out_dir)) is not None:
      rates.setdefault(p.method, []).append(sec)
  per_method = {name: float(np.median(v)) for name, v in rates.items()}
  steps = sum(h for _, h in todo)
  line = f"plan: {len(todo)} runs to train ({cached} read back), {steps:,} steps"
  if not todo:
    return line
  if not per_method:
    return line + "; no finished run under --out_dir to time a step by, so no time estimate"
  slowest = max(per_method.values())
  guessed = sorted({n for n, _ in todo if n not in per_method})
  seconds = sum(h * per_method.get(n, slowest) for n, h in todo)
  line += f", about {seconds / 3600:.1f} h at the finished runs' median step times"
  if guessed:
    line += f" (untimed, taken at the slowest, {slowest:.2f} s: {', '.join(guessed)})"
  return line


def _cached(cfg: TrainConfig) -> Summary | None:
  """A finished run's summary in ``cfg.out_dir``, once it is checked to be ``cfg``'s."""
  summary_path = os.path.join(cfg.out_dir, "summary.json")
  if not os.path.exists(summary_path):
    return None
  summary = Summary.load(summary_path)
  _check_cached(summary, cfg)
  return summary


def _warn_if_rereading(base: TrainConfig, horizons: Sequence[int]) -> None:
  """One line, before anything trains, for each horizon whose runs would read data twice."""
  from experiments.run import data, presets

  vocab = presets.get_preset(base.preset).vocab_size
  windows = data.planned_reading(
    base.data_path, vocab, seq_len=base.seq_len, steps=1, global_batch_size=base.batch_size
  ).train_windows
  for horizon in sorted(horizons):
    reading = data.Reading.of(horizon, base.batch_size, windows)
    if line := gaps.reading_warning(f"each run of {horizon} steps", reading.train_epochs):
      print(f"[frontier] {line}", file=sys.stderr, flush=True)


# A frontier point is what its run computed (the fingerprint a resume must
# match), on how many workers (a resume may change that, a point may not), and
# over how much held-out text its validation loss was averaged.
_ALSO_COMPARED = config.ELASTIC_FIELDS | {"eval_batches"}


def _identity(cfg: TrainConfig) -> dict[str, Any]:
  return {**config.fingerprint(cfg), **{f: getattr(cfg, f) for f in _ALSO_COMPARED}}


def _check_cached(summary: Summary, cfg: TrainConfig) -> None:
  """Refuses to read back a run that trained with other settings than ``cfg`` asks for.

  A run's directory is named by its method, horizon and tuned fields only, so
  a call with another seed, corpus, preset or worker count (or a recipe that
  has changed since) would otherwise pass off the old run as its own. Fields
  a run's summary predates are not compared.
  """
  if summary.steps is not None and summary.steps != cfg.steps:
    raise ConfigError(
      f"{cfg.out_dir} holds a run that stopped at step {summary.steps} of {cfg.steps}; resume "
      f"it (python -m experiments.train --resume --out_dir={cfg.out_dir} and its flags), or "
      "delete that run's directory to train it again."
    )
  known = {f.name for f in dataclasses.fields(TrainConfig)}
  saved = {k: v for k, v in (summary.config or {}).items() if k in known}
  had, want = _identity(TrainConfig(**saved)), _identity(checks.resolve(cfg))
  differ = sorted(f for f in want if f in saved and had[f] != want[f])
  if differ:
    shown = ", ".join(f"{f}={had[f]!r} (now {want[f]!r})" for f in differ)
    raise ConfigError(
      f"{cfg.out_dir} holds a finished run with other settings: {shown}. Give this frontier "
      "its own --out_dir, or delete that run's directory to train it again."
    )


def _tag_fields(tag: str) -> list[str]:
  """The config fields a run directory's tag names (see :func:`_point_dir`), in order."""
  names = sorted((f.name for f in dataclasses.fields(TrainConfig)), key=len, reverse=True)
  return re.findall(r"(?:^|_)(" + "|".join(names) + r")-", tag)


def read_runs(out_dir: str) -> list[Point]:
  """Every finished run under ``out_dir``, whichever command and grid made it.

  Each call of :func:`run_frontier` writes its tables and figures from its own
  runs; this gathers all of them (every method, horizon and grid point with a
  ``summary.json``; unfinished ones are skipped), so several calls, e.g. one
  per horizon, draw as one frontier. The settings are read back from each
  run's own config, for the fields its directory names.
  """
  points = []
  for horizon_dir in glob.glob(os.path.join(out_dir, "steps*")):
    horizon = os.path.basename(horizon_dir)[len("steps") :]
    if not horizon.isdigit():
      continue
    for summary_path in glob.glob(os.path.join(horizon_dir, "*", "*", "summary.json")):
      run_dir = os.path.dirname(summary_path)
      method = os.path.basename(os.path.dirname(run_dir))
      summary = Summary.load(summary_path)
      settings = {f: summary.config[f] for f in _tag_fields(os.path.basename(run_dir))}
      points.append(Point(method, int(horizon), settings, run_dir, summary))
  points.sort(key=lambda p: (p.horizon, p.method, json.dumps(p.settings, sort_keys=True)))
  return points


def _seed(p: Point) -> Any:
  if "seed" in p.settings:
    return p.settings["seed"]
  return (p.summary.config or {}).get("seed")


def best_points(points: Sequence[Point]) -> dict[tuple[str, int], Point]:
  """The lowest final validation loss per (method, horizon), seeds averaged.

  Runs that differ only in ``seed`` are one setting. Settings are compared
  on the seeds they all ran (a ``--grid`` over ``seed``: all of them, so the
  best setting is not whichever had the luckiest seed; ``--seeds``: the
  tuning seed, since only the best setting runs again at the others); a
  setting whose run diverged at any seed scores inf. A setting of several
  seeds is returned as its run nearest the mean (its curves and bytes are
  drawn), with every seed's loss in ``seed_losses``.
  """
  settings: dict[tuple[str, int], dict[str, dict[Any, Point]]] = {}
  for p in points:
    rest = json.dumps({k: v for k, v in p.settings.items() if k != "seed"}, sort_keys=True)
    settings.setdefault((p.method, p.horizon), {}).setdefault(rest, {}).setdefault(_seed(p), p)
  best: dict[tuple[str, int], Point] = {}
  for key, by_setting in settings.items():
    common = set.intersection(*(set(by_seed) for by_seed in by_setting.values()))

    def score(by_seed: dict[Any, Point], common: set[Any] = common) -> float:
      if not all(math.isfinite(p.val_loss) for p in by_seed.values()):
        return math.inf  # diverged at some seed: unstable, whatever the others did
      losses = [by_seed[s].val_loss for s in (common or by_seed)]
      return sum(losses) / len(losses)

    by_seed = min(by_setting.values(), key=score)
    runs = [by_seed[s] for s in sorted(by_seed, key=lambda s: (s is None, s or 0))]
    if len(runs) == 1:
      best[key] = runs[0]
      continue
    losses = tuple(r.val_loss for r in runs)
    mean = sum(losses) / len(losses)
    near = runs[0] if not math.isfinite(mean) else min(runs, key=lambda r: abs(r.val_loss - mean))
    seeds = tuple(sorted(by_seed, key=lambda s: (s is None, s or 0)))
    best[key] = dataclasses.replace(near, seed_losses=losses, seeds=seeds)
  return best


def results(points: Sequence[Point]) -> list[dict[str, Any]]:
  """The best point of every method at every horizon, with its gaps: ``results.json``'s rows.

  Each row: ``method``, ``horizon``, ``dense``, ``settings``, ``val_loss``
  (the mean over ``seeds``), ``val_loss_std`` (over the seeds; ``None`` for
  one), ``seeds``, ``seed_losses``, ``val_gap_vs_adamw``, ``best_dense``,
  ``gap_to_best_dense`` (of the means; ``experiments.study.gaps``),
  ``gap_to_best_dense_std`` (of the gaps seed by seed, over the seeds both
  ran, where there are two or more), ``train_epochs``, ``rereads_data``,
  ``payload_bytes_per_step``, ``ratio_vs_bf16_grad`` and ``out_dir``.
  """
  best = best_points(points)
  rows = []
  for horizon in sorted({h for _, h in best}):
    at = {m: p for (m, h), p in best.items() if h == horizon}
    found = gaps.gaps({m: p.val_loss for m, p in at.items()})
    for name, p in sorted(at.items(), key=lambda kv: (not gaps.is_dense(kv[0]), kv[0])):
      g = found[name]
      reference = at.get(g["best_dense"]) if g["best_dense"] else None
      rows.append(
        {
          "method": name,
          "horizon": horizon,
          "dense": gaps.is_dense(name),
          "settings": p.tuned,
          "val_loss": p.val_loss,
          "val_loss_std": p.val_loss_std,
          "seeds": list(p.seeds) or [_seed(p)],
          "seed_losses": list(p.seed_losses) or [p.val_loss],
          **g,
          "gap_to_best_dense_std": _paired_std(p, reference),
          "train_epochs": p.summary.train_epochs,
          "rereads_data": p.summary.rereads_data,
          "payload_bytes_per_step": p.summary.payload_bytes_per_step,
          "ratio_vs_bf16_grad": p.summary.ratio_vs_bf16_grad,
          "out_dir": p.out_dir,
        }
      )
  return rows


def _paired_std(p: Point, reference: Point | None) -> float | None:
  """The spread of ``p``'s gap to ``reference``, seed by seed, over the seeds both ran."""
  if reference is None or reference is p:
    return None
  mine, theirs = p.by_seed, reference.by_seed
  paired = [mine[s] / theirs[s] - 1 for s in mine if s in theirs]
  if len(paired) < 2 or not all(math.isfinite(g) for g in paired):
    return None
  return float(np.std(paired, ddof=1))


def ratio_text(x: float) -> str:
  """A bytes ratio as the tables print it: ``1,015x``, or ``0.42x`` below 10."""
  return f"{x:,.0f}x" if x >= 10 else f"{x:.2f}x"


def _pct(gap: float | None, std: float | None = None) -> str:
  if gap is None:
    return ""
  return f"{100 * gap:+.1f}%" + (f" ± {100 * std:.1f}" if std is not None else "")


def markdown(points: Sequence[Point]) -> str:
  """The best point of every method at every horizon, with its gaps and seeds, then every run."""
  lines = [
    "| steps | method | val loss | seeds | vs AdamW | vs best dense | epochs | payload B/step "
    "| vs bf16 grad | best settings |",
    "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
  ]
  for r in results(points):
    val = f"{r['val_loss']:.4f}"
    if r["val_loss_std"] is not None:
      val += f" ± {r['val_loss_std']:.4f}"
    seeds = str(len(r["seeds"]))
    if len(r["seeds"]) > 1:
      seeds += " (" + ", ".join(f"{v:.4f}" for v in r["seed_losses"]) + ")"
    dense_gap = _pct(r["gap_to_best_dense"], r["gap_to_best_dense_std"])
    if dense_gap and r["best_dense"]:
      dense_gap += f" ({r['best_dense']})"
    epochs = "" if r["train_epochs"] is None else f"{r['train_epochs']:.2f}"
    if r["rereads_data"]:
      epochs += " (rereads)"
    lines.append(
      f"| {r['horizon']} | {r['method']}{' (dense)' if r['dense'] else ''} | {val} | {seeds} "
      f"| {_pct(r['val_gap_vs_adamw'])} | {dense_gap} | {epochs} "
      f"| {r['payload_bytes_per_step']:,.0f} | {ratio_text(r['ratio_vs_bf16_grad'])} "
      f"| {json.dumps(r['settings'])} |"
    )
  lines += [
    "",
    "Val loss: the mean over the seeds, ± their sample standard deviation; a gap's ± is "
    "the standard deviation of the gap seed by seed. Best dense: the dense method (an "
    "all-reduce every step) with the lowest val loss at that horizon. Epochs: the share of "
    "the training split each run read; above 1 it read some data twice.",
  ]
  lines += ["", "Every run:", "", "| steps | method | settings | val loss | epochs |"]
  lines += ["| ---: | --- | --- | ---: | ---: |"]
  for p in points:
    epochs = "" if p.summary.train_epochs is None else f"{p.summary.train_epochs:.2f}"
    lines.append(
      f"| {p.horizon} | {p.method} | {json.dumps(p.settings)} | {p.val_loss:.4f} | {epochs} |"
    )
  return "\n".join(lines)


def _write(points: Sequence[Point], out_dir: str, link_mbit: float) -> None:
  os.makedirs(out_dir, exist_ok=True)
  rows = results(points)
  record = {
    "runs": [
      {
        "method": p.method,
        "horizon": p.horizon,
        "settings": p.settings,
        "out_dir": p.out_dir,
        "final_val_loss": p.summary.final_val_loss,
        "final_train_loss": p.summary.final_train_loss,
        "payload_bytes_per_step": p.summary.payload_bytes_per_step,
        "ratio_vs_bf16_grad": p.summary.ratio_vs_bf16_grad,
        "train_epochs": p.summary.train_epochs,
        "rereads_data": p.summary.rereads_data,
      }
      for p in points
    ],
    "best": rows,
  }
  with open(os.path.join(out_dir, "frontier.json"), "w") as f:
    json.dump(record, f, indent=2)
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(rows, f, indent=2)
  with open(os.path.join(out_dir, "frontier.md"), "w") as f:
    f.write(markdown(points) + "\n")
  _plot(points, out_dir, link_mbit)


def _time_curve(p: Point, link_mbit: float) -> tuple[list[float], list[float]]:
  """Validation loss against projected seconds on the link, for one run."""
  records: list[StepRecord] = read_metrics(p.out_dir)
  cfg = p.summary.config
  method = methods.get(p.summary.optimizer)
  step_s = [cfg["batch_size"] * cfg["seq_len"] / r.tokens_per_s for r in records[1:]]
  compute = float(np.median(step_s)) if step_s else 0.0
  run_cfg = TrainConfig(**cfg)
  every = method.exchange_every(run_cfg)
  up, down = time_model.link_bytes(
    method.collective, p.summary.payload_bytes_per_step * every, p.summary.workers
  )
  link = time_model.Link(f"{link_mbit:g} Mbit/s", link_mbit * 1e6, link_mbit * 1e6)
  # A step that exchanges, and its overlapped share hidden under its compute.
  exchanging = time_model.step_seconds(compute, up, down, link, methods.overlapped_share(run_cfg))
  xs, ys = [], []
  for r in records:
    if r.val_loss is not None:
      exchanges = r.step // every
      xs.append((r.step - exchanges) * compute + exchanges * exchanging)
      ys.append(r.val_loss)
  return xs, ys


def _frontier_line(pts: list[tuple[float, float]]) -> list[tuple[float, float]]:
  """The points no other beats on both bytes and loss, by bytes: the frontier's curve."""
  line: list[tuple[float, float]] = []
  for x, y in sorted(pts):
    if math.isfinite(y) and (not line or y < line[-1][1]):
      line.append((x, y))
  return line


def _plot(points: Sequence[Point], out_dir: str, link_mbit: float) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  best = best_points(points)
  rows = results(points)
  horizons = sorted({h for _, h in best})
  names = list(dict.fromkeys(m for m, _ in best))
  colors = {h: f"C{i % 10}" for i, h in enumerate(horizons)}
  styles = ("--", ":", "-.", (0, (5, 1)))

  # Validation loss against bytes per step: a curve per horizon through the
  # compressed methods that no other beats, the dense methods as lines.
  fig, ax = plt.subplots(figsize=(8, 5.5))
  for horizon in horizons:
    at = [r for r in rows if r["horizon"] == horizon]
    sparse = [r for r in at if not r["dense"] and math.isfinite(r["val_loss"])]
    if sparse:
      ax.errorbar(
        [r["payload_bytes_per_step"] for r in sparse],
        [r["val_loss"] for r in sparse],
        yerr=[r["val_loss_std"] or 0.0 for r in sparse],
        fmt="o",
        ms=4,
        color=colors[horizon],
        capsize=2,
      )
      line = _frontier_line([(r["payload_bytes_per_step"], r["val_loss"]) for r in sparse])
      ax.plot(*zip(*line), "-", color=colors[horizon], label=f"{horizon} steps")
      for r in sparse:
        ax.annotate(
          r["method"],
          (r["payload_bytes_per_step"], r["val_loss"]),
          fontsize=6,
          xytext=(3, 3),
          textcoords="offset points",
        )
    dense = [r for r in at if r["dense"] and math.isfinite(r["val_loss"])]
    for r, style in zip(dense, itertools.cycle(styles)):
      ax.axhline(
        r["val_loss"],
        color=colors[horizon],
        ls=style,
        lw=1,
        label=f"{r['method']}, {horizon} steps",
      )
  ax.set(xscale="log", xlabel="payload bytes per worker per step", ylabel="final val loss")
  ax.set_title("Validation loss against bytes per step (lines: dense methods)")
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "frontier_bytes.png"), dpi=100)
  plt.close(fig)

  # Each method's gap to the best dense method of its horizon, against the horizon.
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name in names:
    mine = [r for r in rows if r["method"] == name and r["gap_to_best_dense"] is not None]
    if mine and any(r["best_dense"] != name for r in mine):
      ax.errorbar(
        [r["horizon"] for r in mine],
        [100 * r["gap_to_best_dense"] for r in mine],
        yerr=[100 * (r["gap_to_best_dense_std"] or 0.0) for r in mine],
        fmt="o--" if gaps.is_dense(name) else "o-",
        capsize=2,
        label=name,
      )
  ax.axhline(0, color="k", ls="--")
  ax.set(xscale="log", xlabel="steps (horizon)", ylabel="val loss gap to the best dense method (%)")
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:  # no line yet while only dense methods have finished
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "frontier_gap.png"), dpi=100)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name in names:
    if p := best.get((name, horizons[-1])):
      xs, ys = _time_curve(p, link_mbit)
      ax.plot(xs, ys, "o-", ms=3, label=name)
  ax.set(xscale="log", xlabel=f"seconds on a {link_mbit:g} Mbit/s link (time model)")
  ax.set(ylabel="val loss", title=f"{horizons[-1]} steps")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "frontier_time.png"), dpi=100)
  plt.close(fig)


def parse_horizons_flag(values: Sequence[str]) -> list[int]:
  """``--horizons``' values as step counts; anything else is a ConfigError naming the flag."""
  try:
    return [int(h) for h in values]
  except ValueError:
    raise ConfigError(f"--horizons={','.join(values)}: give step counts, e.g. 300,1000.") from None


def parse_grid_flag(text: str) -> dict[str, tuple[Any, ...]] | None:
  """``--grid``'s text as each field's values (``None`` for no text); see ``sweep.parse_grid``."""
  if not text:
    return None
  from experiments.study.sweep import parse_grid

  points = parse_grid(text)
  return {k: tuple(dict.fromkeys(p[k] for p in points)) for k in points[0]}


def _main(
  train_flags: Mapping[str, flags.FlagHolder],
  launch_flags: Mapping[str, flags.FlagHolder],
  own: Mapping[str, flags.FlagHolder],
  argv: Sequence[str],
) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")

  def frontier() -> list[Point]:
    base = cli.config_from_flags(train_flags)
    if own["draw_only"].value:
      points = read_runs(base.out_dir)
      if own["methods"].present:
        points = [p for p in points if p.method in own["methods"].value]
      if own["horizons"].present:
        points = [p for p in points if str(p.horizon) in own["horizons"].value]
      if not points:
        raise ConfigError(
          f"--draw_only: no finished run under --out_dir={base.out_dir} for these methods and "
          "horizons; give the directory a frontier command trained into (it holds "
          "steps<N>/<method>/<settings>/), or other --methods/--horizons."
        )
      _write(points, base.out_dir, own["link_mbit"].value)
      return points
    horizons = parse_horizons_flag(own["horizons"].value)
    setup_devices(cli.config_from_flags(launch_flags, LaunchConfig), base.devices)
    return run_frontier(
      base,
      own["methods"].value,
      horizons,
      base.out_dir,
      grid=parse_grid_flag(own["grid"].value),
      link_mbit=own["link_mbit"].value,
      seeds=own["seeds"].value,
    )

  points = cli.report_user_errors(frontier)
  print(markdown(points))


def main(argv: Sequence[str] | None = None) -> None:
  """The command: the driver's flags (small preset) and the frontier's own."""
  train_flags = cli.define_flags(defaults={"preset": "small", "out_dir": "runs/frontier"})
  launch_flags = cli.define_flags(LaunchConfig)
  own = {
    "methods": flags.DEFINE_list("methods", list(DEFAULT_METHODS), "Registry method names."),
    "horizons": flags.DEFINE_list("horizons", ["300", "1000"], "Steps to train each for."),
    "grid": flags.DEFINE_string(
      "grid", "", "field=v1,v2;... to tune for every method (default: each method's tuning)."
    ),
    "link_mbit": flags.DEFINE_float("link_mbit", 10.0, "The time figure's link, Mbit/s."),
    "seeds": flags.DEFINE_integer(
      "seeds",
      1,
      "Seeds per best point: the grid is tuned at --seed, then each method's best setting "
      "at each horizon runs again at the next seeds-1 seeds; the tables give the mean and "
      "the spread.",
    ),
    "draw_only": flags.DEFINE_bool(
      "draw_only",
      False,
      "Train nothing: write the tables and figures from every finished run under --out_dir "
      "(every setting; only the --methods and --horizons given, if any).",
    ),
  }
  app.run(functools.partial(_main, train_flags, launch_flags, own), argv=argv)


if __name__ == "__main__":
  main()
