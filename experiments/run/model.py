"""A Llama-2-style decoder-only language model in Flax NNX.

Pre-norm blocks of [RMSNorm -> causal attention with RoPE (and optional
grouped-query attention) -> residual; RMSNorm -> SwiGLU MLP -> residual], no
biases. Every weight is a plain 2-D matrix, e.g. ``wq`` is
``(d_model, n_heads * head_dim)``, so an optimizer that chunks the last two axes
(DeMo's DCT) sees natural matrices rather than head-split 3-D tensors.

The module holds only ``nnx.Param`` state, so a pure train step is just::

  graphdef, params = nnx.split(model, nnx.Param)

  @jax.jit
  def logits_fn(params, tokens_BxL):
    return nnx.merge(graphdef, params)(tokens_BxL)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

_INIT_STD = 0.02


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a :class:`Llama` model.

  Attributes:
    vocab_size: Number of token ids (256 for byte-level data).
    d_model: Residual stream width.
    n_layers: Number of transformer blocks.
    n_heads: Query heads; ``d_model // n_heads`` is the head width.
    n_kv_heads: Key/value heads. Fewer than ``n_heads`` gives grouped-query
      attention; it must divide ``n_heads``.
    d_ff: Hidden width of the SwiGLU MLP.
    max_seq_len: Longest sequence the model accepts.
    tie_embeddings: Reuse the token embedding as the output projection.
    rope_theta: RoPE base frequency.
    norm_eps: RMSNorm epsilon.
    param_dtype: Storage dtype of the weights, e.g. ``"float32"``.
    compute_dtype: Dtype of the matmuls, e.g. ``"bfloat16"``. Norms, softmax
      and logits are always computed in float32.
    scan_layers: Hold the blocks' weights stacked, one ``(n_layers, ...)``
      array per kind of weight, and run the blocks with a scan, as MaxText's
      ``scan_layers`` does. The program is then one block, not ``n_layers``,
      and DeMo's update, one pipeline per tensor, compiles about ten times
      faster at ``medium``'s sizes (``docs/performance.md``). Each layer's
      norm scale is then a ``(1, d_model)`` row, so DeMo cuts the same chunks
      and sends the same bytes as for separate layers
      (``tests/test_stacked_layers.py``).
  """

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  d_ff: int
  max_seq_len: int
  tie_embeddings: bool = False
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  scan_layers: bool = False

  def __post_init__(self) -> None:
    for name in (
      "vocab_size",
      "d_model",
      "n_layers",
      "n_heads",
      "n_kv_heads",
      "d_ff",
      "max_seq_len",
    ):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}.")
    if self.d_model % self.n_heads:
      raise ValueError(
        f"ModelConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}); "
        "choose n_heads among the divisors of d_model."
      )
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
        f"ModelConfig.n_heads ({self.n_heads}) must be divisible by n_kv_heads "
        f"({self.n_kv_heads}); choose n_kv_heads among the divisors of n_heads."
      )
    if self.head_dim % 2:
      raise ValueError(
        f"ModelConfig head_dim = d_model // n_heads = {self.head_dim} must be even for RoPE; "
        "change d_model or n_heads."
      )
    if self.rope_theta <= 0:
      raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}.")
    if self.norm_eps <= 0:
      raise ValueError(f"ModelConfig.norm_eps must be > 0, got {self.norm_eps}.")
    for name in ("param_dtype", "compute_dtype"):
      value = getattr(self, name)
      try:
        dtype = jnp.dtype(value)
      except TypeError as e:
        raise ValueError(
          f"ModelConfig.{name}={value!r} is not a dtype name; use e.g. 'float32' or 'bfloat16'."
        ) from e
      if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
          f"ModelConfig.{name}={value!r} must be a floating dtype, e.g. 'float32' or 'bfloat16'."
        )

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads


def _normal(key: jax.Array, shape: tuple[int, ...], std: float, dtype: jnp.dtype) -> jax.Array:
  return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class RMSNorm(nnx.Module):
  """Root-mean-square norm with a learned per-feature scale."""

  def __init__(
    self,
    dim: int,
    *,
    eps: float,
    param_dtype: jnp.dtype,
    compute_dtype: jnp.dtype,
    as_row: bool = False,
  ):
    # In a stack of layers each scale is a (1, dim) row, so the stack is
    # (n_layers, 1, dim) and DeMo chunks each layer's scale on its own, as it
    # does a separate layer's. An (n_layers, dim) stack would be cut into
    # chunks that span the layers, with one top-k across them.
    self.scale = nnx.Param(jnp.ones((1, dim) if as_row else (dim,), param_dtype))
    self.eps = eps
    self.compute_dtype = compute_dtype

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    # Statistics in float32: bf16 mean-of-squares loses too much precision.
    x = x_BxLxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * self.scale[...].astype(jnp.float32)).astype(self.compute_dtype)


def _rope(x_BxLxHxK: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding, half-split (rotate-half) layout, positions 0..L-1."""
  L, K = x_BxLxHxK.shape[1], x_BxLxHxK.shape[3]
  inv_freq_F = theta ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)
  angle_LxF = jnp.arange(L, dtype=jnp.float32)[:, None] * inv_freq_F[None, :]
  cos_1xLx1xF = jnp.cos(angle_LxF)[None, :, None, :]
  sin_1xLx1xF = jnp.sin(angle_LxF)[None, :, None, :]
  x = x_BxLxHxK.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate(
    [x1 * cos_1xLx1xF - x2 * sin_1xLx1xF, x2 * cos_1xLx1xF + x1 * sin_1xLx1xF], axis=-1
  )
  return out.astype(x_BxLxHxK.dtype)


class Attention(nnx.Module):
  """Causal multi-head attention with RoPE and optional grouped-query heads."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    pdt = jnp.dtype(c.param_dtype)
    out_std = _INIT_STD / math.sqrt(2 * c.n_layers)
    self.wq = nnx.Param(_normal(rngs.params(), (c.d_model, c.n_heads * c.head_dim), _INIT_STD, pdt))
    self.wk = nnx.Param(
      _normal(rngs.params(), (c.d_model, c.n_kv_heads * c.head_dim), _INIT_STD, pdt)
    )
    self.wv = nnx.Param(
      _normal(rngs.params(), (c.d_model, c.n_kv_heads * c.head_dim), _INIT_STD, pdt)
    )
    self.wo = nnx.Param(_normal(rngs.params(), (c.n_heads * c.head_dim, c.d_model), out_std, pdt))
    self.config = c

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    c = self.config
    cdt = jnp.dtype(c.compute_dtype)
    B, L, _ = x_BxLxD.shape
    q_BxLxHxK = (x_BxLxD @ self.wq[...].astype(cdt)).reshape(B, L, c.n_heads, c.head_dim)
    k_BxLxGxK = (x_BxLxD @ self.wk[...].astype(cdt)).reshape(B, L, c.n_kv_heads, c.head_dim)
    v_BxLxGxK = (x_BxLxD @ self.wv[...].astype(cdt)).reshape(B, L, c.n_kv_heads, c.head_dim)
    q_BxLxHxK = _rope(q_BxLxHxK, c.rope_theta)
    k_BxLxGxK = _rope(k_BxLxGxK, c.rope_theta)
    # The XLA path broadcasts the G kv heads over H query heads itself and
    # keeps the attention logits and softmax in float32.
    o_BxLxHxK = jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, is_causal=True)
    return o_BxLxHxK.reshape(B, L, c.n_heads * c.head_dim) @ self.wo[...].astype(cdt)


class SwiGLU(nnx.Module):
  """MLP ``down(silu(gate(x)) * up(x))``."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    pdt = jnp.dtype(c.param_dtype)
    out_std = _INIT_STD / math.sqrt(2 * c.n_layers)
    self.w_gate = nnx.Param(_normal(rngs.params(), (c.d_model, c.d_ff), _INIT_STD, pdt))
    self.w_up = nnx.Param(_normal(rngs.params(), (c.d_model, c.d_ff), _INIT_STD, pdt))
    self.w_down = nnx.Param(_normal(rngs.params(), (c.d_ff, c.d_model), out_std, pdt))
    self.compute_dtype = jnp.dtype(c.compute_dtype)

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    cdt = self.compute_dtype
    gate_BxLxF = x_BxLxD @ self.w_gate[...].astype(cdt)
    up_BxLxF = x_BxLxD @ self.w_up[...].astype(cdt)
    return (jax.nn.silu(gate_BxLxF) * up_BxLxF) @ self.w_down[...].astype(cdt)


class Block(nnx.Module):
  """One pre-norm transformer block."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    pdt, cdt = jnp.dtype(config.param_dtype), jnp.dtype(config.compute_dtype)
    norm = lambda: RMSNorm(
      config.d_model,
      eps=config.norm_eps,
      param_dtype=pdt,
      compute_dtype=cdt,
      as_row=config.scan_layers,
    )
    self.attn_norm = norm()
    self.attn = Attention(config, rngs=rngs)
    self.mlp_norm = norm()
    self.mlp = SwiGLU(config, rngs=rngs)

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD))
    return x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD))


class Llama(nnx.Module):
  """Llama-2-style decoder-only LM: ``tokens_BxL -> logits_BxLxV`` (float32)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    pdt, cdt = jnp.dtype(c.param_dtype), jnp.dtype(c.compute_dtype)
    self.config = c
    self.embedding = nnx.Param(_normal(rngs.params(), (c.vocab_size, c.d_model), _INIT_STD, pdt))
    if c.scan_layers:
      # One Block whose every weight has a leading axis of n_layers, each
      # layer drawn from its own split of the key.
      @nnx.split_rngs(splits=c.n_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def stacked_blocks(rngs: nnx.Rngs) -> Block:
        return Block(c, rngs=rngs)

      self.blocks = stacked_blocks(rngs)
    else:
      # nnx.List, not a bare list: Flax NNX only tracks sub-modules held in
      # its own containers. Still a plain Python sequence, unrolled.
      self.blocks = nnx.List([Block(c, rngs=rngs) for _ in range(c.n_layers)])
    self.final_norm = RMSNorm(c.d_model, eps=c.norm_eps, param_dtype=pdt, compute_dtype=cdt)
    if not c.tie_embeddings:
      self.lm_head = nnx.Param(_normal(rngs.params(), (c.d_model, c.vocab_size), _INIT_STD, pdt))

  def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
    """Returns next-token logits, float32 of shape ``(B, L, vocab_size)``.

    Args:
      tokens_BxL: Integer token ids, with ``L <= config.max_seq_len``.
    """
    c = self.config
    cdt = jnp.dtype(c.compute_dtype)
    if tokens_BxL.ndim != 2:
      raise ValueError(f"tokens must be (batch, length), got shape {tokens_BxL.shape}.")
    if tokens_BxL.shape[1] > c.max_seq_len:
      raise ValueError(
        f"sequence length {tokens_BxL.shape[1]} exceeds max_seq_len={c.max_seq_len}; "
        "crop the input or raise ModelConfig.max_seq_len."
      )
    embedding_VxD = self.embedding[...]
    x_BxLxD = jnp.take(embedding_VxD, tokens_BxL, axis=0).astype(cdt)
    if c.scan_layers:

      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def through(x_BxLxD: jax.Array, block: Block) -> jax.Array:
        return block(x_BxLxD)

      x_BxLxD = through(x_BxLxD, self.blocks)
    else:
      for block in self.blocks:
        x_BxLxD = block(x_BxLxD)
    x_BxLxD = self.final_norm(x_BxLxD)
    head_DxV = embedding_VxD.T if c.tie_embeddings else self.lm_head[...]
    # float32 accumulation: the softmax over a 32k vocab is precision-sensitive.
    return jnp.matmul(x_BxLxD, head_DxV.astype(cdt), preferred_element_type=jnp.float32)


def next_token_loss(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
  """Mean cross-entropy of integer targets under the logits, in float32.

  The caller aligns the two: for a token batch ``t_BxL1`` use
  ``next_token_loss(model(t_BxL1[:, :-1]), t_BxL1[:, 1:])``.

  Args:
    logits_BxLxV: Unnormalized scores, any float dtype.
    targets_BxL: Integer ids in ``[0, V)``.

  Returns:
    A float32 scalar.
  """
  ce_BxL = optax.softmax_cross_entropy_with_integer_labels(
    logits_BxLxV.astype(jnp.float32), targets_BxL
  )
  return jnp.mean(ce_BxL)


def abstract_params(config: ModelConfig) -> nnx.State:
  """The ``nnx.Param`` state of a :class:`Llama` as ``jax.ShapeDtypeStruct`` leaves.

  Same tree structure as ``nnx.split(model, nnx.Param)[1]``, but nothing is
  allocated, so it serves byte accounting of the largest presets.
  """
  abstract_model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
  return nnx.state(abstract_model, nnx.Param)


def param_paths(config: ModelConfig) -> list[str]:
  """Each param's path as ``jax.tree_util.keystr`` writes it, in tree order.

  E.g. ``"['blocks'][0]['attn']['wq'].value"``: what ``--synchronous_params``
  is searched in.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(abstract_params(config))
  return [jax.tree_util.keystr(path) for path, _ in flat]


def param_count(config: ModelConfig) -> int:
  """Number of trainable parameters, computed without allocating them."""
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract_params(config)))
