"""Elastic resume: a run's checkpoint continued on another worker or process count.

In a JAX SPMD job the workers are fixed at start, so a run that loses or gains
machines stops and resumes from its last checkpoint with another ``--workers``
(and, across processes, ``--num_processes``). The fingerprint leaves the
worker count out (``config.ELASTIC_FIELDS``); this module reads the count
the checkpoint was saved with off its state's shapes, restores the state
onto the new mesh (:func:`distro_jax.abstract_state_of_workers`), resizes it
(:func:`distro_jax.resize_worker_state`) and describes the change as a
:class:`~experiments.run.records.ResizeEvent` for ``metrics.jsonl``. The data
needs nothing: global batch ``t`` has the same rows on any count
(``experiments.run.data``).

Worker ``i`` of the new run continues old worker ``i`` for ``i < min(W, W')``;
on fewer workers the last ones leave, on more the new ones join at the end
(and, with ``--cold_start_steps``, send messages marked invalid at first).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

import distro_jax as dj
from experiments.run import data as data_lib
from experiments.run.config import TrainConfig
from experiments.run.launch import REPLICA
from experiments.run.records import ResizeEvent

__all__ = ["Resize", "Restore", "saved_shapes"]


@dataclasses.dataclass(frozen=True)
class Resize:
  """What an elastic resume changes.

  Attributes:
    step: the checkpoint's step.
    workers_before: data-parallel workers (sites) that saved it.
    workers_after: data-parallel workers from here on.
    processes_before: processes that saved it.
    processes_after: processes from here on.
  """

  step: int
  workers_before: int
  workers_after: int
  processes_before: int
  processes_after: int

  @property
  def changed(self) -> bool:
    return (self.workers_before, self.processes_before) != (
      self.workers_after,
      self.processes_after,
    )

  @property
  def left(self) -> list[int]:
    """Old workers that left: the last ones (``dj.resize_worker_state``'s default ``keep``)."""
    return list(range(self.workers_after, self.workers_before))

  @property
  def joined(self) -> list[int]:
    """New workers that joined, at the end."""
    return list(range(self.workers_before, self.workers_after))

  def cold_until(self, cold_start_steps: int) -> tuple[int, ...] | None:
    """Per new worker, the last step its message is marked invalid (0: none); None if no one."""
    if not cold_start_steps or not self.joined:
      return None
    until = self.step + cold_start_steps
    return tuple(until if w in self.joined else 0 for w in range(self.workers_after))

  def event(self, cfg: TrainConfig) -> ResizeEvent:
    return ResizeEvent(
      step=self.step,
      wall_time=time.time(),
      workers_before=self.workers_before,
      workers_after=self.workers_after,
      processes_before=self.processes_before,
      processes_after=self.processes_after,
      left=self.left,
      joined=self.joined,
      leaving=cfg.leaving,
      cold_start_steps=cfg.cold_start_steps if self.joined else 0,
    )

  def describe(self, cfg: TrainConfig) -> str:
    """One line for the progress output."""
    line = f"elastic resume at step {self.step}: {self.workers_before} -> {self.workers_after} "
    line += "workers"
    if self.processes_before != self.processes_after:
      line += f", {self.processes_before} -> {self.processes_after} processes"
    if self.left:
      fate = {"fold": "folded into the others", "drop": "dropped"}[cfg.leaving]
      line += f"; workers {self.left} left, their unsent momentum {fate}"
    if self.joined:
      line += f"; workers {self.joined} joined from zero momentum"
      if cfg.cold_start_steps:
        line += f", their messages marked invalid through step {self.step + cfg.cold_start_steps}"
    return line


def _key(path: tuple[Any, ...]) -> tuple[str, ...]:
  """A tree path as names, the same for a NamedTuple field and the dict key orbax saves it as."""
  out = []
  for entry in path:
    for attr in ("name", "key", "idx"):
      if hasattr(entry, attr):
        out.append(str(getattr(entry, attr)))
        break
  return tuple(out)


def saved_shapes(step_dir: str | os.PathLike[str]) -> dict[tuple[str, ...], tuple[int, ...]]:
  """The array shapes of a checkpoint's ``state`` item, by path (read from its metadata)."""
  meta = ocp.StandardCheckpointHandler().metadata(epath.Path(step_dir) / "state")
  tree = getattr(meta, "item_metadata", meta)
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
  return {_key(p): tuple(x.shape) for p, x in flat if hasattr(x, "shape")}


class Restore:
  """The restore target of whichever checkpoint the checkpointer picks, then the resize.

  Args:
    program: the built run (``trainer.Program``) on the new worker count.
    directory: the checkpoint directory (``OUT_DIR/checkpoints``).
  """

  def __init__(self, program: Any, directory: str):
    self.program, self.directory = program, directory
    self.resize: Resize | None = None
    self.per_worker = False

  def target(self, step: int) -> Any:
    """The restore target for ``step``: as saved if the worker count is the same, else resizable."""
    program, cfg = self.program, self.program.cfg
    step_dir = os.path.join(self.directory, str(step))
    shapes = saved_shapes(step_dir)
    abstract = program.abstract_state()
    opt_paths, treedef = jax.tree_util.tree_flatten_with_path(abstract["opt_state"])
    saved = [
      jax.ShapeDtypeStruct(shapes.get(("opt_state", *_key(p)), x.shape), x.dtype)
      for p, x in opt_paths
    ]
    spec = {"param_specs": program.fsdp_plan.specs}
    before = dj.worker_count(
      program.tx, treedef.unflatten(saved), program.abstract, program.mesh, REPLICA, **spec
    )
    split = data_lib.saved_split(os.path.join(step_dir, "data"))
    # A state with nothing per worker (AdamW's) fits any count: the data item says which ran.
    recorded = split["workers"] // cfg.fsdp if "workers" in split else cfg.replicas
    self.per_worker = before is not None
    self.resize = Resize(
      step,
      recorded if before is None else before,
      cfg.replicas,
      split.get("processes", jax.process_count()),
      jax.process_count(),
    )
    if before is None or before == cfg.replicas:
      return abstract
    opt_state = dj.abstract_state_of_workers(
      program.tx, program.abstract, program.mesh, before, REPLICA, **spec
    )
    return {**abstract, "opt_state": opt_state}

  def finish(self, params: Any, opt_state: Any) -> Any:
    """The restored optimizer state for the new worker count (as it was if that is unchanged)."""
    resize = self.resize
    if resize is None or not self.per_worker or resize.workers_before == resize.workers_after:
      return opt_state
    return dj.resize_worker_state(
      self.program.tx,
      opt_state,
      params,
      self.program.mesh,
      REPLICA,
      leaving=self.program.cfg.leaving,
      param_specs=self.program.fsdp_plan.specs,
    )
