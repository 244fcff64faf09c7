"""The commands import together, and each defines its flags only when run."""

import dataclasses
import pathlib
import subprocess
import sys

import pytest

from experiments.run.config import TrainConfig

ROOT = pathlib.Path(__file__).parent.parent
COMMANDS = [
  "experiments.train",
  "experiments.compare",
  "experiments.frontier",
  "experiments.sweep",
  "experiments.netlab",
  "experiments.bench_update",
  "experiments.memory_report",
  "experiments.index_cost",
  "experiments.methods",
  "experiments.presets",
  "experiments.english_corpus",
  "experiments.fetch_corpus",
  "experiments.gpu_bench",
]
# A flag name only a command defines; seeing it after the imports means one did at import.
_PROBE = """
import importlib, sys
from absl import flags
for name in sys.argv[1:]:
  importlib.import_module(name)
print(sorted(set(flags.FLAGS) & set({NAMES})))
"""


def test_importing_every_command_defines_no_flag():
  ours = {f.name for f in dataclasses.fields(TrainConfig)} | {
    "methods",
    "grid",
    "num_processes",
    "horizons",
    "from_dir",
  }
  code = _PROBE.replace("{NAMES}", repr(sorted(ours)))
  out = subprocess.run(
    [sys.executable, "-c", code, *COMMANDS],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=180,
    check=False,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  # The probe itself can fail: a module that defines flags at import shows up here.
  assert out.stdout.strip() == "[]", out.stdout


# A flag each command must list in its help; bench_update's are its own to choose.
_HELP = {
  "experiments.train": "--optimizer",
  "experiments.compare": "--methods",
  "experiments.frontier": "--horizons",
  "experiments.sweep": "--grid",
  "experiments.netlab": "--processes",
  "experiments.bench_update": "--",
  "experiments.memory_report": "--fsdp",
  "experiments.index_cost": "--topks",
  "experiments.fetch_corpus": "--from_dir",
}


# Each case is a fresh process (a few seconds of imports): the quick loop runs
# train's, the whole suite every command's.
@pytest.mark.parametrize(
  ("command", "flag"),
  [
    pytest.param(c, f, marks=() if c == "experiments.train" else pytest.mark.slow)
    for c, f in _HELP.items()
  ],
)
def test_each_command_defines_its_flags_when_run(command, flag):
  out = subprocess.run(
    [sys.executable, "-m", command, "--helpshort"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=180,
    check=False,
  )
  # absl's help exits with status 1 after printing.
  assert out.returncode in (0, 1), out.stderr[-3000:]
  assert "Traceback" not in out.stderr + out.stdout
  assert flag in out.stdout + out.stderr
