"""``--scan_layers``: the driver trains a model with stacked layers, and refuses what would change.

The stacked layout compiles DeMo's update in a fraction of the time
(docs/performance.md). It must send the bytes of the separate layers, step
each layer as it would step alone, resume exactly, keep the replicas
identical, and refuse every setting that would treat a stack as one tensor.
"""

import jax
import numpy as np
import pytest
import tiny_runs
from flax import nnx

import distro_jax as dj
from distro_jax.unit_rms import normalized_step
from experiments.run import checks, config, methods, model, presets


@pytest.mark.parametrize(
  "flags, message",
  [
    (dict(optimizer="sparseloco", steps=60), "Add --nosparseloco_clip"),
    # Layers have no paths of their own once stacked.
    (
      dict(delayed_apply=True, synchronous_params=r"\['blocks'\]\[0\]"),
      "matches no param of preset 'tiny'",
    ),
    (dict(compression_groups=r"\['blocks'\]\[0\]=8:2"), "matches no param of preset 'tiny'"),
  ],
  ids=["sparseloco-clip", "synchronous-layer", "group-layer"],
)
def test_the_driver_refuses_what_a_stack_would_change(flags, message):
  cfg = config.TrainConfig(**{"preset": "tiny", "workers": 4, **flags, "scan_layers": True})
  with pytest.raises(config.ConfigError, match=message):
    checks.resolve(cfg)
  # Without the stacking, each of these is a valid run.
  checks.resolve(config.TrainConfig(**{"preset": "tiny", "workers": 4, **flags}))


def test_what_works_on_every_param_alike_is_accepted():
  for flags in [
    dict(optimizer="adamw"),
    dict(optimizer="diloco", steps=100),
    dict(optimizer="sparseloco", steps=60, sparseloco_clip=False),
    dict(delayed_apply=True, synchronous_params="'attn'"),
    dict(compression_topk=1, compression_chunk=8, quantize_1bit=True, random_positions=True),
    dict(normalize="orth", delayed_apply=True),
    dict(normalize="rms"),
    dict(fsdp=2),
    dict(fsdp=2, delayed_apply=True),
    dict(fsdp=2, normalize="rms"),
    dict(fsdp=2, normalize="orth"),
  ]:
    checks.resolve(config.TrainConfig(preset="tiny", workers=4, scan_layers=True, **flags))


@pytest.mark.slow
def test_a_scanned_run_sends_the_same_bytes_resumes_exactly_and_keeps_replicas_equal(tmp_path):
  flags = dict(steps=6, checkpoint_every=3, check_replicas=True, log_every=1)
  straight = tiny_runs.run_tiny(tmp_path / "a", scan_layers=True, **flags)
  tiny_runs.run_tiny(tmp_path / "b", scan_layers=True, stop_at_step=3, **flags)
  resumed = tiny_runs.run_tiny(tmp_path / "b", scan_layers=True, resume=True, **flags)

  # The bytes the compiled step moves are the separate layers' message (which
  # their own runs move: tests/test_train.py).
  cfg = checks.resolve(config.TrainConfig(**{**tiny_runs.TINY, "steps": 6}))
  separate = methods.get("demo").payload(cfg, model.abstract_params(presets.get_preset("tiny")))
  assert straight.measured_exchange_bytes_per_step == separate.per_step
  assert straight.payload_bytes_per_step == separate.per_step
  a, b = tiny_runs.read_metrics(tmp_path / "a"), tiny_runs.read_metrics(tmp_path / "b")
  assert [r.loss for r in a] == [r.loss for r in b]
  assert straight.params_digest == resumed.params_digest
  assert a[-1].loss < a[0].loss


@pytest.mark.slow
@pytest.mark.parametrize(
  ("normalize", "delayed_apply"), [("rms", False), ("orth", True)], ids=["rms", "orth-overlapped"]
)
def test_sites_of_two_devices_split_the_stacks_and_train_as_two_workers(
  tmp_path, normalize, delayed_apply
):
  # A stack's layers at unit RMS, or orthogonalized, need each whole layer:
  # FSDP's devices gather the aggregate (dj.Split) and each keeps its block,
  # in the update and in the lookahead's guess.
  flags = dict(
    steps=5, scan_layers=True, log_every=1, normalize=normalize, delayed_apply=delayed_apply
  )
  whole = tiny_runs.run_tiny(tmp_path / "whole", workers=2, **flags)
  split = tiny_runs.run_tiny(tmp_path / "fsdp", replicas=2, fsdp=2, check_replicas=True, **flags)
  a = [r.loss for r in tiny_runs.read_metrics(tmp_path / "whole")]
  b = [r.loss for r in tiny_runs.read_metrics(tmp_path / "fsdp")]
  # As in tests/test_fsdp_train.py: only the site's gradient sum is ordered
  # differently, and the lookahead's sign turns that into a little more.
  np.testing.assert_allclose(b, a, rtol=1e-3 if delayed_apply else 1e-4)
  assert a[-1] < a[0]

  # Every stack splits along its layers or within them; on tiny only the final
  # norm (one 64-wide chunk) stays whole, where the separate layers keep
  # every block param whole and each device of a site sends all of them.
  assert split.params_kept_whole == ["['final_norm']['scale'].value"]
  stacked = presets.get_preset("tiny", scan_layers=True)
  norm = {"final_norm": model.abstract_params(stacked)["final_norm"]}
  kept = dj.wire_bytes(norm, num_workers=2).payload
  # The site's devices together send the whole message once, and the kept
  # norm's share once per device: no chunk is lost or sent twice.
  assert 2 * split.payload_bytes_per_step == whole.payload_bytes_per_step + kept
  assert split.measured_by_axes["replica"] == split.payload_bytes_per_step


@pytest.mark.parametrize("name", [pytest.param("rms", marks=pytest.mark.slow), "orth"])
def test_normalize_steps_each_stacked_layer_as_its_separate_param(name):
  # The modes --normalize gives the scanned tree, applied to a stacked
  # aggregate, equal the modes it gives the separate layers, applied to each
  # layer: the same step whichever way the model holds its layers.
  tiny = presets.get_preset("tiny")
  separate = nnx.to_pure_dict(model.abstract_params(tiny))
  scanned = nnx.to_pure_dict(model.abstract_params(presets.get_preset("tiny", scan_layers=True)))

  def modes(tree, scan_layers):
    given = methods.demo_normalize(name, scan_layers)
    given = given(tree) if callable(given) else jax.tree.map(lambda _: given, tree)
    flat = jax.tree_util.tree_flatten_with_path(given)[0]
    shapes = [x.shape for x in jax.tree.leaves(tree)]
    return {jax.tree_util.keystr(p): (m, shape) for (p, m), shape in zip(flat, shapes)}

  want_modes, got_modes = modes(separate, False), modes(scanned, True)
  # Jitted: one program per shape and mode, where an eager call compiles one per operation.
  step = jax.jit(normalized_step, static_argnums=1)
  rng = np.random.default_rng(0)
  layers_checked = 0
  for key, (mode, shape) in got_modes.items():
    q = rng.normal(size=shape).astype(np.float32)
    got = step(q, mode)
    if not key.startswith("['blocks']"):
      want_mode, _ = want_modes[key]
      np.testing.assert_allclose(got, step(q, want_mode), rtol=1e-5, atol=1e-5)
      continue
    for layer in range(tiny.n_layers):
      want_mode, want_shape = want_modes[key.replace("['blocks']", f"['blocks'][{layer}]", 1)]
      want = step(q[layer].reshape(want_shape), want_mode)
      np.testing.assert_allclose(got[layer].reshape(want_shape), want, rtol=1e-5, atol=1e-5)
      layers_checked += 1
  assert layers_checked == tiny.n_layers * 9  # four attention, three MLP weights, two norms
