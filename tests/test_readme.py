"""The README's train step runs as written."""

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).parent.parent / "README.md"


@pytest.mark.slow  # a fresh process that trains both optimizers
def test_readme_train_step_runs_and_both_optimizers_learn():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
  code = next(b for b in blocks if "make_train_step" in b)
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
  )
  assert out.returncode == 0, out.stderr[-3000:]
  losses = {
    m[0]: (float(m[1]), float(m[2]))
    for m in re.findall(r"(\w+): loss ([\d.]+) -> ([\d.]+)", out.stdout)
  }
  assert set(losses) == {"demo", "adamw"}, out.stdout
  assert all(last < 0.7 * first for first, last in losses.values()), out.stdout
