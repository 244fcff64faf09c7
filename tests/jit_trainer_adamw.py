"""A minimal jit trainer in the shape of google-deepmind/nanodo, with AdamW: the "before".

Written here for docs/porting.md, which walks its port to DeMo
(``jit_trainer_demo.py``; ``tests/test_porting.py`` runs both and checks the
diff between them). Its shape is nanodo's: a linen model whose kernels carry
FSDP partitioning over the mesh axis ``"data"``, a ``TrainState`` placed by
``nn.get_sharding`` of its abstract value, ``optax.MultiSteps`` around every
optimizer (picked by the config), one ``jax.jit`` step with ``in_shardings``
and ``out_shardings`` whose loss closes over the batch, metrics from the step,
and an orbax checkpoint of the whole state.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import linen as nn
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 16
  features: int = 32
  hidden: int = 64
  batch_size: int = 64
  learning_rate: float = 3e-2
  warmup_steps: int = 5
  num_train_steps: int = 30
  grad_accumulation_steps: int = 2
  clip_by_global_norm: float = 1.0
  optimizer: str = "adamw"


class Mlp(nn.Module):
  """Two dense layers; the kernels are sharded over ``"data"`` (FSDP) as nanodo's are."""

  c: Config

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    x = nn.Dense(self.c.hidden, kernel_init=nn.with_partitioning(init, (None, "data")))(x)
    x = nn.gelu(x)
    return nn.Dense(self.c.vocab, kernel_init=nn.with_partitioning(init, ("data", None)))(x)


def get_loss_fn(batch, apply_fn):
  """The loss of ``batch``'s rows as a function of the params, as nanodo builds it."""

  def loss_fn(params):
    x, labels = batch
    logits = apply_fn({"params": params}, x)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.mean(losses), {"ntokens": jnp.asarray(labels.size, jnp.float32)}

  return loss_fn


def get_learning_rate_schedule(c):
  return optax.join_schedules(
    [
      optax.linear_schedule(0.0, c.learning_rate, c.warmup_steps),
      optax.cosine_decay_schedule(c.learning_rate, c.num_train_steps - c.warmup_steps, 0.1),
    ],
    [c.warmup_steps],
  )


def get_base_optimizer(c):
  # As nanodo: the config picks the optimizer.
  lr = get_learning_rate_schedule(c)
  if c.optimizer == "adamw":
    return optax.adamw(lr, b2=0.98, weight_decay=0.1)
  if c.optimizer == "lion":
    return optax.lion(lr, b2=0.99, weight_decay=0.1)
  raise ValueError(f"unknown optimizer {c.optimizer!r}")


def get_optimizer(c):
  tx = optax.chain(optax.clip_by_global_norm(c.clip_by_global_norm), get_base_optimizer(c))
  return optax.MultiSteps(tx, c.grad_accumulation_steps)


def make_mesh(c, devices):
  return Mesh(np.asarray(devices), ("data",))


def init_train_state(c, rng, mesh):
  """The sharded ``TrainState`` and its shardings, placed as nanodo places them."""
  model = Mlp(c)

  def init(rng):
    params = model.init(rng, jnp.zeros((1, c.features)))["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=get_optimizer(c))

  shardings = nn.get_sharding(jax.eval_shape(init, rng), mesh)
  return jax.jit(init, out_shardings=shardings)(rng), shardings


def train_step(state, batch, mesh):
  batch = jax.lax.with_sharding_constraint(batch, NamedSharding(mesh, P("data")))
  grad_fn = jax.value_and_grad(get_loss_fn(batch, state.apply_fn), has_aux=True)
  (loss, aux), grads = grad_fn(state.params)
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  return new_state, get_metrics(state, loss, aux, grads, updates)


def get_metrics(state, loss, aux, grads, updates):
  # As nanodo: the mean gradient of the accumulation so far, from the MultiSteps state.
  n = state.opt_state.mini_step + 1
  acc_grads = jax.tree.map(lambda a, g: a + (g - a) / n, state.opt_state.acc_grads, grads)
  return {
    "train_loss": loss,
    "train_ntokens": aux["ntokens"],
    "grads/norm": optax.tree.norm(acc_grads),
    "updates/norm": optax.tree.norm(updates),
    "params/norm": optax.tree.norm(state.params),
  }


def make_train_step(mesh, shardings):
  # As nanodo: the host feeds the whole batch, and the step shards it.
  return jax.jit(
    functools.partial(train_step, mesh=mesh),
    in_shardings=(shardings, NamedSharding(mesh, P())),
    out_shardings=(shardings, NamedSharding(mesh, P())),
    donate_argnames=("state",),
  )


def save_checkpoint(directory, state):
  with ocp.CheckpointManager(directory) as mngr:
    mngr.save(int(state.step), args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    mngr.wait_until_finished()


def restore_checkpoint(directory, state):
  """The latest checkpoint, restored onto the layout of ``state`` (built for this run)."""
  with ocp.CheckpointManager(directory) as mngr:
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    args = ocp.args.Composite(state=ocp.args.StandardRestore(target))
    state = mngr.restore(mngr.latest_step(), args=args)["state"]
  return state


def train(c, mesh, batches, state=None, rng=None):
  """Runs ``train_step`` over ``batches``; returns the state and every step's metrics."""
  if state is None:
    state, shardings = init_train_state(c, rng, mesh)
  else:
    shardings = jax.tree.map(lambda x: x.sharding, state)
  step_fn = make_train_step(mesh, shardings)
  history = []
  for batch in batches:
    state, metrics = step_fn(state, batch)
    history.append(jax.device_get(metrics))
  return state, history
