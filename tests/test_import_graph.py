"""The import graph of ``distro_jax`` and ``experiments``: no cycles, and arrows point down.

Every import counts, also one inside a function or under ``TYPE_CHECKING``:
a cycle hidden in a function still ties the modules together for a reader.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("distro_jax", "experiments")


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
  """The project modules that module ``name`` imports, anywhere in its body."""
  is_package = path.name == "__init__.py"
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = name.split(".") if is_package else name.split(".")[:-1]
        anchor = anchor[: len(anchor) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
      # ``from pkg import mod`` imports the module pkg.mod when there is one.
      targets = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
      targets = targets or [base]
    else:
      continue
    for t in targets:
      while t and t not in known:
        t = t.rpartition(".")[0]
      if t and t != name:
        found.add(t)
  return found


def _graph() -> dict[str, set[str]]:
  modules = _modules()
  known = set(modules)
  graph = {}
  for name, path in modules.items():
    graph[name] = _imports(name, path, known)
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan's algorithm)."""
  index, low, on_stack, stack, out = {}, {}, set(), [], []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_no_import_cycles():
  cycles = _cycles(_graph())
  assert cycles == [], "import cycles (each a set of modules that reach each other):\n" + "\n".join(
    " <-> ".join(c) for c in cycles
  )


def test_the_library_never_imports_the_experiments():
  graph = _graph()
  wrong = {m: sorted(t for t in ts if t.startswith("experiments")) for m, ts in graph.items()}
  wrong = {m: ts for m, ts in wrong.items() if m.startswith("distro_jax") and ts}
  assert wrong == {}


@pytest.mark.parametrize(
  "lower, upper",
  [
    ("experiments.run", "experiments.study"),
    ("experiments.run", "experiments.netlab"),
    ("experiments.run", "experiments.bench"),
    ("experiments.run", "experiments.cluster"),
    ("experiments.corpus", "experiments.run"),
  ],
)
def test_arrows_point_down(lower, upper):
  """A lower subpackage never imports a higher one (the trainer knows no study)."""
  graph = _graph()
  up = {
    m: sorted(t for t in ts if t == upper or t.startswith(upper + "."))
    for m, ts in graph.items()
    if m == lower or m.startswith(lower + ".")
  }
  assert {m: ts for m, ts in up.items() if ts} == {}


def test_the_cycle_finder_finds_a_cycle():
  """The check above can fail: a two-module loop is reported."""
  graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
  assert _cycles(graph) == [["a", "b"]]
