# `python -m experiments.frontier`: the command. Its usage and its logic live in
# experiments.study.frontier; absl prints __main__'s __doc__ for --help, hence its import.
from experiments.study.frontier import __doc__, main  # noqa: F401

if __name__ == "__main__":
  main()
