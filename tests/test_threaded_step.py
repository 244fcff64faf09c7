"""The overlapped step as three programs, its all-gather on a thread of its own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_runs
from jax.sharding import NamedSharding

import distro_jax as dj
from experiments import config, trainer


@pytest.mark.slow
@pytest.mark.parametrize("synchronous", ["", "'attn'"], ids=["overlapped", "partially-overlapped"])
def test_the_threaded_step_trains_as_the_fused_one(tmp_path, synchronous):
  steps = 5
  flags = dict(delayed_apply=True, synchronous_params=synchronous, steps=steps)
  runs = {}
  for mode in ("fused", "thread"):
    runs[mode] = tiny_runs.run_tiny(
      tmp_path / mode, overlap_exchange=mode, check_replicas=True, log_every=1, **flags
    )
  fused, thread = (tiny_runs.read_metrics(tmp_path / m) for m in ("fused", "thread"))
  a, b = [r.loss for r in fused], [r.loss for r in thread]
  # Step 1 applies nothing and step 2 the first aggregate, from the same
  # gradients; compiled apart, the update rounds differently after that.
  np.testing.assert_array_equal(b[:2], a[:2])
  np.testing.assert_allclose(b, a, rtol=1e-3)
  assert a[-1] < a[0]
  assert [r.excluded_contributions for r in thread] == [4] + [0] * (steps - 1)
  for field in ("measured_exchange_bytes_per_step", "measured_by_kind", "measured_by_axes"):
    assert getattr(runs["thread"], field) == getattr(runs["fused"], field)
  assert runs["thread"].measured_exchange_bytes_per_step == runs["thread"].payload_bytes_per_step


def test_only_the_exchange_program_crosses_the_workers():
  # What lets the gradient run beside the all-gather: it has no collective
  # of its own, and the exchange has nothing else.
  fields = {**tiny_runs.TINY, "delayed_apply": True, "out_dir": "unused"}
  # In one process `auto` keeps the fused step: nothing crosses a network.
  assert trainer.build(config.resolve(trainer.TrainConfig(**fields))).threaded_step is None
  cfg = config.resolve(trainer.TrainConfig(**fields, overlap_exchange="thread"))
  program = trainer.build(cfg)
  assert program.threaded_step is not None
  abstract = program.abstract_state()
  rows = NamedSharding(program.mesh, program.rows)
  batch = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), jnp.int32, sharding=rows)
  step = jax.ShapeDtypeStruct((), jnp.int32, sharding=program.sharding())
  compiled = program.threaded_step.compile(
    abstract["params"], abstract["opt_state"], step, batch, batch
  )
  exchange, gradient, _ = (dj.parse_collective_bytes(t) for t in compiled.hlo_texts())
  assert gradient.total == 0
  assert {k for k, v in exchange.by_kind.items() if v} == {"all-gather"}


@pytest.mark.parametrize(
  ("overrides", "message"),
  [
    ({"overlap_exchange": "thread"}, "only --delayed_apply has one"),
    (
      {"overlap_exchange": "thread", "delayed_apply": True, "replicas": 2, "fsdp": 2},
      "use --overlap_exchange=fused",
    ),
    ({"overlap_exchange": "threads"}, "use auto, thread or fused"),
  ],
)
def test_bad_overlap_flags_name_the_fix(tmp_path, overrides, message):
  with pytest.raises(trainer.ConfigError, match=message):
    tiny_runs.run_tiny(tmp_path, **overrides)
