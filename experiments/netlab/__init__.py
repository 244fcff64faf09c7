"""netlab: train over real bandwidth-limited links between processes on one Linux machine.

``python -m experiments.netlab`` is the command (``__main__``). Its parts, one
job each:

- :mod:`experiments.netlab.links`: network namespaces joined by veth pairs to
  a bridge, ``tc tbf`` shaping, a routed hub for impairments, a link taken
  down and up, and their teardown (with a guardian process).
- :mod:`experiments.netlab.impair`: delay, jitter and loss, from a user-space
  forwarder on the hub's TUN device (this kernel has no netem).
- :mod:`experiments.netlab.faults`: the impairment and blackout flags, and
  the blackout driven from the lab's wait loop.
- :mod:`experiments.netlab.counters`: the ``/sys/class/net`` byte-counter
  sampler, run as a process in the lab's hub namespace.
- :mod:`experiments.netlab.lab`: running the methods unshaped, then shaped,
  from a :class:`~experiments.netlab.lab.LabConfig`, and restarting a run
  whose drivers stop with 75 or 76, as a scheduler would.
- :mod:`experiments.netlab.drivers`: the drivers waited on, a failure told
  from a restart, stopped.
- :mod:`experiments.netlab.interrupt`: the kill drill (``--kill_step``).
- :mod:`experiments.netlab.floor`: the bandwidth floor (``python -m
  experiments.netlab.floor``): every method clean, then at each rate of a
  sweep at one delay and loss, each cell cached; ``floor.md``, ``.json``, ``.png``.
- :mod:`experiments.netlab.report`: step times, bytes on the links, the time
  to a target loss; ``netlab.md``, ``netlab.json`` and ``netlab_loss.png``.

docs/netlab.md describes what it measures and what it measured.
"""
