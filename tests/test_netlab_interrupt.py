"""netlab --kill_step: a training process killed mid-run, the run continued on the survivors.

The figures and the flag checks run everywhere. The drill itself runs in
tests/test_netlab.py, on the same lab run as the shaped and unshaped
comparison (it needs root and iproute2, and is slow).
"""

import pytest

from experiments.netlab import lab, links, report, results
from experiments.run.records import ResizeEvent, StepRecord


def _rec(step, t, loss=1.0, val=None):
  return StepRecord(step=step, loss=loss, wall_time=t, bytes_sent=1, lr=0.1, tokens_per_s=1,
                    val_loss=val)  # fmt: skip


def test_figures_count_steps_redone_and_wall_time_lost():
  # Killed after step 7; the last checkpoint was step 5; the survivors start 20 s later.
  first = [_rec(s, 100.0 + s) for s in range(1, 8)]
  second = [_rec(s, 130.0 + s, loss=0.9) for s in range(6, 11)]
  final = results.RunResult("demo-interrupted", True, first[:5] + second, None, started_at=99.0)
  run = results.InterruptedRun(
    method="demo",
    killed_process=3,
    kill_step=7,
    killed_at=108.0,
    attempts=[results.Attempt(4, 99.0, first), results.Attempt(3, 110.0, second)],
    final=final,
    events=[ResizeEvent(5, 120.0, 4, 3, 4, 3, [3], [], "fold", 0)],
    survivors_exit={"exit_codes": [76, 76, 76], "seconds": 21.0, "lines": []},
  )
  reference = results.RunResult("demo", True, [_rec(s, 100.0 + s, 0.8, 0.7) for s in range(1, 11)],
                               None, started_at=99.0)  # fmt: skip
  f = report.interruption_figures(run, reference)
  assert (f["kill_step"], f["resumed_from_step"], f["steps_redone"]) == (7, 5, 2)
  assert f["processes"] == [4, 3] and f["killed_process"] == 3
  assert f["seconds_to_regain_kill_step"] == pytest.approx(137.0 - 108.0)
  assert f["wall_s_interrupted"] == pytest.approx(140.0 - 99.0)
  assert f["wall_s_uninterrupted"] == pytest.approx(110.0 - 99.0)
  assert f["wall_s_lost"] == pytest.approx(30.0)
  assert (f["final_loss_interrupted"], f["final_loss_uninterrupted"]) == (0.9, 0.8)
  assert f["final_val_loss_uninterrupted"] == 0.7
  rows = report._interruption_rows({"demo": {"interrupted": f}})
  row = "| demo | 4 -> 3 | 7 | exit 76 after 21.0 s | 5 | 2 | 29.0 s | 41.0 s | 11.0 s | 30.0 s |"
  assert row in "\n".join(rows)
  assert report._interruption_rows({"demo": {}}) == []


def test_kill_drill_flags_default_to_a_batch_the_survivors_divide_and_checkpoints():
  flags = lab.driver_flags([], 4, kill=True)
  assert "--batch_size=12" in flags and "--checkpoint_every=10" in flags
  assert "--batch_size=4" in lab.driver_flags([], 4)


@pytest.mark.parametrize(
  ("changes", "passthrough", "match"),
  [
    ({"kill_step": 60}, [], "must be in \\[1, --steps=60\\)"),
    ({"kill_step": 5}, [], "needs a checkpoint before it"),
    ({"kill_step": 20}, ["--checkpoint_every=0"], "needs a checkpoint before it"),
    ({"kill_step": 20}, ["--batch_size=8"], "--batch_size=12 or a multiple"),
    ({"kill_step": 20, "rejoin_step": 10}, [], "must be after --kill_step=20"),
    ({"kill_step": 20, "kill_process": 4}, [], "not one of the 4 processes"),
  ],
)
def test_kill_drill_that_cannot_work_is_refused(changes, passthrough, match):
  cfg = lab.LabConfig(processes=4, steps=60, **changes)
  with pytest.raises(links.NetlabError, match=match):
    lab._check(cfg, passthrough)
