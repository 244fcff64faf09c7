"""Runs commands as ``python -m`` does, each in a child forked from one process that imported them.

A fresh process per command spends about 3 CPU-seconds importing JAX and the
project before the command does anything; a test that runs a dozen commands
to see their help or their one-line refusals spends most of its time there.
:func:`run_commands` starts one process, imports the given modules once
(which must define no flag, as ``tests/test_commands.py`` checks), and forks
a child per command, which runs the command's module as ``__main__`` with its
own ``sys.argv`` and exits as the process would (``tests/as_main.py``).
Nothing in the parent has touched a JAX backend, so each child starts its
own. A command that needs another environment (a ``JAX_PLATFORMS`` read at
import) needs a process of its own.
"""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parent.parent

_RUNNER = """
import importlib, json, os, sys, tempfile
from absl import flags
sys.path.insert(0, "tests")
from as_main import run_and_exit
imports, cases = json.loads(sys.argv[1])
for name in imports:
  importlib.import_module(name)
result = {"flags": sorted(flags.FLAGS), "runs": {}}
for case, argv in cases.items():
  with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
    pid = os.fork()
    if pid == 0:
      os.dup2(out.fileno(), 1)
      os.dup2(err.fileno(), 2)
      run_and_exit(argv)
    _, status = os.waitpid(pid, 0)
    out.seek(0)
    err.seek(0)
    result["runs"][case] = [
      os.waitstatus_to_exitcode(status),
      out.read().decode(errors="replace"),
      err.read().decode(errors="replace"),
    ]
print(json.dumps(result))
"""


def run_commands(imports, cases, timeout=300):
  """Runs each of ``cases`` (``{case: [module, *args]}``) in a child of one process.

  Args:
    imports: modules the parent imports before it forks (the commands, say).
    cases: each case's ``python -m`` arguments: the module, then its flags.
    timeout: seconds for all of them.

  Returns:
    ``{"flags": the absl flags defined after the imports, "runs": {case:
    [exit status, stdout, stderr]}}``.
  """
  out = subprocess.run(
    [sys.executable, "-c", _RUNNER, json.dumps([list(imports), dict(cases)])],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])
