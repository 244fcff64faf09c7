"""``--scan_layers``: the driver trains a model with stacked layers, and refuses what would change.

The stacked layout compiles DeMo's update in a fraction of the time
(docs/performance.md). It must send the bytes of the separate layers,
resume exactly, keep the replicas identical, and refuse every setting that
treats a param as a whole, since a stack is then all layers at once.
"""

import pytest
import tiny_runs

from experiments import config


@pytest.mark.parametrize(
  "flags, message",
  [
    (dict(normalize="orth"), "Use --normalize=sign with --scan_layers"),
    (dict(normalize="rms"), "Use --normalize=sign with --scan_layers"),
    (dict(workers=4, fsdp=2), "Use --fsdp=1 with --scan_layers"),
    (dict(optimizer="sparseloco", steps=60), "Add --nosparseloco_clip"),
    # Layers have no paths of their own once stacked.
    (
      dict(delayed_apply=True, synchronous_params=r"\['blocks'\]\[0\]"),
      "matches no param of preset 'tiny'",
    ),
    (dict(compression_groups=r"\['blocks'\]\[0\]=8:2"), "matches no param of preset 'tiny'"),
  ],
  ids=["orth", "rms", "fsdp", "sparseloco-clip", "synchronous-layer", "group-layer"],
)
def test_the_driver_refuses_what_a_stack_would_change(flags, message):
  cfg = config.TrainConfig(**{"preset": "tiny", "workers": 4, **flags, "scan_layers": True})
  with pytest.raises(config.ConfigError, match=message):
    config.resolve(cfg)
  # Without the stacking, each of these is a valid run.
  config.resolve(config.TrainConfig(**{"preset": "tiny", "workers": 4, **flags}))


def test_what_works_on_every_param_alike_is_accepted():
  for flags in [
    dict(optimizer="adamw"),
    dict(optimizer="diloco", steps=100),
    dict(optimizer="sparseloco", steps=60, sparseloco_clip=False),
    dict(delayed_apply=True, synchronous_params="'attn'"),
    dict(compression_topk=1, compression_chunk=8, quantize_1bit=True, random_positions=True),
  ]:
    config.resolve(config.TrainConfig(preset="tiny", workers=4, scan_layers=True, **flags))


@pytest.mark.slow
def test_a_scanned_run_sends_the_same_bytes_resumes_exactly_and_keeps_replicas_equal(tmp_path):
  flags = dict(steps=6, checkpoint_every=3, check_replicas=True, log_every=1)
  separate = tiny_runs.run_tiny(tmp_path / "separate", steps=6)
  straight = tiny_runs.run_tiny(tmp_path / "a", scan_layers=True, **flags)
  tiny_runs.run_tiny(tmp_path / "b", scan_layers=True, stop_at_step=3, **flags)
  resumed = tiny_runs.run_tiny(tmp_path / "b", scan_layers=True, resume=True, **flags)

  # The bytes the compiled step moves, not only the computed payload.
  assert straight.measured_exchange_bytes_per_step == separate.measured_exchange_bytes_per_step
  assert straight.payload_bytes_per_step == separate.payload_bytes_per_step
  a, b = tiny_runs.read_metrics(tmp_path / "a"), tiny_runs.read_metrics(tmp_path / "b")
  assert [r.loss for r in a] == [r.loss for r in b]
  assert straight.params_digest == resumed.params_digest
  assert a[-1].loss < a[0].loss
