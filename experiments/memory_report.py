# `python -m experiments.memory_report`: the command. Its usage and its logic live in
# experiments.bench.memory_report; absl prints __main__'s __doc__ for --help, hence its import.
from experiments.bench.memory_report import __doc__, main  # noqa: F401

if __name__ == "__main__":
  main()
