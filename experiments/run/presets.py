"""Named model sizes, smallest to largest.

``tiny`` and ``small`` run on a laptop CPU, ``base`` is a ~10M byte-level
model, and the rest are for accelerators: ``medium`` (~110M), ``1b``
(OLMo-1B-like) and ``report-1.2b``, the 1.2B Llama-2 of the DisTrO preliminary
report.

  python -m experiments.presets   # prints the table
"""

from __future__ import annotations

import dataclasses

from experiments.run.model import ModelConfig, param_count

# d_ff = 8/3 * d_model, Llama's SwiGLU ratio.
_BASE = ModelConfig(
  vocab_size=256,
  d_model=384,
  n_layers=6,
  n_heads=6,
  n_kv_heads=6,
  d_ff=1024,
  max_seq_len=512,
)

PRESETS: dict[str, ModelConfig] = {
  # CPU smoke test; exercises grouped-query attention (2 kv heads for 4 heads).
  "tiny": ModelConfig(
    vocab_size=256,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=192,
    max_seq_len=256,
  ),
  # Trains to a visibly falling loss in minutes on 2 CPU cores.
  "small": ModelConfig(
    vocab_size=256,
    d_model=128,
    n_layers=4,
    n_heads=4,
    n_kv_heads=4,
    d_ff=384,
    max_seq_len=256,
  ),
  # ``base`` with 4 of its 6 layers: 7.3M, the size netlab's headline asks for.
  "mini": dataclasses.replace(_BASE, n_layers=4),
  "base": _BASE,
  # GPT-2-small-sized body; tied so the 32k-token embedding is counted once.
  "medium": ModelConfig(
    vocab_size=32000,
    d_model=768,
    n_layers=12,
    n_heads=12,
    n_kv_heads=12,
    d_ff=2048,
    max_seq_len=1024,
    tie_embeddings=True,
  ),
  # OLMo-1B shapes (DeMo paper's 1B): 16 x 2048, MLP 8192, tied, padded GPT-NeoX vocab.
  "1b": ModelConfig(
    vocab_size=50304,
    d_model=2048,
    n_layers=16,
    n_heads=16,
    n_kv_heads=16,
    d_ff=8192,
    max_seq_len=2048,
    tie_embeddings=True,
  ),
  # DisTrO report: Llama-2, 16 layers, hidden 2048, 16 heads, 32k vocab, untied.
  # d_ff 8192 is what makes it 1.2B (5632, Llama's 8/3 rounding, gives only
  # 0.95B) and matches the report's 74.4 GB/step: 1.2e9 bf16 grads x 31 peers.
  "report-1.2b": ModelConfig(
    vocab_size=32000,
    d_model=2048,
    n_layers=16,
    n_heads=16,
    n_kv_heads=16,
    d_ff=8192,
    max_seq_len=2048,
  ),
}


def get_preset(name: str, *, scan_layers: bool = False) -> ModelConfig:
  """The :class:`ModelConfig` called ``name`` in :data:`PRESETS`.

  Args:
    name: a key of :data:`PRESETS`.
    scan_layers: the same model with its layers stacked and scanned
      (:attr:`ModelConfig.scan_layers`).

  Raises:
    ValueError: ``name`` is not a preset.
  """
  try:
    config = PRESETS[name]
  except KeyError:
    raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
  return dataclasses.replace(config, scan_layers=True) if scan_layers else config


def describe_presets(num_workers: int = 8) -> str:
  """A table of every preset, built under ``jax.eval_shape`` (nothing is allocated).

  Besides the shape it gives the DeMo payload per worker per step at the
  reference defaults (top-k 32, chunk 64, values in fp32) and at Psyche's
  top-k 8 with 1-bit values, and the ring all-reduce it replaces.
  """
  import distro_jax as dj
  from experiments.run.model import abstract_params

  header = (
    f"{'name':<12} {'params':>14} {'layers':>6} {'d_model':>7} {'heads':>5} {'kv':>3} "
    f"{'d_ff':>5} {'vocab':>6} {'tied':>5} {'payload k32':>12} {'payload k8 1bit':>15} "
    f"{'ring all-reduce':>16}"
  )
  rows = [header]
  for name, c in PRESETS.items():
    params = abstract_params(c)
    default = dj.wire_bytes(params, num_workers=num_workers)
    psyche = dj.wire_bytes(params, num_workers=num_workers, compression_topk=8, quantize_1bit=True)
    rows.append(
      f"{name:<12} {param_count(c):>14,} {c.n_layers:>6} {c.d_model:>7} {c.n_heads:>5} "
      f"{c.n_kv_heads:>3} {c.d_ff:>5} {c.vocab_size:>6} {c.tie_embeddings!s:>5} "
      f"{default.payload:>12,} {psyche.payload:>15,} {default.ring_allreduce:>16,.0f}"
    )
  rows.append(
    f"(bytes per worker per step; ring all-reduce of the fp32 gradient at W={num_workers})"
  )
  return "\n".join(rows)


def main() -> None:
  """``python -m experiments.presets``: the table of every preset."""
  print(describe_presets())


if __name__ == "__main__":
  main()
