r"""What a message would cost with its indices coded as sets: today, Elias-Fano, the bound.

A chunk's k indices are a set of k of its n positions, so they need only
``log2 C(n, k)`` bits, against ``k * ceil(log2 n)`` in today's format. This
prints, for a model preset's params and a list of top-ks, the bytes of one
worker's message in today's format (``distro_jax.wire.wire_layout``), with Elias-Fano
indices (a fixed-size code: per chunk ``k * L`` low bits plus a unary bitmap
of ``k + ceil(n / 2**L)`` bits for the high parts, ``L = floor(log2(n / k))``),
and at the ``log2 C(n, k)`` bound. Both set codings carry no order, so their
values cost what they cost unordered: k sign bits per chunk with 1-bit values
(today's format sends half of them in the order of index pairs), the
parameter dtype otherwise. Nothing is trained; the counts come from the
layout alone.

  python -m experiments.index_cost                                  # small, 1-bit values
  python -m experiments.index_cost --preset=medium --topks=8,32 --noquantize_1bit
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from absl import app, flags

from distro_jax import wire
from experiments.run import cli, config, presets
from experiments.run.model import abstract_params


class IndexCost(NamedTuple):
  """One worker's message bytes at one top-k, per index coding."""

  topk: int
  today: int
  elias_fano: int
  bound: int


def elias_fano_bits(n: int, k: int) -> int:
  """Bits of an Elias-Fano code of k distinct positions out of n (indices only)."""
  if k >= n:
    return 0  # every position is kept: nothing to say
  low = max(0, math.floor(math.log2(n / k)))
  return k * low + k + math.ceil(n / 2**low)


def bound_bits(n: int, k: int) -> float:
  """``log2 C(n, k)``: the fewest bits that tell k of n positions apart."""
  return math.log2(math.comb(n, k))


def index_costs(
  params: Any, topks: Sequence[int], *, compression_chunk: int = 64, quantize_1bit: bool = True
) -> list[IndexCost]:
  """Message bytes per top-k for ``params`` in today's format and with set-coded indices.

  Args:
    params: a params tree, or its shapes (``jax.ShapeDtypeStruct`` leaves).
    topks: the top-ks to count.
    compression_chunk: the chunk target, as given to :func:`distro_jax.demo`.
    quantize_1bit: 1-bit values (k sign bits per chunk when set-coded), else
      values in each parameter's dtype.

  Returns:
    One :class:`IndexCost` per top-k, in the order given.
  """
  out = []
  for k in topks:
    layout = wire.wire_layout(
      params, compression_topk=k, compression_chunk=compression_chunk, quantize_1bit=quantize_1bit
    )
    ef_bits = bound = 0.0
    for t in layout.tensors:
      value_bits = t.k if quantize_1bit else t.k * 8 * np.dtype(t.value_dtype).itemsize
      ef_bits += t.rows * (elias_fano_bits(t.chunk_size, t.k) + value_bits)
      bound += t.rows * (bound_bits(t.chunk_size, t.k) + value_bits)
    out.append(IndexCost(k, layout.num_bytes, math.ceil(ef_bits / 8), math.ceil(bound / 8)))
  return out


def _report(preset: str, topks: tuple[int, ...], chunk: int, quantize_1bit: bool) -> None:
  params = abstract_params(presets.get_preset(preset))
  values = "1-bit values" if quantize_1bit else "values in the param dtype"
  print(f"preset {preset}, chunk {chunk}, {values}: bytes per worker per step")
  print("| top-k | today | Elias-Fano | log2 C(n, k) |")
  print("| ---: | ---: | ---: | ---: |")
  for row in index_costs(params, topks, compression_chunk=chunk, quantize_1bit=quantize_1bit):
    print(
      f"| {row.topk} | {row.today:,} B | {row.elias_fano:,} B ({row.elias_fano / row.today:.2f}x) "
      f"| {row.bound:,} B ({row.bound / row.today:.2f}x) |"
    )


def _checked(preset: str, topks: Sequence[str], chunk: int) -> tuple[str, tuple[int, ...], int]:
  """The flags as ``_report`` takes them; each error names its flag and the fix."""
  config.checked_preset(preset)
  ks = config.positive_ints("topks", topks, "4,8,32", wants="top-ks of 1 or more")
  return preset, ks, config.checked_chunk(chunk)


def main(argv: Sequence[str] | None = None) -> None:
  """The command; its flags are defined here, not at import."""
  preset = flags.DEFINE_string("preset", "small", "Model preset (experiments/run/presets.py).")
  topks = flags.DEFINE_list("topks", ["4", "8", "32", "128"], "Top-ks to count.")
  chunk = flags.DEFINE_integer("compression_chunk", 64, "DeMo's chunk target.")
  one_bit = flags.DEFINE_boolean("quantize_1bit", True, "Count 1-bit values.")

  def run(argv: Sequence[str]) -> None:
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")

    def report() -> None:
      _report(*_checked(preset.value, topks.value, chunk.value), one_bit.value)

    cli.report_user_errors(report)

  app.run(run, argv=argv)


if __name__ == "__main__":
  main()
