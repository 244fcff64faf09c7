"""The same seed gives the same run to the bit; another seed does not.

SIGKILL mid-run and the resume after it are in ``test_interrupted_runs.py``.
"""

import pytest
from tiny_runs import read_metrics, run_tiny

# Whole runs: deselect with -m "not slow" while working.
pytestmark = pytest.mark.slow


def _losses(out_dir):
  return [(r.step, r.loss, r.val_loss) for r in read_metrics(out_dir)]


def test_same_seed_gives_bit_identical_losses_and_another_seed_differs(tmp_path):
  a = run_tiny(tmp_path / "a", steps=5, eval_every=5)
  b = run_tiny(tmp_path / "b", steps=5, eval_every=5)
  c = run_tiny(tmp_path / "c", steps=5, eval_every=5, seed=1)
  assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
  assert a.params_digest == b.params_digest
  # The seed reaches both the init and the data order, so every loss moves.
  assert all(x[1] != y[1] for x, y in zip(_losses(tmp_path / "a"), _losses(tmp_path / "c")))
  assert a.params_digest != c.params_digest
