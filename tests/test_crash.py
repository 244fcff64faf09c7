"""SIGKILL in the middle of a 2-process run, then --resume: nothing lost, nothing different."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import portpicker
import pytest
from tiny_runs import read_metrics, run_tiny

# Whole runs: deselect with -m "not slow" while working.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).parent.parent
FLAGS = [
  "--preset=small",
  "--workers=4",
  "--batch_size=8",
  "--seq_len=64",
  "--steps=16",
  "--checkpoint_every=4",
  "--eval_every=1000",
  "--noprogress",
  "--num_processes=2",
]


def _launch(out_dir, *extra):
  port = portpicker.pick_unused_port()
  return [
    subprocess.Popen(
      [
        sys.executable,
        "-m",
        "experiments.train",
        *FLAGS,
        f"--out_dir={out_dir}",
        f"--coordinator_address=127.0.0.1:{port}",
        f"--process_id={i}",
        *extra,
      ],
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]


def _wait(procs, timeout=240):
  outs = [p.communicate(timeout=timeout)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)


def _losses(out_dir):
  return [(r.step, r.loss, r.val_loss) for r in read_metrics(out_dir)]


def test_sigkill_mid_training_then_resume_matches_an_uninterrupted_run(tmp_path):
  straight, crashed = tmp_path / "straight", tmp_path / "crashed"
  _wait(_launch(straight))

  procs = _launch(crashed)
  deadline = time.time() + 240
  ckpt = crashed / "checkpoints" / "4"
  while not (ckpt.is_dir() and any(p.poll() is None for p in procs)):
    assert time.time() < deadline and all(p.poll() is None for p in procs), "run ended early"
    time.sleep(0.02)
  for p in procs:
    os.kill(p.pid, signal.SIGKILL)
  for p in procs:
    p.wait(timeout=30)
    p.stdout.close()
  assert all(p.returncode == -signal.SIGKILL for p in procs)

  _wait(_launch(crashed, "--resume"))
  assert _losses(crashed) == _losses(straight)
  assert [r[0] for r in _losses(crashed)] == list(range(1, 17))
  digests = {(crashed / f"params_digest.process{i}").read_text() for i in range(2)}
  assert digests == {(straight / "params_digest.process0").read_text()}


def test_same_seed_gives_bit_identical_losses_and_another_seed_differs(tmp_path):
  a = run_tiny(tmp_path / "a", steps=5, eval_every=5)
  b = run_tiny(tmp_path / "b", steps=5, eval_every=5)
  c = run_tiny(tmp_path / "c", steps=5, eval_every=5, seed=1)
  assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
  assert a.params_digest == b.params_digest
  # The seed reaches both the init and the data order, so every loss moves.
  assert all(x[1] != y[1] for x, y in zip(_losses(tmp_path / "a"), _losses(tmp_path / "c")))
  assert a.params_digest != c.params_digest
