r"""A grid sweep of the train driver, one process, printed as a markdown table.

  python -m experiments.sweep --preset=small --data_path=english.txt --steps=300 \
      --grid="optimizer=adamw,demo;learning_rate=1e-3,3e-3;compression_decay=0.99,0.999"

Each grid point is a full ``experiments.trainer.run``; flags not in the grid
keep the driver's defaults (the recipe for the preset). Results go to
``OUT_DIR/sweep.md`` and ``OUT_DIR/sweep.json``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time

import jax
from absl import app, flags

from experiments import trainer

_PRESET = flags.DEFINE_string("preset", "small", "Model preset.")
_DATA = flags.DEFINE_string("data_path", None, "Training data (default: embedded corpus).")
_STEPS = flags.DEFINE_integer("steps", 300, "Steps per run.")
_WORKERS = flags.DEFINE_integer("workers", 8, "Simulated workers.")
_GRID = flags.DEFINE_string(
  "grid", "optimizer=adamw,demo", "Semicolon-separated field=v1,v2 lists (TrainConfig fields)."
)
_OUT = flags.DEFINE_string("out_dir", "runs/sweep", "Where runs and the table go.")


def _parse_grid(text: str) -> list[dict]:
  fields = {f.name: f.type for f in dataclasses.fields(trainer.TrainConfig)}
  axes = []
  for part in filter(None, text.split(";")):
    name, _, values = part.partition("=")
    name = name.strip()
    if name not in fields:
      raise app.UsageError(f"--grid: unknown field {name!r}; fields: {', '.join(fields)}")
    axes.append([(name, _convert(v.strip())) for v in values.split(",")])
  return [dict(point) for point in itertools.product(*axes)]


def _convert(v: str):
  for cast in (int, float):
    try:
      return cast(v)
    except ValueError:
      pass
  return {"true": True, "false": False}.get(v.lower(), v)


def main(argv):
  del argv
  jax.config.update("jax_num_cpu_devices", _WORKERS.value)  # before any device query
  rows = []
  for point in _parse_grid(_GRID.value):
    name = ",".join(f"{k}={v}" for k, v in point.items())
    cfg = trainer.TrainConfig(
      preset=_PRESET.value,
      data_path=_DATA.value,
      steps=_STEPS.value,
      workers=_WORKERS.value,
      out_dir=os.path.join(_OUT.value, name.replace("=", "-").replace(",", "_")),
      progress=False,
      **point,
    )
    t0 = time.perf_counter()
    summary = trainer.run(cfg)
    rows.append(
      {
        **point,
        "final_train_loss": summary["final_train_loss"],
        "train_loss_avg10": summary["final_train_loss_avg10"],
        "final_val_loss": summary["final_val_loss"],
        "seconds": time.perf_counter() - t0,
      }
    )
    print(
      f"{name}: train {summary['final_train_loss']:.4f} "
      f"(avg10 {summary['final_train_loss_avg10']:.4f}) val {summary['final_val_loss']:.4f} "
      f"in {rows[-1]['seconds']:.0f}s",
      flush=True,
    )

  keys = [k for k in _parse_grid(_GRID.value)[0]]
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
  table = "\n".join(lines)
  print(table)
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, "sweep.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(_OUT.value, "sweep.json"), "w") as f:
    json.dump(rows, f, indent=2)


if __name__ == "__main__":
  app.run(main)
