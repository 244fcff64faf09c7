"""Running the trainer under a scheduler that restarts it: SLURM and Kubernetes.

- ``slurm_requeue.sbatch``: a batch script that requeues itself when the
  trainer stops with status 75 (preempted) or 76 (a peer lost), and resumes,
  on fewer nodes where one was lost.
- ``jobset.yaml``: the same for Kubernetes, a JobSet whose failure policy
  restarts on those statuses and stops on a user error (status 2).
- :mod:`experiments.cluster.jobset_check`: checks that manifest here, without
  a cluster.
"""
