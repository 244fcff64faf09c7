r"""Checks a JobSet manifest here, without a cluster: its fields, and what each exit status does.

``experiments/cluster/jobset.yaml`` restarts a training run after a
preemption or a lost peer and stops it on a user error. Nothing here can run
Kubernetes, so this module checks the manifest in two ways:

- :func:`problems`: the fields the manifest relies on, against the JobSet
  ``v1alpha2`` API (its ``failurePolicy``, ``replicatedJobs`` and
  ``network``; JobSet v0.10 added ``onJobFailureMessagePatterns``) and the
  parts of ``batch/v1`` Job and ``v1`` Pod specs it sets (``podFailurePolicy``,
  ``completionMode``, ``restartPolicy``, containers). Unknown fields are
  problems too: the API server would drop or refuse them.
- :func:`action_on`: what the controllers would do with a pod that ended with
  an exit status (or was evicted): the Job controller's first matching
  ``podFailurePolicy`` rule and the failure message it writes
  (``Container train for pod ... failed with exit code 75 matching FailJob
  rule at index 0``), then the JobSet controller's first failure-policy rule
  whose reasons and message patterns match, else its default,
  ``RestartJobSet``.

  python -m experiments.cluster.jobset_check experiments/cluster/jobset.yaml
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["action_on", "load", "problems"]

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
_JOBSET_ACTIONS = {
  "FailJobSet",
  "RestartJobSet",
  "RestartJobSetAndIgnoreMaxRestarts",
  "RestartJob",
  "RestartJobAndIgnoreMaxRestarts",
}
_JOB_FAILURE_REASONS = {
  "BackoffLimitExceeded",
  "DeadlineExceeded",
  "FailedIndexes",
  "MaxFailedIndexesExceeded",
  "PodFailurePolicy",
}
_POD_ACTIONS = {"FailJob", "FailIndex", "Ignore", "Count"}
_FIELDS = {
  "jobset": {"apiVersion", "kind", "metadata", "spec"},
  "spec": {
    "replicatedJobs",
    "network",
    "successPolicy",
    "failurePolicy",
    "startupPolicy",
    "suspend",
    "coordinator",
    "managedBy",
    "ttlSecondsAfterFinished",
  },  # fmt: skip
  "network": {"enableDNSHostnames", "subdomain", "publishNotReadyAddresses"},
  "failurePolicy": {"maxRestarts", "restartStrategy", "rules"},
  "rule": {
    "name",
    "action",
    "onJobFailureReasons",
    "onJobFailureMessagePatterns",
    "targetReplicatedJobs",
  },  # fmt: skip
  "replicatedJob": {"name", "groupName", "template", "replicas", "dependsOn"},
  "jobSpec": {
    "parallelism",
    "completions",
    "completionMode",
    "backoffLimit",
    "backoffLimitPerIndex",
    "maxFailedIndexes",
    "activeDeadlineSeconds",
    "podFailurePolicy",
    "successPolicy",
    "template",
    "ttlSecondsAfterFinished",
    "suspend",
    "podReplacementPolicy",
    "manualSelector",
    "selector",
    "managedBy",
  },  # fmt: skip
  "podRule": {"action", "onExitCodes", "onPodConditions"},
  "onExitCodes": {"containerName", "operator", "values"},
  "podCondition": {"type", "status"},
}


def load(path: str) -> dict[str, Any]:
  """The manifest at ``path`` (YAML), as a dict."""
  import yaml

  with open(path) as f:
    return yaml.safe_load(f)


def _unknown(obj: Mapping[str, Any], kind: str, where: str) -> list[str]:
  return [f"{where}.{k}: not a field of {kind}" for k in sorted(set(obj) - _FIELDS[kind])]


def _int(value: Any, where: str, least: int) -> list[str]:
  if not isinstance(value, int) or isinstance(value, bool) or value < least:
    return [f"{where}: {value!r} must be an integer of at least {least}"]
  return []


def _strings(value: Any, where: str) -> list[str]:
  if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
    return [f"{where}: must be a list of strings"]
  if len(set(value)) != len(value):
    return [f"{where}: items must be unique"]
  return []


def _failure_policy(policy: Mapping[str, Any], job_names: set[str]) -> list[str]:
  where = "spec.failurePolicy"
  out = _unknown(policy, "failurePolicy", where)
  if "maxRestarts" in policy:
    out += _int(policy["maxRestarts"], f"{where}.maxRestarts", 0)
  for i, rule in enumerate(policy.get("rules", [])):
    at = f"{where}.rules[{i}]"
    out += _unknown(rule, "rule", at)
    if not _RULE_NAME.match(str(rule.get("name", ""))):
      out.append(f"{at}.name: {rule.get('name')!r} does not match {_RULE_NAME.pattern}")
    if rule.get("action") not in _JOBSET_ACTIONS:
      out.append(f"{at}.action: {rule.get('action')!r} is not one of {sorted(_JOBSET_ACTIONS)}")
    reasons = rule.get("onJobFailureReasons", [])
    out += _strings(reasons, f"{at}.onJobFailureReasons")
    out += [
      f"{at}.onJobFailureReasons: unknown reason {r!r}" for r in set(reasons) - _JOB_FAILURE_REASONS
    ]
    patterns = rule.get("onJobFailureMessagePatterns", [])
    out += _strings(patterns, f"{at}.onJobFailureMessagePatterns")
    for p in patterns:
      try:
        re.compile(p)
      except re.error as e:
        out.append(f"{at}.onJobFailureMessagePatterns: {p!r} is no regular expression ({e})")
    targets = rule.get("targetReplicatedJobs", [])
    out += [f"{at}.targetReplicatedJobs: no replicated job {t!r}" for t in set(targets) - job_names]
  return out


def _pod_failure_policy(policy: Mapping[str, Any], containers: set[str], at: str) -> list[str]:
  out = []
  for i, rule in enumerate(policy.get("rules", [])):
    where = f"{at}.podFailurePolicy.rules[{i}]"
    out += _unknown(rule, "podRule", where)
    if rule.get("action") not in _POD_ACTIONS:
      out.append(f"{where}.action: {rule.get('action')!r} is not one of {sorted(_POD_ACTIONS)}")
    if ("onExitCodes" in rule) == ("onPodConditions" in rule):
      out.append(f"{where}: needs exactly one of onExitCodes and onPodConditions")
    codes = rule.get("onExitCodes")
    if codes is not None:
      out += _unknown(codes, "onExitCodes", f"{where}.onExitCodes")
      if codes.get("operator") not in ("In", "NotIn"):
        out.append(f"{where}.onExitCodes.operator: must be In or NotIn")
      values = codes.get("values", [])
      if not values or not all(isinstance(v, int) and 0 <= v <= 255 for v in values):
        out.append(f"{where}.onExitCodes.values: must be exit statuses (0 to 255)")
      elif codes.get("operator") == "In" and 0 in values:
        out.append(f"{where}.onExitCodes.values: 0 (success) cannot fail a pod")
      name = codes.get("containerName")
      if name is not None and name not in containers:
        out.append(f"{where}.onExitCodes.containerName: no container {name!r}")
    for j, cond in enumerate(rule.get("onPodConditions") or []):
      out += _unknown(cond, "podCondition", f"{where}.onPodConditions[{j}]")
      if cond.get("status", "True") not in ("True", "False", "Unknown"):
        out.append(f"{where}.onPodConditions[{j}].status: must be True, False or Unknown")
  return out


def _job(job: Mapping[str, Any], i: int) -> list[str]:
  at = f"spec.replicatedJobs[{i}]"
  out = _unknown(job, "replicatedJob", at)
  if not _DNS_LABEL.match(str(job.get("name", ""))):
    out.append(f"{at}.name: {job.get('name')!r} is not a DNS label")
  out += _int(job.get("replicas", 1), f"{at}.replicas", 1)
  spec = job.get("template", {}).get("spec", {})
  at += ".template.spec"
  out += _unknown(spec, "jobSpec", at)
  for key in ("parallelism", "completions"):
    out += _int(spec.get(key, 1), f"{at}.{key}", 1)
  out += _int(spec.get("backoffLimit", 6), f"{at}.backoffLimit", 0)
  if spec.get("completionMode", "NonIndexed") not in ("Indexed", "NonIndexed"):
    out.append(f"{at}.completionMode: must be Indexed or NonIndexed")
  pod = spec.get("template", {}).get("spec", {})
  containers = pod.get("containers", [])
  names = {c.get("name") for c in containers}
  if not containers or len(names) != len(containers) or not all(c.get("image") for c in containers):
    out.append(f"{at}.template.spec.containers: each needs a distinct name and an image")
  if "podFailurePolicy" in spec:
    out += _pod_failure_policy(spec["podFailurePolicy"], names, at)
    if pod.get("restartPolicy") != "Never":
      out.append(f"{at}.template.spec.restartPolicy: a podFailurePolicy needs Never")
  return out


def problems(manifest: Mapping[str, Any]) -> list[str]:
  """What in ``manifest`` the API server would refuse or drop, one line each (empty: none).

  Args:
    manifest: a JobSet manifest, as :func:`load` reads it.
  """
  out = _unknown(manifest, "jobset", "")
  if manifest.get("apiVersion") != "jobset.x-k8s.io/v1alpha2" or manifest.get("kind") != "JobSet":
    out.append("apiVersion/kind: must be jobset.x-k8s.io/v1alpha2 JobSet")
  if not _DNS_LABEL.match(str(manifest.get("metadata", {}).get("name", ""))):
    out.append("metadata.name: must be a DNS label")
  spec = manifest.get("spec", {})
  out += _unknown(spec, "spec", "spec")
  out += _unknown(spec.get("network", {}), "network", "spec.network")
  jobs = spec.get("replicatedJobs", [])
  if not jobs:
    out.append("spec.replicatedJobs: needs at least one")
  for i, job in enumerate(jobs):
    out += _job(job, i)
  names = {j.get("name") for j in jobs}
  out += _failure_policy(spec.get("failurePolicy", {}), names)
  return out


def _job_failure(spec: Mapping[str, Any], exit_code: int | None) -> tuple[str, str] | None:
  """``(reason, message)`` of the Job when a pod ends so (``None``: evicted), or None (ignored)."""
  container = spec["template"]["spec"]["containers"][0]["name"]
  for index, rule in enumerate(spec.get("podFailurePolicy", {}).get("rules", [])):
    codes, conditions = rule.get("onExitCodes"), rule.get("onPodConditions")
    if codes is not None and exit_code is not None:
      hit = (exit_code in codes["values"]) == (codes["operator"] == "In")
      hit = hit and codes.get("containerName", container) == container
      message = (
        f"Container {container} for pod default/pod-0 failed with exit code {exit_code} "
        f"matching {rule['action']} rule at index {index}"
      )
    elif conditions is not None and exit_code is None:
      hit = any(c["type"] == "DisruptionTarget" for c in conditions)
      message = (
        f"Pod default/pod-0 has condition DisruptionTarget matching {rule['action']} rule at "
        f"index {index}"
      )
    else:
      continue
    if hit:
      if rule["action"] == "Ignore":
        return None
      if rule["action"] == "FailJob":
        return "PodFailurePolicy", message
      break  # Count: counts against backoffLimit, as when no rule matches
  if spec.get("backoffLimit", 6) == 0:
    return "BackoffLimitExceeded", "Job has reached the specified backoff limit"
  return None


def action_on(manifest: Mapping[str, Any], exit_code: int | None) -> str | None:
  """What the JobSet controller does when a pod of the first replicated job ends with ``exit_code``.

  Args:
    manifest: a JobSet manifest.
    exit_code: the training container's exit status, or None for a pod
      evicted or preempted by Kubernetes (the ``DisruptionTarget`` condition).

  Returns:
    The failure-policy action (``RestartJobSet``, ``FailJobSet``, ...), or
    None when the Job does not fail (the pod is retried within it).
  """
  spec = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
  failure = _job_failure(spec, exit_code)
  if failure is None:
    return None
  reason, message = failure
  for rule in manifest["spec"].get("failurePolicy", {}).get("rules", []):
    reasons = rule.get("onJobFailureReasons") or [reason]
    patterns = rule.get("onJobFailureMessagePatterns") or [""]
    if reason in reasons and any(re.search(p, message) for p in patterns):
      return rule["action"]
  return "RestartJobSet"


def _main(argv: list[str]) -> None:
  if len(argv) != 1:
    sys.exit("usage: python -m experiments.cluster.jobset_check MANIFEST.yaml")
  manifest = load(argv[0])
  found = problems(manifest)
  for line in found:
    print(f"error: {line}", file=sys.stderr)
  if found:
    sys.exit(2)
  for what, code in (("75 (preempted)", 75), ("evicted", None), ("76 (peer lost)", 76),
                     ("2 (user error)", 2), ("1 (a crash)", 1)):  # fmt: skip
    print(f"{what}: {action_on(manifest, code)}")


if __name__ == "__main__":
  _main(sys.argv[1:])
