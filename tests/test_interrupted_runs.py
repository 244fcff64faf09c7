"""SIGTERM, SIGSTOP and SIGKILL sent to real training processes (slow: whole runs).

A preempted run saves the step it reached and exits 75; its resume ends
bit-identical to a run never stopped, as does the resume of a job killed
outright (from its last periodic checkpoint). A peer that stops answering is named by
the survivor, which exits 76 without JAX's abort.
"""

import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

import portpicker
import pytest
from tiny_runs import read_metrics

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).parent.parent
# No checkpoint is ever due: the preemption's is the only one.
FLAGS = [
  "--preset=tiny",
  "--batch_size=4",
  "--seq_len=32",
  "--steps=14",
  "--eval_every=7",
  "--eval_batches=1",
  "--noprogress",
]


def _start(out_dir, *extra, processes=1, port=None):
  launch = []
  if processes > 1:
    launch = [f"--num_processes={processes}", f"--coordinator_address=127.0.0.1:{port}"]
  return [
    subprocess.Popen(
      [
        sys.executable,
        "-m",
        "experiments.train",
        *FLAGS,
        f"--out_dir={out_dir}",
        f"--workers={2 * processes}",
        *launch,
        *([f"--process_id={i}"] if launch else []),
        *extra,
      ],  # fmt: skip
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(processes)
  ]


def _finish(procs, timeout=300):
  outs = [p.communicate(timeout=timeout)[0] for p in procs]
  return [p.returncode for p in procs], outs


def _when_logged(out_dir, step, procs, timeout=240):
  """Waits until process 0 has logged ``step``."""
  deadline = time.monotonic() + timeout
  while not (os.path.exists(out_dir / "metrics.jsonl") and len(read_metrics(out_dir)) >= step):
    assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "ended early"
    time.sleep(0.05)


def _losses(out_dir):
  return [(r.step, r.loss, r.val_loss) for r in read_metrics(out_dir)]


def _resume_command(line):
  """The command a ``preempted at step N; resume with: ...`` line gives, runnable here."""
  argv = shlex.split(line.split("resume with: ", 1)[1])
  assert argv[:3] == ["python", "-m", "experiments.train"]
  return [sys.executable, *argv[1:]]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """``straight(processes)``: the directory of a run of FLAGS never stopped (run once each)."""
  runs = {}

  def get(processes):
    if processes not in runs:
      out_dir = tmp_path_factory.mktemp(f"straight{processes}")
      port = portpicker.pick_unused_port()
      codes, outs = _finish(_start(out_dir, processes=processes, port=port))
      assert codes == [0] * processes, outs
      runs[processes] = out_dir
    return runs[processes]

  return get


def _assert_same_as(out_dir, straight_dir, processes):
  """Every loss and each process's params digest as in the run never stopped."""
  assert _losses(out_dir) == _losses(straight_dir)
  for i in range(processes):
    digest = (out_dir / f"params_digest.process{i}").read_text()
    assert digest == (straight_dir / "params_digest.process0").read_text()


@pytest.mark.parametrize(
  "processes",
  [
    pytest.param(1, id="one-process"),
    # Compared with the same straight run as the SIGKILL check below.
    pytest.param(2, id="two-processes", marks=pytest.mark.xdist_group("straight2")),
  ],
)
def test_sigterm_saves_the_step_reached_and_the_resume_is_bit_identical(
  tmp_path, processes, straight
):
  stopped = tmp_path / "stopped"
  procs = _start(stopped, processes=processes, port=portpicker.pick_unused_port())
  _when_logged(stopped, 4, procs)
  signaled = time.monotonic()
  procs[-1].send_signal(signal.SIGTERM)  # one process hears it; all stop at the same step
  codes, outs = _finish(procs)
  took = time.monotonic() - signaled
  assert codes == [75] * processes, outs
  assert took < 60, took
  lines = [re.findall(r"^preempted at step (\d+); resume with: .*$", o, re.M) for o in outs]
  (step,) = {int(found[0]) for found in lines}
  assert all(len(found) == 1 for found in lines)
  assert 4 <= step < 14
  assert sorted(os.listdir(stopped / "checkpoints")) == [str(step)]
  assert [r.step for r in read_metrics(stopped)] == list(range(1, step + 1))

  last_lines = [o.strip().splitlines()[-1] for o in outs]
  assert all(line.startswith("preempted at step") for line in last_lines), last_lines
  resumed = [
    subprocess.Popen(
      _resume_command(line), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    for line in last_lines
  ]
  codes, outs = _finish(resumed)
  assert codes == [0] * processes, outs
  _assert_same_as(stopped, straight(processes), processes)


@pytest.mark.xdist_group("straight2")
def test_sigkill_of_every_process_mid_run_then_resume_is_bit_identical(tmp_path, straight):
  # A crash of the whole job: no handler runs, and the resume starts from the
  # last complete periodic checkpoint (and takes over the dead run's lock).
  crashed = tmp_path / "crashed"
  procs = _start(crashed, "--checkpoint_every=2", processes=2, port=portpicker.pick_unused_port())
  deadline = time.monotonic() + 240
  while not (crashed / "checkpoints" / "2").is_dir():
    assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "ended early"
    time.sleep(0.02)
  for p in procs:
    os.kill(p.pid, signal.SIGKILL)
  codes, _ = _finish(procs, timeout=30)
  assert codes == [-signal.SIGKILL] * 2
  assert read_metrics(crashed)[-1].step < 14

  port = portpicker.pick_unused_port()
  codes, outs = _finish(_start(crashed, "--resume", processes=2, port=port))
  assert codes == [0, 0], outs
  assert [r.step for r in read_metrics(crashed)] == list(range(1, 15))
  _assert_same_as(crashed, straight(2), 2)


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_lost_peer_is_named_and_the_survivor_exits_76_and_can_resume_alone(tmp_path, sig):
  port = portpicker.pick_unused_port()
  procs = _start(
    tmp_path, "--steps=200", "--checkpoint_every=3", "--peer_timeout_s=10", processes=2, port=port
  )
  try:
    _when_logged(tmp_path, 4, procs)
    procs[1].send_signal(sig)
    lost_at = time.monotonic()
    out = procs[0].communicate(timeout=120)[0]
    took = time.monotonic() - lost_at
  finally:
    procs[1].kill()
    procs[1].communicate()
  assert procs[0].returncode == 76, out[-3000:]
  assert took < 30, took  # --peer_timeout_s=10, beats every 0.83 s, judged every 1 s
  assert "Fatal Python error" not in out and "Check failure stack trace" not in out
  line = out.strip().splitlines()[-1]
  assert line.startswith("peer lost: process 1 of 2 sent no heartbeat for 10 s"), line
  step = int(re.search(r"the last checkpoint is step (\d+)", line).group(1))
  assert step >= 3
  if sig == signal.SIGKILL:
    return  # the same line as for a stopped peer: resumed once, below
  # The survivor alone, on its own 2 devices: the elastic resume the line offers.
  survivors = line.split("resume on the 1 surviving process with: ", 1)[1].split("; or on all")[0]
  argv = shlex.split(survivors)
  assert "--workers=2" in argv and not any(a.startswith("--process_id") for a in argv)
  argv = [sys.executable, *argv[1:], "--stop_at_step=" + str(step + 2)]
  done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert read_metrics(tmp_path)[-1].step == step + 2
