"""The frontier command: grids from the registry, the best point, cached runs, the figures."""

import dataclasses
import os

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
  assert "| 300 | demo | 1.5000 (mean of 2 seeds: 1.4000, 1.6000) |" in table
  assert '{"learning_rate": 0.003} |' in table  # the seed is averaged over, not a setting
  # A seed that diverged makes its setting's mean inf, whatever the other seeds did.
  pts = [_seeded(1e-3, 0, 1.0), _seeded(1e-3, 1, float("nan")), _seeded(3e-3, 0, 1.9)]
  assert frontier.best_points(pts)[("demo", 300)].settings["learning_rate"] == 3e-3


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
  grid = {"learning_rate": (3e-3, 1e-2)}
  points = frontier.run_frontier(base, ["adamw", "demo-k8-1bit"], [4, 8], str(tmp_path), grid=grid)
  assert len(points) == 2 * 2 * 2
  for name in ("frontier.json", "frontier.md", "frontier_bytes.png", "frontier_gap.png"):
    assert (tmp_path / name).stat().st_size > 100, name
  assert (tmp_path / "frontier_time.png").stat().st_size > 1000
  # A second call reads every run back instead of training it again.
  mtimes = {p.out_dir: os.path.getmtime(os.path.join(p.out_dir, "summary.json")) for p in points}
  again = frontier.run_frontier(base, ["adamw", "demo-k8-1bit"], [4, 8], str(tmp_path), grid=grid)
  assert [p.val_loss for p in again] == [p.val_loss for p in points]
  assert all(os.path.getmtime(os.path.join(d, "summary.json")) == t for d, t in mtimes.items())
  # Another call, another horizon: reading the directory back gives both calls' runs.
  more = frontier.run_frontier(base, ["adamw"], [6], str(tmp_path), grid={"learning_rate": (3e-3,)})
  (tmp_path / "steps6" / "adamw" / "learning_rate-0.5").mkdir()  # unfinished: no summary
  (tmp_path / "stepsX").mkdir()
  read = frontier.read_runs(str(tmp_path))

  def described(pts):
    return sorted((p.horizon, p.method, p.settings["learning_rate"], p.val_loss) for p in pts)

  assert described(read) == described(points + more)
  k8 = frontier.best_points(points)[("demo-k8-1bit", 8)]
  assert k8.summary.config["compression_topk"] == 8 and k8.summary.config["quantize_1bit"]
