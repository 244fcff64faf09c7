"""The colab/ notebooks run top to bottom, headless, as a fresh kernel sees them.

Each notebook has one cell tagged ``parameters`` (papermill's convention). The
test inserts a cell after it with small settings, runs the notebook through
nbclient in a new kernel, and then runs a few checks in that kernel against the
values the notebook computed. The kernel starts without a device count in
``XLA_FLAGS`` and without ``JAX_PLATFORMS``, so the notebook must set up its 8
simulated devices itself, as it must in Colab.
"""

from __future__ import annotations

import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

# Whole notebooks: deselect with -m "not slow" while working.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
COLAB = ROOT / "colab"

# Small settings: every notebook still trains, measures and plots, in seconds.
SMALL = {
  "01_quickstart.ipynb": {"STEPS": 20, "SEQ_LEN": 32, "BATCH_SIZE": 16, "WARMUP_STEPS": 5},
  "02_anatomy_of_compression.ipynb": {
    "PRESET": "tiny",
    "TRAIN_STEPS": 5,
    "BATCH_SIZE": 8,
    "SEQ_LEN": 32,
  },
  "03_distro_in_miniature.ipynb": {
    "STEPS": 8,
    "METHODS": ["adamw", "demo"],
    "BATCH_SIZE": 16,
    "SEQ_LEN": 32,
    "EVAL_EVERY": 4,
  },
}

# Run in the notebook's kernel after its last cell: what the figures claim must hold.
CHECKS = {
  "01_quickstart.ipynb": """
for _name, _run in runs.items():
  assert np.isfinite(_run["losses"]).all(), (_name, _run["losses"])
  assert copies_identical(_run["params"]), f"{_name}: replicas differ"
# The computed payload is exactly what enters DeMo's one all-gather.
_demo = runs["demo"]["measured"].by_kind
assert _demo["all-gather"] == wire.payload, (_demo, wire.payload)
assert _demo["all-reduce"] < 64, _demo  # only the logged loss
# AdamW all-reduces the whole fp32 gradient, besides the loss both steps log.
assert runs["adamw"]["measured"].by_kind["all-reduce"] - _demo["all-reduce"] == wire.grad_fp32
""",
  "02_anatomy_of_compression.ipynb": """
for _label, _frac in curves.items():
  assert np.all(np.diff(_frac) >= -1e-6), _label  # more coefficients never hold less
  assert abs(_frac[-1] - 1) < 1e-4, (_label, _frac[-1])  # a whole chunk holds everything
# Keeping every coefficient reconstructs the momentum (the DCT is orthonormal).
assert message_quality(momentum, COMPRESSION_CHUNK**2, False, True)[0] < 1e-4
# Error feedback loses nothing: what was sent and what stayed make up the momentum.
for _h in history:
  _parts = _h["sent"] ** 2 + _h["residual"] ** 2
  assert abs(_parts - _h["momentum"] ** 2) <= 1e-4 * _h["momentum"] ** 2, _h
assert int(mask.sum()) == plan.rows * min(COMPRESSION_TOPK, plan.chunk_size)
assert all(_s.dtype == jnp.int32 and int(_s.max()) <= TRAIN_STEPS for _s in sent_count)
""",
  "03_distro_in_miniature.ipynb": """
import math

assert [r["method"] for r in rows] == METHODS
_by = {r["method"]: r for r in rows}
for _r in rows:
  assert math.isfinite(_r["final_val_loss"]), _r
  assert os.path.exists(os.path.join(OUT_DIR, _r["method"], "metrics.jsonl")), _r["method"]
assert _by["demo"]["payload_bytes_per_step"] < _by["adamw"]["payload_bytes_per_step"] / 50
assert len(projection) == len(METHODS) * len(time_model.DEFAULT_LINKS)
# Every projected step costs at least its measured compute.
assert all(p["step_seconds"] >= _by[p["method"]]["step_seconds"] > 0 for p in projection)
_table = link_table(1.0, 1.0, 8, 100)
assert all(f"| {m} |" in _table for m in METHODS), _table
""",
}

# Figures each notebook must draw (inline PNGs).
FIGURES = {
  "01_quickstart.ipynb": 1,
  "02_anatomy_of_compression.ipynb": 6,
  "03_distro_in_miniature.ipynb": 2,
}


def with_parameters(nb: nbformat.NotebookNode, overrides: dict[str, object]) -> None:
  """Inserts ``NAME = value`` lines after the cell tagged ``parameters``."""
  tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
  assert len(tagged) == 1, f"expected one cell tagged 'parameters', found {len(tagged)}"
  source = nb.cells[tagged[0]].source
  unknown = [k for k in overrides if f"\n{k} = " not in f"\n{source}"]
  assert not unknown, f"the parameters cell does not define {unknown}"
  cell = nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in overrides.items()))
  cell.metadata["tags"] = ["injected-parameters"]
  nb.cells.insert(tagged[0] + 1, cell)


def without_device_count(xla_flags: str) -> str:
  """``xla_flags`` less any ``--xla_force_host_platform_device_count``."""
  return " ".join(
    f for f in xla_flags.split() if not f.startswith("--xla_force_host_platform_device_count")
  )


def png_outputs(nb: nbformat.NotebookNode) -> int:
  return sum(
    "image/png" in out.get("data", {})
    for cell in nb.cells
    if cell.cell_type == "code"
    for out in cell.outputs
  )


def test_every_notebook_has_settings_and_checks():
  names = sorted(p.name for p in COLAB.glob("*.ipynb"))
  assert names, f"no notebooks in {COLAB}"
  assert names == sorted(SMALL) == sorted(CHECKS) == sorted(FIGURES)


def test_notebooks_are_stored_without_outputs():
  for path in sorted(COLAB.glob("*.ipynb")):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
      if cell.cell_type == "code":
        assert not cell.outputs and cell.execution_count is None, f"{path.name} cell {i}"


def test_first_code_cell_installs_only_when_missing():
  for path in sorted(COLAB.glob("*.ipynb")):
    nb = nbformat.read(path, as_version=4)
    first_md = next(c for c in nb.cells if c.cell_type == "markdown").source
    first_code = next(c for c in nb.cells if c.cell_type == "code").source
    assert (
      f"colab.research.google.com/github/distro-jax/distro_jax/blob/main/colab/{path.name}"
      in (first_md)
    ), path.name
    assert "find_spec" in first_code and "pip" in first_code, path.name
    # The notebooks import experiments/, whose packages (flax, grain, ...) are an extra.
    assert 'f"distro_jax[experiments] @ git+{REPO_URL}"' in first_code, path.name


@pytest.mark.parametrize("name", sorted(SMALL))
def test_notebook_runs_top_to_bottom(name, tmp_path, monkeypatch):
  nb = nbformat.read(COLAB / name, as_version=4)
  with_parameters(nb, SMALL[name])
  nb.cells.append(nbformat.v4.new_code_cell(CHECKS[name]))
  # The notebook sets its platform and device count itself; a kernel that
  # inherited them would hide a missing setup. The suite's other XLA flags
  # (compile faster, tests/conftest.py) stay.
  monkeypatch.setenv("XLA_FLAGS", without_device_count(os.environ.get("XLA_FLAGS", "")))
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  # Import this checkout, even where another one is installed in editable mode.
  monkeypatch.setenv(
    "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
  )
  monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend draws PNGs
  client = NotebookClient(
    nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
  )
  # nbclient mimics a front end's Output widget (ipywidgets.interact makes
  # one) by sending the kernel a comm message on the shell socket from the
  # task reading IOPub, while another task polls that socket for the cell's
  # reply. On a loaded machine that poll can miss its wake-up and return only
  # at the cell's timeout, after which the cell passes: 300 s lost. The
  # checks read no widget's state, so nothing is mimicked.
  client.widget_registry = {}
  client.execute()
  assert png_outputs(nb) >= FIGURES[name], f"{name} drew {png_outputs(nb)} figures"
