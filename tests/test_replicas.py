"""Every worker ends every step with bit-identical parameters."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_step import mesh_of, per_device_copies

import distro_jax as dj


def _mlp_loss(params, x_BxD, y_B):
  h = jnp.tanh(x_BxD @ params["w1"] + params["b1"])
  pred = (h @ params["w2"]).squeeze(-1) * params["scale"]
  return jnp.mean((pred - y_B) ** 2)


DRAWN = dict(compression_topk=2, compression_chunk=8, quantize_1bit=True, random_positions=True)
# The compression options each run's lookahead needs (those of its dj.demo).
LOOKAHEAD = {"demo-delayed-drawn": DRAWN}


IDS = [
  "demo",
  "demo-k4-1bit",
  "demo-k2-c8-random",
  "distro_adamw",
  "sparseloco-h3",
  "sparseloco-h2-drawn-orth",
  "demo-partial",
  "demo-delayed-drawn",
  "demo-drawn-rms",
  "demo-drawn-orth",
  "demo-groups",
]


def _quick_first(factories):
  """The defaults stay in the quick loop; each other optimizer compiles a step of its own."""
  return [
    pytest.param(f, id=i, marks=() if i == "demo" else pytest.mark.slow)
    for f, i in zip(factories, IDS)
  ]


@pytest.mark.parametrize(
  "make_tx",
  _quick_first(
    [
      lambda: dj.demo(3e-3, weight_decay=0.01),
      lambda: dj.demo(3e-3, compression_topk=4, quantize_1bit=True),
      # Positions drawn on every worker from the step and the sender's index.
      lambda: dj.demo(3e-3, compression_topk=2, compression_chunk=8, random_positions=True),
      lambda: dj.distro_adamw(3e-3, weight_decay=0.01, compression_topk=8),
      lambda: dj.sparseloco(optax.adamw(3e-3), sync_every=3, compression_topk=16),
      # DeMo's drawn 1-bit message every 2 local steps, each matrix's mean
      # orthogonalized on every worker.
      lambda: dj.sparseloco(
        optax.adamw(3e-3),
        sync_every=2,
        outer_learning_rate=6e-3,
        use_dct=True,
        value_bits=1,
        random_positions=True,
        frequency_bias=1.0,
        normalize="orth",
        **{k: DRAWN[k] for k in ("compression_topk", "compression_chunk")},
      ),
      # A partial overlap: the weights exchanged in their own step, the rest
      # one step late, each worker looking ahead from its own momentum.
      lambda: dj.demo(
        3e-3, delayed_apply=True, synchronous=lambda p: {k: k.startswith("w") for k in p}
      ),
      # Overlapped with drawn positions: the message in flight is decoded at the
      # positions its senders drew a step before.
      lambda: dj.demo(3e-3, delayed_apply=True, **DRAWN),
      # Each tensor's step at unit RMS: a mean over the tensor, on every worker.
      lambda: dj.demo(3e-3, normalize="rms", **DRAWN),
      # Each matrix's step orthogonalized (matmuls on every worker), the
      # vector at unit RMS.
      lambda: dj.demo(3e-3, normalize="orth", **DRAWN),
      # Groups of params with their own message sizes (--compression_groups):
      # one DeMo, message and all-gather per group.
      lambda: optax.multi_transform(
        {
          "w": dj.demo(3e-3, normalize="rms", **{**DRAWN, "compression_chunk": 16}),
          "rest": dj.demo(3e-3, normalize="rms", **{**DRAWN, "compression_topk": 1}),
        },
        lambda p: {k: "w" if k.startswith("w") else "rest" for k in p},
      ),
    ]
  ),
)
def test_params_bit_identical_on_8_workers_after_20_steps(make_tx, request):
  workers = 8
  mesh = mesh_of(workers)
  rng = np.random.default_rng(0)
  params = {
    "w1": jnp.asarray(rng.normal(size=(24, 96)) * 0.3, jnp.float32),
    "b1": jnp.zeros((96,), jnp.float32),
    "w2": jnp.asarray(rng.normal(size=(96, 1)) * 0.3, jnp.float32),
    "scale": jnp.ones((), jnp.float32),
  }
  tx = make_tx()
  look = LOOKAHEAD.get(request.node.callspec.id, {})
  if "sparseloco" in request.node.callspec.id:
    # Per-worker inner params cannot hold a scalar (see init_worker_state's error).
    params["scale"] = jnp.ones((1,), jnp.float32)
  specs = dj.worker_state_specs(tx, params, mesh)
  state = dj.init_worker_state(tx, params, mesh)
  params = jax.device_put(params, NamedSharding(mesh, P()))

  @jax.jit
  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(P(), specs, P("data"), P("data")),
    out_specs=(P(), specs, P()),
  )
  def train_step(params, opt_state, x_BxD, y_B):
    # SparseLoCo's workers take their gradients at their own inner params, an
    # overlapped exchange's at its own lookahead.
    at = dj.worker_local(dj.gradient_point(opt_state, params, 3e-3, **look))
    loss, grads = dj.local_value_and_grad(_mlp_loss)(at, x_BxD, y_B)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

  w_true = rng.normal(size=(24,))
  losses = []
  for _ in range(20):
    x = rng.normal(size=(workers * 16, 24)).astype(np.float32)  # a different batch per worker
    y = np.sin(x @ w_true).astype(np.float32)
    sharded = NamedSharding(mesh, P("data"))
    params, state, loss = train_step(
      params, state, jax.device_put(x, sharded), jax.device_put(y, sharded)
    )
    losses.append(float(loss))
    for leaf in jax.tree.leaves(params):
      copies = per_device_copies(leaf)
      assert len(copies) == workers
      for c in copies[1:]:
        np.testing.assert_array_equal(c.view(np.uint32), copies[0].view(np.uint32))

  # The workers really did see different data: their local momenta differ.
  demo_states = [
    x
    for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, dj.DemoState))
    if isinstance(x, dj.DemoState)
  ]
  own = demo_states[0].momentum if demo_states else state.error_feedback
  per_worker = np.asarray(jax.tree.leaves(own)[0]).reshape(workers, -1)
  assert not np.array_equal(per_worker[0], per_worker[1])
  assert losses[-1] < losses[0]
