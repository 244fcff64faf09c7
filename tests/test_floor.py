"""The bandwidth floor's pure parts, on synthetic cells in the real cache format (no lab)."""

import json

import pytest

from experiments.netlab import floor, lab, round_trips
from experiments.netlab.floor import Cell, Entry
from experiments.netlab.links import NetlabError

CLEAN_SETTINGS = {
  "processes": 4,
  "preset": "mini",
  "steps": 20,
  "skip_steps": 3,
  "driver_flags": ["--seq_len=128"],
}
SHAPED_SETTINGS = {"delay_ms": 25.0, "loss_pct": 0.5, "latency_ms": 100.0}
RATES = [10.0, 3.0, 1.0]


def _cell(method, rate, median, *, finished=True, limit=300.0, settings=None, **kw):
  if settings is None:
    settings = CLEAN_SETTINGS if rate is None else {**CLEAN_SETTINGS, **SHAPED_SETTINGS}
  return Cell(
    method,
    rate,
    finished,
    kw.pop("steps_done", 20),
    kw.pop("elapsed_s", 60.0),
    median,
    limit,
    dict(settings),
    **kw,
  )


def _write(out_dir, *cells):
  for c in cells:
    floor.write_cell(str(out_dir), c)


def test_a_cell_is_written_where_the_cache_says_and_read_back_equal(tmp_path):
  cell = _cell("demo", 0.3, 1.5, model_step_s=None, optimizer="demo")
  path = floor.write_cell(str(tmp_path), cell)
  assert path == str(tmp_path / "cells" / "demo" / "0.3.json")
  assert json.loads((tmp_path / "cells" / "demo" / "0.3.json").read_text())["median_step_s"] == 1.5
  assert floor.read_cell(str(tmp_path), "demo", 0.3) == cell
  assert floor.cell_path("o", "adamw", None) == "o/cells/adamw/clean.json"
  assert floor.read_cell(str(tmp_path), "demo", 10.0) is None


def test_the_plan_runs_only_the_cells_the_cache_lacks(tmp_path):
  _write(
    tmp_path,
    _cell("adamw", None, 1.0),
    _cell("demo", None, 1.2),
    _cell("adamw", 10.0, 4.0),
  )
  plan = floor.plan_cells(
    str(tmp_path), ["adamw", "demo"], RATES, CLEAN_SETTINGS, SHAPED_SETTINGS, 300.0
  )
  assert plan.read_back == (("adamw", None), ("demo", None), ("adamw", 10.0))
  # Clean cells first, then rate by rate from the highest.
  assert plan.to_run == (
    ("demo", 10.0),
    ("adamw", 3.0),
    ("demo", 3.0),
    ("adamw", 1.0),
    ("demo", 1.0),
  )
  text = plan.text()
  assert "5 cells to run, 3 read back" in text
  assert "read back: adamw clean, demo clean, adamw 10 Mbit/s" in text


def test_the_plan_reruns_a_cell_of_other_settings_a_failure_or_a_shorter_limit(tmp_path):
  other = {**CLEAN_SETTINGS, **SHAPED_SETTINGS, "delay_ms": 50.0}
  _write(
    tmp_path,
    _cell("demo", None, 1.2),
    _cell("demo", 10.0, 1.3, settings=other),
    _cell("demo", 3.0, 1.9, finished=False, error="process 2 failed"),
    _cell("demo", 1.0, None, finished=False, limit=100.0),
  )
  plan = floor.plan_cells(str(tmp_path), ["demo"], RATES, CLEAN_SETTINGS, SHAPED_SETTINGS, 300.0)
  assert plan.read_back == (("demo", None),)
  assert plan.to_run == (("demo", 10.0), ("demo", 3.0), ("demo", 1.0))
  # A cell stopped at a limit no shorter than the sweep's is an answer: read back.
  plan = floor.plan_cells(str(tmp_path), ["demo"], RATES, CLEAN_SETTINGS, SHAPED_SETTINGS, 100.0)
  assert ("demo", 1.0) in plan.read_back


def test_forms_pair_a_method_with_its_delayed_variant_only_when_both_are_listed():
  forms = floor.forms_of(["adamw", "demo-k1", "demo-k1-delayed", "muon-delayed"])
  assert forms == {
    "adamw": ("adamw",),
    "demo-k1": ("demo-k1", "demo-k1-delayed"),
    "demo-k1-delayed": ("demo-k1", "demo-k1-delayed"),
    "muon-delayed": ("muon-delayed",),
  }


def test_the_best_clean_step_is_the_fastest_of_the_forms():
  cells = {
    ("d", None): _cell("d", None, 1.552),
    ("d-delayed", None): _cell("d-delayed", None, 2.942),
    ("adamw", None): _cell("adamw", None, 1.13),
  }
  best = floor.best_clean_steps(cells, ["adamw", "d", "d-delayed", "muon"])
  assert best == {"adamw": 1.13, "d": 1.552, "d-delayed": 1.552, "muon": None}


def test_the_floor_is_broken_by_the_first_rate_out_of_tolerance():
  entries = [
    Entry(1.0, "ok", ratio=1.05),
    Entry(10.0, "ok", ratio=1.02),
    Entry(3.0, "ok", ratio=1.25),
  ]
  # Within at 10 and 1 but not at 3: the floor is 10, not 1.
  assert floor.floor_of(entries) == 10.0
  assert floor.floor_of([Entry(10.0, "ok", ratio=1.1), Entry(3.0, "ok", ratio=1.09)]) == 3.0
  assert floor.floor_of([Entry(10.0, "ok", ratio=1.11), Entry(3.0, "ok", ratio=1.0)]) is None
  # A cell that did not finish, or did not run, is not within.
  assert floor.floor_of([Entry(10.0, "ok", ratio=1.0), Entry(3.0, "dnf", model_ratio=1.0)]) == 10.0
  assert floor.floor_of([Entry(10.0, "not run")]) is None


def _sweep_cells():
  """Four methods, three rates: a clean sweep, a dnf, a failure, a broken floor, a missing cell."""
  return {
    ("adamw", None): _cell("adamw", None, 1.0),
    ("adamw", 10.0): _cell("adamw", 10.0, 35.0),
    ("adamw", 3.0): _cell(
      "adamw", 3.0, 80.0, finished=False, steps_done=4, elapsed_s=300.4, model_step_s=116.0
    ),
    ("adamw", 1.0): _cell("adamw", 1.0, None, finished=False, steps_done=1, elapsed_s=300.0),
    ("d", None): _cell("d", None, 2.0),
    ("d", 10.0): _cell("d", 10.0, 2.04),
    ("d", 3.0): _cell("d", 3.0, 2.5),
    ("d", 1.0): _cell("d", 1.0, 2.1),
    ("d-delayed", None): _cell("d-delayed", None, 3.0),
    ("d-delayed", 10.0): _cell("d-delayed", 10.0, 2.1),
    ("d-delayed", 3.0): _cell("d-delayed", 3.0, 2.15),
    ("d-delayed", 1.0): _cell(
      "d-delayed", 1.0, 2.3, finished=False, steps_done=7, elapsed_s=41.0, error="netlab: boom\nx"
    ),
    ("muon", None): _cell("muon", None, 1.5),
    ("muon", 10.0): _cell("muon", 10.0, 1.6),
  }


def _report():
  return floor.build_report(_sweep_cells(), ["adamw", "d", "d-delayed", "muon"], RATES, "a line")


def test_the_report_gives_ratios_to_the_best_clean_step_and_the_floors():
  rep = _report()
  assert rep.rates_mbit == (10.0, 3.0, 1.0)
  rows = {r.method: r for r in rep.rows}
  assert [e.text() for e in rows["adamw"].entries] == ["35.00x", "dnf (model 116.0x)", "dnf"]
  assert rows["adamw"].floor_mbit is None
  # d's best clean step is its own (2.0 s), d-delayed's too: the fastest of the two forms.
  assert rows["d-delayed"].best_clean_step_s == 2.0
  assert [e.text() for e in rows["d"].entries] == ["**1.02x**", "1.25x", "**1.05x**"]
  assert rows["d"].floor_mbit == 10.0
  assert [e.text() for e in rows["d-delayed"].entries] == ["**1.05x**", "**1.07x**", "failed"]
  assert rows["d-delayed"].floor_mbit == 3.0
  assert [e.text() for e in rows["muon"].entries] == ["**1.07x**", "not run", "not run"]
  assert rows["muon"].floor_mbit == 10.0


def test_the_markdown_table(tmp_path):
  text = floor.markdown(_report())
  lines = text.splitlines()
  head = lines.index("| method | best clean step | 10 Mbit/s | 3 Mbit/s | 1 Mbit/s | floor |")
  assert lines[head + 2 : head + 6] == [
    "| adamw | 1.000 s | 35.00x | dnf (model 116.0x) | dnf | none |",
    "| d | 2.000 s | **1.02x** | 1.25x | **1.05x** | 10 Mbit/s |",
    "| d-delayed | 2.000 s | **1.05x** | **1.07x** | failed | 3 Mbit/s |",
    "| muon | 1.500 s | **1.07x** | not run | not run | 10 Mbit/s |",
  ]
  assert (
    "- `adamw` at 3 Mbit/s: did not finish: 4 steps in 300 s; the time model's step is "
    "116.000 s (116.0x)" in lines
  )
  assert "- `adamw` at 1 Mbit/s: did not finish: 1 steps in 300 s" in lines
  assert "- `d-delayed` at 1 Mbit/s: failed after 7 steps in 41 s: netlab: boom" in lines


def test_the_report_survives_a_trip_through_json():
  rep = _report()
  back = floor.FloorReport.from_json(json.loads(json.dumps(rep.to_json())))
  assert back == rep
  assert back.rows[2].entries[2].error == "netlab: boom\nx"


def test_write_report_writes_the_three_files_and_a_png(tmp_path):
  text = floor.write_report(str(tmp_path), _report())
  assert (tmp_path / "floor.md").read_text() == text
  assert json.loads((tmp_path / "floor.json").read_text())["rows"][1]["floor_mbit"] == 10.0
  png = (tmp_path / "floor.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n"
  assert len(png) > 5000


def test_the_model_prices_the_recorded_far_cell_and_resizes_the_count():
  link = floor.netlab_link(10, 25, 0.5)
  assert link.rtt_s == pytest.approx(0.1)
  assert link.loss == pytest.approx(0.009975)
  assert link.burst_bytes == round_trips.NETLAB_BURST_BYTES
  kw = {"clean_step_s": 1.552, "payload_bytes_per_step": 1811, "collective": "all-gather"}
  # docs/netlab.md, "Far links after the cut": 1.772 s with a round 1% loss end to end.
  step = floor.model_step_s(round_trips.demo_step(1811), link, **kw)
  assert step == pytest.approx(1.7714, abs=1e-4)
  # The count's message (the method's own options) is resized to what the run sent.
  assert floor.model_step_s(round_trips.demo_step(40_000), link, **kw) == pytest.approx(step)
  # The overlapped form hides its hops under the compute.
  hidden = round_trips.demo_step(1811, overlapped=True)
  assert floor.model_step_s(hidden, link, **{**kw, "overlapped_share": 1.0}) == 1.552


def test_rates_are_read_highest_first_and_refused_when_wrong():
  assert floor.parse_rates("1,10,0.3") == [10.0, 1.0, 0.3]
  for bad in ("", "10,x", "10,0", "3,3"):
    with pytest.raises(NetlabError, match="--rate_mbit"):
      floor.parse_rates(bad)


def test_a_sweep_with_every_cell_cached_needs_no_lab_and_prices_its_dnf(tmp_path, capsys):
  cfg = floor.FloorConfig(rate_mbit="10,3", methods="adamw,demo", out_dir=str(tmp_path))
  clean, shaped = floor.cell_settings(cfg, lab.driver_flags((), cfg.processes))
  demo = {"optimizer": "demo", "preset": "mini"}
  _write(
    tmp_path,
    Cell("adamw", None, True, 20, 50.0, 1.0, 300.0, clean),
    Cell("demo", None, True, 20, 50.0, 1.552, 300.0, clean, "demo", 1811.0, demo),
    Cell("adamw", 10.0, True, 20, 90.0, 3.0, 300.0, {**clean, **shaped}),
    Cell("adamw", 3.0, True, 20, 200.0, 9.0, 300.0, {**clean, **shaped}),
    Cell("demo", 10.0, True, 20, 50.0, 1.6, 300.0, {**clean, **shaped}),
    Cell("demo", 3.0, False, 5, 300.0, 1.7, 300.0, {**clean, **shaped}),
  )
  counted = []

  def counter(method, workers, preset):
    counted.append((method, workers, preset))
    return round_trips.demo_step(1811, workers)

  rep = floor.run(cfg, counter=counter)
  out = capsys.readouterr().out
  assert "0 cells to run, 6 read back" in out
  assert counted == [("demo", 4, "mini")]
  demo_row = rep.rows[1]
  assert demo_row.entries[1].model_step_s == pytest.approx(1.7714, abs=1e-4)
  assert demo_row.entries[1].text() == "dnf (model 1.1x)"
  assert demo_row.floor_mbit == 10.0
  assert rep.rows[0].floor_mbit is None
  # The model is cached with its cell: a rerun compiles nothing.
  assert floor.read_cell(str(tmp_path), "demo", 3.0).model_step_s == pytest.approx(1.7714, abs=1e-4)
  floor.run(cfg, counter=counter)
  assert len(counted) == 1
  assert (tmp_path / "floor.png").exists()
