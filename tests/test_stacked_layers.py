"""Layers stacked into one array train as the separate layers do.

A model that keeps its layers stacked (one ``(layers, ...)`` array per kind of
weight, as a scanned model does) compiles DeMo's update about ten times
faster than one with a tensor per layer (docs/performance.md). That advice
holds only if stacking changes nothing else: the chunks, the bytes and the
values must be those of the separate tensors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distro_jax as dj

LAYERS = 3


@pytest.mark.parametrize(
  "kwargs", [{}, {"compression_topk": 8, "quantize_1bit": True}], ids=["defaults", "k8-1bit"]
)
def test_a_stack_of_layers_updates_as_its_layers_do(kwargs):
  rng = np.random.default_rng(0)
  grads_LxMxN = [rng.normal(size=(LAYERS, 128, 256)).astype(np.float32) for _ in range(3)]
  tx = dj.demo(1e-3, axis_name=None, **kwargs)

  stacked = {"w": jnp.zeros((LAYERS, 128, 256))}
  separate = {f"w{i}": jnp.zeros((128, 256)) for i in range(LAYERS)}
  assert dj.wire_bytes(stacked, **kwargs).payload == dj.wire_bytes(separate, **kwargs).payload

  update = jax.jit(tx.update)
  s_stacked, s_separate = tx.init(stacked), tx.init(separate)
  for g in grads_LxMxN:  # a few steps, so the momentum and error feedback count
    u_stacked, s_stacked = update({"w": jnp.asarray(g)}, s_stacked, stacked)
    u_separate, s_separate = update(
      {f"w{i}": jnp.asarray(g[i]) for i in range(LAYERS)}, s_separate, separate
    )
    for i in range(LAYERS):
      np.testing.assert_array_equal(np.asarray(u_stacked["w"][i]), np.asarray(u_separate[f"w{i}"]))


def test_a_stack_of_vectors_needs_a_row_axis_to_update_as_its_vectors_do():
  # A vector (d,) is chunked as a (1, d) row. Stacked as (layers, d), the
  # layers would become the chunks' first axis, with one top-k across layers;
  # as (layers, 1, d) they stay a batch axis, as a scanned model's norm
  # scales do (experiments/run/model.py).
  rng = np.random.default_rng(1)
  grads_Lx1xD = [rng.normal(size=(LAYERS, 1, 256)).astype(np.float32) for _ in range(3)]
  tx = dj.demo(1e-3, axis_name=None)
  rows = {"s": jnp.zeros((LAYERS, 1, 256))}
  separate = {f"s{i}": jnp.zeros((256,)) for i in range(LAYERS)}
  assert dj.wire_bytes(rows).payload == dj.wire_bytes(separate).payload
  assert dj.wire_bytes({"s": jnp.zeros((LAYERS, 256))}).payload < dj.wire_bytes(separate).payload

  update = jax.jit(tx.update)
  s_rows, s_separate = tx.init(rows), tx.init(separate)
  for g in grads_Lx1xD:
    u_rows, s_rows = update({"s": jnp.asarray(g)}, s_rows, rows)
    u_separate, s_separate = update(
      {f"s{i}": jnp.asarray(g[i, 0]) for i in range(LAYERS)}, s_separate, separate
    )
    for i in range(LAYERS):
      np.testing.assert_array_equal(np.asarray(u_rows["s"][i, 0]), np.asarray(u_separate[f"s{i}"]))


@pytest.mark.parametrize("preset", ["tiny", "small", "medium"])
def test_a_scanned_preset_sends_the_bytes_of_its_separate_layers(preset):
  from experiments.run.model import abstract_params
  from experiments.run.presets import get_preset

  separate = abstract_params(get_preset(preset))
  scanned = abstract_params(get_preset(preset, scan_layers=True))
  assert len(jax.tree.leaves(scanned)) < len(jax.tree.leaves(separate))
  for kwargs in [{}, {"compression_topk": 8, "quantize_1bit": True}]:
    assert dj.wire_bytes(scanned, **kwargs).payload == dj.wire_bytes(separate, **kwargs).payload
