r"""A grid sweep of the train driver, one process, printed as a markdown table.

  python -m experiments.sweep --preset=small --data_path=english.txt --steps=300 \
      --grid="optimizer=adamw,demo;learning_rate=1e-3,3e-3;compression_decay=0.99,0.999"

Each grid point is a full ``experiments.trainer.run``; the driver's flags
set everything the grid does not (the recipe for the preset, unless given).
The whole grid is checked before the first point trains. Results go to
``OUT_DIR/sweep.md`` and ``OUT_DIR/sweep.json``, rewritten after every point.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from absl import app, flags

from experiments import cli, config
from experiments.config import ConfigError, TrainConfig
from experiments.launch import LaunchConfig, setup_devices

__all__ = ["main", "parse_grid", "run_sweep", "sweep_table"]


def _convert(v: str) -> Any:
  for cast in (int, float):
    try:
      return cast(v)
    except ValueError:
      pass
  return {"true": True, "false": False}.get(v.lower(), v)


def parse_grid(text: str) -> list[dict[str, Any]]:
  """``"a=1,2;b=x"`` -> every combination, as ``TrainConfig`` field overrides.

  Raises:
    ConfigError: a name that is not a ``TrainConfig`` field, or a part with no values.
  """
  fields = [f.name for f in dataclasses.fields(TrainConfig)]
  axes = []
  for part in filter(None, (p.strip() for p in text.split(";"))):
    name, _, values = part.partition("=")
    name = name.strip()
    if name not in fields:
      raise ConfigError(f"--grid: unknown field {name!r}; fields: {', '.join(fields)}.")
    if not values.strip():
      raise ConfigError(f"--grid: {name!r} has no values; write {name}=v1,v2.")
    axes.append([(name, _convert(v.strip())) for v in values.split(",")])
  return [dict(point) for point in itertools.product(*axes)]


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
      + f" | {r['final_train_loss']:.4f} | {r['train_loss_avg10']:.4f}"
      + f" | {r['final_val_loss']:.4f} |"
    )
  return "\n".join(lines)


def run_sweep(base: TrainConfig, grid: str, out_dir: str) -> list[dict[str, Any]]:
  """Trains every grid point on top of ``base``; returns one row per point.

  Raises:
    ConfigError: for a grid or a point that cannot run, before any trains.
  """
  from experiments import trainer

  points = parse_grid(grid)
  configs = []
  for point in points:
    name = ",".join(f"{k}={v}" for k, v in point.items())
    run_dir = os.path.join(out_dir, name.replace("=", "-").replace(",", "_"))
    cfg = dataclasses.replace(base, out_dir=run_dir, progress=False, **point)
    config.validate(cfg)
    configs.append((name, point, cfg))
  rows: list[dict[str, Any]] = []
  keys = list(points[0]) if points else []
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
      f"{name}: train {summary.final_train_loss:.4f} "
      f"(avg10 {summary.final_train_loss_avg10:.4f}) val {summary.final_val_loss:.4f} "
      f"in {rows[-1]['seconds']:.0f}s",
      flush=True,
    )
    _write(rows, keys, out_dir)
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
    base = config.config_from_flags(train_flags)
    setup_devices(config.config_from_flags(launch_flags, LaunchConfig), base.devices)
    return run_sweep(base, grid_flag.value, base.out_dir)

  rows = cli.report_user_errors(sweep)
  if rows:
    print(sweep_table(rows, [k for k in rows[0] if k not in _RESULT_KEYS]))


_RESULT_KEYS = ("final_train_loss", "train_loss_avg10", "final_val_loss", "seconds")


def main(argv: Sequence[str] | None = None) -> None:
  """The command: the driver's flags (small preset, 300 steps) and ``--grid``."""
  train_flags = config.define_flags(
    defaults={"preset": "small", "steps": 300, "out_dir": "runs/sweep"}
  )
  launch_flags = config.define_flags(LaunchConfig)
  grid_flag = flags.DEFINE_string(
    "grid",
    "optimizer=adamw,demo",
    "Semicolon-separated field=v1,v2 lists (TrainConfig fields).",
  )
  app.run(functools.partial(_main, train_flags, launch_flags, grid_flag), argv=argv)


if __name__ == "__main__":
  main()
