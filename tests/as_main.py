"""The end both fork runners share: a module run as ``python -m`` runs it, then the exit."""

import atexit
import os
import runpy
import sys
import traceback


def run_and_exit(argv: list[str]) -> None:
  """Runs ``python -m argv[0] argv[1:]`` in this forked process, which then exits as it would.

  The process that forked this one imported the module; it runs afresh as
  ``__main__`` with ``argv`` as ``sys.argv``. The exit status is
  ``SystemExit``'s (a message instead goes to stderr, with status 1), or 1
  after an uncaught exception, whose traceback goes to stderr. The atexit
  functions run first, as at the end of ``python -m``.
  """
  code = 0
  try:
    sys.argv = list(argv)
    sys.modules.pop(argv[0], None)
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
  except SystemExit as e:
    if e.code is None or isinstance(e.code, int):
      code = e.code or 0
    else:
      print(e.code, file=sys.stderr)
      code = 1
  except BaseException:
    traceback.print_exc()
    code = 1
  try:
    atexit._run_exitfuncs()
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
