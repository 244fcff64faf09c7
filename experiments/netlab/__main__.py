r"""Train over real bandwidth-limited links: N processes in shaped network namespaces.

Needs root and iproute2 (``ip``, ``tc``) with the kernel's tbf qdisc.

  python -m experiments.netlab --processes=4 --rate_mbit=10 --methods=adamw,demo \
      --preset=mini --steps=60 --out_dir=runs/netlab
  python -m experiments.netlab --processes=4 --rate_mbit=10,100,100,1000   # one rate each
  python -m experiments.netlab --methods=adamw,demo-k32,demo-k8-1bit --seq_len=64

Every netlab flag is a field of ``experiments.netlab.lab.LabConfig``. Flags it
does not define go to every ``experiments.train`` process. A mistake in them
(or a machine that cannot build the lab) is one ``error:`` line and exit
status 2; Ctrl-C tears the lab down and exits with 130.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping, Sequence

from absl import app, flags

from experiments.netlab import lab
from experiments.netlab.links import NetlabError
from experiments.run import cli

__all__ = ["main", "run_command"]


def run_command(cfg: lab.LabConfig, passthrough: Sequence[str]) -> None:
  """Runs the lab as the command does: a user's mistake is one ``error:`` line and exit 2.

  Anything else is a bug and keeps its traceback.

  Args:
    cfg: the lab's settings.
    passthrough: flags for every driver.
  """
  try:
    lab.run(cfg, passthrough)
  except NetlabError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except KeyboardInterrupt:
    print("netlab: interrupted; processes and links are torn down.", file=sys.stderr)
    sys.exit(130)


def _main(holders: Mapping[str, flags.FlagHolder], argv: Sequence[str]) -> None:
  run_command(cli.config_from_flags(holders, lab.LabConfig), argv[1:])


def main(argv: Sequence[str] | None = None) -> None:
  """The command: defines its flags (only now, not at import), parses them, runs the lab."""
  holders = cli.define_flags(lab.LabConfig)
  app.run(
    functools.partial(_main, holders),
    argv=argv,
    # Flags netlab does not define are the driver's: keep them for the runs.
    flags_parser=lambda args: flags.FLAGS(args, known_only=True),
  )


if __name__ == "__main__":
  main()
