"""The library installs light: ``distro_jax/`` needs only ``[project].dependencies``.

``pip install distro_jax`` pulls what ``pyproject.toml`` declares there, and
the experiments' packages (flax, orbax, grain, absl, matplotlib) are an extra.
Two checks keep the two in step: the third-party modules that ``distro_jax/``
imports at module level are exactly the declared dependencies (one read from
the source), and ``import distro_jax`` then a DeMo step run in a process that
cannot import any of the extras (one read from the interpreter).
"""

import ast
import functools
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "distro_jax"
# The experiments' packages, by the module each is imported as.
EXTRAS_ONLY = {
  "flax": "flax",
  "orbax": "orbax-checkpoint",
  "grain": "grain",
  "absl": "absl-py",
  "matplotlib": "matplotlib",
}


def _project() -> dict:
  return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
  """The normalized distribution name of a requirement (``"jax>=0.10"`` -> ``"jax"``)."""
  name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
  return re.sub(r"[-_.]+", "-", name).lower()


def _pulled_in(names: set[str]) -> set[str]:
  """``names`` and every distribution they require, installed, leaving out their extras'."""
  seen, todo = set(), list(names)
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    try:
      requires = importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
      continue
    todo += [_name(r) for r in requires if "extra ==" not in r.replace('"', "").replace("'", "")]
  return seen


@functools.cache
def _providers() -> dict[str, list[str]]:
  return importlib.metadata.packages_distributions()


def _third_party(module: str) -> str | None:
  """The distribution that provides top-level ``module``; ``None`` for stdlib and the project."""
  top = module.partition(".")[0]
  if top in sys.stdlib_module_names or top == "distro_jax":
    return None
  dists = _providers().get(top)
  assert dists, f"no installed distribution provides the module {top!r}"
  return _name(dists[0])


def _imports() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
  """Distributions imported at module level and inside functions, each with its importers."""
  module_level, in_functions = {}, {}
  for path in sorted(PACKAGE.rglob("*.py")):
    tree = ast.parse(path.read_text(), str(path))
    top = set()
    # The module body, with its try/except and if blocks (a fallback import
    # runs at import time too), but no function or class body.
    stack = list(tree.body)
    while stack:
      node = stack.pop()
      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        continue
      if isinstance(node, ast.Import | ast.ImportFrom):
        top.add(id(node))
      stack.extend(ast.iter_child_nodes(node))
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and not node.level:
        names = [node.module]
      else:
        continue
      where = module_level if id(node) in top else in_functions
      for name in names:
        dist = _third_party(name)
        if dist is not None:
          where.setdefault(dist, set()).add(path.relative_to(ROOT).as_posix())
  return module_level, in_functions


def test_module_level_imports_are_exactly_the_declared_dependencies():
  declared = {_name(r) for r in _project()["dependencies"]}
  module_level, _ = _imports()
  extra = {d: sorted(files) for d, files in module_level.items() if d not in declared}
  assert not extra, f"imported when distro_jax is, but not a declared dependency: {extra}"
  assert set(module_level) == declared, f"declared, but distro_jax/ has no use for it: {declared}"


def test_imports_inside_functions_are_declared_extras():
  project = _project()
  declared = {_name(r) for r in project["dependencies"]}
  extras = {_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
  _, in_functions = _imports()
  undeclared = {d: files for d, files in in_functions.items() if d not in declared | extras}
  assert not undeclared, f"imported by distro_jax/ but declared nowhere: {undeclared}"
  # flax is imported where per_worker needs it, not when distro_jax is.
  assert "flax" in in_functions and "flax" not in declared


def test_dev_extra_installs_the_experiments_too():
  """The README's one line, ``pip install -e ".[dev]"``, still sets up everything."""
  extras = _project()["optional-dependencies"]
  assert "distro_jax[experiments]" in extras["dev"]
  assert {_name(r) for r in extras["experiments"]} >= {
    "flax",
    "orbax-checkpoint",
    "grain",
    "absl-py",
    "matplotlib",
  }


_WITHOUT_EXTRAS = textwrap.dedent(
  """
  import importlib.abc, sys

  BLOCKED = {blocked!r}

  class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
      if name.partition(".")[0] in BLOCKED:
        raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
      return None

  sys.meta_path.insert(0, Refuse())
  import jax, jax.numpy as jnp, optax
  import distro_jax as dj

  params = {{"w": jnp.arange(64.0).reshape(8, 8) / 64, "b": jnp.ones((8,))}}
  grads = jax.tree.map(lambda p: jnp.cos(3 * p) - 0.5, params)
  tx = dj.demo(1e-3, axis_name=None, compression_topk=4, compression_chunk=4)
  state = tx.init(params)
  updates, state = tx.update(grads, state, params)
  # DeMo's step is a sign step: every entry moves by the rate exactly.
  assert all(bool(jnp.all(jnp.abs(u) == 1e-3)) for u in jax.tree.leaves(updates)), updates
  loaded = sorted({{m.partition(".")[0] for m in sys.modules}} & BLOCKED)
  assert not loaded, loaded
  print("core-only OK", len(jax.devices()))
  """
)


def test_import_and_a_demo_step_without_the_extras():
  # What a core dependency requires itself is no extra (optax imports absl).
  core = _pulled_in({_name(r) for r in _project()["dependencies"]})
  blocked = {m for m, dist in EXTRAS_ONLY.items() if dist not in core}
  assert {"flax", "orbax", "grain", "matplotlib"} <= blocked
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one device: the core's promise, not the suite's mesh
  out = subprocess.run(
    [sys.executable, "-c", _WITHOUT_EXTRAS.format(blocked=blocked)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip().endswith("core-only OK 1"), out.stdout
