"""netlab: shaped links between processes, its measures, its errors and its teardown.

The runs need root and iproute2 and skip with the reason otherwise; the
measures and error messages are checked everywhere.
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

from experiments import link_counters, netlab, netlab_links, netlab_report

ROOT = pathlib.Path(__file__).parent.parent
CANNOT_RUN = netlab_links.missing_prerequisite()
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


def _netlab(out_dir, *flags):
  return subprocess.Popen(
    [sys.executable, "-m", "experiments.netlab", *SHORT, f"--out_dir={out_dir}", *flags],
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
    left = netlab_links.leftovers(tag)
    procs = _processes_mentioning(str(out_dir))
    if not (left["namespaces"] or left["pids"] or procs) or time.monotonic() > deadline:
      break
    time.sleep(0.2)
  assert left == {"namespaces": [], "pids": []}
  assert procs == []


@needs_lab
def test_two_processes_shaped_and_unshaped(tmp_path):
  # The reference's 7 KB message: Psyche's 624 B on the tiny model would be
  # outweighed by the ~2 KB a step spends on small collectives and ACKs.
  proc = _netlab(
    tmp_path,
    "--methods=adamw,demo",
    "--steps=8",
    "--eval_every=4",
    "--compression_topk=32",
    "--noquantize_1bit",
  )
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-4000:]
  _assert_nothing_left(proc.pid, tmp_path, timeout=0)

  report = json.loads((tmp_path / "netlab.json").read_text())
  assert set(report) == {"adamw", "demo"}
  for method, e in report.items():
    for key in ("median_step_s_shaped", "median_step_s_unshaped"):
      assert e[key] > 0, (method, key)
    # What crossed the links is the collective's traffic plus TCP and coordinator overhead.
    assert 0.5 < e["link_bytes_per_step"] / e["payload_bytes_per_step"] < 2.0, (method, e)
    assert e["bounding_link"]["rate_mbit"] == 10
  # 525 KB of ring all-reduce at 10 Mbit/s takes 0.42 s; the 7 KB message does not.
  assert report["adamw"]["median_step_s_shaped"] > 0.4
  assert report["adamw"]["median_step_s_shaped"] > 5 * report["demo"]["median_step_s_shaped"]
  assert (tmp_path / "netlab_loss.png").stat().st_size > 1000
  assert "| demo |" in (tmp_path / "netlab.md").read_text()


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
  assert len(netlab_links.leftovers(f"nl{proc.pid}")["pids"]) >= 3  # 2 drivers, the sampler
  proc.send_signal(sig)
  out, _ = proc.communicate(timeout=60)
  assert proc.returncode == (130 if sig == signal.SIGINT else -signal.SIGKILL), out[-4000:]
  # After SIGKILL the guardian does the teardown.
  _assert_nothing_left(proc.pid, tmp_path)


def test_not_root_is_a_clear_error(monkeypatch, capsys):
  monkeypatch.setattr(os, "geteuid", lambda: 1000)
  with pytest.raises(SystemExit) as exit_info:
    netlab.main(["netlab"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: netlab needs root") and "sudo" in err


def test_missing_tools_are_named(monkeypatch):
  monkeypatch.setattr(os, "geteuid", lambda: 0)
  monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
  reason = netlab_links.missing_prerequisite()
  assert "tc not found" in reason and "iproute2" in reason
  with pytest.raises(netlab_links.NetlabError, match="apt-get install iproute2"):
    netlab_links.check_prerequisites()


def test_a_kernel_without_tbf_is_named(tmp_path):
  fake_tc = tmp_path / "tc"
  fake_tc.write_text("#!/bin/sh\necho 'Error: Specified qdisc kind is unknown.' >&2\nexit 2\n")
  fake_tc.chmod(0o755)
  with pytest.raises(netlab_links.NetlabError, match="no tbf qdisc.*modprobe sch_tbf"):
    netlab_links._run(str(fake_tc), "qdisc", "replace", "dev", "v0", "root", "tbf", "rate", "1mbit")


@pytest.mark.parametrize(
  "text, processes, expected",
  [("10", 3, [10.0] * 3), ("10,100,100,1000", 4, [10.0, 100.0, 100.0, 1000.0])],
)
def test_rates(text, processes, expected):
  assert netlab.parse_rates(text, processes) == expected


@pytest.mark.parametrize(
  "text, match", [("fast", "not a number"), ("10,0", "positive"), ("10,20,30", "3 rates")]
)
def test_bad_rates(text, match):
  with pytest.raises(netlab_links.NetlabError, match=match):
    netlab.parse_rates(text, 2)


def test_bad_methods_and_reserved_flags():
  with pytest.raises(netlab_links.NetlabError, match="distinct names among demo"):
    netlab.parse_methods("demo,sgd")
  with pytest.raises(netlab_links.NetlabError, match="--workers is set by netlab"):
    netlab.train_flags(["--workers=8"], 2)
  flags = netlab.train_flags(["--seq_len=64", "--noquantize_1bit"], 4)
  assert "--seq_len=64" in flags and "--seq_len=128" not in flags
  assert "--noquantize_1bit" in flags and "--quantize_1bit=true" not in flags
  assert "--batch_size=4" in flags


def _records(times, val_at=()):
  return [
    {
      "step": s + 1,
      "loss": 5.0 - s,
      "wall_time": t,
      **({"val_loss": 4.0 - s} if s in val_at else {}),
    }
    for s, t in enumerate(times)
  ]


def test_step_times_skip_warmup_and_evaluations():
  records = _records([10.0, 15.0, 16.0, 17.0, 20.0, 21.0, 22.5], val_at=(4,))
  # Steps 3..7 after skip=2; step 5 carries an evaluation (3 s) and is left out.
  assert netlab_report.step_seconds(records, 2) == [1.0, 1.0, 1.0, 1.5]
  assert netlab_report.median_step_s(records, 2) == 1.0
  assert netlab_report.measure_window(records, 2) == (15.0, 22.5, 5)
  assert netlab_report.time_to_target_s(records, 0.5) == 10.0  # step 5's val loss 0.0
  assert netlab_report.time_to_target_s(records, -1.0) is None


def test_link_bytes_interpolate_between_samples():
  samples = [
    {"t": 0.0, "bytes": {"v0": [0, 0]}},
    {"t": 2.0, "bytes": {"v0": [2000, 400]}},
    {"t": 4.0, "bytes": {"v0": [2000, 800]}},
  ]
  assert link_counters.bytes_between(samples, "v0", 1.0, 3.0) == (1000.0, 400.0)
  with pytest.raises(ValueError, match="cover"):
    link_counters.bytes_between(samples, "v0", 1.0, 5.0)
  links = netlab_report.link_bytes_per_step(samples, ["v0"], (0.0, 4.0, 4))
  assert links == [{"up": 500.0, "down": 200.0}]


def test_summary_computes_payload_and_the_bounding_link():
  w = 4
  times = [float(t) for t in range(8)]
  samples = [
    {"t": t, "bytes": {f"v{i}": [1000 * (i + 1) * t, 10 * t] for i in range(w)}}
    for t in (-1.0, 100.0)
  ]
  runs = [
    netlab_report.RunResult(
      "demo", shaped, _records(times, val_at=(7,)), {"payload_bytes_per_step": 1000}
    )
    for shaped in (False, True)
  ]
  report = netlab_report.summarize(
    runs,
    samples=samples,
    ifaces=[f"v{i}" for i in range(w)],
    rates_mbit=[1.0, 1.0, 0.001, 1.0],
    skip=2,
    target_loss=None,
  )
  e = report["demo"]
  assert e["payload_bytes_per_step"] == 3000  # W-1 messages forwarded per all-gather
  ring = netlab_report.payload_traffic(
    "adamw", {"payload_bytes_per_step": 400, "bytes_sent_per_step": 600.0}, w
  )
  assert ring == {"message": 400, "payload": 600.0}  # 2 (W-1)/W of the gradient
  assert e["link_bytes_per_step"] == pytest.approx(2500.0)  # mean of 1000..4000 per second
  assert e["bounding_link"]["process"] == 2  # the 1 kbit/s link, not the busiest one
  assert e["target_val_loss"] == -3.0 and e["time_to_target_s_shaped"] == 7.0
