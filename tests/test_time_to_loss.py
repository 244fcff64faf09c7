"""Time to loss over a real path: curves read back, the target found, the table and its rows."""

import dataclasses
import json
import math
import os

import pytest

from experiments.netlab import round_trips
from experiments.netlab.round_trips import Collective, StepCount
from experiments.run import methods
from experiments.run.config import ConfigError, TrainConfig
from experiments.run.records import Summary
from experiments.study import time_model
from experiments.study import time_to_loss as ttl

DEMO = "demo-k1-c8-1bit-rand-fb1-orth"
# tokens per step of the fake runs: batch 32 x 128; tokens_per_s sets their compute.
_TOKENS = 32 * 128


def _write_run(root, method, steps, val, *, payload, ratio, step_s=0.5, lr=0.006):
  """A finished run directory in the driver's format: summary.json and metrics.jsonl."""
  _, overrides = methods.parse(method)
  cfg = dataclasses.asdict(
    TrainConfig(
      preset="small",
      workers=8,
      batch_size=32,
      seq_len=128,
      steps=steps,
      learning_rate=lr,
      **overrides,
    )
  )
  fields = {f.name: None for f in dataclasses.fields(Summary)}
  summary = fields | {
    "optimizer": cfg["optimizer"],
    "preset": "small",
    "num_params": 918_656,
    "steps": steps,
    "workers": 8,
    "final_val_loss": val[steps],
    "payload_bytes_per_step": payload,
    "ratio_vs_bf16_grad": ratio,
    "config": cfg,
  }
  os.makedirs(root, exist_ok=True)
  with open(os.path.join(root, "summary.json"), "w") as f:
    json.dump(summary, f)
  with open(os.path.join(root, "metrics.jsonl"), "w") as f:
    for step in range(1, steps + 1):
      line = {
        "step": step,
        "loss": 5.0 - step / steps,
        "wall_time": float(step),
        "bytes_sent": payload,
        "lr": 1e-3,
        "tokens_per_s": _TOKENS / step_s,
      }
      if step in val:
        line["val_loss"] = val[step]
      f.write(json.dumps(line) + "\n")
  return str(root)


def _curve(steps, first, last):
  """Validation every steps/10 steps, linear from ``first`` to ``last``."""
  every = steps // 10
  return {s: first + (last - first) * (s / steps) for s in range(every, steps + 1, every)}


def _count(method, workers, preset):
  """What round_trips.count finds on small (tests/test_round_trips.py checks its structure)."""
  if methods.parse(method)[0].collective == "all-reduce":
    return StepCount(method, workers, (Collective("all-reduce", 12, 306_218, "train_step"),))
  return round_trips.demo_step(1_811, workers)


@pytest.fixture
def runs(tmp_path):
  muon = _write_run(
    tmp_path / "muon", "muon", 900, _curve(900, 3.0, 1.42), payload=3_674_624, ratio=0.5
  )
  adamw = _write_run(
    tmp_path / "adamw", "adamw", 900, _curve(900, 3.2, 1.60), payload=3_674_624, ratio=0.5
  )
  demo = _write_run(
    tmp_path / "demo", DEMO, 300, _curve(300, 3.0, 1.90), payload=1_811, ratio=1014.53
  )
  return {
    "muon": ttl.load_run("muon", muon),
    "adamw": ttl.load_run("adamw", adamw),
    DEMO: ttl.load_run(DEMO, demo),
    "diloco": None,
  }


def test_the_curve_is_read_back_and_the_first_step_reaching_the_target_interpolated(tmp_path):
  run_dir = _write_run(
    tmp_path / "r", "muon", 40, {10: 3.0, 20: 1.4, 30: 2.0, 40: 1.0}, payload=1, ratio=1
  )
  curve = ttl.read_curve(run_dir)
  assert curve.steps == (10.0, 20.0, 30.0, 40.0) and curve.losses == (3.0, 1.4, 2.0, 1.0)
  # The first crossing, between steps 10 and 20, not the later one.
  assert ttl.first_reaching(curve, 1.5) == pytest.approx(10 + (3.0 - 1.5) / 1.6 * 10)
  assert ttl.first_reaching(curve, 3.0) == 10.0  # met at the first point
  assert ttl.first_reaching(curve, 1.0) == 40.0
  assert ttl.first_reaching(curve, 0.99) is None
  train = ttl.read_curve(run_dir, "train")
  assert len(train.steps) == 40 and train.losses[0] == pytest.approx(5.0 - 1 / 40)
  # A trailing mean over 10 steps: step 10's is the mean of steps 1..10.
  assert train.losses[9] == pytest.approx(5.0 - 5.5 / 40)


def test_a_curve_stops_at_its_first_non_finite_loss(tmp_path):
  run_dir = _write_run(
    tmp_path / "r", "muon", 30, {10: 3.0, 20: float("nan"), 30: 1.0}, payload=1, ratio=1
  )
  assert ttl.read_curve(run_dir).steps == (10.0,)
  with pytest.raises(ConfigError, match="kind"):
    ttl.read_curve(run_dir, "kind")


def test_the_wall_clock_is_the_time_models_steps():
  link = ttl.LINKS[2]
  count = round_trips.demo_step(1_811, 8)
  p = ttl.pricing_of(
    count, compute_s=0.5, compute_source="x", collective="all-gather", message_bytes=1_811
  )
  step = time_model.step_seconds(0.5, 7 * 1_811, 7 * 1_811, link, hops=count.hops())
  assert p.seconds_at(300, link) == pytest.approx(300 * step)
  assert p.round_trips == 3.5  # 7 hops of half a round trip
  # An exchange every 10 steps: 9 plain steps, then one with the transfer and its hops.
  periodic = StepCount("d", 8, (Collective("all-reduce", 1, 4_000, "train_step", every=10),))
  p = ttl.pricing_of(
    periodic,
    compute_s=0.5,
    compute_source="x",
    collective="all-reduce",
    message_bytes=4_000,
    every=10,
  )
  assert p.hops == () and len(p.exchange_hops) == 14
  up, down = time_model.link_bytes("all-reduce", 4_000, 8)
  exchanging = time_model.step_seconds(0.5, up, down, link, hops=p.exchange_hops)
  assert p.seconds_at(20, link) == pytest.approx(18 * 0.5 + 2 * exchanging)
  assert p.mean_step_seconds(link) == pytest.approx(0.45 + exchanging / 10)


def test_time_to_target_and_the_never_cases(runs):
  small, report = ttl.analyse(runs, count=_count)
  assert small.target == pytest.approx(1.42) and report.target == small.target
  rows = {r.method: r for r in small.rows}
  for link, cell in zip(small.links, rows["muon"].cells):
    # Muon reaches its own final loss at its last point, 900 of its steps.
    step = rows["muon"].pricing.mean_step_seconds(link)
    assert cell.reached_s == pytest.approx(900 * step) == pytest.approx(cell.finish_s)
    assert rows["muon"].pricing.compute_s == pytest.approx(0.5)
  # AdamW never reaches 1.42, and its curve spans Muon's finish: its loss then.
  adamw = rows["adamw"].cells[0]
  assert adamw.reached_s is None and adamw.loss_at_finish == pytest.approx(1.60)
  assert adamw.text("muon") == "never: loss 1.6000 at muon's finish"
  # The DeMo run ends (300 steps) long before Muon's 900 over a slow link.
  demo = rows[DEMO].cells[-1]
  assert demo.reached_s is None and demo.loss_at_finish is None
  assert demo.end_step == 300 and demo.end_loss == pytest.approx(1.90)
  assert demo.text("muon").startswith("never in 300 steps: 1.9000 at ")
  assert rows["diloco"].run is None and rows["diloco"].cells == ()


def test_a_faster_link_never_gives_a_longer_time(runs):
  # LINKS runs from the fastest to the slowest path.
  for setting in ttl.analyse(runs, count=_count):
    for row in setting.rows:
      if row.run is None:
        continue
      reached = [c.reached_s if c.reached_s is not None else c.end_s for c in row.cells]
      assert reached == sorted(reached), (setting.name, row.method, reached)
      assert reached[0] < reached[-1]
  # More loss never shortens a step either.
  p = ttl.analyse(runs, count=_count, report=None)[0].rows[0].pricing
  for link in ttl.LINKS:
    clean = dataclasses.replace(link, loss=0.0)
    assert p.mean_step_seconds(clean) < p.mean_step_seconds(link)


def test_the_report_setting_moves_the_time_axis_only(runs):
  small, report = ttl.analyse(runs, count=_count)
  demo = next(r for r in report.rows if r.method == DEMO)
  assert demo.run.curve == runs[DEMO].curve  # the small curve
  p = demo.pricing
  assert p.workers == 32 and p.collective == "all-gather"
  assert p.compute_s == pytest.approx(time_model.REPORT.compute_seconds)
  # The message is the 1.2B model's (this library's accounting, bf16), 31 hops of it.
  assert p.message_bytes > 1e6 and len(p.hops) == 31
  assert demo.ratio_vs_bf16_grad == pytest.approx(ttl.report_gradient_bytes() / p.message_bytes)
  muon = next(r for r in report.rows if r.method == "muon").pricing
  assert muon.message_bytes == ttl.report_gradient_bytes()  # a bf16 gradient, all-reduced
  assert len(muon.hops) == 12 * 2 * 31  # 12 arrays, a ring of 2 (W-1) hops each


def test_missing_methods_are_listed_as_not_run(tmp_path):
  for lr, val in ((0.003, 1.7), (0.006, 1.6)):
    _write_run(
      tmp_path / "steps300" / "muon" / f"learning_rate-{lr:g}",
      "muon",
      300,
      _curve(300, 3.0, val),
      payload=3_674_624,
      ratio=0.5,
      lr=lr,
    )
  _write_run(
    tmp_path / "steps900" / "muon" / "learning_rate-0.006",
    "muon",
    900,
    _curve(900, 3.0, 1.42),
    payload=3_674_624,
    ratio=0.5,
  )
  _write_run(
    tmp_path / "steps300" / "adamw" / "learning_rate-0.003",
    "adamw",
    300,
    _curve(300, 3.0, 1.9),
    payload=3_674_624,
    ratio=0.5,
  )
  runs = ttl.runs_from_cache(str(tmp_path), ["muon", "adamw", "sparseloco"], 900)
  assert runs["sparseloco"] is None
  assert runs["muon"].steps == 900 and runs["adamw"].steps == 300  # its longest horizon
  assert dict(runs["muon"].settings) == {"learning_rate": 0.006}
  at300 = ttl.runs_from_cache(str(tmp_path), ["muon"], 300)
  assert at300["muon"].curve.final == pytest.approx(1.6)  # the best of its two rates
  text = ttl.markdown(ttl.analyse(runs, count=_count, report=None))
  assert "| `sparseloco` | not run | |" + " not run |" * 4 in text
  with pytest.raises(ConfigError, match="no run of muon"):
    ttl.analyse({"muon": None, "adamw": runs["adamw"]}, count=_count)


def test_the_markdown_has_a_row_per_method_and_a_column_per_link(runs, tmp_path):
  settings = ttl.analyse(runs, count=_count)
  text = ttl.write(settings, str(tmp_path / "out"))
  header = "| method | steps run | bytes / step (vs bf16 gradient) | " + " | ".join(
    link.name for link in ttl.LINKS
  )
  assert text.count(header) == 2
  assert "### small: 0.92M parameters, 8 workers, each method's compute" in text
  assert "### report-1.2b: 32 workers, 2.46 s compute per step" in text
  assert "the loss curves are the small runs'" in text
  lines = [line for line in text.splitlines() if line.startswith("| `")]
  time_rows = [line for line in lines if " | not run |" in line or "x) |" in line]
  assert [line.split("`")[1] for line in time_rows] == ["muon", "adamw", DEMO, "diloco"] * 2
  muon = next(line for line in time_rows if line.startswith("| `muon` | 900 | 3,674,624 (0.50x) |"))
  step = settings[0].rows[0].pricing.mean_step_seconds(ttl.LINKS[0])
  assert f" {900 * step / 60:.1f} min |" in muon or f" {900 * step / 3600:.1f} h |" in muon
  assert f"| `{DEMO}` | 300 | 1,811 (1,015x) |" in text
  assert "round trip (one-way delay: half), 1% of packets lost" in text
  assert "| `muon` | all-reduce, W=8 | 252 |" in text  # 12 rings of 14 hops, 1.5 trips each
  assert f"| `{DEMO}` | all-gather, W=8 | 3.5 |" in text
  record = json.loads((tmp_path / "out" / "time_to_loss.json").read_text())
  assert [s["setting"] for s in record] == ["small", "report-1.2b"]
  assert record[0]["rows"][3] == {"method": "diloco", "run": None}
  assert os.path.getsize(tmp_path / "out" / "time_to_loss.png") > 10_000


def test_the_runs_flag_and_the_links():
  with pytest.raises(ConfigError, match="METHOD:RUN_DIR"):
    ttl.parse_runs_flag(["muon"])
  with pytest.raises(ConfigError, match="no summary.json"):
    ttl.parse_runs_flag(["muon:/nonexistent/run"])
  assert [(link.rtt_s, link.loss) for link in ttl.LINKS] == [
    (0.001, 0.01),
    (0.020, 0.01),
    (0.100, 0.01),
    (0.100, 0.01),
  ]
  assert [link.up_bits_per_s for link in ttl.LINKS] == [1e9, 100e6, 10e6, 1e6]
  assert all(link.loss == 0.0 for link in ttl.links_with_loss(0.0))
  assert set(ttl.DEFAULT_METHODS) <= set(methods.DEFAULT_COMPARISON)
  assert math.isclose(ttl.SMALL_COMPUTE_S, 0.59)


def test_an_all_to_all_message_is_priced_as_one_hop_with_the_rings_bytes():
  message = 14_263
  ring = round_trips.demo_step(message, 4)
  direct = round_trips.demo_step(message, 4, kind="all-to-all")
  link = time_model.Link("far", 10e6, 10e6, rtt_s=0.1, loss=0.01)
  priced = {
    kind: ttl.pricing_of(
      count,
      compute_s=1.0,
      compute_source="test",
      collective=ttl._collective("demo", count),
      message_bytes=message,
    )
    for kind, count in (("ring", ring), ("direct", direct))
  }
  assert priced["direct"].collective == "all-to-all" and priced["ring"].collective == "all-gather"
  assert (priced["ring"].round_trips, priced["direct"].round_trips) == (1.5, 0.5)
  no_latency = dataclasses.replace(link, rtt_s=0.0, loss=0.0)
  # The same bytes up each link, so without latency the two steps are one.
  assert priced["direct"].step_seconds(no_latency) == priced["ring"].step_seconds(no_latency)
  assert priced["direct"].step_seconds(link)[0] < priced["ring"].step_seconds(link)[0]
  # Resized for 32 workers, the all-to-all still carries the message once per worker, in one hop.
  (big,) = ttl._resized(direct, 2 * message, 32).collectives
  assert (big.kind, big.operands, big.operand_bytes) == ("all-to-all", 1, 32 * 2 * message)
  assert len(round_trips.hops_of(big, 32)) == 1
