"""The scheduler scripts: what SLURM and a Kubernetes JobSet do with each exit status.

No cluster runs here. The SLURM batch script runs under bash against fake
``srun`` and ``scontrol`` commands; the JobSet manifest is checked against
the API fields it relies on and against what its failure policy does.
"""

import copy
import json
import os
import pathlib
import subprocess

import pytest

from experiments.cluster import jobset_check
from experiments.run.interruption import PEER_LOST, PREEMPTED

ROOT = pathlib.Path(__file__).parent.parent
SBATCH = ROOT / "experiments" / "cluster" / "slurm_requeue.sbatch"
MANIFEST = jobset_check.load(str(ROOT / "experiments" / "cluster" / "jobset.yaml"))


def test_the_jobset_manifest_has_only_fields_the_api_knows():
  assert jobset_check.problems(MANIFEST) == []


def test_the_jobset_restarts_on_preemption_and_lost_peers_and_stops_on_user_errors():
  assert jobset_check.action_on(MANIFEST, PREEMPTED) == "RestartJobSetAndIgnoreMaxRestarts"
  assert jobset_check.action_on(MANIFEST, None) == "RestartJobSetAndIgnoreMaxRestarts"  # evicted
  assert jobset_check.action_on(MANIFEST, PEER_LOST) == "RestartJobSet"  # counted
  assert jobset_check.action_on(MANIFEST, 2) == "FailJobSet"
  assert jobset_check.action_on(MANIFEST, 1) == "RestartJobSet"  # a crash: counted
  command = MANIFEST["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
  assert "--resume" in command["containers"][0]["args"][0]


@pytest.mark.parametrize(
  ("edit", "problem"),
  [
    (lambda m: m["spec"]["failurePolicy"].update(maxRestart=3), "not a field of failurePolicy"),
    (
      lambda m: m["spec"]["failurePolicy"]["rules"][0].update(action="Restart"),
      ".action: 'Restart'",
    ),
    (lambda m: m["spec"]["failurePolicy"]["rules"][1].update(name="peer lost"), "does not match"),
    (
      lambda m: m["spec"]["failurePolicy"]["rules"][2].update(onJobFailureReasons=["Failed"]),
      "unknown reason 'Failed'",
    ),
    (lambda m: _job_spec(m)["podFailurePolicy"]["rules"][0].pop("onExitCodes"), "exactly one"),
    (lambda m: _job_spec(m)["template"]["spec"].update(restartPolicy="OnFailure"), "needs Never"),
    (
      lambda m: _job_spec(m)["podFailurePolicy"]["rules"][2]["onExitCodes"].update(
        containerName="trainer"
      ),
      "no container 'trainer'",
    ),
  ],
)
def test_a_broken_manifest_is_named_where_it_breaks(edit, problem):
  manifest = copy.deepcopy(MANIFEST)
  edit(manifest)
  assert any(problem in p for p in jobset_check.problems(manifest)), jobset_check.problems(manifest)


def test_rules_out_of_order_change_what_happens():
  # The message patterns name the Job's rule indices: swapping two rules is caught.
  manifest = copy.deepcopy(MANIFEST)
  rules = _job_spec(manifest)["podFailurePolicy"]["rules"]
  rules[0], rules[2] = rules[2], rules[0]
  assert jobset_check.action_on(manifest, PREEMPTED) != "RestartJobSetAndIgnoreMaxRestarts"


def _job_spec(manifest):
  return manifest["spec"]["replicatedJobs"][0]["template"]["spec"]


FAKE_SRUN = """#!/bin/bash
echo "$@" > "$FAKE/srun.args"
if [ -n "${RECORD:-}" ]; then echo "$RECORD" > "$OUT/interruption.json"; fi
exit "$SRUN_STATUS"
"""
FAKE_SCONTROL = """#!/bin/bash
echo "$@" >> "$FAKE/scontrol.log"
if [ "$1 $2" = "show hostnames" ]; then printf 'gpu001\\ngpu002\\ngpu003\\n'; fi
"""


def _sbatch(tmp_path, status, record=None, restarts=0, lost_nodes=None, checkpoint=False):
  fake, out = tmp_path / "bin", tmp_path / "run"
  fake.mkdir(exist_ok=True)
  out.mkdir(exist_ok=True)
  for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
    (fake / name).write_text(text)
    (fake / name).chmod(0o755)
  if checkpoint:
    (out / "checkpoints" / "500").mkdir(parents=True, exist_ok=True)
  if lost_nodes:
    (out / "lost_nodes").write_text("\n".join(lost_nodes) + "\n")
  env = {
    **os.environ,
    "PATH": f"{fake}:{os.environ['PATH']}",
    "FAKE": str(fake),
    "OUT": str(out),
    "SRUN_STATUS": str(status),
    "RECORD": json.dumps(record) if record else "",
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[001-003]",
    "SLURM_NTASKS_PER_NODE": "8(x3)",
    "SLURM_RESTART_COUNT": str(restarts),
  }
  done = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
  log = (fake / "scontrol.log").read_text() if (fake / "scontrol.log").exists() else ""
  args = (fake / "srun.args").read_text() if (fake / "srun.args").exists() else ""
  return done, log, args, out


def test_sbatch_requeues_a_preempted_run_which_resumes(tmp_path):
  done, log, args, _ = _sbatch(tmp_path, 75, checkpoint=True)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "requeue 4242" in log
  assert "--resume" in args and "--workers=24" in args and "--nodes=3" in args


def test_sbatch_reads_the_trainers_record_and_leaves_out_the_lost_node(tmp_path):
  # srun reports 137 (it had to kill the hung task); the record says a peer was lost.
  record = {"exit_code": 76, "lost_processes": [9]}
  done, log, _, out = _sbatch(tmp_path, 137, record=record, checkpoint=True)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "requeue 4242" in log
  assert (out / "lost_nodes").read_text() == "gpu002\n"  # process 9 of 8 per node
  # The requeued job runs its step on the two other nodes: 16 workers.
  (out / "interruption.json").unlink()
  done, _, args, _ = _sbatch(tmp_path, 0, checkpoint=True)
  assert done.returncode == 0 and "--nodelist=gpu001,gpu003" in args and "--workers=16" in args


@pytest.mark.parametrize(("status", "restarts"), [(2, 0), (1, 0), (75, 20)])
def test_sbatch_gives_up_on_errors_and_after_max_restarts(tmp_path, status, restarts):
  done, log, _, _ = _sbatch(tmp_path, status, restarts=restarts)
  assert done.returncode == status and "requeue" not in log


def test_sbatch_starts_afresh_without_a_checkpoint(tmp_path):
  done, _, args, _ = _sbatch(tmp_path, 0)
  assert done.returncode == 0 and "--resume" not in args
