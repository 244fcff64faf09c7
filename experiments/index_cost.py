# `python -m experiments.index_cost`: the command. Its usage and its logic live in
# experiments.bench.index_cost; absl prints __main__'s __doc__ for --help, hence its import.
from experiments.bench.index_cost import __doc__, main  # noqa: F401

if __name__ == "__main__":
  main()
