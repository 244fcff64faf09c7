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
