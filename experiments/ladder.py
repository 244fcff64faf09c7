# `python -m experiments.ladder`: the command. Its usage and its logic live in
# experiments.study.ladder; absl prints __main__'s __doc__ for --help, hence its import.
from experiments.study.ladder import __doc__, main  # noqa: F401

if __name__ == "__main__":
  main()
