"""The accelerator benchmark runs end to end, here on CPU at the smallest size."""

import jax
import pytest
from absl import flags

from experiments.bench import bench_update, gpu_bench


@pytest.mark.slow
def test_gpu_bench_runs_on_cpu_at_a_tiny_size(capsys):
  # One device, as on a single GPU: the data axis has size 1. One DeMo update
  # proves the wiring; the figures are the command's, in docs/performance.md.
  demo = bench_update.DEFAULTS_NAME
  results = gpu_bench.run(
    ["tiny"],
    workers=1,
    rounds=1,
    train_rounds=1,
    batch_size=2,
    seq_len=16,
    methods=[gpu_bench.BASELINE, demo],
  )
  tiny = results["tiny"]
  assert tiny["params"] > 0
  update, train = tiny["update"], tiny["train_step"]
  assert update[gpu_bench.BASELINE]["x_adamw"] == 1.0
  # Each DeMo update with the kernels JAX takes here and on XLA's path alone.
  assert set(update) == {gpu_bench.BASELINE, demo, gpu_bench.XLA_PATH.format(demo)}
  assert all(row["ms"] > 0 for row in update.values())
  trained = set(gpu_bench.TRAIN_METHODS) - {gpu_bench.BASELINE}
  assert set(train) == set(gpu_bench.TRAIN_METHODS) | {
    gpu_bench.XLA_PATH.format(m) for m in trained
  }
  assert all(0.0 <= row["optimizer_share"] < 1.0 for row in train.values())
  printed = capsys.readouterr().out
  assert "x AdamW" in printed and "of the step" in printed
  # Every compile is printed as it ends: the update and both train programs.
  assert printed.count("(first call)") == len(update) + 2 * len(train)


def test_methods_are_chosen_by_name_with_the_baseline_always_in():
  every = bench_update.methods()
  assert set(gpu_bench._chosen(None)) == set(every)
  # --methods' short keys name every DeMo update there is, and nothing else.
  assert set(gpu_bench.METHOD_KEYS.values()) | {gpu_bench.BASELINE} == set(every)
  assert list(gpu_bench._chosen([bench_update.ORTH_NAME])) == [
    gpu_bench.BASELINE,
    bench_update.ORTH_NAME,
  ]
  with pytest.raises(ValueError, match="Unknown methods.*choose from"):
    gpu_bench._chosen(["dj.demo (top-k 3)"])


def test_bench_update_times_any_method_compare_takes_and_refuses_others():
  rows = bench_update._registry_rows(["demo-k1-c16-1bit-rand-fb1"], {})
  assert list(rows) == ["demo-k1-c16-1bit-rand-fb1"]
  with pytest.raises(ValueError, match="(?s)Unknown method .demo-k1-nonsense.*as compare takes it"):
    bench_update._registry_rows(["demo-k1-nonsense"], {})


def test_importing_it_defines_no_flags():
  assert "presets" not in flags.FLAGS and "train_rounds" not in flags.FLAGS


@pytest.mark.slow
def test_bench_update_takes_a_preset_and_times_the_parts(capsys):
  assert "repeats" not in flags.FLAGS  # flags only when run as a command
  # Stacked, the preset's layers are one tensor each: half the compile time.
  # The recommended message alone beside AdamW: the figures of every update
  # are the command's, in docs/performance.md.
  out = bench_update.run(
    workers=2,
    preset="tiny",
    d_model=0,
    layers=0,
    vocab=0,
    repeats=1,
    dtype="float32",
    scan_layers=True,
    only=[bench_update.ORTH_NAME],
  )
  updates = {bench_update.BASELINE, bench_update.ORTH_NAME}
  parts = {
    f"  {part} ({label})"
    for part in ("transform", "top-k", "aggregate", "decode")
    for label in ("defaults", "top-k 8, 1-bit")
  }
  assert set(out["ms"]) == updates | parts
  assert out["ratio"][bench_update.BASELINE] == 1.0
  # An update's first call compiles it, which is slower than a compiled call.
  assert set(out["first_call_s"]) == updates
  assert all(out["first_call_s"][n] * 1e3 > out["ms"][n] for n in updates)
  assert "tree: tiny, layers stacked" in capsys.readouterr().out


def test_bench_update_stacks_a_presets_layers_when_asked():
  separate = bench_update.preset_params("tiny", "float32")
  stacked = bench_update.preset_params("tiny", "float32", scan_layers=True)
  assert len(jax.tree.leaves(stacked)) < len(jax.tree.leaves(separate))
  assert sum(x.size for x in jax.tree.leaves(stacked)) == sum(
    x.size for x in jax.tree.leaves(separate)
  )
  # Its own synthetic tree is stacked already; asking again is a usage error.
  with pytest.raises(ValueError, match="pass --preset=NAME with it"):
    bench_update.run(
      workers=1,
      preset="stacked",
      d_model=64,
      layers=1,
      vocab=64,
      repeats=1,
      dtype="float32",
      scan_layers=True,
    )
