"""Where a run executes: devices, processes and the mesh.

A command calls :func:`setup_devices` before anything touches a JAX backend:
it simulates the CPU devices a run needs and joins a multi-process run through
``jax.distributed`` when asked by flags, or when it runs under a cluster
scheduler that started several processes (SLURM's ``srun``, Open MPI's
``mpirun``): then no flag is needed, and a flag that is given wins over the
environment (:func:`resolve_launch`). :func:`make_mesh` then lays the
devices out as ``("replica", "fsdp")``: a replica is a site of ``fsdp``
devices that shard the params, and only the optimizer's message crosses
``"replica"``. A plain data-parallel run is the same mesh with one device
per site.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax

from experiments.run import peers
from experiments.run.config import ConfigError

__all__ = [
  "FSDP",
  "MESH_AXES",
  "REPLICA",
  "LaunchConfig",
  "make_mesh",
  "resolve_launch",
  "setup_devices",
]

REPLICA, FSDP = "replica", "fsdp"
MESH_AXES = (REPLICA, FSDP)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  """How this process joins a run; flags of every training command (``cli.define_flags``).

  ``None`` means "not given": under a cluster scheduler it comes from the
  environment (:func:`resolve_launch`), elsewhere one process runs alone.

  Attributes:
    num_processes: processes in the run.
    process_id: this process's index.
    coordinator_address: ``host:port`` of process 0.
    cluster: where unset values come from: ``auto`` (SLURM or Open MPI when
      their variables say several processes run), ``none`` (never), or
      ``slurm`` / ``ompi`` to insist on one.
    peer_timeout_s: in a multi-process run, the silence after which a peer
      counts as lost (:mod:`experiments.run.peers`); 0 leaves it to JAX.
  """

  num_processes: int | None = dataclasses.field(
    default=None,
    metadata={
      "help": "Processes in a multi-process run (default: from SLURM or Open MPI when the "
      "driver runs under one, else 1)."
    },
  )
  process_id: int | None = dataclasses.field(
    default=None, metadata={"help": "This process's index (default: from the scheduler, else 0)."}
  )
  coordinator_address: str | None = dataclasses.field(
    default=None,
    metadata={
      "help": "host:port of process 0, for multi-process runs (default under a scheduler: its "
      "first node, as jax.distributed.initialize finds it)."
    },
  )
  cluster: str = dataclasses.field(
    default="auto",
    metadata={
      "help": "Where unset process flags come from: auto (SLURM or Open MPI, when they started "
      "several processes), none (never: one process unless flags say otherwise), slurm or ompi."
    },
  )
  peer_timeout_s: float = dataclasses.field(
    default=60.0,
    metadata={
      "help": "Multi-process runs: a peer that sends no heartbeat for this many seconds (hung, "
      "stopped, cut off) counts as lost; the others stop with exit status 76 and one line "
      "naming it, the last checkpoint and the command that resumes (docs/failure_modes.md). "
      "0 leaves it to JAX's own heartbeat, which aborts every process after about 100 s."
    },
  )


# The scheduler variables jax.distributed.initialize reads (jax/_src/clusters): all of
# them must be set for it to use that scheduler, and so for the driver to detect it.
_SCHEDULERS: dict[str, tuple[tuple[str, ...], str, str]] = {
  "slurm": (
    ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
    "SLURM_NTASKS",
    "SLURM_PROCID",
  ),
  "ompi": (
    ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
  ),
}


def _scheduler(cluster: str, environ: Mapping[str, str]) -> str | None:
  """The scheduler whose variables are all set (the one named, or any with ``auto``)."""
  if cluster == "none":
    return None
  if cluster != "auto" and cluster not in _SCHEDULERS:
    raise ConfigError(f"--cluster={cluster!r}; use auto, none, {' or '.join(_SCHEDULERS)}.")
  names = _SCHEDULERS if cluster == "auto" else (cluster,)
  found = [n for n in names if all(v in environ for v in _SCHEDULERS[n][0])]
  if cluster != "auto" and not found:
    missing = [v for v in _SCHEDULERS[cluster][0] if v not in environ]
    raise ConfigError(
      f"--cluster={cluster} but {', '.join(missing)} is not set; launch with the scheduler "
      "(srun, mpirun), or pass --num_processes, --process_id and --coordinator_address."
    )
  return found[0] if found else None


def resolve_launch(
  launch: LaunchConfig, environ: Mapping[str, str] | None = None
) -> tuple[LaunchConfig, str | None]:
  """The process flags with what the cluster scheduler says filled in where they are unset.

  Args:
    launch: the flags as given.
    environ: the environment (default ``os.environ``).

  Returns:
    ``(launch, scheduler)``: ``num_processes`` and ``process_id`` set, and the
    scheduler they came from (``"slurm"``, ``"ompi"``) or ``None``. A
    coordinator address left unset under a scheduler stays ``None``:
    ``jax.distributed.initialize`` derives it from the same variables.

  Raises:
    ConfigError: ``--cluster`` names a scheduler whose variables are not set.
  """
  environ = os.environ if environ is None else environ
  found = _scheduler(launch.cluster, environ)
  num, pid = launch.num_processes, launch.process_id
  if found is not None:
    _, count_var, id_var = _SCHEDULERS[found]
    num = int(environ[count_var]) if num is None else num
    pid = int(environ[id_var]) if pid is None else pid
    if num == 1 and launch.cluster == "auto":
      found = None  # a one-task job step: nothing to join
  resolved = dataclasses.replace(
    launch, num_processes=1 if num is None else num, process_id=0 if pid is None else pid
  )
  return resolved, found


def setup_devices(launch: LaunchConfig, devices: int) -> None:
  """Simulated CPU devices and, when asked or scheduled, the multi-process runtime.

  Must run before anything touches a JAX backend. Under SLURM or Open MPI
  with several processes it joins them with no flag needed; flags that are
  given win (:func:`resolve_launch`).

  Args:
    launch: this process's place in the run, as the flags give it.
    devices: devices the whole run needs; each process simulates its share
      on CPU (a GPU process uses the devices it sees).

  Raises:
    ConfigError: the devices do not split evenly over the processes, a
      multi-process run has no coordinator, or the platform that
      ``JAX_PLATFORMS`` asks for is not on this machine.
  """
  launch, scheduler = resolve_launch(launch)
  if not (launch.peer_timeout_s == 0 or launch.peer_timeout_s >= 1):
    raise ConfigError(
      f"--peer_timeout_s={launch.peer_timeout_s:g} must be 1 or more (seconds), or 0 to leave "
      "lost peers to JAX's own heartbeat; e.g. --peer_timeout_s=60."
    )
  nproc = launch.num_processes
  if devices % nproc:
    raise ConfigError(f"{devices} devices do not divide by --num_processes={nproc}.")
  jax.config.update("jax_num_cpu_devices", devices // nproc)
  if nproc > 1:
    if not launch.coordinator_address and scheduler is None:
      raise ConfigError("--num_processes>1 needs --coordinator_address=host:port of process 0.")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      coordinator_address=launch.coordinator_address,
      num_processes=nproc,
      process_id=launch.process_id,
      # JAX fills what is still unset (the coordinator, one GPU per process)
      # from the same scheduler; with --cluster=none it looks at none.
      cluster_detection_method=scheduler or ("deactivate" if launch.cluster == "none" else None),
      heartbeat_timeout_seconds=peers.jax_heartbeat_timeout_s(launch.peer_timeout_s),
    )
    peers.start(launch.peer_timeout_s)
  _check_platform()


def _check_platform() -> None:
  """Starts the backend now, so a platform that is not here is one line, not a traceback."""
  wanted = jax.config.jax_platforms
  if not wanted:
    return  # JAX picks what is here; a failure then is a broken install, with its traceback
  try:
    jax.devices()
  except Exception as e:  # noqa: BLE001 - JAX raises RuntimeError or a bare AssertionError
    detail = f" ({str(e).splitlines()[0][:160]})" if str(e) else ""
    raise ConfigError(
      f"JAX_PLATFORMS={wanted} asks for a platform this machine does not have{detail}; "
      "unset JAX_PLATFORMS to use the devices that are here, or set it to cpu."
    ) from None


def make_mesh(devices: int, fsdp: int = 1) -> jax.sharding.Mesh:
  """A ``("replica", "fsdp")`` mesh of ``devices``, the same number from each process.

  Args:
    devices: devices in total.
    fsdp: devices per site; each site's devices are consecutive, so within
      one process where they fit.

  Returns:
    The mesh, ``devices // fsdp`` sites of ``fsdp`` devices.

  Raises:
    ConfigError: the devices do not split over the processes, or a process
      has too few.
  """
  nproc = jax.process_count()
  if devices % nproc:
    raise ConfigError(f"--workers={devices} does not divide by the {nproc} processes.")
  per_process = devices // nproc
  chosen: list[Any] = []
  for p in range(nproc):
    local = [d for d in jax.devices() if d.process_index == p]
    if len(local) < per_process:
      raise ConfigError(
        f"--workers={devices} needs {per_process} devices in each of {nproc} process(es), "
        f"but process {p} has {len(local)}. On CPU the driver simulates them; when calling "
        "trainer.run directly, set XLA_FLAGS=--xla_force_host_platform_device_count="
        f"{per_process} before importing jax."
      )
    chosen += local[:per_process]
  return jax.make_mesh((devices // fsdp, fsdp), MESH_AXES, devices=chosen)
