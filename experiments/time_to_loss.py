# `python -m experiments.time_to_loss`: the command. Its usage and its logic live in
# experiments.study.time_to_loss; absl prints __main__'s __doc__ for --help, hence its import.
from experiments.study.time_to_loss import __doc__, main  # noqa: F401

if __name__ == "__main__":
  main()
