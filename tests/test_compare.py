"""The comparison command: every method trains, and the bytes columns are the accounting's."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from tiny_runs import TINY, read_metrics

import distro_jax as dj
from experiments.run import checks, data, methods, model, presets, trainer
from experiments.study import compare, time_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every kind of message: the dense gradient, DeMo's (here 1-bit, and top-k
# without the DCT) and DiLoCo's periodic pseudo-gradient. "demo-stateless" and
# "distro_adamw" send DeMo's message too: their accounting is checked below
# without a run (test_replicas trains distro_adamw).
METHODS = (
  "adamw",
  "demo-k4-c32-1bit",
  "topk-nodct-k8",
  "diloco-h3",
)
REQUIRED_KEYS = {
  "method",
  "final_train_loss",
  "final_val_loss",
  "payload_bytes_per_step",
  "measured_bytes_per_step",
  "ratio_vs_bf16_grad",
  "ratio_vs_ring_allreduce",
  "optimizer_time_fraction",
  "train_epochs",
  "rereads_data",
  "dense",
  "val_gap_vs_adamw",
  "best_dense",
  "gap_to_best_dense",
}


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
  out = tmp_path_factory.mktemp("compare")
  base = trainer.TrainConfig(**{**TINY, "steps": 9, "eval_every": 9})
  rows = compare.run_comparison(base, METHODS, str(out))
  return out, base, rows


@pytest.mark.slow
@pytest.mark.xdist_group("comparison")
def test_results_table_and_json(comparison):
  out, _, rows = comparison
  with open(out / "results.json") as f:
    saved = json.load(f)
  assert [r["method"] for r in saved] == list(METHODS)
  assert all(set(r) >= REQUIRED_KEYS for r in saved)
  assert all(0 <= r["optimizer_time_fraction"] < 1 for r in saved)
  # AdamW is the one dense method here, so the best: both gaps are to it.
  adamw = next(r for r in saved if r["method"] == "adamw")
  windows = data.window_count(data.load_splits(None, 256).train, TINY["seq_len"])
  for r in saved:
    assert r["best_dense"] == "adamw" and r["dense"] == (r["method"] == "adamw")
    assert r["gap_to_best_dense"] == r["val_gap_vs_adamw"]
    assert r["gap_to_best_dense"] == pytest.approx(
      r["final_val_loss"] / adamw["final_val_loss"] - 1
    )
    assert r["train_epochs"] == 9 * TINY["batch_size"] / windows and not r["rereads_data"]
  table = (out / "results.md").read_text().splitlines()
  header = next(i for i, line in enumerate(table) if line.startswith("| method |"))
  body = table[header + 2 : header + 2 + len(METHODS)]
  assert [line.split("|")[1].strip() for line in body] == list(METHODS)
  assert all(line.count("|") == table[header].count("|") for line in body)
  for png in ("loss_vs_step.png", "loss_vs_bytes.png"):
    assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.xdist_group("comparison")
def test_bytes_columns_equal_the_accounting(comparison):
  _, base, rows = comparison
  params = model.abstract_params(presets.get_preset(base.preset))
  by_method = {r["method"]: r for r in rows}
  w = base.workers

  def payload(**kw):
    return dj.wire_bytes(params, num_workers=w, **kw).payload

  full = dj.wire_bytes(params, num_workers=w)
  for name in ("demo-stateless", "distro_adamw"):
    method, fields = methods.parse(name)
    cfg = checks.resolve(dataclasses.replace(base, **fields))
    assert method.payload(cfg, params).per_step == payload(), name
  assert by_method["demo-k4-c32-1bit"]["payload_bytes_per_step"] == payload(
    compression_topk=4, compression_chunk=32, quantize_1bit=True
  )
  assert by_method["topk-nodct-k8"]["payload_bytes_per_step"] == payload(compression_topk=8)
  assert by_method["adamw"]["payload_bytes_per_step"] == full.grad
  # The pseudo-gradient in float32, and the 4-byte count of finite workers.
  assert by_method["diloco-h3"]["payload_bytes_per_step"] == (full.grad_fp32 + 4) / 3
  for r in rows:
    # The compiled train step moves exactly what the accounting says.
    assert r["measured_bytes_per_step"] == r["payload_bytes_per_step"], r["method"]
    assert r["ratio_vs_bf16_grad"] == pytest.approx(full.grad_bf16 / r["payload_bytes_per_step"])


@pytest.mark.slow
@pytest.mark.xdist_group("comparison")
def test_loss_falls_for_every_method(comparison):
  out, _, rows = comparison
  for r in rows:
    first = read_metrics(out / r["method"])[0].loss
    assert r["final_train_loss"] < first, r["method"]
    assert np.isfinite(r["final_val_loss"]) and r["final_val_loss"] < first, r["method"]


def test_time_model_ring_and_relay_bytes():
  assert time_model.link_bytes("all-reduce", 800, 8) == (1400, 1400)
  assert time_model.link_bytes("all-gather", 100, 8) == (700, 700)
  assert time_model.link_bytes("all-gather", 100, 8, "relay") == (100, 700)
  link = time_model.Link("x", up_bits_per_s=8e6, down_bits_per_s=80e6)
  # 1 MB up at 1 MB/s bounds the step; the download takes a tenth of that.
  assert time_model.step_seconds(0.5, 1e6, 1e6, link) == pytest.approx(1.5)
  with pytest.raises(ValueError, match="topology"):
    time_model.link_bytes("all-gather", 1, 2, "mesh")


def test_time_model_hides_the_overlapped_share_under_compute():
  link = time_model.Link("x", up_bits_per_s=8e6, down_bits_per_s=8e6)  # 1 MB/s
  # Fully overlapped: the longer of compute and transfer.
  assert time_model.step_seconds(0.5, 1e6, 1e6, link, 1.0) == pytest.approx(1.0)
  assert time_model.step_seconds(2.0, 1e6, 1e6, link, 1.0) == pytest.approx(2.0)
  # Half overlapped: 0.5 s hidden under 0.2 s of compute (0.3 s shows), 0.5 s waits.
  assert time_model.step_seconds(0.2, 1e6, 1e6, link, 0.5) == pytest.approx(1.0)
  assert time_model.step_seconds(0.6, 1e6, 1e6, link, 0.5) == pytest.approx(1.1)
  with pytest.raises(ValueError, match=r"overlapped_share must be in \[0, 1\]"):
    time_model.step_seconds(0.2, 1e6, 1e6, link, 1.5)


def test_report_setting_reproduces_the_published_adamw_bytes():
  rows = time_model.report_setting()
  adamw = next(r for r in rows if r["method"] == "adamw")
  # W - 1 = 31 copies of a bf16 gradient of the 1.2B model, as the report counts.
  assert adamw["report_style_bytes_per_step"] == pytest.approx(74.4e9, rel=0.01)
  k8 = next(r for r in rows if r["method"] == "demo-k8-1bit")
  assert adamw["report_style_bytes_per_step"] / k8["report_style_bytes_per_step"] > 450


@pytest.mark.slow  # a fresh process: a few seconds of imports
def test_cli_rejects_an_unknown_method_with_one_error_line():
  out = subprocess.run(
    [sys.executable, "-m", "experiments.compare", "--methods=adamw,sgd", "--workers=2"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert out.returncode == 2
  errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "unknown method 'sgd'" in errors[0], out.stderr[-2000:]
  assert "Traceback" not in out.stderr


def test_abstract_params_need_no_devices():
  # The accounting above runs on shapes only, as it must for report-1.2b.
  params = model.abstract_params(presets.get_preset("tiny"))
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))


def test_the_default_methods_include_points_past_1000x_and_3000x_on_small():
  # The default comparison shows the promise's setting, not only the families.
  params = model.abstract_params(presets.get_preset("small"))
  bf16 = sum(2 * int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  ratios = {}
  for name in compare.DEFAULT_METHODS:
    method, fields = methods.parse(name)
    cfg = checks.resolve(trainer.TrainConfig(preset="small", steps=1000, **fields))
    ratios[name] = bf16 / method.payload(cfg, params).per_step
  past = {name: r for name, r in ratios.items() if r >= 1000}
  # 1,811 bytes: a flag byte and one sign bit per 8x8 chunk.
  assert past.keys() >= {"demo-k1-c8-1bit-rand-fb1-orth"}, ratios
  assert int(ratios["demo-k1-c8-1bit-rand-fb1-orth"]) == 1014
  # One drawn sign bit per 16x16 chunk: 458 bytes.
  assert int(ratios[methods.NEAR_3000X]) == 4011
