"""The accelerator benchmark runs end to end, here on CPU at the smallest size."""

from absl import flags

from experiments import gpu_bench


def test_gpu_bench_runs_on_cpu_at_a_tiny_size(capsys):
  # One device, as on a single GPU: the data axis has size 1.
  results = gpu_bench.run(["tiny"], workers=1, rounds=1, train_rounds=1, batch_size=2, seq_len=16)
  tiny = results["tiny"]
  assert tiny["params"] > 0
  update, train = tiny["update"], tiny["train_step"]
  assert update[gpu_bench.BASELINE]["x_adamw"] == 1.0
  assert set(update) == {gpu_bench.BASELINE, "dj.demo (defaults)", "dj.demo (top-k 8, 1-bit)"}
  assert all(row["ms"] > 0 for row in update.values())
  assert set(train) == set(gpu_bench.TRAIN_METHODS)
  assert all(0.0 <= row["optimizer_share"] < 1.0 for row in train.values())
  printed = capsys.readouterr().out
  assert "x AdamW" in printed and "of the step" in printed


def test_importing_it_defines_no_flags():
  assert "presets" not in flags.FLAGS and "train_rounds" not in flags.FLAGS
