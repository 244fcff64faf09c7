"""The hop probe: both collectives deliver every message in order, and the table reads them."""

import pytest

from experiments.netlab import hops, links
from experiments.netlab.hops import HopsConfig
from experiments.netlab.impair import Impairment

CANNOT_RUN = links.missing_prerequisite()


def test_table_gives_medians_over_processes_and_the_ratio_to_the_ring():
  rows = [
    {"all_gather": 0.30, "all_to_all": 0.15, "all_gather_again": 0.30},
    {"all_gather": 0.40, "all_to_all": 0.20, "all_gather_again": 0.40},
    {"all_gather": 0.35, "all_to_all": 0.10, "all_gather_again": 0.35},
  ]
  table = hops.summary_table({"far": rows})
  assert "| far | 0.350 s | 0.150 s | 0.350 s | 0.43x |" in table


@pytest.mark.slow
@pytest.mark.skipif(CANNOT_RUN is not None, reason=f"netlab cannot run: {CANNOT_RUN}")
def test_four_processes_on_a_delayed_link_take_fewer_hops_by_all_to_all():
  cfg = HopsConfig(processes=4, message_bytes=2048, iters=3, rate_mbit=100.0)
  # 20 ms one way per link, 40 ms between processes: the ring's three hops wait 120 ms at least.
  rows = hops.measure(cfg, Impairment(delay_ms=20.0))
  assert len(rows) == 4
  for r in rows:
    assert r["all_gather"] >= 0.12 and r["all_gather_again"] >= 0.12, r
    assert r["all_to_all"] < 0.75 * min(r["all_gather"], r["all_gather_again"]), r
