"""The frontier command: grids from the registry, the best point, cached runs, the figures."""

import dataclasses
import json
import os

import numpy as np
import pytest
from tiny_runs import TINY

from experiments.run import checks, methods
from experiments.run.config import ConfigError, TrainConfig
from experiments.run.records import Summary
from experiments.study import frontier


def test_grid_points_come_from_the_registry_or_the_given_grid():
  demo = methods.get("demo")
  points = frontier.grid_points(demo, None)
  assert len(points) == len(demo.tuning["learning_rate"]) * len(demo.tuning["compression_decay"])
  assert {tuple(sorted(p)) for p in points} == {("compression_decay", "learning_rate")}
  assert frontier.grid_points(demo, {"learning_rate": (1e-3, 2e-3)}) == [
    {"learning_rate": 1e-3},
    {"learning_rate": 2e-3},
  ]


def _point(method, horizon, val):
  summary = dataclasses.replace(_SUMMARY, final_val_loss=val)
  return frontier.Point(method, horizon, {"learning_rate": val}, "", summary)


_SUMMARY = Summary(**{f.name: None for f in dataclasses.fields(Summary)})


def test_best_point_is_the_lowest_finite_validation_loss():
  pts = [_point("demo", 300, 2.0), _point("demo", 300, float("nan")), _point("demo", 300, 1.5)]
  pts.append(_point("demo", 1000, 1.2))
  best = frontier.best_points(pts)
  assert best[("demo", 300)].val_loss == 1.5 and best[("demo", 1000)].val_loss == 1.2


def _seeded(lr, seed, val):
  summary = dataclasses.replace(
    _SUMMARY, final_val_loss=val, payload_bytes_per_step=100.0, ratio_vs_bf16_grad=10.0
  )
  return frontier.Point("demo", 300, {"learning_rate": lr, "seed": seed}, f"{lr}-{seed}", summary)


def test_best_point_averages_over_seeds_not_the_luckiest():
  # lr 1e-3 has the single best run (1.0) but the worse mean (1.6 against 1.5).
  pts = [_seeded(1e-3, 0, 1.0), _seeded(1e-3, 1, 2.2), _seeded(3e-3, 0, 1.4), _seeded(3e-3, 1, 1.6)]
  best = frontier.best_points(pts)[("demo", 300)]
  assert best.settings["learning_rate"] == 3e-3
  assert best.seed_losses == (1.4, 1.6) and best.val_loss == pytest.approx(1.5)
  table = frontier.markdown(pts)
  assert "| 300 | demo | 1.5000 ± 0.1414 | 2 (1.4000, 1.6000) |" in table
  assert '{"learning_rate": 0.003} |' in table  # the seed is averaged over, not a setting
  # A seed that diverged makes its setting's mean inf, whatever the other seeds did.
  pts = [_seeded(1e-3, 0, 1.0), _seeded(1e-3, 1, float("nan")), _seeded(3e-3, 0, 1.9)]
  assert frontier.best_points(pts)[("demo", 300)].settings["learning_rate"] == 3e-3


def test_settings_tuned_at_one_seed_are_chosen_there_and_reported_over_all():
  # --seeds: only the best setting at the tuning seed (0) ran again, at 1 and 2.
  pts = [
    _seeded(1e-3, 0, 1.40),
    _seeded(3e-3, 0, 1.35),
    _seeded(3e-3, 1, 1.6),
    _seeded(3e-3, 2, 1.6),
  ]
  best = frontier.best_points(pts)[("demo", 300)]
  # Chosen on seed 0, where both ran (1.35 against 1.40), though its mean is worse.
  assert best.settings["learning_rate"] == 3e-3 and best.seeds == (0, 1, 2)
  assert best.val_loss == pytest.approx(4.55 / 3)
  assert best.val_loss_std == pytest.approx(np.std([1.35, 1.6, 1.6], ddof=1))


def _at(method, val, seeds=(0,)):
  vals = val if isinstance(val, tuple) else (val,)
  summary = dataclasses.replace(
    _SUMMARY, payload_bytes_per_step=100.0, ratio_vs_bf16_grad=10.0, train_epochs=0.5
  )
  return [
    frontier.Point(
      method,
      300,
      {"seed": s},
      f"{method}-{s}",
      dataclasses.replace(summary, final_val_loss=v, rereads_data=False),
    )
    for s, v in zip(seeds, vals)
  ]


def test_results_give_each_method_its_gap_to_adamw_and_to_the_best_dense_method():
  pts = [
    *_at("adamw", (1.50, 1.52), seeds=(0, 1)),
    *_at("muon", (1.40, 1.44), seeds=(0, 1)),
    *_at("demo-k8-1bit", (1.47, 1.48), seeds=(0, 1)),
    *_at("diloco", 2.0),
  ]
  rows = {r["method"]: r for r in frontier.results(pts)}
  assert [r["method"] for r in frontier.results(pts)][:2] == ["adamw", "muon"]  # dense first
  demo = rows["demo-k8-1bit"]
  assert demo["dense"] is False and rows["muon"]["dense"] is True
  assert demo["best_dense"] == "muon"
  assert demo["val_gap_vs_adamw"] == pytest.approx(1.475 / 1.51 - 1)
  assert demo["gap_to_best_dense"] == pytest.approx(1.475 / 1.42 - 1)
  # The spread of the gap, seed by seed: 1.47/1.40 and 1.48/1.44.
  assert demo["gap_to_best_dense_std"] == pytest.approx(np.std([1.47 / 1.4, 1.48 / 1.44], ddof=1))
  assert demo["seeds"] == [0, 1] and demo["seed_losses"] == [1.47, 1.48]
  assert rows["muon"]["gap_to_best_dense"] == 0.0 and rows["muon"]["gap_to_best_dense_std"] is None
  assert rows["adamw"]["gap_to_best_dense"] == pytest.approx(1.51 / 1.42 - 1)
  # One seed: no spread to give.
  assert rows["diloco"]["val_loss_std"] is None and rows["diloco"]["gap_to_best_dense_std"] is None
  assert demo["train_epochs"] == 0.5 and demo["rereads_data"] is False
  table = frontier.markdown(pts)
  row = "| 300 | demo-k8-1bit | 1.4750 ± 0.0071 | 2 (1.4700, 1.4800) | -2.3% | +3.9% ± 1.6 (muon) |"
  assert row + " 0.50 |" in table
  assert "| 300 | muon (dense) |" in table


def test_no_dense_method_no_gap():
  rows = frontier.results(_at("demo", 1.5))
  assert rows[0]["best_dense"] is None and rows[0]["gap_to_best_dense"] is None


def test_a_cached_run_with_other_settings_is_refused_before_anything_trains(tmp_path):
  base = TrainConfig(**TINY)
  # adamw at 4 steps would train first; demo's cached run was made with another seed.
  demo_dir = tmp_path / "steps4" / "demo" / "learning_rate-0.003"
  demo_dir.mkdir(parents=True)
  cfg = dataclasses.replace(
    base, optimizer="demo", steps=4, eval_every=1, learning_rate=3e-3, out_dir=str(demo_dir)
  )
  resolved = dataclasses.asdict(checks.resolve(cfg))
  dataclasses.replace(_SUMMARY, config={**resolved, "seed": 7}).save(demo_dir / "summary.json")
  with pytest.raises(ConfigError, match=r"other settings: seed=7 \(now 0\)\. Give this frontier"):
    frontier.run_frontier(
      base, ["adamw", "demo"], [4], str(tmp_path), grid={"learning_rate": (3e-3,)}
    )
  assert not (tmp_path / "steps4" / "adamw").exists()  # nothing trained
  # A run stopped short of the horizon (--stop_at_step) is no point of it either.
  dataclasses.replace(_SUMMARY, steps=2, config=resolved).save(demo_dir / "summary.json")
  with pytest.raises(ConfigError, match="stopped at step 2 of 4; resume it"):
    frontier.run_frontier(base, ["demo"], [4], str(tmp_path), grid={"learning_rate": (3e-3,)})


def test_run_directory_tags_name_their_fields():
  assert frontier._tag_fields("learning_rate-0.0015") == ["learning_rate"]
  tag = "compression_decay-0.999_learning_rate-1e-05_sparseloco_sync_every-15"
  fields = ["compression_decay", "learning_rate", "sparseloco_sync_every"]
  assert frontier._tag_fields(tag) == fields
  assert frontier._tag_fields("default") == []


def test_a_bad_method_or_horizon_is_refused_before_training(tmp_path):
  base = TrainConfig(**TINY)
  with pytest.raises(ConfigError, match="unknown method 'sgd'"):
    frontier.run_frontier(base, ["adamw", "sgd"], [4], str(tmp_path))
  with pytest.raises(ConfigError, match="horizons"):
    frontier.run_frontier(base, ["adamw"], [0], str(tmp_path))
  assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_frontier_trains_reads_back_and_draws(tmp_path):
  base = TrainConfig(**{**TINY, "eval_batches": 1})
  # One point of the grid here; the call at another horizon below searches two.
  grid = {"learning_rate": (3e-3,)}
  points = frontier.run_frontier(base, ["adamw", "demo-k8-1bit"], [4, 8], str(tmp_path), grid=grid)
  assert len(points) == 2 * 2
  for name in ("frontier.json", "frontier.md", "frontier_bytes.png", "frontier_gap.png"):
    assert (tmp_path / name).stat().st_size > 100, name
  assert (tmp_path / "frontier_time.png").stat().st_size > 1000
  # A second call reads every run back instead of training it again.
  mtimes = {p.out_dir: os.path.getmtime(os.path.join(p.out_dir, "summary.json")) for p in points}
  again = frontier.run_frontier(base, ["adamw", "demo-k8-1bit"], [4, 8], str(tmp_path), grid=grid)
  assert [p.val_loss for p in again] == [p.val_loss for p in points]
  assert all(os.path.getmtime(os.path.join(d, "summary.json")) == t for d, t in mtimes.items())
  # Another call, another horizon: reading the directory back gives both calls' runs.
  more = frontier.run_frontier(
    base, ["adamw"], [6], str(tmp_path), grid={"learning_rate": (3e-3, 1e-2)}, seeds=2
  )
  # The best rate, and it again at seed 1; the result is the mean of the two.
  assert len(more) == 3 and more[-1].settings["seed"] == 1
  (row,) = json.loads((tmp_path / "results.json").read_text())
  assert row["seeds"] == [0, 1] and row["settings"] == {
    "learning_rate": more[-1].settings["learning_rate"]
  }
  assert row["val_loss"] == pytest.approx(sum(row["seed_losses"]) / 2)
  assert row["best_dense"] == "adamw" and row["gap_to_best_dense"] == 0.0
  assert 0 < row["train_epochs"] < 1 and row["rereads_data"] is False
  (tmp_path / "steps6" / "adamw" / "learning_rate-0.5").mkdir()  # unfinished: no summary
  (tmp_path / "stepsX").mkdir()
  read = frontier.read_runs(str(tmp_path))

  def described(pts):
    return sorted((p.horizon, p.method, p.settings["learning_rate"], p.val_loss) for p in pts)

  assert described(read) == described(points + more)
  k8 = frontier.best_points(points)[("demo-k8-1bit", 8)]
  assert k8.summary.config["compression_topk"] == 8 and k8.summary.config["quantize_1bit"]


def test_a_horizon_that_would_reread_its_data_is_named_before_anything_trains(capsys):
  # The embedded corpus holds 8,837 windows of 129 bytes; 32 a step.
  frontier._warn_if_rereading(TrainConfig(preset="small"), [100, 300])
  err = capsys.readouterr().err.splitlines()
  assert err == [
    "[frontier] warning: each run of 300 steps reads its training split 1.09 times, so its "
    "validation loss also measures memorization; fewer steps, or more data (python -m "
    "experiments.fetch_corpus), reads it once"
  ]


def _timed_run(run_dir, seconds_per_step, steps=3):
  """A finished run whose metrics say each step of 8 x 32 tokens took ``seconds_per_step``."""
  run_dir.mkdir(parents=True)
  config = {"batch_size": 8, "seq_len": 32, "learning_rate": 3e-3}
  dataclasses.replace(_SUMMARY, steps=steps, config=config).save(run_dir / "summary.json")
  lines = [
    {"step": s, "loss": 1.0, "wall_time": 0.0, "bytes_sent": 0.0, "lr": 0.1}
    | {"tokens_per_s": 8 * 32 / seconds_per_step}
    for s in range(1, steps + 1)
  ]
  (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_the_plan_cost_counts_what_is_left_and_times_it_by_the_finished_runs(tmp_path):
  _timed_run(tmp_path / "steps300" / "adamw" / "learning_rate-0.003", 0.5)
  _timed_run(tmp_path / "steps300" / "muon" / "learning_rate-0.003", 2.0)
  assert frontier.step_seconds(str(tmp_path / "steps300" / "muon" / "learning_rate-0.003")) == 2.0
  base = TrainConfig(**TINY)

  def plan(names):
    cfgs = []
    for name in names:
      for lr in (3e-3, 6e-3):
        out = str(tmp_path / "steps300" / name / f"learning_rate-{lr}")
        cfg = dataclasses.replace(base, steps=300, out_dir=out)
        cfgs.append((name, 300, {"learning_rate": lr}, cfg))
    return cfgs

  done = {str(tmp_path / "steps300" / "adamw" / "learning_rate-0.003"): _SUMMARY}
  line = frontier.plan_cost(plan(["adamw", "muon"]), done, 1, str(tmp_path))
  # Three runs of 300 steps: adamw's at 0.5 s a step, muon's two at 2.0 s.
  assert line.startswith("plan: 3 runs to train (1 read back), 900 steps"), line
  assert f"about {(300 * 0.5 + 600 * 2.0) / 3600:.1f} h" in line and "untimed" not in line
  # A method with no finished run is taken at the slowest, and named; seeds add reruns.
  line = frontier.plan_cost(plan(["demo"]), {}, 3, str(tmp_path))
  assert line.startswith("plan: 4 runs to train (0 read back), 1,200 steps"), line
  assert "about 0.7 h" in line and "untimed, taken at the slowest, 2.00 s: demo" in line
  assert "no time estimate" in frontier.plan_cost(plan(["demo"]), {}, 1, str(tmp_path / "empty"))
