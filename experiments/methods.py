# `python -m experiments.methods`: the command. Its usage and its logic live in
# experiments.run.methods; absl prints __main__'s __doc__ for --help, hence its import.
from experiments.run.methods import __doc__, main  # noqa: F401

if __name__ == "__main__":
  main()
