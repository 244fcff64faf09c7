r"""Loss against bytes, over several horizons: the frontier each method reaches.

  python -m experiments.frontier --data_path=english.txt --horizons=300,1000 \
      --methods=adamw,demo,demo-k8-1bit,demo-k2-1bit,diloco

For every horizon (a number of steps) and every method (a registry name, so
one family at several budgets of bytes per step is several methods), each
point of the method's tuning grid (``Method.tuning`` in the registry, or
``--grid`` for all) is one full run of the driver; the point with the lowest
final validation loss is that method's result at that horizon. A ``--grid``
over ``seed`` (``"learning_rate=1e-3,3e-3;seed=0,1"``) scores each setting by
its mean over the seeds. A run whose ``summary.json`` already exists is read
instead of trained, so the command picks up where it stopped; one trained
with other settings than this call's (another seed, corpus or worker count
in the same ``--out_dir``) is refused before anything trains. Each call
draws its own runs; ``--draw_only`` trains nothing and draws every finished
run under ``OUT_DIR`` as one frontier (only the ``--methods`` and
``--horizons`` given, if any), so calls made separately (one per horizon, a
method added later) combine.

It writes to ``OUT_DIR``: ``frontier.json`` (every run, its settings and
results, and the best point per method and horizon), ``frontier.md``, and
three figures:

* ``frontier_bytes.png``: final validation loss against payload bytes per
  step (log scale), one panel per horizon, AdamW as a horizontal line;
* ``frontier_gap.png``: each method's gap to AdamW's validation loss against
  the horizon;
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
from experiments.study import time_model

__all__ = ["DEFAULT_METHODS", "Point", "best_points", "grid_points", "run_frontier"]

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
    seed_losses: for a best point tuned over ``seed`` (:func:`best_points`),
      the final validation loss at each seed, in seed order; else empty.
  """

  method: str
  horizon: int
  settings: dict[str, Any]
  out_dir: str
  summary: Summary
  seed_losses: tuple[float, ...] = ()

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
  plan = _plan(base, method_names, horizons, grid, out_dir)
  done = {}
  for *_, cfg in plan:  # every cached run checked before any trains
    summary_path = os.path.join(cfg.out_dir, "summary.json")
    if os.path.exists(summary_path):
      done[cfg.out_dir] = Summary.load(summary_path)
      _check_cached(done[cfg.out_dir], cfg)
  points = []
  for name, horizon, settings, cfg in plan:
    summary = done.get(cfg.out_dir)
    cached = summary is not None
    if not cached:
      print(f"[frontier] {name} {horizon} steps {settings}", file=sys.stderr, flush=True)
      summary = trainer.run(cfg)
    points.append(Point(name, horizon, settings, cfg.out_dir, summary))
    if not cached:
      _write(points, out_dir, link_mbit)  # after each run trained: a long frontier shows progress
  _write(points, out_dir, link_mbit)
  return points


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

  Runs that differ only in ``seed`` (a ``--grid`` over it) are one setting,
  scored by the mean of their losses, so the best setting is not whichever
  had the luckiest seed; a seed whose run diverged makes the mean inf. The
  point returned for such a setting is its run nearest the mean (its curves
  and bytes are drawn), with every seed's loss in ``seed_losses``.
  """
  settings: dict[tuple[str, int, str], dict[Any, Point]] = {}
  for p in points:
    rest = json.dumps({k: v for k, v in p.settings.items() if k != "seed"}, sort_keys=True)
    settings.setdefault((p.method, p.horizon, rest), {}).setdefault(_seed(p), p)
  best: dict[tuple[str, int], Point] = {}
  for (method, horizon, _), by_seed in settings.items():
    runs = [by_seed[s] for s in sorted(by_seed, key=lambda s: (s is None, s or 0))]
    if len(runs) == 1:
      p = runs[0]
    else:
      losses = tuple(r.val_loss for r in runs)
      mean = sum(losses) / len(losses)
      near = runs[0] if not math.isfinite(mean) else min(runs, key=lambda r: abs(r.val_loss - mean))
      p = dataclasses.replace(near, seed_losses=losses)
    key = (method, horizon)
    if key not in best or p.val_loss < best[key].val_loss:
      best[key] = p
  return best


def _baseline(best: Mapping[tuple[str, int], Point], horizon: int) -> float | None:
  p = best.get((methods.BASELINE, horizon))
  return p.val_loss if p else None


def _ratio(x: float) -> str:
  return f"{x:,.0f}x" if x >= 10 else f"{x:.2f}x"


def markdown(points: Sequence[Point]) -> str:
  """The best point of every method at every horizon, then every run."""
  best = best_points(points)
  lines = [
    "| steps | method | val loss | vs AdamW | payload B/step | vs bf16 grad | best settings |",
    "| ---: | --- | ---: | ---: | ---: | ---: | --- |",
  ]
  for (name, horizon), p in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    base = _baseline(best, horizon)
    gap = f"{100 * (p.val_loss / base - 1):+.1f}%" if base else ""
    s = p.summary
    val = f"{p.val_loss:.4f}"
    if p.seed_losses:
      each = ", ".join(f"{v:.4f}" for v in p.seed_losses)
      val += f" (mean of {len(p.seed_losses)} seeds: {each})"
    lines.append(
      f"| {horizon} | {name} | {val} | {gap} | {s.payload_bytes_per_step:,.0f} "
      f"| {_ratio(s.ratio_vs_bf16_grad)} | {json.dumps(p.tuned)} |"
    )
  lines += ["", "Every run:", "", "| steps | method | settings | val loss |"]
  lines += ["| ---: | --- | --- | ---: |"]
  for p in points:
    lines.append(f"| {p.horizon} | {p.method} | {json.dumps(p.settings)} | {p.val_loss:.4f} |")
  return "\n".join(lines)


def _write(points: Sequence[Point], out_dir: str, link_mbit: float) -> None:
  os.makedirs(out_dir, exist_ok=True)
  best = best_points(points)
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
      }
      for p in points
    ],
    "best": [
      {
        "method": m,
        "horizon": h,
        "settings": p.tuned,
        "val_loss": p.val_loss,
        "seed_losses": list(p.seed_losses),
      }
      for (m, h), p in best.items()
    ],
  }
  with open(os.path.join(out_dir, "frontier.json"), "w") as f:
    json.dump(record, f, indent=2)
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


def _plot(points: Sequence[Point], out_dir: str, link_mbit: float) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  best = best_points(points)
  horizons = sorted({h for _, h in best})
  names = list(dict.fromkeys(m for m, _ in best))
  fig, axes = plt.subplots(1, len(horizons), figsize=(6 * len(horizons), 4.5), squeeze=False)
  families = {}
  for name in names:
    families.setdefault(methods.parse(name)[0].name, []).append(name)
  for ax, horizon in zip(axes[0], horizons):
    for family, members in families.items():
      pts = sorted(
        (p.summary.payload_bytes_per_step, p.val_loss, n)
        for n in members
        if (p := best.get((n, horizon))) and n != methods.BASELINE
      )
      if not pts:
        continue
      ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], "o-", label=family)
      for x, y, n in pts:
        ax.annotate(n, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    if (base := _baseline(best, horizon)) is not None:
      ax.axhline(base, color="k", ls="--", label=f"{methods.BASELINE} (all-reduce)")
    ax.set(xscale="log", xlabel="payload bytes per worker per step", ylabel="final val loss")
    ax.set_title(f"{horizon} steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "frontier_bytes.png"), dpi=100)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name in names:
    pts = [(h, best[(name, h)].val_loss / b - 1) for h in horizons
           if (name, h) in best and (b := _baseline(best, h))]  # fmt: skip
    if pts and name != methods.BASELINE:
      ax.plot([x for x, _ in pts], [100 * y for _, y in pts], "o-", label=name)
  ax.axhline(0, color="k", ls="--")
  ax.set(xscale="log", xlabel="steps (horizon)", ylabel="val loss gap to AdamW (%)")
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:  # no line yet while only AdamW has finished
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


def _parse_grid(text: str) -> dict[str, tuple[Any, ...]] | None:
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
    try:
      horizons = [int(h) for h in own["horizons"].value]
    except ValueError:
      given = ",".join(own["horizons"].value)
      raise ConfigError(f"--horizons={given}: give step counts, e.g. 300,1000.") from None
    setup_devices(cli.config_from_flags(launch_flags, LaunchConfig), base.devices)
    return run_frontier(
      base,
      own["methods"].value,
      horizons,
      base.out_dir,
      grid=_parse_grid(own["grid"].value),
      link_mbit=own["link_mbit"].value,
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
