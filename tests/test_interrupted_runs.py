"""SIGTERM, SIGSTOP and SIGKILL sent to real training processes (slow: whole runs).

A preempted run saves the step it reached and exits 75; its resume ends
bit-identical to a run never stopped, as does the resume of a job killed
outright (from its last periodic checkpoint). A peer that stops answering is named by
the survivors, which exit 76 without JAX's abort; the elastic resume their
lines offer continues the run on fewer processes.

Each process is forked from tests/forked_runs.py's server, which imported the
trainer once: a real process, which the signals reach, without its 2
CPU-seconds of imports.
"""

import math
import os
import re
import shlex
import signal
import time

import forked_runs
import portpicker
import pytest
from tiny_runs import read_metrics

from experiments.run.records import read_events

pytestmark = pytest.mark.slow

# Room after the step at which a test sends SIGTERM: the processes agree on a
# later step to stop at, and on an idle machine a run of 14 steps once ended
# (at step 14) before the preemption took effect.
STEPS = 40
# Two resumed processes agree through JAX's coordination service, which on a
# loaded machine (the suite beside them) took longer than their last 35 or so
# steps: twice of 5 runs of this file they finished (exit 0) before the
# agreed stop. Three times the room.
TWO_PROCESS_STEPS = 120
# No checkpoint is ever due unless a test asks. --scan_layers: each process
# compiles one block, not two, about a fifth less CPU per process start.
FLAGS = [
  "--preset=tiny",
  "--scan_layers",
  "--batch_size=4",
  "--seq_len=32",
  "--eval_every=7",
  "--eval_batches=1",
  "--noprogress",
]


def _start(out_dir, *extra, processes=1, port=None, steps=STEPS):
  launch = []
  if processes > 1:
    launch = [f"--num_processes={processes}", f"--coordinator_address=127.0.0.1:{port}"]
  return [
    forked_runs.start(
      [
        "experiments.train",
        *FLAGS,
        f"--out_dir={out_dir}",
        f"--workers={2 * processes}",
        f"--steps={steps}",
        *launch,
        *([f"--process_id={i}"] if launch else []),
        *extra,
      ]
    )
    for i in range(processes)
  ]


def _finish(procs, timeout=300):
  outs = [p.communicate(timeout=timeout)[0] for p in procs]
  return [p.returncode for p in procs], outs


def _when_logged(out_dir, step, procs, timeout=240):
  """Waits until process 0 of ``procs`` has logged ``step`` (not a run before them)."""
  started = time.time()
  deadline = time.monotonic() + timeout

  def logged():
    if not os.path.exists(out_dir / "metrics.jsonl"):
      return False
    return any(r.step >= step and r.wall_time > started for r in read_metrics(out_dir))

  while not logged():
    assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "ended early"
    time.sleep(0.05)


def _losses(out_dir):
  return [(r.step, r.loss, r.val_loss) for r in read_metrics(out_dir)]


def _module_argv(command):
  """The module and flags of a ``python -m experiments.train ...`` command a line offers."""
  argv = shlex.split(command)
  assert argv[:3] == ["python", "-m", "experiments.train"], command
  return argv[2:]


def _resume_command(line):
  """The module and flags of the command a ``preempted at step N; resume with: ...`` line gives."""
  return _module_argv(line.split("resume with: ", 1)[1])


def _straight(out_dir, *extra, processes=1, steps=STEPS):
  """``out_dir`` of a run of FLAGS (and ``extra``) never stopped."""
  port = portpicker.pick_unused_port()
  codes, outs = _finish(_start(out_dir, *extra, processes=processes, port=port, steps=steps))
  assert codes == [0] * processes, outs
  return out_dir


def _assert_same_as(out_dir, straight_dir, processes):
  """Every loss and each process's params digest as in the run never stopped."""
  assert _losses(out_dir) == _losses(straight_dir)
  for i in range(processes):
    digest = (out_dir / f"params_digest.process{i}").read_text()
    assert digest == (straight_dir / "params_digest.process0").read_text()


def _preempt(out_dir, procs, after_step, steps=STEPS):
  """SIGTERMs one process once ``after_step`` is logged: each exits 75 at the same step, saved.

  Returns:
    The step, and each process's last line (the command that resumes it).
  """
  _when_logged(out_dir, after_step, procs)
  signaled = time.monotonic()
  procs[-1].send_signal(signal.SIGTERM)  # one process hears it; all stop at the same step
  codes, outs = _finish(procs)
  took = time.monotonic() - signaled
  assert codes == [75] * len(procs), outs
  assert took < 60, took
  lines = [re.findall(r"^preempted at step (\d+); resume with: .*$", o, re.M) for o in outs]
  (step,) = {int(found[0]) for found in lines}
  assert all(len(found) == 1 for found in lines)
  assert after_step <= step < steps
  assert (out_dir / "checkpoints" / str(step)).is_dir()
  assert [r.step for r in read_metrics(out_dir)] == list(range(1, step + 1))
  last_lines = [o.strip().splitlines()[-1] for o in outs]
  assert all(line.startswith("preempted at step") for line in last_lines), last_lines
  return step, last_lines


def _resume_as_told(last_lines):
  resumed = [forked_runs.start(_resume_command(line)) for line in last_lines]
  codes, outs = _finish(resumed)
  assert codes == [0] * len(resumed), outs


def test_sigterm_saves_the_step_reached_and_the_resume_is_bit_identical(tmp_path):
  # AdamW, whose step compiles fastest: DeMo's state across a preemption is
  # the two-process test's below; here, the handler of a run on its own.
  adamw = "--optimizer=adamw"
  stopped = tmp_path / "stopped"
  procs = _start(stopped, adamw)
  step, last_lines = _preempt(stopped, procs, 4)
  # No checkpoint was due: the preemption's is the only one.
  assert os.listdir(stopped / "checkpoints") == [str(step)]
  _resume_as_told(last_lines)
  _assert_same_as(stopped, _straight(tmp_path / "straight", adamw), 1)


def test_two_processes_killed_then_preempted_resume_bit_identical(tmp_path):
  # A crash of the whole job: no handler runs, and the resume starts from the
  # last complete periodic checkpoint (and takes over the dead run's lock).
  run, steps = tmp_path / "run", TWO_PROCESS_STEPS
  port = portpicker.pick_unused_port()
  procs = _start(run, "--checkpoint_every=2", processes=2, port=port, steps=steps)
  deadline = time.monotonic() + 240
  while not (run / "checkpoints" / "2").is_dir():
    assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "ended early"
    time.sleep(0.02)
  # The coordinator (process 0) last: a process that saw it go first would
  # abort (SIGABRT) before its own SIGKILL came.
  for p in reversed(procs):
    os.kill(p.pid, signal.SIGKILL)
  codes, _ = _finish(procs, timeout=30)
  assert codes == [-signal.SIGKILL] * 2
  assert read_metrics(run)[-1].step < steps
  saved = max(int(d) for d in os.listdir(run / "checkpoints") if d.isdigit())

  # The resumed job, with no periodic checkpoint, is preempted: one process
  # hears SIGTERM, both save the step they reached and exit 75; their resume
  # ends bit-identical to the job never stopped.
  port = portpicker.pick_unused_port()
  procs = _start(run, "--resume", "--checkpoint_every=0", processes=2, port=port, steps=steps)
  step, last_lines = _preempt(run, procs, saved + 1, steps)
  assert step > saved
  _resume_as_told(last_lines)
  assert [r.step for r in read_metrics(run)] == list(range(1, steps + 1))
  _assert_same_as(run, _straight(tmp_path / "straight", processes=2, steps=steps), 2)


def _lost_peer_line(proc, out, who):
  """The survivor's last line: it exited 76 and named ``who`` (e.g. "process 1 of 2")."""
  assert proc.returncode == 76, out[-3000:]
  assert "Fatal Python error" not in out and "Check failure stack trace" not in out
  line = out.strip().splitlines()[-1]
  assert line.startswith(f"peer lost: {who} sent no heartbeat for 10 s"), line
  return line


def _checkpoint_named(line):
  return int(re.search(r"the last checkpoint is step (\d+)", line).group(1))


def test_a_killed_peer_is_named_and_the_survivor_exits_76(tmp_path):
  # AdamW, whose step compiles fastest: what is tested is how the processes
  # stop, whatever they compute.
  port = portpicker.pick_unused_port()
  extra = ["--optimizer=adamw", "--steps=200", "--checkpoint_every=3", "--peer_timeout_s=10"]
  procs = _start(tmp_path, *extra, processes=2, port=port)
  try:
    _when_logged(tmp_path, 4, procs)
    procs[1].send_signal(signal.SIGKILL)
    lost_at = time.monotonic()
    out = procs[0].communicate(timeout=120)[0]
    took = time.monotonic() - lost_at
  finally:
    procs[1].kill()
    procs[1].communicate()
  line = _lost_peer_line(procs[0], out, "process 1 of 2")
  assert took < 30, took  # --peer_timeout_s=10, beats every 0.83 s, judged every 1 s
  assert _checkpoint_named(line) >= 3


def test_a_stopped_peer_is_named_and_the_survivors_continue_without_it(tmp_path):
  # Three DeMo processes of 2 workers each; process 2 stops (hung, or its
  # machine frozen). Both survivors name it and exit 76, and each one's line
  # holds its part of the elastic resume on the 2 of them: 4 workers of the
  # 6, their own momentum kept, the replicas identical.
  port = portpicker.pick_unused_port()
  extra = ["--batch_size=12", "--steps=200", "--checkpoint_every=3", "--peer_timeout_s=10"]
  procs = _start(tmp_path, *extra, "--check_replicas", processes=3, port=port)
  try:
    _when_logged(tmp_path, 4, procs)
    procs[2].send_signal(signal.SIGSTOP)
    lost_at = time.monotonic()
    outs = [p.communicate(timeout=120)[0] for p in procs[:2]]
    took = time.monotonic() - lost_at
  finally:
    procs[2].kill()
    procs[2].communicate()
  lines = [_lost_peer_line(p, out, "process 2 of 3") for p, out in zip(procs, outs)]
  assert took < 30, took
  (step,) = {_checkpoint_named(line) for line in lines}
  assert step >= 3
  resumed = []
  for i, line in enumerate(lines):
    command = line.split("resume on the 2 surviving processes with: ", 1)[1].split("; or on all")[0]
    argv = _module_argv(command)
    assert {"--workers=4", "--num_processes=2", f"--process_id={i}", "--resume"} <= set(argv)
    resumed.append(forked_runs.start([*argv, f"--stop_at_step={step + 2}"]))
  codes, outs = _finish(resumed)
  assert codes == [0, 0], outs
  logged = read_metrics(tmp_path)
  assert [r.step for r in logged] == list(range(1, step + 3))
  assert all(math.isfinite(r.loss) for r in logged)
  (event,) = read_events(tmp_path)
  assert (event.step, event.processes_before, event.processes_after) == (step, 3, 2)
  assert (event.workers_before, event.workers_after, event.left) == (6, 4, [4, 5])
  digests = {(tmp_path / f"params_digest.process{i}").read_text() for i in range(2)}
  assert len(digests) == 1
