# `python -m experiments.fetch_corpus`: the command. Its usage and its logic live in
# experiments.corpus.fetch; absl prints __main__'s __doc__ for --help, hence its import.
from experiments.corpus.fetch import __doc__, main  # noqa: F401

if __name__ == "__main__":
  main()
