"""``python -m`` processes forked from a server that has imported the project once.

A process of ``python -m experiments.train`` spends about 2 CPU-seconds
importing JAX and the project before it trains; the drills that start a dozen
such processes (to kill them, stop them and resume them) spend much of their
time there. :func:`start` asks a server, a process that has imported
:data:`PRELOAD` and touched no JAX backend, to fork a child. The child takes
its environment, sends its output to a file of its own, and runs the module
as ``__main__`` with its own ``sys.argv``, as ``python -m`` would
(``tests/as_main.py``). Each is a real process of its own: signals reach it,
it starts its own backend (and ``jax.distributed``), and it exits with the
status the command chose, which the server writes down when it reaps it.

One server runs per test process, started on the first call with that
process's environment (``tests/conftest.py`` has set the devices and the
compilation cache by then). A variable that JAX or the project reads at
import (``JAX_PLATFORMS``) needs a process of its own; one read later, as
``jax.distributed`` reads SLURM's when it starts, can be a child's own.
"""

import atexit
import contextlib
import functools
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).parent.parent
PRELOAD = ["experiments.train"]

# One process, no thread: it forks only from its one thread. It reads one
# request a line ({"argv", "env", "log"}), answers the child's pid, and
# writes each ended child's exit status to LOG.status before it reaps it, so
# that a pid without a status file is never another process's (a signal sent
# to it reaches the child or a zombie).
_SERVER = """
import importlib, json, os, select, sys
sys.path.insert(0, "tests")
from as_main import run_and_exit
for name in json.loads(sys.argv[1]):
  importlib.import_module(name)
logs = {}

def reap():
  while logs:
    ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if ended is None:
      return
    code = ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status
    path = logs.pop(ended.si_pid) + ".status"
    with open(path + ".part", "w") as f:
      f.write(str(code))
    os.replace(path + ".part", path)
    os.waitpid(ended.si_pid, 0)

def child(request):
  null = os.open(os.devnull, os.O_RDONLY)
  out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
  os.dup2(null, 0)
  os.dup2(out, 1)
  os.dup2(out, 2)
  os.environ.update(request["env"])
  run_and_exit(request["argv"])

print("ready", flush=True)
while True:
  ready, _, _ = select.select([sys.stdin], [], [], 0.05)
  reap()
  if not ready:
    continue
  line = sys.stdin.readline()
  if not line:
    break
  request = json.loads(line)
  pid = os.fork()
  if pid == 0:
    child(request)
  logs[pid] = request["log"]
  print(pid, flush=True)
while logs:
  reap()
  select.select([], [], [], 0.05)
"""

_server: subprocess.Popen | None = None


@functools.cache
def _logs() -> str:
  """This process's directory of the children's output, removed at its exit."""
  path = tempfile.mkdtemp(prefix="forked_runs_")
  atexit.register(shutil.rmtree, path, ignore_errors=True)
  return path


def _the_server() -> subprocess.Popen:
  global _server
  if _server is None or _server.poll() is not None:
    _server = subprocess.Popen(
      [sys.executable, "-c", _SERVER, json.dumps(PRELOAD)],
      cwd=ROOT,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
    )
    assert _server.stdout.readline().strip() == "ready"
    atexit.register(_stop, _server)
  return _server


def _stop(server: subprocess.Popen) -> None:
  """Ends the server once its children have exited (it reaps them); a hung one is not waited for."""
  server.stdin.close()
  try:
    server.wait(timeout=30)
  except subprocess.TimeoutExpired:
    server.kill()
    server.wait()


class Forked:
  """One forked command, used as the tests use a ``subprocess.Popen`` with output merged."""

  def __init__(self, pid: int, log_path: str):
    self.pid = pid
    self.returncode: int | None = None
    self._log_path = log_path

  def poll(self) -> int | None:
    if self.returncode is None:
      with contextlib.suppress(FileNotFoundError):  # not reaped yet
        self.returncode = int(pathlib.Path(self._log_path + ".status").read_text())
    return self.returncode

  def send_signal(self, sig: int) -> None:
    if self.poll() is None:
      os.kill(self.pid, sig)

  def kill(self) -> None:
    self.send_signal(signal.SIGKILL)

  def communicate(self, timeout: float | None = None) -> tuple[str, None]:
    """Waits for the exit; returns the output, as ``Popen.communicate`` would."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while self.poll() is None:
      if deadline is not None and time.monotonic() > deadline:
        raise subprocess.TimeoutExpired(f"forked {self.pid}", timeout)
      time.sleep(0.05)
    return pathlib.Path(self._log_path).read_text(errors="replace"), None


def start(argv: list[str], env: dict[str, str] | None = None) -> Forked:
  """Starts ``python -m argv[0] argv[1:]`` forked from the server.

  Args:
    argv: the module, then its arguments.
    env: variables set in the child before it runs.
  """
  server = _the_server()
  fd, log_path = tempfile.mkstemp(suffix=".log", dir=_logs())
  os.close(fd)
  request = {"argv": list(argv), "env": dict(env or {}), "log": str(log_path)}
  server.stdin.write(json.dumps(request) + "\n")
  server.stdin.flush()
  return Forked(int(server.stdout.readline()), str(log_path))
