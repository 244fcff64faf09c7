# `python -m experiments.bench_update`: the command. Its usage and its logic live in
# experiments.bench.bench_update; absl prints __main__'s __doc__ for --help, hence its import.
from experiments.bench.bench_update import __doc__, main  # noqa: F401

if __name__ == "__main__":
  main()
