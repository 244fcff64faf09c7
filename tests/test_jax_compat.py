"""The library on a jax without ``jax.experimental.shard_alike`` (jax 0.11.2 has none).

The first import on a GPU machine with jax 0.11.2 failed there; these tests
hide the module and check that the library imports, trains and says what it
loses (the auto-mesh sharding hint), with the same values.
"""

import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import distro_jax as dj
from distro_jax import dct


def test_imports_and_updates_without_experimental_shard_alike():
  script = textwrap.dedent(
    """
    import sys
    sys.modules["jax.experimental.shard_alike"] = None  # import now raises ImportError
    import jax, jax.numpy as jnp
    import distro_jax as dj
    params = {"w": jnp.ones((64, 128)), "b": jnp.ones((128,))}
    tx = dj.demo(1e-3, axis_name=None)
    updates, _ = jax.jit(tx.update)(params, tx.init(params), params)
    assert all(bool(jnp.isfinite(u).all()) for u in jax.tree.leaves(updates))
    print("shard_alike:", dj.dct.shard_alike)
    """
  )
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "shard_alike:" in done.stdout


def _auto_mesh_update(params, grads):
  tx = dj.demo(1e-3, axis_name=None)
  update = jax.jit(tx.update)
  state = jax.jit(tx.init)(params)
  updates, state = update(grads, state, params)
  return update(grads, state, params)


def test_auto_mesh_without_shard_alike_warns_and_gives_the_same_values(monkeypatch):
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
  sharding = NamedSharding(mesh, P(None, "x"))
  rng = np.random.default_rng(0)
  params = {"w": jax.device_put(rng.normal(size=(64, 512)).astype(np.float32), sharding)}
  grads = {"w": jax.device_put(rng.normal(size=(64, 512)).astype(np.float32), sharding)}
  want_updates, want_state = _auto_mesh_update(params, grads)

  monkeypatch.setattr(dct, "shard_alike", None)
  dct._warn_no_shard_alike.cache_clear()
  with pytest.warns(UserWarning, match="AxisType.Explicit"):
    updates, state = _auto_mesh_update(params, grads)
  np.testing.assert_array_equal(np.asarray(updates["w"]), np.asarray(want_updates["w"]))
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(want_state), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
