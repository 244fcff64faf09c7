"""netlab: train over real bandwidth-limited links between processes on one Linux machine.

``python -m experiments.netlab`` is the command (``__main__``). Its parts, one
job each:

- :mod:`experiments.netlab.links`: network namespaces joined by veth pairs to
  a bridge, ``tc tbf`` shaping, and their teardown (with a guardian process).
- :mod:`experiments.netlab.counters`: the ``/sys/class/net`` byte-counter
  sampler, run as a process in the lab's hub namespace.
- :mod:`experiments.netlab.lab`: running the methods unshaped, then shaped,
  from a :class:`~experiments.netlab.lab.LabConfig`.
- :mod:`experiments.netlab.report`: step times, bytes on the links, the time
  to a target loss; ``netlab.md``, ``netlab.json`` and ``netlab_loss.png``.

docs/netlab.md describes what it measures and what it measured.
"""
