"""experiments.index_cost: the set codings it counts are real codes, and today is the wire."""

import itertools
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import distro_jax as dj
from experiments.bench import index_cost
from experiments.run.model import abstract_params
from experiments.run.presets import get_preset

ROOT = pathlib.Path(__file__).parent.parent


def _elias_fano(positions: np.ndarray, n: int) -> tuple[list[int], list[int], int]:
  """Elias-Fano of sorted positions: the low bits, then the high parts' gaps in unary."""
  k = len(positions)
  low = max(0, math.floor(math.log2(n / k)))
  lows = [int(p) & ((1 << low) - 1) for p in positions]
  unary, prev = [], 0
  for p in positions:
    high = int(p) >> low
    unary += [0] * (high - prev) + [1]
    prev = high
  return lows, unary, low


def _decode(lows: list[int], unary: list[int], low: int) -> list[int]:
  out, high, i = [], 0, 0
  for bit in unary:
    if bit:
      out.append((high << low) | lows[i])
      i += 1
    else:
      high += 1
  return out


@pytest.mark.parametrize(
  ("n", "k"), [(4096, 1), (4096, 4), (4096, 8), (4096, 32), (4096, 128), (64, 8)]
)
def test_every_set_fits_the_counted_elias_fano_bits_and_decodes(n, k):
  rng = np.random.default_rng(n * 1000 + k)
  worst = np.arange(n - k, n)  # the largest high parts: the longest unary part
  for positions in [worst, *(np.sort(rng.choice(n, k, replace=False)) for _ in range(50))]:
    lows, unary, low = _elias_fano(positions, n)
    used = len(lows) * low + len(unary)
    assert used <= index_cost.elias_fano_bits(n, k)
    assert _decode(lows, unary, low) == positions.tolist()


def test_the_bound_counts_the_sets():
  for n, k in [(8, 3), (10, 5), (12, 1), (12, 12)]:
    sets = sum(1 for _ in itertools.combinations(range(n), k))
    assert index_cost.bound_bits(n, k) == pytest.approx(math.log2(sets))


def test_today_is_the_wire_payload_and_the_set_codings_are_ordered():
  params = abstract_params(get_preset("small"))
  rows = index_cost.index_costs(params, [4, 8, 32, 128])
  for one_bit in (True, False):
    for row in index_cost.index_costs(params, [4, 32], quantize_1bit=one_bit):
      sent = dj.wire_bytes(params, compression_topk=row.topk, quantize_1bit=one_bit, num_workers=8)
      assert row.today == sent.payload
  assert [r.topk for r in rows] == [4, 8, 32, 128]
  for row in rows:
    assert row.bound <= row.elias_fano
  # The saving grows with k: index bits fall from 12 toward log2(4096 / k) + 2.
  shares = [r.elias_fano / r.today for r in rows]
  assert shares == sorted(shares, reverse=True)
  assert shares[-1] < 0.7 < 1.0 < shares[0]


@pytest.mark.slow  # a fresh process: a few seconds of imports
def test_the_command_prints_its_table():
  out = subprocess.run(
    [sys.executable, "-m", "experiments.index_cost", "--topks=8"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=180,
    check=False,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  params = abstract_params(get_preset("small"))
  (row,) = index_cost.index_costs(params, [8])
  assert f"| 8 | {row.today:,} B | {row.elias_fano:,} B" in out.stdout
