# `python -m experiments.sweep`: the command. Its usage and its logic live in
# experiments.study.sweep; absl prints __main__'s __doc__ for --help, hence its import.
from experiments.study.sweep import __doc__, main  # noqa: F401

if __name__ == "__main__":
  main()
