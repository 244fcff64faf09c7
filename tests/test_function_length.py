"""No function in ``distro_jax/`` runs over 100 lines of code, docstrings aside.

A line of code is a line that holds a token other than a comment; blank lines,
comment lines and the lines of docstrings (the function's own and those of
the functions and classes inside it) do not count. A nested function's lines
count in its enclosing function too, since a reader of the outer function
reads them. The limit is what keeps the update in named stages
(docs/library.md, "The pipeline") rather than one long function with its
options interleaved.
"""

import ast
import io
import pathlib
import textwrap
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIMIT = 100
_NOT_CODE = {
  tokenize.COMMENT,
  tokenize.NL,
  tokenize.NEWLINE,
  tokenize.INDENT,
  tokenize.DEDENT,
  tokenize.ENDMARKER,
}
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _code_lines(source: str) -> set[int]:
  """Line numbers that hold code: a token other than a comment or a line break."""
  lines = set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type not in _NOT_CODE:
      lines.update(range(tok.start[0], tok.end[0] + 1))
  return lines


def _docstring_lines(tree: ast.AST) -> set[int]:
  """Line numbers of every docstring in ``tree`` (modules, classes, functions)."""
  lines = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, *_DEFS)) and node.body:
      first = node.body[0]
      if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
      ):
        lines.update(range(first.lineno, first.end_lineno + 1))
  return lines


def function_lengths(source: str, filename: str = "<source>") -> dict[str, int]:
  """Each function's lines of code, by qualified name (``outer.<locals>.inner``)."""
  tree = ast.parse(source, filename)
  code = _code_lines(source) - _docstring_lines(tree)
  out = {}

  def visit(node: ast.AST, prefix: str) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, _DEFS):
        name = f"{prefix}{child.name}"
        out[name] = len(code & set(range(child.lineno, child.end_lineno + 1)))
        visit(child, f"{name}.<locals>.")
      elif isinstance(child, ast.ClassDef):
        visit(child, f"{prefix}{child.name}.")
      else:
        visit(child, prefix)

  visit(tree, "")
  return out


def library_lengths() -> dict[str, int]:
  """Every function in ``distro_jax/`` as ``module:qualified name`` -> lines of code."""
  out = {}
  for path in sorted((ROOT / "distro_jax").rglob("*.py")):
    module = path.relative_to(ROOT).as_posix()
    for name, n in function_lengths(path.read_text(), str(path)).items():
      out[f"{module}:{name}"] = n
  return out


def test_counter_counts_code_not_docstrings_or_comments():
  body = "\n".join(f"  x{i} = {i}" for i in range(LIMIT + 1))
  head = textwrap.dedent('''\
    def short():
      """A docstring
      over three lines."""
      # a comment

      return 1


    def long():
      """Doc."""
      def inner():
        """Inner doc."""
        return 2
    ''')
  lengths = function_lengths(head + body + "\n  return inner\n")
  # def line and return; the docstring, comment and blank line do not count.
  assert lengths["short"] == 2
  assert lengths["long.<locals>.inner"] == 2
  # def, inner's two lines, the body and the return.
  assert lengths["long"] == 1 + 2 + (LIMIT + 1) + 1
  assert lengths["long"] > LIMIT  # so the check below would catch it


def test_no_library_function_over_the_limit():
  lengths = library_lengths()
  assert len(lengths) > 100, "found too few functions: is ROOT right?"
  over = {name: n for name, n in lengths.items() if n > LIMIT}
  assert not over, (
    f"Functions in distro_jax/ over {LIMIT} lines of code (docstrings aside): {over}. "
    "Split them into named parts (docs/library.md, 'The pipeline')."
  )


if __name__ == "__main__":
  for name, n in sorted(library_lengths().items(), key=lambda kv: -kv[1])[:15]:
    print(f"{n:5d}  {name}")
