"""The research side of distro_jax: training runs, studies, a network lab, benchmarks.

The top level holds the commands (``python -m experiments.train``, ``compare``,
``frontier``, ``methods``, ...), each a thin entry point; the work lives in
subpackages, each importing only those listed before it:

- :mod:`experiments.corpus`: text to train on with no download.
- :mod:`experiments.run`: one training run (settings, method registry, model,
  data, pure steps, the loop, checkpoints).
- :mod:`experiments.study`: many runs compared (compare, sweep, frontier, the
  internet time model).
- :mod:`experiments.netlab`: real processes over shaped network links.
- :mod:`experiments.bench`: timings and sizes without a training run.
"""
