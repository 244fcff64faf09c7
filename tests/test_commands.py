"""The commands import together, and each defines its flags only when run."""

import dataclasses
import json
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
# One process imports every command, says which flags the imports defined
# (a name only a command defines, seen then, means one did at import), and
# then runs each command with --helpshort in a child forked from it: a command
# run as from a fresh process, without a few seconds of imports each.
_PROBE = """
import importlib, json, os, runpy, sys, tempfile
from absl import flags
names, ours, helped = json.loads(sys.argv[1])
for name in names:
  importlib.import_module(name)
defined = sorted(set(flags.FLAGS) & set(ours))
runs = {}
for name in helped:
  with tempfile.TemporaryFile() as out:
    pid = os.fork()
    if pid == 0:
      os.dup2(out.fileno(), 1)
      os.dup2(out.fileno(), 2)
      code = 0
      try:
        sys.argv = [name, "--helpshort"]
        sys.modules.pop(name, None)  # as python -m finds it: not imported under its name
        runpy.run_module(name, run_name="__main__", alter_sys=True)
      except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
      except BaseException:
        import traceback
        traceback.print_exc()
        code = 3
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)
    _, status = os.waitpid(pid, 0)
    out.seek(0)
    runs[name] = [os.waitstatus_to_exitcode(status), out.read().decode(errors="replace")]
print(json.dumps({"defined": defined, "runs": runs}))
"""

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


@pytest.fixture(scope="module")
def probe():
  """What :data:`_PROBE` found: ``{"defined": [...], "runs": {command: [status, output]}}``."""
  ours = {f.name for f in dataclasses.fields(TrainConfig)} | {
    "methods",
    "grid",
    "num_processes",
    "horizons",
    "from_dir",
  }
  out = subprocess.run(
    [sys.executable, "-c", _PROBE, json.dumps([COMMANDS, sorted(ours), list(_HELP)])],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=180,
    check=False,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_every_command_defines_no_flag(probe):
  # The probe itself can fail: a module that defines flags at import shows up here.
  assert probe["defined"] == []


@pytest.mark.parametrize(("command", "flag"), list(_HELP.items()))
def test_each_command_defines_its_flags_when_run(probe, command, flag):
  status, output = probe["runs"][command]
  # absl's help exits with status 1 after printing.
  assert status in (0, 1), output[-3000:]
  assert "Traceback" not in output
  assert flag in output
