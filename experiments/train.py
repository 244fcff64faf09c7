r"""Train a Llama-style LM with any method of the registry, from absl flags.

With no flags: the ``tiny`` preset, DeMo, 8 simulated CPU workers, the
embedded corpus.

  python -m experiments.train
  python -m experiments.train --optimizer=adamw --preset=small --data_path=book.txt
  # 2 sites of 4 devices: FSDP within a site, only DeMo's message between sites
  python -m experiments.train --replicas=2 --fsdp=4
  # two processes of a multi-host run (here both on one machine, gloo on CPU):
  python -m experiments.train --num_processes=2 --process_id=0 \
      --coordinator_address=127.0.0.1:12355 --workers=4 &
  python -m experiments.train --num_processes=2 --process_id=1 \
      --coordinator_address=127.0.0.1:12355 --workers=4

Every flag is a field of ``experiments.run.config.TrainConfig`` (or of
``experiments.run.launch.LaunchConfig`` for the three process flags).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

from absl import app, flags

from experiments.run import checks, cli
from experiments.run.launch import LaunchConfig, setup_devices

__all__ = ["main"]


def _main(
  train_flags: Mapping[str, flags.FlagHolder],
  launch_flags: Mapping[str, flags.FlagHolder],
  argv: Sequence[str],
) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  from experiments.run import trainer

  def train() -> None:
    cfg = cli.config_from_flags(train_flags)
    checks.validate(cfg)  # before the backend starts: a bad flag needs no devices
    setup_devices(cli.config_from_flags(launch_flags, LaunchConfig), cfg.devices)
    trainer.run(cfg)

  cli.report_user_errors(train)


def main(argv: Sequence[str] | None = None) -> None:
  """The command: defines its flags (only now, not at import), parses them, trains."""
  train_flags = cli.define_flags()
  launch_flags = cli.define_flags(LaunchConfig)
  app.run(functools.partial(_main, train_flags, launch_flags), argv=argv)


if __name__ == "__main__":
  main()
