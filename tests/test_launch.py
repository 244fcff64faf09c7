"""Multi-host launch: process flags from a cluster scheduler's environment, flags winning.

Two processes started as srun starts them train in
``test_train.py::test_two_processes_with_gloo_end_identical_and_learn``.
"""

import pytest

from experiments.run import launch as launch_lib
from experiments.run.config import ConfigError
from experiments.run.launch import LaunchConfig, resolve_launch

SLURM = {
  "SLURM_JOB_ID": "4242",
  "SLURM_STEP_NODELIST": "gpu[001-004]",
  "SLURM_NTASKS": "4",
  "SLURM_PROCID": "2",
  "SLURM_LOCALID": "0",
}
OMPI = {
  "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1:34911",
  "OMPI_COMM_WORLD_SIZE": "8",
  "OMPI_COMM_WORLD_RANK": "5",
}


def test_no_flags_under_slurm_or_open_mpi_take_the_schedulers_count_and_rank():
  launch, found = resolve_launch(LaunchConfig(), SLURM)
  assert (launch.num_processes, launch.process_id, found) == (4, 2, "slurm")
  assert launch.coordinator_address is None  # jax.distributed derives it from SLURM's node list
  launch, found = resolve_launch(LaunchConfig(), OMPI)
  assert (launch.num_processes, launch.process_id, found) == (8, 5, "ompi")


def test_flags_win_over_the_environment():
  given = LaunchConfig(num_processes=2, process_id=1, coordinator_address="h:1")
  launch, found = resolve_launch(given, SLURM)
  assert (launch.num_processes, launch.process_id, launch.coordinator_address) == (2, 1, "h:1")
  assert found == "slurm"


def test_alone_without_a_scheduler_a_single_task_step_or_cluster_none():
  assert resolve_launch(LaunchConfig(), {}) == (LaunchConfig(num_processes=1, process_id=0), None)
  one_task = {**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}
  assert resolve_launch(LaunchConfig(), one_task)[1] is None
  launch, found = resolve_launch(LaunchConfig(cluster="none"), SLURM)
  assert (launch.num_processes, found) == (1, None)
  # A job allocation without a step (salloc's shell) lacks the step's variables.
  partial = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}
  assert resolve_launch(LaunchConfig(), partial)[1] is None


def test_naming_a_scheduler_that_is_absent_is_one_clear_error():
  with pytest.raises(ConfigError, match="SLURM_JOB_ID"):
    resolve_launch(LaunchConfig(cluster="slurm"), {})
  with pytest.raises(ConfigError, match="use auto, none"):
    resolve_launch(LaunchConfig(cluster="pbs"), {})


def test_setup_devices_initializes_jax_distributed_from_the_environment(monkeypatch):
  calls, settings = [], {}
  monkeypatch.setattr(launch_lib.jax.distributed, "initialize", lambda **kw: calls.append(kw))
  monkeypatch.setattr(launch_lib.jax.config, "update", lambda k, v: settings.update({k: v}))
  for k, v in SLURM.items():
    monkeypatch.setenv(k, v)
  launch_lib.setup_devices(LaunchConfig(), devices=8)
  assert calls == [
    {
      "coordinator_address": None,
      "num_processes": 4,
      "process_id": 2,
      "cluster_detection_method": "slurm",
      # JAX's own heartbeat stays behind the peer watchdog's 60 s (experiments.run.peers).
      "heartbeat_timeout_seconds": 180,
    }
  ]
  assert settings["jax_num_cpu_devices"] == 2
  with pytest.raises(ConfigError, match="do not divide"):
    launch_lib.setup_devices(LaunchConfig(), devices=6)
