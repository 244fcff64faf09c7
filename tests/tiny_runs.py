"""Short driver runs on the tiny preset, shared by the driver and reliability tests."""

from experiments.run import records, trainer

TINY = {
  "preset": "tiny",
  "workers": 4,
  "batch_size": 8,
  "seq_len": 32,
  "progress": False,
  "eval_batches": 1,
}


def run_tiny(out_dir, **overrides):
  """``trainer.run`` on the tiny preset; ``overrides`` replace any TrainConfig field."""
  return trainer.run(trainer.TrainConfig(out_dir=str(out_dir), **{**TINY, **overrides}))


def read_metrics(out_dir):
  """The :class:`~experiments.run.records.StepRecord`\\ s of ``OUT_DIR/metrics.jsonl``."""
  return records.read_metrics(out_dir)
