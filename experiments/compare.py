# `python -m experiments.compare`: the command. Its usage and its logic live in
# experiments.study.compare; absl prints __main__'s __doc__ for --help, hence its import.
from experiments.study.compare import __doc__, main  # noqa: F401

if __name__ == "__main__":
  main()
