"""The commands import together, and each defines its flags only when run."""

import dataclasses

import command_runs
import pytest

from experiments.run.config import TrainConfig

COMMANDS = [
  "experiments.train",
  "experiments.compare",
  "experiments.frontier",
  "experiments.sweep",
  "experiments.netlab",
  "experiments.netlab.floor",
  "experiments.netlab.hops",
  "experiments.bench_update",
  "experiments.memory_report",
  "experiments.index_cost",
  "experiments.methods",
  "experiments.presets",
  "experiments.english_corpus",
  "experiments.fetch_corpus",
  "experiments.gpu_bench",
  "experiments.ladder",
  "experiments.time_to_loss",
]
# A flag each command must list in its help; bench_update's are its own to choose.
_HELP = {
  "experiments.train": "--optimizer",
  "experiments.compare": "--methods",
  "experiments.frontier": "--horizons",
  "experiments.sweep": "--grid",
  "experiments.netlab": "--processes",
  "experiments.netlab.floor": "--rate_mbit",
  "experiments.netlab.hops": "--message_bytes",
  "experiments.bench_update": "--",
  "experiments.memory_report": "--fsdp",
  "experiments.index_cost": "--topks",
  "experiments.fetch_corpus": "--from_dir",
  "experiments.ladder": "--rungs",
  "experiments.time_to_loss": "--cache",
}


@pytest.fixture(scope="module")
def probe():
  """One process imports every command, then runs each one's --helpshort in a forked child."""
  return command_runs.run_commands(COMMANDS, {c: [c, "--helpshort"] for c in _HELP}, timeout=180)


def test_importing_every_command_defines_no_flag(probe):
  # A flag name only a command defines; seeing it after the imports means one did at import.
  ours = {f.name for f in dataclasses.fields(TrainConfig)} | {
    "methods",
    "grid",
    "num_processes",
    "horizons",
    "from_dir",
  }
  assert sorted(ours & set(probe["flags"])) == []


@pytest.mark.parametrize(("command", "flag"), list(_HELP.items()))
def test_each_command_defines_its_flags_when_run(probe, command, flag):
  status, out, err = probe["runs"][command]
  # absl's help exits with status 1 after printing.
  assert status in (0, 1), err[-3000:]
  assert "Traceback" not in out + err
  assert flag in out + err
