"""Short driver runs on the tiny preset, shared by the driver and reliability tests."""

from experiments.run import records, trainer

TINY = {
  "preset": "tiny",
  "workers": 4,
  "batch_size": 8,
  "seq_len": 32,
  "progress": False,
  "eval_batches": 1,
  # One block traced and compiled, not one per layer: a fifth less CPU per
  # compile. The separate layers keep their own runs (the default command's,
  # and tests/test_scan_layers_train.py's side-by-side checks).
  "scan_layers": True,
}


def run_tiny(out_dir, **overrides):
  """``trainer.run`` on the tiny preset; ``overrides`` replace any TrainConfig field."""
  return trainer.run(trainer.TrainConfig(out_dir=str(out_dir), **{**TINY, **overrides}))


def read_metrics(out_dir):
  """The :class:`~experiments.run.records.StepRecord`\\ s of ``OUT_DIR/metrics.jsonl``."""
  return records.read_metrics(out_dir)
