"""Preemption notices and lost peers, without a run: the lines, the resume commands, the verdicts.

The runs themselves (SIGTERM and SIGSTOP sent to real training processes)
are in ``tests/test_interrupted_runs.py`` (slow).
"""

import json
import os
import signal

import pytest

from experiments.run import interruption, peers, preemption
from experiments.run.config import ConfigError, TrainConfig
from experiments.run.interruption import edit_argv, elastic_resume_edits
from experiments.run.launch import LaunchConfig, setup_devices

ARGV = [
  "--preset=tiny",
  "--workers",
  "8",
  "--num_processes=4",
  "--process_id=2",
  "--coordinator_address=10.0.0.1:12355",
  "--noresume",
  "--normalize=rms",
  "--noprogress",
]


def test_the_resume_command_is_the_typed_one_with_resume_once():
  assert edit_argv(ARGV, {}) == [
    "--preset=tiny", "--workers", "8", "--num_processes=4", "--process_id=2",
    "--coordinator_address=10.0.0.1:12355", "--normalize=rms", "--noprogress", "--resume",
  ]  # fmt: skip
  assert interruption.command_text(["--out_dir=a b", "--resume"]) == (
    "python -m experiments.train '--out_dir=a b' --resume"
  )


def test_an_elastic_resume_keeps_each_survivors_devices_and_renumbers_it():
  cfg = TrainConfig(workers=8, batch_size=24)
  # 4 processes of 2 devices; process 3 lost: 3 x 2 = 6 devices, 24 rows divide.
  edits = elastic_resume_edits(cfg, 4, [3], me=2, coordinator="10.0.0.1:12355")
  assert edits == {"workers": "6", "replicas": None, "num_processes": "3", "process_id": "2"}
  assert edit_argv(ARGV, edits)[-5:] == [
    "--noprogress",
    "--workers=6",
    "--num_processes=3",
    "--process_id=2",
    "--resume",
  ]
  # Process 0 lost: the survivors renumber, and the new coordinator's host is not known here.
  edits = elastic_resume_edits(cfg, 4, [0], me=2, coordinator="10.0.0.1:12355")
  assert (edits["process_id"], edits["coordinator_address"]) == ("1", "HOST_OF_PROCESS_1:12355")
  # One survivor runs alone: no process flags at all.
  edits = elastic_resume_edits(
    TrainConfig(workers=4, batch_size=8), 2, [1], me=0, coordinator="h:1"
  )
  assert edit_argv(["--num_processes=2", "--process_id=0", "--coordinator_address=h:1"], edits) == [
    "--workers=2",
    "--resume",
  ]
  # 32 rows do not divide over 6 devices: only a resume on all processes is offered.
  assert elastic_resume_edits(TrainConfig(workers=8, batch_size=32), 4, [3], 2, None) is None
  # Sites of 2 FSDP devices: the site count changes, not the device count per site.
  edits = elastic_resume_edits(TrainConfig(workers=8, fsdp=2, batch_size=24), 4, [1], 0, None)
  assert (edits["replicas"], edits["workers"]) == ("3", None)


def test_the_lost_peer_line_names_it_the_checkpoint_and_both_resumes():
  line = interruption.peer_lost_line([1], 2, 60.0, (200, "/r/checkpoints"), "ALL", "SURV")
  assert line == (
    "peer lost: process 1 of 2 sent no heartbeat for 60 s (hung, stopped or cut off); the last "
    "checkpoint is step 200 in /r/checkpoints; resume on the 1 surviving process with: SURV; "
    "or on all 2 once process 1 is back with: ALL"
  )
  line = interruption.peer_lost_line([0, 2], 4, 20.0, None, "ALL", None)
  assert "processes 0, 2 (the coordinator) of 4" in line and "from step 0" in line
  assert line.endswith("(the batch does not divide over the survivors) with: ALL")
  assert "before training began" in interruption.peer_lost_line([1], 2, 5, None, None, None)


def test_train_argv_is_the_typed_command_or_the_fields_that_differ():
  typed = ["/x/experiments/train.py", "--preset=tiny", "--noprogress"]
  assert interruption.train_argv(TrainConfig(), typed) == ["--preset=tiny", "--noprogress"]
  cfg = TrainConfig(steps=7, progress=False, out_dir="o")
  assert interruption.train_argv(cfg, ["ipykernel"]) == ["--steps=7", "--out_dir=o", "--noprogress"]


def test_a_single_process_hears_sigterm_only_while_the_notice_stands():
  before = signal.getsignal(signal.SIGTERM)
  with preemption.Notice() as notice:
    assert not notice.reached(1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert notice.reached(2) and notice.reached(3)
  assert signal.getsignal(signal.SIGTERM) is before


def test_the_preempted_error_says_the_step_and_the_resume_and_records_it(tmp_path):
  error = preemption.stop(TrainConfig(out_dir=str(tmp_path)), 282, ["--steps=400"])
  assert isinstance(error, interruption.PreemptedError) and error.exit_code == 75
  assert str(error) == (
    "preempted at step 282; resume with: python -m experiments.train --steps=400 --resume"
  )
  record = json.loads((tmp_path / "interruption.json").read_text())
  assert (record["reason"], record["step"], record["line"]) == ("preempted", 282, str(error))


class _Store:
  """The coordination service's key-value store, as the watchdog uses it."""

  def __init__(self):
    self.kv = {}
    self.down = False

  def key_value_set(self, key, value, allow_overwrite=False):
    if self.down:
      raise RuntimeError("DEADLINE_EXCEEDED")
    self.kv[key] = value

  def key_value_dir_get(self, prefix):
    if self.down:
      raise RuntimeError("DEADLINE_EXCEEDED")
    return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


class _Clock:
  def __init__(self):
    self.t = 1000.0

  def __call__(self):
    return self.t


def _watchdogs(n, timeout=60.0):
  store, clock, exits = _Store(), _Clock(), []
  dogs = [peers.Watchdog(store, i, n, timeout, clock=clock, exit=exits.append) for i in range(n)]
  return store, clock, exits, dogs


def test_a_peer_silent_past_the_timeout_is_lost_and_one_that_finished_is_not():
  store, clock, exits, dogs = _watchdogs(3)
  assert dogs[0].beat_s == 5.0
  for _ in range(10):  # 50 s of everyone beating
    clock.t += 5
    for d in dogs:
      d.beat()
  assert [d.lost() for d in dogs] == [[], [], []]
  dogs[2].finish()  # ended normally: marked done
  # Process 1 stops beating (SIGSTOP); process 0 saw its last counter at its next beat.
  clock.t += 5
  dogs[0].beat()
  last_seen = clock.t
  while clock.t < last_seen + 60:
    clock.t += 5
    dogs[0].beat()
  assert dogs[0].lost() == []  # silent for exactly the timeout: not yet
  clock.t += 1
  assert dogs[0].lost() == [1]


def test_the_first_verdict_settles_it_for_every_survivor_and_process_0_ends_last(capsys):
  store, clock, exits, dogs = _watchdogs(3)
  for d in dogs:
    d.beat()
  dogs[1].end([2])  # process 1 judged first: it posts, prints, exits
  assert exits == [76] and store.kv["distro_jax/lost/1"] == "2"
  dogs[0].beat()
  assert dogs[0].lost() == [2]  # adopted at once, long before its own timeout
  dogs[0].end(dogs[0].lost())  # process 1 already posted: process 0 need not wait
  assert exits == [76, 76]
  assert capsys.readouterr().err.count("peer lost: process 2 of 3") == 2


def test_a_stopped_coordinator_is_named_by_whoever_cannot_reach_it():
  store, clock, exits, dogs = _watchdogs(2, timeout=20.0)
  dogs[1].beat()
  store.down = True  # process 0, which hosts the store, stopped
  clock.t += 21
  with pytest.raises(RuntimeError):
    dogs[1].beat()
  assert dogs[1].lost() == [0]


def test_the_survivor_prints_one_line_records_it_and_exits_76(tmp_path, capsys):
  store, clock, exits, dogs = _watchdogs(2)
  cfg = TrainConfig(workers=4, batch_size=8, out_dir=str(tmp_path))
  (tmp_path / "checkpoints" / "50").mkdir(parents=True)
  (tmp_path / "checkpoints" / "100.orbax-checkpoint-tmp-1").mkdir()  # a save cut short
  argv = ["--workers=4", "--num_processes=2", "--process_id=0", "--coordinator_address=h:9"]
  dogs[0].run = peers._Run(cfg, argv, str(tmp_path / "checkpoints"))
  dogs[0].end([1])
  assert exits == [76]
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("peer lost: process 1 of 2")
  assert f"the last checkpoint is step 50 in {tmp_path / 'checkpoints'}" in err
  assert "with: python -m experiments.train --workers=2 --resume; or on all 2" in err
  record = json.loads((tmp_path / "interruption.json").read_text())
  assert (record["lost_processes"], record["checkpoint_step"], record["exit_code"]) == ([1], 50, 76)


def test_jax_heartbeat_stays_behind_the_watchdog():
  assert peers.jax_heartbeat_timeout_s(60) == 180
  assert peers.jax_heartbeat_timeout_s(10) == 100
  assert peers.jax_heartbeat_timeout_s(0) == 100


def test_a_peer_timeout_below_a_second_is_refused():
  with pytest.raises(ConfigError, match="--peer_timeout_s=0.5 must be 1 or more"):
    setup_devices(LaunchConfig(peer_timeout_s=0.5), 8)
