r"""DisTrO against AdamW all-reduce and its peers: same model, data, steps and seed.

  python -m experiments.compare      # small preset, 8 workers, 300 steps, embedded corpus
  python -m experiments.compare --data_path=english.txt \
      --methods=adamw,demo,demo-k8-1bit,demo-k2-1bit,diloco

Every method is one full run of the training driver (``trainer.run``), under
``OUT_DIR/<method>/``. The comparison writes ``OUT_DIR/results.md`` (the
table, the internet time model and the DisTrO report's setting projected by
the same model), ``results.json`` (one object per method),
``projection.json``, ``loss_vs_step.png`` and ``loss_vs_bytes.png``.

Methods are names in the registry's grammar (``experiments.methods``): a
family, then dash-separated options, e.g. ``demo-k8-1bit-delayed`` or
``diloco-h20``; ``python -m experiments.methods`` lists them.

The training flags are the driver's (``python -m experiments.train --help``);
``--optimizer`` is ignored here, ``--methods`` chooses.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from absl import app, flags

from experiments.run import checks, cli, data, methods, presets, rundir
from experiments.run.config import ConfigError, TrainConfig
from experiments.run.launch import LaunchConfig, setup_devices
from experiments.run.records import Summary, read_metrics
from experiments.study import gaps, time_model

# The command is experiments.compare; its flags belong to it, so --helpshort lists them.
flags.disclaim_key_flags()

__all__ = ["DEFAULT_METHODS", "method_overrides", "run_comparison", "markdown_table"]

DEFAULT_METHODS = methods.DEFAULT_COMPARISON


def method_overrides(name: str) -> dict[str, Any]:
  """The :class:`~experiments.run.config.TrainConfig` fields that make method ``name``.

  Args:
    name: a method name, e.g. ``"demo-k8-1bit"`` or ``"diloco-h100"``.

  Returns:
    Field overrides, always including ``optimizer``.

  Raises:
    ConfigError: for a name that is not a method, listing the valid forms.
  """
  return methods.parse(name)[1]


def _row(method: str, summary: Summary, seconds: float) -> dict[str, Any]:
  return {
    "method": method,
    "optimizer": summary.optimizer,
    "collective": methods.get(summary.optimizer).collective,
    "final_train_loss": summary.final_train_loss,
    "final_train_loss_avg10": summary.final_train_loss_avg10,
    "final_val_loss": summary.final_val_loss,
    "payload_bytes_per_step": summary.payload_bytes_per_step,
    "measured_bytes_per_step": summary.measured_exchange_bytes_per_step,
    "ratio_vs_bf16_grad": summary.ratio_vs_bf16_grad,
    "ratio_vs_ring_allreduce": summary.ratio_vs_ring_allreduce,
    "optimizer_time_fraction": summary.optimizer_time_fraction,
    "step_seconds": summary.step_seconds,
    "gradient_seconds": summary.gradient_seconds,
    "bytes_sent_per_step": summary.bytes_sent_per_step,
    "learning_rate": summary.config["learning_rate"],
    "overlapped_share": methods.overlapped_share(TrainConfig(**summary.config)),
    "run_seconds": seconds,
    "dense": methods.get(summary.optimizer).dense,
    "train_epochs": summary.train_epochs,
    "rereads_data": summary.rereads_data,
  }


def run_comparison(
  base: TrainConfig, method_names: Sequence[str], out_dir: str, *, progress: bool = False
) -> list[dict[str, Any]]:
  """Trains every method on ``base``'s model, data, steps and seed, and reports.

  Args:
    base: a :class:`~experiments.run.config.TrainConfig`; its ``optimizer`` and
      ``out_dir`` are replaced per method.
    method_names: method names (see :func:`method_overrides`).
    out_dir: where the runs, tables and plots go.
    progress: show each run's progress line.

  Returns:
    One row per method, as in ``results.json``: ``method``,
    ``final_train_loss``, ``final_val_loss``, ``payload_bytes_per_step``
    (computed), ``measured_bytes_per_step`` (the optimizer's collective
    operand bytes in the compiled train step), ``ratio_vs_bf16_grad``,
    ``ratio_vs_ring_allreduce``, ``optimizer_time_fraction`` (the share of a
    step after the gradient: exchange and update), ``step_seconds``, and more.

  Raises:
    ConfigError: for an unknown or repeated method, or settings one of them
      cannot run with, before anything runs.
  """
  if not method_names:
    raise ConfigError("--methods is empty; name at least one method, e.g. --methods=adamw,demo.")
  if len(set(method_names)) != len(method_names):
    raise ConfigError(f"--methods repeats a method: {','.join(method_names)}.")
  configs = {
    m: dataclasses.replace(
      base,
      out_dir=os.path.join(out_dir, m),
      time_optimizer=True,
      progress=progress,
      **method_overrides(m),
    )
    for m in method_names
  }
  for method, cfg in configs.items():
    try:
      checks.validate(cfg)
    except ConfigError as e:
      raise ConfigError(f"--methods {method}: {e}") from None
  _warn_if_rereading(base)
  with rundir.claim(out_dir):
    return _run_all(configs, base, out_dir)


def _warn_if_rereading(base: TrainConfig) -> None:
  """One line before anything trains when every run would read its data more than once."""
  reading = data.planned_reading(
    base.data_path,
    presets.get_preset(base.preset).vocab_size,
    seq_len=base.seq_len,
    steps=base.stop_at_step or base.steps,
    global_batch_size=base.batch_size,
  )
  if line := gaps.reading_warning(f"each run of {base.steps} steps", reading.train_epochs):
    print(f"[compare] {line}", file=sys.stderr, flush=True)


def _run_all(configs: dict[str, TrainConfig], base: TrainConfig, out_dir: str) -> list:
  from experiments.run import trainer

  rows = []
  for method, cfg in configs.items():
    print(f"[compare] {method}: training {cfg.steps} steps ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    summary = trainer.run(cfg)
    rows.append(_row(method, summary, time.perf_counter() - t0))
    print(
      f"[compare] {method}: val loss {rows[-1]['final_val_loss']:.4f}, "
      f"{rows[-1]['payload_bytes_per_step']:,.0f} B/step, {rows[-1]['run_seconds']:.0f} s, "
      f"{_fmt_epochs(summary.train_epochs)} epochs",
      file=sys.stderr,
      flush=True,
    )
  found = gaps.gaps({r["method"]: _loss(r["final_val_loss"]) for r in rows})
  for r in rows:
    r.update(found[r["method"]])
  _write(rows, configs, base, out_dir)
  return rows


def _loss(value: float | None) -> float:
  return math.inf if value is None else value


def _fmt_gap(gap: float | None, name: str | None = None) -> str:
  if gap is None:
    return ""
  return f"{100 * gap:+.1f}%" + (f" ({name})" if name else "")


def _fmt_epochs(epochs: float | None) -> str:
  if epochs is None:
    return ""
  return f"{epochs:.2f}" + (" (rereads)" if epochs > 1 else "")


def _fmt_ratio(x: float) -> str:
  return f"{x:,.0f}x" if x >= 10 else f"{x:.2f}x"


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
  """The comparison as a markdown table."""
  lines = [
    "| method | train loss | val loss | val vs adamw | vs best dense | epochs "
    "| payload B/step (computed) | B/step in HLO collectives (measured) | vs bf16 grad "
    "| vs ring all-reduce | optimizer share of step |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for r in rows:
    lines.append(
      f"| {r['method']} | {r['final_train_loss']:.4f} | {r['final_val_loss']:.4f} "
      f"| {_fmt_gap(r['val_gap_vs_adamw'])} "
      f"| {_fmt_gap(r.get('gap_to_best_dense'), r.get('best_dense'))} "
      f"| {_fmt_epochs(r.get('train_epochs'))} "
      f"| {r['payload_bytes_per_step']:,.0f} | {r['measured_bytes_per_step']:,.0f} "
      f"| {_fmt_ratio(r['ratio_vs_bf16_grad'])} | {_fmt_ratio(r['ratio_vs_ring_allreduce'])} "
      f"| {100 * r['optimizer_time_fraction']:.0f}% |"
    )
  return "\n".join(lines)


def _curves(cfg: Any, row: dict[str, Any]) -> list[dict[str, Any]]:
  """The run's metrics, with the bytes each worker's link carried up so far.

  The count is the time model's for a ring, the same for every method: an
  all-gather moves W-1 messages, an all-reduce ``2 (W-1)/W`` operands, and
  a method that exchanges every H steps (DiLoCo) sends its whole message then.
  """
  method = methods.get(cfg.optimizer)
  every = method.exchange_every(cfg)
  # The peers of the ring are the sites (--replicas overrides --workers).
  up, _ = time_model.link_bytes(method.collective, row["payload_bytes_per_step"], cfg.sites)
  out, total = [], 0.0
  for r in read_metrics(cfg.out_dir):
    if r.step % every == 0:
      total += up * every
    out.append({"step": r.step, "loss": r.loss, "val_loss": r.val_loss, "cumulative_bytes": total})
  return out


def _smooth(values: list[float], weight: float = 0.9) -> list[float]:
  out, acc = [], None
  for v in values:
    acc = v if acc is None else weight * acc + (1 - weight) * v
    out.append(acc)
  return out


def _plots(curves: dict[str, list[dict[str, Any]]], out_dir: str, title: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  for name, x_key, x_label, log_x in (
    ("loss_vs_step.png", "step", "step", False),
    ("loss_vs_bytes.png", "cumulative_bytes", "cumulative bytes up each worker link (ring)", True),
  ):
    fig, ax = plt.subplots(figsize=(8, 5))
    for method, records in curves.items():
      pts = [(r[x_key], r["loss"]) for r in records if not (log_x and r[x_key] <= 0)]
      if not pts:
        continue
      (line,) = ax.plot(
        [p[0] for p in pts], _smooth([p[1] for p in pts]), label=f"{method} (train, smoothed)"
      )
      val = [
        (r[x_key], r["val_loss"]) for r in records if r["val_loss"] is not None and r[x_key] > 0
      ]
      if val:
        ax.plot([v[0] for v in val], [v[1] for v in val], "o", color=line.get_color(), ms=4)
    ax.set_xlabel(x_label)
    ax.set_ylabel("loss (dots: validation)")
    if log_x:
      ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=100)
    plt.close(fig)


def _write(rows, configs, base, out_dir) -> None:
  import jax

  if jax.process_index() != 0:
    return
  first = checks.resolve(next(iter(configs.values())))
  num_params = Summary.load(first.out_dir).num_params
  # As run: --replicas overrides --workers, and under FSDP a site is one worker.
  workers = f"{first.sites} workers" + (f" of {first.fsdp} devices" if first.fsdp > 1 else "")
  setup = (
    f"Preset `{base.preset}` ({num_params / 1e6:.2f}M params), {workers}, "
    f"{base.steps} steps of {base.batch_size} x {base.seq_len} tokens, seed {base.seed}, "
    f"data: {base.data_path or 'the embedded corpus'}. Learning rates: "
    + ", ".join(f"{r['method']} {r['learning_rate']:g}" for r in rows)
    + "."
  )
  projection = time_model.project(rows, time_model.DEFAULT_LINKS, base.steps, first.sites)
  report = time_model.report_setting()
  text = "\n\n".join(
    [
      "# DisTrO comparison",
      setup,
      markdown_table(rows),
      "Gaps: validation loss over AdamW's, and over the best dense method's (a "
      "gradient all-reduce every step: "
      + ", ".join(n for n in methods.names() if methods.get(n).dense)
      + "), minus one. Epochs: how much of the training split each run read (windows "
      "drawn over windows in the split); above 1 it read some data twice, and its "
      "validation loss also measures memorization.",
      "Payload: what one worker puts into the collective per step (DeMo's message, "
      "AdamW's gradient, DiLoCo's fp32 pseudo-gradient divided by H). Measured: the "
      "optimizer's collective operand bytes in the compiled train step (DiLoCo's divided "
      "by H). Ratios are against the payload. Optimizer share: 1 - (loss and gradient "
      "time) / (train step time), medians of interleaved timings in this run.",
      f"## Internet time model: these runs ({base.steps} steps, {first.sites} workers)",
      time_model.markdown(projection),
      f"## The DisTrO report's setting ({time_model.REPORT.preset}, "
      f"{time_model.REPORT.workers} workers, {time_model.REPORT.steps:,} steps)",
      f"Compute per step is the report's AdamW time, {time_model.REPORT.adamw_hours} h / "
      f"{time_model.REPORT.steps:,} steps = {time_model.REPORT.compute_seconds:.2f} s. "
      f"Published: {time_model.REPORT.adamw_hours} h for AdamW and "
      f"{time_model.REPORT.distro_hours} h for DisTrO on datacenter links.",
      time_model.markdown(report),
    ]
  )
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(rows, f, indent=2)
  with open(os.path.join(out_dir, "projection.json"), "w") as f:
    json.dump({"this_run": projection, "report_setting": report}, f, indent=2)
  curves = {r["method"]: _curves(configs[r["method"]], r) for r in rows}
  _plots(curves, out_dir, f"{first.preset}, {first.sites} workers")


def _main(
  train_flags: Mapping[str, flags.FlagHolder],
  launch_flags: Mapping[str, flags.FlagHolder],
  method_flag: flags.FlagHolder,
  argv: Sequence[str],
) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")

  def compare() -> list[dict[str, Any]]:
    base = cli.config_from_flags(train_flags)
    setup_devices(cli.config_from_flags(launch_flags, LaunchConfig), base.devices)
    return run_comparison(base, method_flag.value, base.out_dir, progress=base.progress)

  rows = cli.report_user_errors(compare)
  print(markdown_table(rows))
  print(f"\nTables, projections and plots: {train_flags['out_dir'].value}/results.md")


def main(argv: Sequence[str] | None = None) -> None:
  """The command: the driver's flags with this command's defaults, and ``--methods``."""
  train_flags = cli.define_flags(
    defaults={"preset": "small", "steps": 300, "out_dir": "runs/compare"}
  )
  launch_flags = cli.define_flags(LaunchConfig)
  method_flag = flags.DEFINE_list(
    "methods", list(DEFAULT_METHODS), "Comma-separated methods to compare (see the module help)."
  )
  app.run(functools.partial(_main, train_flags, launch_flags, method_flag), argv=argv)


if __name__ == "__main__":
  main()
