# `python -m experiments.gpu_bench`: the command. Its usage and its logic live in
# experiments.bench.gpu_bench; absl prints __main__'s __doc__ for --help, hence its import.
from experiments.bench.gpu_bench import __doc__, main  # noqa: F401

if __name__ == "__main__":
  main()
