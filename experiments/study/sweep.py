r"""A grid sweep of the train driver, one process, printed as a markdown table.

  python -m experiments.sweep --preset=small --data_path=english.txt --steps=300 \
      --grid="optimizer=adamw,demo;learning_rate=1e-3,3e-3;compression_decay=0.99,0.999"

Each grid point is a full ``experiments.run.trainer.run``; the driver's flags
set everything the grid does not (the recipe for the preset, unless given).
The whole grid is checked before the first point trains: every field name,
every value's type, and every point's config (``checks.validate``). Results
go to ``OUT_DIR/sweep.md`` and ``OUT_DIR/sweep.json``, rewritten after every
point, and written with the finished points when a later point fails.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from absl import app, flags

from experiments.run import checks, cli, config
from experiments.run.config import ConfigError, TrainConfig
from experiments.run.launch import LaunchConfig, setup_devices

# The command is experiments.sweep; its flags belong to it, so --helpshort lists them.
flags.disclaim_key_flags()

__all__ = ["check_grid", "main", "parse_grid", "run_sweep", "sweep_table"]


# Fields the sweep sets for every point itself.
_SET_BY_SWEEP = {"out_dir": "each point trains in OUT_DIR/<point>; set --out_dir instead"}


def parse_grid(text: str) -> list[dict[str, Any]]:
  """``"a=1,2;b=x"`` -> every combination, as ``TrainConfig`` field overrides.

  Each value is typed as its field (``config.parse_field``), so a typo in any
  point is found here, before the first point trains.

  Raises:
    ConfigError: a name that is not a ``TrainConfig`` field, a field given
      twice or set by the sweep, an empty value, a value of the wrong type,
      or two points that are the same.
  """
  fields = [f.name for f in dataclasses.fields(TrainConfig)]
  axes: dict[str, list[Any]] = {}
  for part in filter(None, (p.strip() for p in text.split(";"))):
    name, _, values = part.partition("=")
    name = name.strip()
    if name not in fields:
      raise ConfigError(f"--grid: unknown field {name!r}; fields: {', '.join(fields)}.")
    if name in _SET_BY_SWEEP:
      raise ConfigError(f"--grid: {name} is the sweep's to set; {_SET_BY_SWEEP[name]}.")
    if name in axes:
      raise ConfigError(f"--grid: {name!r} appears twice; list its values once: {name}=v1,v2.")
    texts = [v.strip() for v in values.split(",")]
    if not all(texts):
      raise ConfigError(f"--grid: {name!r} has an empty value in {part!r}; write {name}=v1,v2.")
    try:
      axes[name] = [config.parse_field(name, v) for v in texts]
    except ConfigError as e:
      raise ConfigError(f"--grid: {e}") from None
    if len(set(map(repr, axes[name]))) < len(texts):
      raise ConfigError(f"--grid: {name!r} repeats a value in {part!r}; list each value once.")
  return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def _cell(value: Any) -> str:
  return "-" if value is None else f"{value:.4f}"


def sweep_table(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> str:
  """The finished points as a markdown table."""
  lines = [
    "| " + " | ".join(keys) + " | train loss (last) | train loss (avg of last 10) | val loss |",
    "|" + "---|" * (len(keys) + 3),
  ]
  for r in rows:
    lines.append(
      "| "
      + " | ".join(str(r[k]) for k in keys)
      + f" | {_cell(r['final_train_loss'])} | {_cell(r['train_loss_avg10'])}"
      + f" | {_cell(r['final_val_loss'])} |"
    )
  return "\n".join(lines)


def _point_name(point: dict[str, Any]) -> str:
  return ",".join(f"{k}={v}" for k, v in point.items())


def check_grid(base: TrainConfig, grid: str, out_dir: str) -> list[tuple[str, dict, TrainConfig]]:
  """Every point's name, overrides and config, each checked by ``checks.validate``.

  Raises:
    ConfigError: for the grid, or for the first point that cannot run, named.
  """
  configs = []
  for point in parse_grid(grid):
    name = _point_name(point)
    run_dir = os.path.join(out_dir, name.replace("=", "-").replace(",", "_"))
    cfg = dataclasses.replace(base, out_dir=run_dir, progress=False, **point)
    try:
      checks.validate(cfg)
    except ConfigError as e:
      raise ConfigError(f"--grid point {name}: {e}") from None
    configs.append((name, point, cfg))
  return configs


def run_sweep(base: TrainConfig, grid: str, out_dir: str) -> list[dict[str, Any]]:
  """Trains every grid point on top of ``base``; returns one row per point.

  The table of finished points (``OUT_DIR/sweep.md`` and ``sweep.json``) is
  rewritten after every point, and once more if a point fails, so what
  finished is kept.

  Raises:
    ConfigError: for a grid or a point that cannot run, before any trains.
  """
  from experiments.run import rundir, trainer

  configs = check_grid(base, grid, out_dir)
  keys = list(configs[0][1]) if configs else []
  rows: list[dict[str, Any]] = []
  with rundir.claim(out_dir):
    try:
      for name, point, cfg in configs:
        t0 = time.perf_counter()
        summary = trainer.run(cfg)
        rows.append(
          {
            **point,
            "final_train_loss": summary.final_train_loss,
            "train_loss_avg10": summary.final_train_loss_avg10,
            "final_val_loss": summary.final_val_loss,
            "seconds": time.perf_counter() - t0,
          }
        )
        print(
          f"{name}: train {_cell(summary.final_train_loss)} "
          f"(avg10 {_cell(summary.final_train_loss_avg10)}) val {_cell(summary.final_val_loss)} "
          f"in {rows[-1]['seconds']:.0f}s",
          flush=True,
        )
        _write(rows, keys, out_dir)
    except BaseException:
      _write(rows, keys, out_dir)
      print(
        f"sweep stopped after {len(rows)} of {len(configs)} points; the finished ones are in "
        f"{os.path.join(out_dir, 'sweep.md')}",
        file=sys.stderr,
        flush=True,
      )
      raise
  return rows


def _write(rows: Sequence[dict[str, Any]], keys: Sequence[str], out_dir: str) -> None:
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "sweep.md"), "w") as f:
    f.write(sweep_table(rows, keys) + "\n")
  with open(os.path.join(out_dir, "sweep.json"), "w") as f:
    json.dump(list(rows), f, indent=2)


def _main(
  train_flags: Mapping[str, flags.FlagHolder],
  launch_flags: Mapping[str, flags.FlagHolder],
  grid_flag: flags.FlagHolder,
  argv: Sequence[str],
) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")

  def sweep() -> list[dict[str, Any]]:
    base = cli.config_from_flags(train_flags)
    # Checked before any backend starts, which then gets as many devices as the
    # largest point needs (a grid may vary --workers).
    points = check_grid(base, grid_flag.value, base.out_dir)
    devices = max((cfg.devices for _, _, cfg in points), default=base.devices)
    setup_devices(cli.config_from_flags(launch_flags, LaunchConfig), devices)
    return run_sweep(base, grid_flag.value, base.out_dir)

  rows = cli.report_user_errors(sweep)
  if rows:
    print(sweep_table(rows, [k for k in rows[0] if k not in _RESULT_KEYS]))


_RESULT_KEYS = ("final_train_loss", "train_loss_avg10", "final_val_loss", "seconds")


def main(argv: Sequence[str] | None = None) -> None:
  """The command: the driver's flags (small preset, 300 steps) and ``--grid``."""
  train_flags = cli.define_flags(
    defaults={"preset": "small", "steps": 300, "out_dir": "runs/sweep"}
  )
  launch_flags = cli.define_flags(LaunchConfig)
  grid_flag = flags.DEFINE_string(
    "grid",
    "optimizer=adamw,demo",
    "Semicolon-separated field=v1,v2 lists (TrainConfig fields).",
  )
  app.run(functools.partial(_main, train_flags, launch_flags, grid_flag), argv=argv)


if __name__ == "__main__":
  main()
