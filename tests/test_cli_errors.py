"""The real commands: one ``error:`` line and exit status 2, and one run per directory.

The refusals run as children forked from one process that imported the
commands (tests/command_runs.py), each as ``python -m`` runs it; the one
that needs another environment, and the two runs that share a directory,
are processes of their own. The file is marked slow.
"""

import fcntl
import os
import pathlib
import subprocess
import sys
import time

import command_runs
import forked_runs
import numpy as np
import pytest
from tiny_runs import read_metrics

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).parent.parent
SMALL = ["--preset=tiny", "--workers=2", "--batch_size=4", "--seq_len=16", "--noprogress"]


def _start(args, env=None):
  return subprocess.Popen(
    [sys.executable, "-m", *args],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env={**os.environ, **(env or {})},
  )


def _one_error(status, err):
  assert status == 2, err[-3000:]
  assert "Traceback" not in err, err[-3000:]
  lines = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(lines) == 1, err[-3000:]
  return lines[0]


def _error_line(proc, timeout=300):
  """The one ``error:`` line of ``proc``'s stderr (of its merged output, for a forked run)."""
  out, err = proc.communicate(timeout=timeout)
  return _one_error(proc.returncode, out if err is None else err)


def test_the_issues_examples_through_the_commands(tmp_path):
  npz = tmp_path / "tokens.npz"
  np.savez(npz, tokens=np.arange(1000))
  (tmp_path / "a_file").write_text("not a directory")
  out = f"--out_dir={tmp_path / 'run'}"
  cases = {
    "clip": ["experiments.train", *SMALL, out, "--clip_norm=-1"],
    "nan": ["experiments.train", *SMALL, out, "--learning_rate=nan"],
    "stop": ["experiments.train", *SMALL, out, "--steps=5", "--stop_at_step=9"],
    "diloco": ["experiments.train", *SMALL, out, "--optimizer=diloco", "--steps=10"],
    "topk": ["experiments.train", *SMALL, out, "--compression_topk=5000"],
    "npz": ["experiments.train", *SMALL, out, f"--data_path={npz}"],
    "file": ["experiments.train", *SMALL, f"--out_dir={tmp_path / 'a_file'}"],
    "grid": ["experiments.sweep", *SMALL, out, "--grid=learning_rate=1e-3,3e-3,3e-e"],
    "memory": ["experiments.memory_report", "--fsdp=1,two"],
    "index": ["experiments.index_cost", "--topks=8,0"],
    "draw": ["experiments.frontier", "--draw_only", f"--out_dir={tmp_path / 'none'}"],
  }
  # JAX reads JAX_PLATFORMS when it is imported: this one needs a process of its own.
  cuda = _start(["experiments.train", *SMALL, out], {"JAX_PLATFORMS": "cuda"})
  commands = sorted({argv[0] for argv in cases.values()})
  runs = command_runs.run_commands(commands, cases)["runs"]
  lines = {name: _one_error(status, err) for name, (status, _, err) in runs.items()}
  lines["cuda"] = _error_line(cuda)
  assert lines["clip"].startswith("error: --clip_norm=-1.0 must be a finite number in [0, inf)")
  assert "--learning_rate=nan must be a finite number" in lines["nan"]
  assert "--stop_at_step=9 is beyond --steps=5" in lines["stop"]
  assert "--steps=10 is shorter than --diloco_sync_every=50" in lines["diloco"]
  assert "--compression_topk=5000 is above the largest chunk" in lines["topk"]
  assert "'.npz', which is not a supported format; supported: text" in lines["npz"]
  assert "is a file, not a directory" in lines["file"]
  assert "JAX_PLATFORMS=cuda asks for a platform this machine does not have" in lines["cuda"]
  assert "learning_rate='3e-e' is not a number" in lines["grid"]
  assert "--fsdp=1,two must be comma-separated integers" in lines["memory"]
  assert "--topks=8,0 needs top-ks of 1 or more" in lines["index"]
  assert "--draw_only: no finished run under --out_dir=" in lines["draw"]
  assert not (tmp_path / "run").exists()  # refused before anything was written


def _held(lock_path):
  """Whether another process holds the flock on ``lock_path``."""
  try:
    fd = os.open(lock_path, os.O_RDWR)
  except FileNotFoundError:
    return False
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    return True
  finally:
    os.close(fd)
  return False


def test_a_second_run_on_the_same_directory_fails_at_once_and_the_first_finishes(tmp_path):
  # Both forked from tests/forked_runs.py's server (output merged): real
  # processes, without their imports.
  argv = ["experiments.train", *SMALL, f"--out_dir={tmp_path}", "--steps=40", "--eval_every=20"]
  first = forked_runs.start(argv)
  deadline = time.time() + 240
  while not _held(tmp_path / "run.lock"):
    assert first.poll() is None and time.time() < deadline, first.communicate()[0][-3000:]
    time.sleep(0.05)
  t0 = time.time()
  line = _error_line(forked_runs.start(argv))
  assert f"--out_dir={tmp_path} is in use by another run (pid {first.pid} on " in line
  second_seconds = time.time() - t0
  out, _ = first.communicate(timeout=300)
  assert first.returncode == 0, out[-3000:]
  assert [r.step for r in read_metrics(tmp_path)] == list(range(1, 41))
  # At once: before compiling anything (the first run takes far longer to compile).
  assert second_seconds < 60
