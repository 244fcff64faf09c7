"""netlab: shaped links between processes, its measures, its errors and its teardown.

The lab runs need root and iproute2 and skip with the reason otherwise; they
are marked slow. The measures, the flag handling and the error messages are
checked everywhere.
"""

import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
from absl import flags

from experiments.netlab import __main__ as netlab_command
from experiments.netlab import counters, lab, links, report, results
from experiments.run import methods
from experiments.run.config import TrainConfig
from experiments.run.launch import LaunchConfig
from experiments.run.records import StepRecord, Summary, read_events, read_metrics

ROOT = pathlib.Path(__file__).parent.parent
CANNOT_RUN = links.missing_prerequisite()
needs_lab = pytest.mark.skipif(CANNOT_RUN is not None, reason=f"netlab cannot run: {CANNOT_RUN}")
SHORT = [
  "--processes=2",
  "--rate_mbit=10",
  "--preset=tiny",
  "--batch_size=2",
  "--seq_len=32",
  "--eval_batches=1",
  "--noprogress",
]


def _netlab(out_dir, *args):
  return subprocess.Popen(
    [sys.executable, "-m", "experiments.netlab", *SHORT, f"--out_dir={out_dir}", *args],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def _processes_mentioning(text):
  """Pids of live processes whose command line contains ``text``."""
  pids = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      cmdline = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes()
    except OSError:
      continue
    if text.encode() in cmdline:
      pids.append(int(entry))
  return pids


def _assert_nothing_left(launcher_pid, out_dir, timeout=20.0):
  tag = f"nl{launcher_pid}"
  deadline = time.monotonic() + timeout
  while True:
    left = links.leftovers(tag)
    procs = _processes_mentioning(str(out_dir))
    if not (left["namespaces"] or left["pids"] or procs) or time.monotonic() > deadline:
      break
    time.sleep(0.2)
  assert left == {"namespaces": [], "pids": []}
  assert procs == []


# One lab run serves the two tests below (they share a worker under xdist):
# AdamW (the cheapest step to compile) on 2 processes over 10 Mbit/s links,
# unshaped, shaped, and then with process 1 killed after step 7, continued on
# process 0 alone; a 5 s peer timeout (the drill's default is 20 s) so that it
# stops soon. Several survivors agreeing on a lost (stopped) peer is
# tests/test_interrupted_runs.py's, without the lab. What DeMo's message gains
# over AdamW on such links is a figure, measured by a documented command
# (docs/netlab.md), not re-measured here.
KILLED_LAB = pytest.mark.xdist_group("netlab_killed_lab")


@pytest.fixture(scope="module")
def killed_lab(tmp_path_factory):
  """The directory of the lab run described above, checked to have succeeded."""
  out_dir = tmp_path_factory.mktemp("killed_lab")
  args = [
    "--methods=adamw", "--steps=12", "--eval_every=6", "--skip_steps=2", "--kill_step=7",
    "--checkpoint_every=4", "--peer_timeout_s=5",
  ]  # fmt: skip
  proc = _netlab(out_dir, *args)
  out, _ = proc.communicate(timeout=900)
  assert proc.returncode == 0, out[-4000:]
  _assert_nothing_left(proc.pid, out_dir, timeout=0)
  return out_dir


@pytest.mark.slow
@needs_lab
@KILLED_LAB
def test_two_processes_shaped_and_unshaped(killed_lab):
  ran = Summary.load(killed_lab / "runs" / "adamw-shaped")
  assert (ran.optimizer, ran.workers) == ("adamw", 2)
  report_ = json.loads((killed_lab / "netlab.json").read_text())
  assert list(report_) == ["adamw"]
  e = report_["adamw"]
  for key in ("median_step_s_shaped", "median_step_s_unshaped"):
    assert e[key] > 0, key
  # What crossed the links is the collective's traffic plus TCP and coordinator overhead.
  assert 0.5 < e["link_bytes_per_step"] / e["payload_bytes_per_step"] < 2.0, e
  assert e["bounding_link"]["rate_mbit"] == 10
  # 525 KB of ring all-reduce each way per step takes 0.42 s at 10 Mbit/s.
  assert e["median_step_s_shaped"] > 0.4
  # Shaping changes the timing, not the arithmetic.
  runs = killed_lab / "runs"
  assert [r.loss for r in read_metrics(runs / "adamw-shaped")] == [
    r.loss for r in read_metrics(runs / "adamw-unshaped")
  ]
  assert (killed_lab / "netlab_loss.png").stat().st_size > 1000
  assert "| adamw |" in (killed_lab / "netlab.md").read_text()
  assert (killed_lab / "link_counters.jsonl").stat().st_size > 0


@pytest.mark.slow
@needs_lab
@KILLED_LAB
def test_one_of_two_processes_killed_finish_on_one_and_report_the_cost(killed_lab):
  figures = json.loads((killed_lab / "netlab.json").read_text())["adamw"]["interrupted"]
  assert figures["processes"] == [2, 1] and figures["steps"] == 12
  assert figures["kill_step"] >= 7 and figures["resumed_from_step"] == 4
  # The survivor found the killed peer silent and stopped on its own.
  assert figures["survivors_exit_codes"] == [76]
  assert figures["steps_redone"] == figures["kill_step"] - 4
  assert figures["wall_s_lost"] is not None and figures["seconds_to_regain_kill_step"] > 0
  assert figures["final_loss_interrupted"] < 6 and figures["final_loss_uninterrupted"] < 6
  run = killed_lab / "runs" / "adamw-interrupted"
  assert [r.step for r in read_metrics(run)] == list(range(1, 13))
  (event,) = read_events(run)
  assert (event.step, event.processes_before, event.processes_after) == (4, 2, 1)
  assert "## A process killed mid-run" in (killed_lab / "netlab.md").read_text()


@pytest.mark.slow
@needs_lab
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_killed_midway_leaves_nothing(tmp_path, sig):
  proc = _netlab(tmp_path, "--methods=demo", "--steps=100000")
  log = tmp_path / "runs" / "demo-unshaped" / "process1.log"
  deadline = time.monotonic() + 120
  # Kill it once both drivers run in the lab and have reached the coordinator.
  while not (log.exists() and "Connecting to JAX distributed service" in log.read_text()):
    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
    time.sleep(0.1)
  assert len(links.leftovers(f"nl{proc.pid}")["pids"]) >= 3  # 2 drivers, the sampler
  proc.send_signal(sig)
  out, _ = proc.communicate(timeout=60)
  assert proc.returncode == (130 if sig == signal.SIGINT else -signal.SIGKILL), out[-4000:]
  # After SIGKILL the guardian does the teardown.
  _assert_nothing_left(proc.pid, tmp_path)


@pytest.mark.slow  # a fresh process: a few seconds of imports
def test_command_parses_its_flags_and_passes_the_drivers_on():
  # Every netlab flag below is valid, so the error is the reserved driver
  # flag, reached only after --seq_len went through as the drivers'.
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.netlab",
      "--processes=3",
      "--rate_mbit=10,20,30",
      "--methods=adamw,demo-k8-1bit",
      "--preset=tiny",
      "--steps=4",
      "--skip_steps=3",
      "--seq_len=64",
      "--workers=3",
    ],  # fmt: skip
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.splitlines() == [
    "error: --workers is set by netlab for each run; netlab runs one process per namespace "
    "with one device each; use --processes."
  ]


def test_importing_the_command_defines_no_flags():
  assert "processes" not in flags.FLAGS and "rate_mbit" not in flags.FLAGS
  assert callable(netlab_command.main)


def test_not_root_is_a_clear_error(monkeypatch, capsys):
  monkeypatch.setattr(os, "geteuid", lambda: 1000)
  with pytest.raises(SystemExit) as exit_info:
    netlab_command.run_command(lab.LabConfig(), [])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: netlab needs root") and "sudo" in err


def test_missing_tools_are_named(monkeypatch):
  monkeypatch.setattr(os, "geteuid", lambda: 0)
  monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
  reason = links.missing_prerequisite()
  assert "tc not found" in reason and "iproute2" in reason
  with pytest.raises(links.NetlabError, match="apt-get install iproute2"):
    links.check_prerequisites()


def test_a_kernel_without_tbf_is_named(tmp_path):
  fake_tc = tmp_path / "tc"
  fake_tc.write_text("#!/bin/sh\necho 'Error: Specified qdisc kind is unknown.' >&2\nexit 2\n")
  fake_tc.chmod(0o755)
  with pytest.raises(links.NetlabError, match="no tbf qdisc.*modprobe sch_tbf"):
    links._run(str(fake_tc), "qdisc", "replace", "dev", "v0", "root", "tbf", "rate", "1mbit")


@pytest.mark.parametrize(
  "text, processes, expected",
  [("10", 3, [10.0] * 3), ("10,100,100,1000", 4, [10.0, 100.0, 100.0, 1000.0])],
)
def test_rates(text, processes, expected):
  assert lab.parse_rates(text, processes) == expected


@pytest.mark.parametrize(
  "text, match", [("fast", "not a number"), ("10,0", "positive"), ("10,20,30", "3 rates")]
)
def test_bad_rates(text, match):
  with pytest.raises(links.NetlabError, match=match):
    lab.parse_rates(text, 2)


def test_methods_are_registry_names_with_options():
  assert lab.parse_methods("adamw, demo-k8-1bit,topk-nodct,diloco-h20") == {
    "adamw": ["--optimizer=adamw"],
    "demo-k8-1bit": ["--optimizer=demo", "--compression_topk=8", "--quantize_1bit"],
    "topk-nodct": ["--optimizer=demo", "--nouse_dct"],
    "diloco-h20": ["--optimizer=diloco", "--diloco_sync_every=20"],
  }
  for text, match in (("demo,sgd", "unknown method 'sgd'"), ("demo,demo", "twice"), (",", "")):
    with pytest.raises(links.NetlabError, match=f"{match}.*distinct names among demo"):
      lab.parse_methods(text)


def test_driver_flags_defaults_passthrough_and_reserved():
  driver = lab.driver_flags(["--seq_len=64", "--noquantize_1bit"], 4)
  assert "--seq_len=64" in driver and "--seq_len=128" not in driver
  assert "--noquantize_1bit" in driver and "--quantize_1bit" not in driver
  assert "--batch_size=4" in driver
  with pytest.raises(links.NetlabError, match="--workers is set by netlab"):
    lab.driver_flags(["--workers=8"], 2)
  with pytest.raises(links.NetlabError, match="--resume is set by netlab"):
    lab.driver_flags(["--noresume"], 2)
  with pytest.raises(links.NetlabError, match="--seq_lne is neither"):
    lab.driver_flags(["--seq_lne=64"], 2)
  with pytest.raises(links.NetlabError, match="unexpected argument 'x'"):
    lab.driver_flags(["x"], 2)


def test_reserved_and_default_flags_are_config_fields():
  # A renamed config field must fail here, not as a driver that rejects its flag.
  fields = {f.name for c in (TrainConfig, LaunchConfig) for f in dataclasses.fields(c)}
  assert set(lab._reserved()) <= fields
  assert set(lab._DRIVER_DEFAULTS) <= fields
  assert {"optimizer", "workers", "num_processes", "preset", "steps", "out_dir"} <= set(
    lab._reserved()
  )


def test_read_counters_reads_sysfs():
  (rx, tx) = counters.read_counters(["lo"])["lo"]
  assert rx >= 0 and tx >= 0


def _records(times, val_at=()):
  return [
    StepRecord(
      step=s + 1,
      loss=5.0 - s,
      wall_time=t,
      bytes_sent=0.0,
      lr=1e-3,
      tokens_per_s=1.0,
      val_loss=4.0 - s if s in val_at else None,
    )
    for s, t in enumerate(times)
  ]


def _summary(optimizer, payload, sent):
  """A summary.json with what the report reads; the rest is filler."""
  return Summary(
    optimizer=optimizer, preset="tiny", num_params=0, steps=8, workers=4,
    final_train_loss=None, final_train_loss_avg10=None, final_val_loss=None,
    bytes_sent_per_step=sent, payload_bytes_per_step=payload,
    measured_collective_bytes_per_step=0, measured_by_kind={},
    measured_exchange_bytes_per_step=0.0, measured_by_axes={},
    measured_crossing_replicas_per_step=0, params_kept_whole=[],
    total_bytes_sent_per_worker=0.0, ratio_vs_ring_allreduce=0.0, ratio_vs_bf16_grad=0.0,
    params_digest="", config={},
  )  # fmt: skip


def test_step_times_skip_warmup_and_evaluations():
  records = _records([10.0, 15.0, 16.0, 17.0, 20.0, 21.0, 22.5], val_at=(4,))
  # Steps 3..7 after skip=2; step 5 carries an evaluation (3 s) and is left out.
  assert report.step_seconds(records, 2) == [1.0, 1.0, 1.0, 1.5]
  assert report.median_step_s(records, 2) == 1.0
  assert report.measure_window(records, 2) == (15.0, 22.5, 5)
  assert report.time_to_target_s(records, 0.5) == 10.0  # step 5's val loss 0.0
  assert report.time_to_target_s(records, -1.0) is None


def test_link_bytes_interpolate_between_samples():
  samples = [
    {"t": 0.0, "bytes": {"v0": [0, 0]}},
    {"t": 2.0, "bytes": {"v0": [2000, 400]}},
    {"t": 4.0, "bytes": {"v0": [2000, 800]}},
  ]
  assert counters.bytes_between(samples, "v0", 1.0, 3.0) == (1000.0, 400.0)
  with pytest.raises(ValueError, match="cover"):
    counters.bytes_between(samples, "v0", 1.0, 5.0)
  assert report.link_bytes_per_step(samples, ["v0"], (0.0, 4.0, 4)) == [
    {"up": 500.0, "down": 200.0}
  ]


@pytest.mark.parametrize("name", methods.names())
def test_payload_follows_the_methods_collective(name):
  # An all-gather forwards the W-1 other messages; an all-reduce sends what
  # the driver counted, 2 (W-1)/W of its operand.
  traffic = report.payload_traffic(_summary(name, payload=400, sent=600.0), workers=4)
  gather = methods.get(name).collective == methods.ALL_GATHER
  assert traffic == {"message": 400, "payload": 1200 if gather else 600.0}


def test_summary_computes_payload_the_bounding_link_and_the_baseline():
  w = 4
  times = [float(t) for t in range(8)]
  samples = [
    {"t": t, "bytes": {f"v{i}": [1000 * (i + 1) * t, 10 * t] for i in range(w)}}
    for t in (-1.0, 100.0)
  ]
  runs = [
    results.RunResult(name, shaped, _records(times, val_at=(7,)), _summary(opt, 1000, 1500.0))
    for name, opt in (("adamw", "adamw"), ("demo-k8", "demo"))
    for shaped in (False, True)
  ]
  rep = report.summarize(
    runs,
    samples=samples,
    ifaces=[f"v{i}" for i in range(w)],
    rates_mbit=[1.0, 1.0, 0.001, 1.0],
    skip=2,
    target_loss=None,
  )
  e = rep["demo-k8"]
  assert e["payload_bytes_per_step"] == 3000  # W-1 messages forwarded per all-gather
  assert rep["adamw"]["payload_bytes_per_step"] == 1500.0  # the ring's bytes_sent
  assert e["link_bytes_per_step"] == pytest.approx(2500.0)  # mean of 1000..4000 per second
  assert e["bounding_link"]["process"] == 2  # the 1 kbit/s link, not the busiest one
  assert e["target_val_loss"] == -3.0 and e["time_to_target_s_shaped"] == 7.0
  # The first method listed is the baseline of the speed-up, named in the key.
  assert (
    e["shaped_step_speedup_vs_adamw"] == 1.0
    and "shaped_step_speedup_vs_adamw" not in (rep["adamw"])
  )
  text = report.markdown(rep, "2 processes")
  assert "| demo-k8 |" in text and "1.0x shorter than adamw's" in text
  assert "(bounds the step)" in text
