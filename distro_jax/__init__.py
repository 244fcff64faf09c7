"""distro_jax: DisTrO / DeMo data-parallel training for JAX, as optax transformations.

Each worker sends a compressed message (per-chunk top-k of its decoupled
momentum in a chunked DCT basis) instead of its gradient. See ``README.md``.
"""

from distro_jax import (
  bitpack,
  codec,
  cpu_kernels,
  dct,
  dense_step,
  exchange,
  gspmd,
  hlo_bytes,
  pallas_kernels,
  wire,
)
from distro_jax.aggregate_momentum import MuonMomentumState, scale_by_muon_momentum
from distro_jax.compression import Compression
from distro_jax.dense_step import DenseStepWarning
from distro_jax.diloco import DilocoState, diloco, inner_params
from distro_jax.elastic import (
  abstract_state_of_workers,
  resize_worker_state,
  worker_count,
)
from distro_jax.exchange import local_value_and_grad, pmean_gradients, varies_over, worker_local
from distro_jax.fsdp import (
  DeviceBytes,
  FsdpPlan,
  clip_by_sharded_global_norm,
  device_bytes,
  fsdp_value_and_grad,
  gather_params,
  local_shapes,
  plan_fsdp,
)
from distro_jax.gspmd import (
  PerWorker,
  abstract_per_worker,
  per_worker,
  reduce_over_workers,
  resize_per_worker,
  worker_value_and_grad,
  workers_mesh,
)
from distro_jax.hlo_bytes import (
  CollectiveBytes,
  collective_bytes,
  collective_bytes_by_axes,
  parse_collective_bytes,
)
from distro_jax.lookahead import gradient_point, lookahead_update
from distro_jax.orthogonal import orthogonalize
from distro_jax.overlap import gather_pending
from distro_jax.shared_estimate import EstimateState, track_shared_estimate
from distro_jax.sparseloco import (
  SparseLocoBytes,
  SparseLocoState,
  sparseloco,
  sparseloco_bytes,
)
from distro_jax.transforms import DemoState, demo, distro, distro_adamw, scale_by_demo
from distro_jax.unit_rms import PerLayer, Split, scale_to_unit_rms
from distro_jax.wire import WireBytes, wire_bytes
from distro_jax.worker_state import abstract_worker_state, init_worker_state, worker_state_specs

__version__ = "0.1.0"

__all__ = [
  "bitpack",
  "codec",
  "cpu_kernels",
  "dct",
  "dense_step",
  "exchange",
  "gspmd",
  "hlo_bytes",
  "pallas_kernels",
  "wire",
  "CollectiveBytes",
  "Compression",
  "DemoState",
  "DenseStepWarning",
  "DeviceBytes",
  "DilocoState",
  "FsdpPlan",
  "MuonMomentumState",
  "EstimateState",
  "PerLayer",
  "PerWorker",
  "SparseLocoBytes",
  "SparseLocoState",
  "Split",
  "WireBytes",
  "abstract_per_worker",
  "abstract_state_of_workers",
  "abstract_worker_state",
  "clip_by_sharded_global_norm",
  "collective_bytes",
  "collective_bytes_by_axes",
  "demo",
  "device_bytes",
  "diloco",
  "distro",
  "distro_adamw",
  "fsdp_value_and_grad",
  "gather_params",
  "gather_pending",
  "gradient_point",
  "init_worker_state",
  "inner_params",
  "local_shapes",
  "local_value_and_grad",
  "lookahead_update",
  "orthogonalize",
  "parse_collective_bytes",
  "per_worker",
  "plan_fsdp",
  "pmean_gradients",
  "reduce_over_workers",
  "resize_per_worker",
  "resize_worker_state",
  "scale_by_demo",
  "scale_by_muon_momentum",
  "track_shared_estimate",
  "scale_to_unit_rms",
  "sparseloco",
  "sparseloco_bytes",
  "varies_over",
  "wire_bytes",
  "worker_count",
  "worker_local",
  "worker_state_specs",
  "worker_value_and_grad",
  "workers_mesh",
]
