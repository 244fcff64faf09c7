"""Where a run executes: devices, processes and the mesh.

A command calls :func:`setup_devices` before anything touches a JAX backend:
it simulates the CPU devices a run needs and, when asked, joins a
multi-process run through ``jax.distributed``. :func:`make_mesh` then lays the
devices out as ``("replica", "fsdp")``: a replica is a site of ``fsdp``
devices that shard the params, and only the optimizer's message crosses
``"replica"``. A plain data-parallel run is the same mesh with one device
per site.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from experiments.config import ConfigError

__all__ = [
  "FSDP",
  "MESH_AXES",
  "REPLICA",
  "LaunchConfig",
  "make_mesh",
  "setup_devices",
]

REPLICA, FSDP = "replica", "fsdp"
MESH_AXES = (REPLICA, FSDP)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  """How this process joins a run; flags of every training command (``config.define_flags``).

  Attributes:
    num_processes: processes in the run (1: this one alone).
    process_id: this process's index.
    coordinator_address: ``host:port`` of process 0.
  """

  num_processes: int = dataclasses.field(
    default=1, metadata={"help": "Processes in a multi-process run."}
  )
  process_id: int = dataclasses.field(default=0, metadata={"help": "This process's index."})
  coordinator_address: str | None = dataclasses.field(
    default=None, metadata={"help": "host:port of process 0, for multi-process runs."}
  )


def setup_devices(launch: LaunchConfig, devices: int) -> None:
  """Simulated CPU devices and, when asked, the multi-process runtime.

  Must run before anything touches a JAX backend.

  Args:
    launch: this process's place in the run.
    devices: devices the whole run needs; each process simulates its share.

  Raises:
    ConfigError: the devices do not split evenly over the processes, a
      multi-process run has no coordinator, or the platform that
      ``JAX_PLATFORMS`` asks for is not on this machine.
  """
  nproc = launch.num_processes
  if devices % nproc:
    raise ConfigError(f"{devices} devices do not divide by --num_processes={nproc}.")
  jax.config.update("jax_num_cpu_devices", devices // nproc)
  if nproc > 1:
    if not launch.coordinator_address:
      raise ConfigError("--num_processes>1 needs --coordinator_address=host:port of process 0.")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      coordinator_address=launch.coordinator_address,
      num_processes=nproc,
      process_id=launch.process_id,
    )
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
