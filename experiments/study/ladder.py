r"""The gap to dense Muon taken apart: every message budget with every step rule.

  python -m experiments.ladder --data_path=nltk_corpus --horizons=300 \
      --grid="learning_rate=1.5e-3,3e-3,6e-3" --out_dir=runs/ladder

Two things separate DeMo's compressed message from dense Muon: what the
message drops (its bytes), and how the step is made from what arrives (its
rule). The ladder crosses them. Its rungs are message budgets, from nothing
dropped (every DCT coefficient of every 8x8 chunk, float32: the exchange with
no compression at all) down to a 1-bit message past 4,000x; its step rules
are DeMo's sign, the orthogonalized step (``orth``: hidden matrices as Muon
does, the rest at unit RMS), and Muon's momentum on the aggregate before that
step (``am``). Dense AdamW, Muon and Muon without momentum are the
references. With nothing dropped the aggregate is the mean gradient times the
rate, so ``momentum + orth`` there is dense Muon on the hidden matrices
(``tests/test_aggregate_momentum.py`` checks this to 1e-4): the rung where
the compression costs nothing, and the rule's own cost shows.

Every point is one run of :mod:`experiments.study.frontier` (its cache, so an
interrupted ladder resumes, and its refusals of a cached run with other
settings), the best point of the grid per method. It writes to ``OUT_DIR``
the frontier's tables and figures plus ``ladder.md`` (a row per rung, a
column per rule: the loss and its gap to the best dense method) and
``ladder.png`` (loss against bytes per step, a line per rule, the dense
methods as horizontal lines).
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from absl import app, flags

from experiments.run import cli
from experiments.run.config import ConfigError
from experiments.run.launch import LaunchConfig, setup_devices
from experiments.study import frontier

# The command is experiments.ladder; its flags belong to it, so --helpshort lists them.
flags.disclaim_key_flags()

__all__ = ["DENSE", "RULES", "RUNGS", "ladder_methods", "ladder_table", "main"]

# Message budgets, most bytes first: (key, the method's options after "demo").
RUNGS = (
  ("whole", "k64-c8"),  # nothing dropped: every coefficient of every 8x8 chunk, fp32
  ("defaults", ""),  # the reference's top-32 of each 64x64 chunk, fp32
  ("top8", "k8-1bit"),  # top-8 of each 64x64 chunk, 1-bit values
  ("drawn8", "k1-c8-1bit-rand-fb1"),  # one drawn coefficient of each 8x8 chunk, 1 bit
  ("drawn16", "k1-c16-1bit-rand-fb1"),  # the same of each 16x16 chunk
)
# Step rules: (key, the options that choose it).
RULES = (
  ("sign", ""),
  ("orth", "orth"),
  ("momentum-orth", "orth-am0.95"),
)
DENSE = ("adamw", "muon", "muon-beta0")


def _name(rung: str, rule: str) -> str:
  return "-".join(p for p in ("demo", rung, rule) if p)


def ladder_methods(
  rungs: Sequence[str] | None = None, rules: Sequence[str] | None = None
) -> list[str]:
  """Registry names of the ladder: the dense references, then every (rung, rule).

  Args:
    rungs: the rung keys to keep (default all of :data:`RUNGS`).
    rules: the rule keys to keep (default all of :data:`RULES`).

  Raises:
    ConfigError: a key that is not a rung or a rule.
  """
  for given, known, flag in ((rungs, RUNGS, "rungs"), (rules, RULES, "rules")):
    unknown = set(given or ()) - {label for label, _ in known}
    if unknown:
      raise ConfigError(
        f"--{flag}: unknown {sorted(unknown)}; choose from {[label for label, _ in known]}."
      )
  names = list(DENSE)
  for label, rung in RUNGS:
    if rungs and label not in rungs:
      continue
    names += [_name(rung, opt) for rl, opt in RULES if not rules or rl in rules]
  return names


def ladder_table(points: Sequence[frontier.Point], horizon: int) -> str:
  """``ladder.md``: a row per rung, a column per rule; each cell the loss and gap to best dense."""
  rows = {r["method"]: r for r in frontier.results(points) if r["horizon"] == horizon}
  dense = [rows[d] for d in DENSE if d in rows]
  lines = [f"Validation loss after {horizon} steps, best rate of each method's grid.", ""]
  for r in dense:
    lines.append(f"- `{r['method']}` ({_settings(r)}): {r['val_loss']:.4f} {_gap(r)}")
  lines += ["", "| rung | bytes / step | vs bf16 | " + " | ".join(lbl for lbl, _ in RULES) + " |"]
  lines.append("| --- | ---: | ---: |" + " ---: |" * len(RULES))
  for label, rung in RUNGS:
    cells = [rows.get(_name(rung, opt)) for _, opt in RULES]
    if not any(cells):
      continue
    some = next(c for c in cells if c)
    cell = lambda r: f"{r['val_loss']:.4f} {_gap(r)} ({_settings(r)})" if r else ""
    ratio = frontier.ratio_text(some["ratio_vs_bf16_grad"])
    lines.append(
      f"| {label} | {some['payload_bytes_per_step']:,.0f} | {ratio} | "
      + " | ".join(map(cell, cells))
      + " |"
    )
  return "\n".join(lines) + "\n"


def _gap(row: Mapping[str, Any]) -> str:
  g = row["gap_to_best_dense"]
  return "" if g is None else f"({100 * g:+.1f}% vs {row['best_dense']})"


def _settings(row: Mapping[str, Any]) -> str:
  shown = (f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in row["settings"].items())
  return ", ".join(shown)


def _draw(points: Sequence[frontier.Point], horizon: int, out_dir: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = {r["method"]: r for r in frontier.results(points) if r["horizon"] == horizon}
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for (label, opt), marker in zip(RULES, "osD"):
    xy = [
      (rows[n]["payload_bytes_per_step"], rows[n]["val_loss"])
      for n in (_name(rung, opt) for _, rung in RUNGS)
      if n in rows and math.isfinite(rows[n]["val_loss"])
    ]
    if xy:
      ax.plot(*zip(*sorted(xy)), marker + "-", ms=4, label=label)
  for name, style in zip(DENSE, ("--", "-.", ":")):
    if name in rows and math.isfinite(rows[name]["val_loss"]):
      ax.axhline(rows[name]["val_loss"], color="k", ls=style, lw=1, label=name)
  ax.set(xscale="log", xlabel="payload bytes per worker per step", ylabel="final val loss")
  ax.set_title(f"The ladder at {horizon} steps: a line per step rule, dense as lines")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "ladder.png"), dpi=100)
  plt.close(fig)


def write(points: Sequence[frontier.Point], out_dir: str) -> str:
  """Writes ``ladder.md`` and ``ladder.png`` for the longest horizon; returns the table."""
  horizon = max(p.horizon for p in points)
  table = ladder_table(points, horizon)
  with open(os.path.join(out_dir, "ladder.md"), "w") as f:
    f.write(table)
  _draw(points, horizon, out_dir)
  return table


def _main(train_flags, launch_flags, own, argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")

  def run() -> str:
    base = cli.config_from_flags(train_flags)
    names = ladder_methods(own["rungs"].value, own["rules"].value)
    if own["draw_only"].value:
      points = [p for p in frontier.read_runs(base.out_dir) if p.method in names]
      if own["horizons"].present:  # else the longest horizon any ladder method ran
        kept = frontier.parse_horizons_flag(own["horizons"].value)
        points = [p for p in points if p.horizon in kept]
      if not points:
        raise ConfigError(f"--draw_only: no finished ladder run under --out_dir={base.out_dir}.")
      return write(points, base.out_dir)
    horizons = frontier.parse_horizons_flag(own["horizons"].value)
    setup_devices(cli.config_from_flags(launch_flags, LaunchConfig), base.devices)
    grid = frontier.parse_grid_flag(own["grid"].value)
    print(f"[ladder] {len(names)} methods: {', '.join(names)}", file=sys.stderr, flush=True)
    points = frontier.run_frontier(base, names, horizons, base.out_dir, grid=grid)
    return write(points, base.out_dir)

  print(cli.report_user_errors(run))


def main(argv: Sequence[str] | None = None) -> None:
  """The command: the driver's flags (small preset) and the ladder's own."""
  train_flags = cli.define_flags(defaults={"preset": "small", "out_dir": "runs/ladder"})
  launch_flags = cli.define_flags(LaunchConfig)
  own = {
    "horizons": flags.DEFINE_list("horizons", ["300"], "Steps to train each for."),
    "grid": flags.DEFINE_string(
      "grid", "learning_rate=1.5e-3,3e-3,6e-3", "field=v1,v2;... tuned for every method."
    ),
    "rungs": flags.DEFINE_list(
      "rungs", [], f"Rungs to run, of {', '.join(k for k, _ in RUNGS)} (default: all)."
    ),
    "rules": flags.DEFINE_list(
      "rules", [], f"Step rules to run, of {', '.join(k for k, _ in RULES)} (default: all)."
    ),
    "draw_only": flags.DEFINE_bool(
      "draw_only",
      False,
      "Train nothing: draw the ladder from the finished runs under --out_dir, at the longest "
      "of the --horizons given (default: of every horizon found).",
    ),
  }
  app.run(functools.partial(_main, train_flags, launch_flags, own), argv=argv)


if __name__ == "__main__":
  main()
