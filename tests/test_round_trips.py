"""Round trips per step, counted from compiled programs, and the time model's latency term."""

import ast
import dataclasses
import doctest
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.netlab import round_trips
from experiments.study import time_model
from experiments.study.time_model import Hop, Link

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _mesh(workers):
  devices = np.array(jax.devices()[:workers]).reshape(workers, 1)
  return jax.sharding.Mesh(devices, ("replica", "fsdp"))


def _compiled_text(body, workers, operand_shape):
  """HLO of ``body`` under shard_map over ``workers`` single-device processes."""
  mesh = _mesh(workers)
  fn = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=P("replica"), out_specs=P(), check_vma=False)
  )
  arg = jax.ShapeDtypeStruct(
    (workers, *operand_shape), jnp.float32, sharding=NamedSharding(mesh, P("replica"))
  )
  return fn.lower(arg).compile().as_text(), mesh


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_an_all_gather_over_w_processes_is_w_minus_1_hops(workers):
  text, mesh = _compiled_text(
    lambda x: jax.lax.all_gather(x, "replica", tiled=True), workers, (100,)
  )
  (found,) = round_trips.collectives_in(text, mesh, program="p")
  assert (found.kind, found.operands, found.operand_bytes) == ("all-gather", 1, 400)
  hops = round_trips.hops_of(found, workers)
  assert len(hops) == workers - 1
  # Every process forwards its 400 B (one segment) in each hop.
  assert hops[0] == Hop(segments=workers, flights=1, senders=workers)
  assert time_model.round_trips(hops) == (workers - 1) / 2


@pytest.mark.parametrize("workers", [2, 4])
def test_a_tuple_all_reduce_is_one_ring_per_operand(workers):
  def two_psums(x):
    return jax.lax.psum(jnp.sum(x), "replica"), jax.lax.psum(jnp.max(x), "replica")

  text, mesh = _compiled_text(lambda x: jnp.stack(two_psums(x)), workers, (3,))
  found = round_trips.collectives_in(text, mesh, program="p")
  assert sum(c.operands for c in found if c.kind == "all-reduce") == 2
  hops = [h for c in found for h in round_trips.hops_of(c, workers)]
  assert len(hops) == 2 * 2 * (workers - 1)
  # A scalar's ring carries one segment, from one process at a time.
  assert set(hops) == {Hop(segments=1, flights=1)}


def test_a_collective_in_a_branch_runs_once_every_h_steps():
  mesh = _mesh(4)

  def body(x, step):
    return jax.lax.cond(step % 5 == 0, lambda v: jax.lax.psum(v, "replica"), lambda v: v * 4.0, x)

  fn = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(P("replica"), P()), out_specs=P(), check_vma=False)
  )
  arg = jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=NamedSharding(mesh, P("replica")))
  step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
  text = fn.lower(arg, step).compile().as_text()
  (found,) = round_trips.collectives_in(text, mesh, program="p", every=5)
  assert found.every == 5
  count = round_trips.StepCount("x", 4, (found,))
  assert count.hops() == [] and count.round_trips == 0


@functools.cache
def _count(method):
  return round_trips.count(method, 4)


def _shape(count):
  return sorted((c.kind, c.operands, c.program, c.hidden, c.every) for c in count.collectives)


@pytest.mark.parametrize("method", ["demo-k8-1bit", "demo-k1-c8-1bit-rand-fb1-orth"])
def test_the_plain_demo_step_crosses_the_workers_with_the_message_alone(method):
  counted = _count(method)
  # One collective across the workers, the message's all-gather: its ring's
  # 3 hops. The loss's two psums (12 hops) left with issue 69.
  (message,) = counted.collectives
  assert (message.kind, message.operands, message.program) == ("all-gather", 1, "train_step")
  assert not message.hidden and message.every == 1
  assert _shape(counted) == _shape(round_trips.demo_step(message.operand_bytes, 4))
  assert len(counted.hops()) == 3 and counted.round_trips == 1.5
  assert counted.hops(hidden=True) == []


def test_the_overlapped_demo_step_has_nothing_left_on_the_path():
  counted = _count("demo-k8-1bit-delayed")
  (message,) = counted.collectives
  assert (message.program, message.kind, message.hidden) == ("exchange", "all-gather", True)
  assert _shape(counted) == _shape(round_trips.demo_step(message.operand_bytes, overlapped=True))
  assert counted.round_trips == 0 and counted.hidden_round_trips == 1.5


def test_the_all_to_all_step_is_one_hop_of_every_pair():
  counted = _count("demo-k1-c8-1bit-rand-fb1-orth-a2a")
  (message,) = counted.collectives
  assert (message.kind, message.program, message.hidden) == ("all-to-all", "train_step", False)
  ring = _count("demo-k1-c8-1bit-rand-fb1-orth").collectives[0]
  # However XLA splits the operand, it carries the ring's message once per worker.
  assert message.operands * message.operand_bytes == 4 * ring.operand_bytes
  (hop,) = counted.hops()
  assert counted.round_trips == 0.5 and hop.senders == 4 * 3
  modelled = round_trips.demo_step(ring.operand_bytes, 4, kind="all-to-all").hops()
  assert modelled == [hop]


def test_the_recorded_step_keeps_the_loss_and_the_step_check():
  # The recorded cells ran the step before issue 69: 9 and 7.5 round trips.
  plain = round_trips.demo_step(454, as_recorded=True)
  overlapped = round_trips.demo_step(454, overlapped=True, as_recorded=True)
  assert plain.round_trips == 9 and len(plain.hops()) == 18
  assert overlapped.round_trips == 7.5 and overlapped.hidden_round_trips == 1.5
  kinds = {(c.kind, c.operands, c.program) for c in plain.collectives}
  assert kinds == {
    ("all-gather", 1, "train_step"),
    ("all-reduce", 2, "train_step"),
    ("all-gather", 1, "host"),
  }


def test_the_step_numbers_check_is_one_all_gather_of_four_bytes():
  (check,) = round_trips.step_check_collectives(4)
  assert (check.kind, check.operands, check.operand_bytes, check.program) == (
    "all-gather",
    1,
    4,
    "host",
  )


def test_a_larger_message_needs_more_slow_start_windows():
  step = round_trips.demo_step(454, as_recorded=True).with_message(22_567)
  message = round_trips.hops_of(step.collectives[0], 4)
  # 16 segments from a 10-segment window: two windows, so a round trip more per hop.
  assert message == [Hop(segments=64, flights=2, senders=4)] * 3
  assert step.round_trips == 9 + 3
  assert round_trips.demo_step(22_567).round_trips == 1.5 + 3


def test_no_host_call_crosses_processes_on_the_steps_path():
  assert [c.what for c in round_trips.HOST_CALLS if c.crosses and c.on_path] == []
  assert round_trips.STEP_CHECK.crosses and round_trips.STEP_CHECK.on_path


_HOLDS = {
  "step_number": "make_array_from_single_device_arrays",
  "place": "make_array_from_process_local_data",
  "_read": "addressable_shards",
  "_write": "process_allgather",
}


@pytest.mark.parametrize(
  ("where", "text"),
  [(c.where, _HOLDS[c.where.split("::")[1]]) for c in round_trips.HOST_CALLS[:4]],
)
def test_the_host_calls_point_at_their_functions(where, text):
  path, name = where.split("::")
  source = (ROOT / path).read_text()
  (fn,) = [
    n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == name
  ]
  assert text in ast.get_source_segment(source, fn), (
    f"{where} no longer holds {text!r}: update HOST_CALLS and docs/netlab.md (Round trips per step)"
  )


def test_the_step_number_is_placed_without_a_check_across_processes():
  source = (ROOT / "experiments/run/trainer.py").read_text()
  # jax.device_put of a host int onto a mesh of several processes all-gathers
  # it to check it, every step (round_trips.STEP_CHECK).
  assert "device_put(np.int32(" not in source


# The time model's latency term.

LINKS = [
  Link("a", 10e6, 100e6),
  Link("b", 1e9, 1e9),
  Link("c", 8e6, 8e6),
]


def _old_step_seconds(compute, up, down, link, share):
  """The model before latency, as it was written."""
  transfer = max(up * 8 / link.up_bits_per_s, down * 8 / link.down_bits_per_s)
  hidden = share * transfer
  return max(compute, hidden) + transfer - hidden


@pytest.mark.parametrize("link", LINKS, ids=lambda link: link.name)
def test_at_zero_latency_the_model_is_the_old_one_to_the_bit(link):
  hops = [Hop(segments=64, flights=2)] * 3
  for compute in (0.0, 0.2, 1.7):
    for up, down in ((0.0, 0.0), (1e6, 1e6), (3.3e5, 7.1e6)):
      for share in (0.0, 0.4, 1.0):
        old = _old_step_seconds(compute, up, down, link, share)
        assert time_model.step_seconds(compute, up, down, link, share) == old
        # Hops cost nothing on a path of zero length.
        assert time_model.step_seconds(compute, up, down, link, share, hops=hops) == old


def test_projections_without_latency_are_unchanged():
  rows = [{"method": "m", "optimizer": "demo", "payload_bytes_per_step": 1e5, "step_seconds": 0.5}]
  (row,) = time_model.project(rows, [LINKS[0]], steps=100, workers=4)
  up, down = time_model.link_bytes("all-gather", 1e5, 4)
  assert row["step_seconds"] == _old_step_seconds(0.5, up, down, LINKS[0], 0.0)


def test_the_latency_term_arithmetic():
  far = Link("far", 10e6, 10e6, rtt_s=0.1, loss=0.01)
  # A lone segment: a one-way trip, and 1% of a 0.3 s retransmission timeout.
  assert time_model.hop_seconds(Hop(), far) == pytest.approx(0.05 + 0.01 * 0.3)
  # 64 segments in flight from one sender: a loss among its last 3 waits for
  # the timeout, one among the other 61 is resent a round trip late; a second
  # window costs a round trip.
  tail, body = 1 - 0.99**3, 1 - 0.99**61
  assert time_model.hop_seconds(Hop(segments=64, flights=2), far) == pytest.approx(
    0.05 + 0.1 + tail * 0.3 + (1 - tail) * body * 0.1
  )
  # Four senders of 16 each: 12 segments are some sender's last three.
  tail, body = 1 - 0.99**12, 1 - 0.99**52
  assert time_model.hop_seconds(Hop(segments=64, flights=2, senders=4), far) == pytest.approx(
    0.05 + 0.1 + tail * 0.3 + (1 - tail) * body * 0.1
  )
  # Small messages are all tail: every segment of four one-segment senders.
  assert time_model.hop_seconds(Hop(segments=4, senders=4), far) == pytest.approx(
    0.05 + (1 - 0.99**4) * 0.3
  )
  lossless = dataclasses.replace(far, loss=0.0)
  assert time_model.latency_seconds([Hop()] * 18, lossless) == pytest.approx(0.9)
  # The step: compute, the transfer at the rate, then the hops.
  hops = [Hop()] * 18
  assert time_model.step_seconds(1.0, 1.25e6, 1.25e6, lossless, hops=hops) == pytest.approx(
    1.0 + 1.0 + 0.9
  )
  # Hidden hops cost nothing until they outlast the compute.
  assert time_model.step_seconds(1.0, 0, 0, lossless, 1.0, hidden_hops=hops) == pytest.approx(1.0)
  assert time_model.step_seconds(0.5, 0, 0, lossless, 1.0, hidden_hops=hops) == pytest.approx(0.9)


def test_a_burst_passes_at_line_rate():
  bucket = Link("tbf", 8e6, 8e6, burst_bytes=1e5)  # 1 MB/s past 100 KB
  assert time_model.step_seconds(0.5, 5e4, 5e4, bucket) == 0.5
  assert time_model.step_seconds(0.5, 1.1e6, 1.1e6, bucket) == pytest.approx(1.5)
  # At 10 KB/s a second of compute refills 10 KB of the bucket, not 100 KB.
  slow = Link("tbf", 8e4, 8e4, burst_bytes=1e5)
  assert time_model.step_seconds(1.0, 5e4, 5e4, slow) == pytest.approx(1.0 + 4.0)


@pytest.mark.parametrize(
  "kwargs", [{"rtt_s": -0.1}, {"loss": 1.0}, {"loss": -0.01}, {"burst_bytes": -1}]
)
def test_a_link_refuses_impossible_latency(kwargs):
  with pytest.raises(ValueError, match="rtt_s must be >= 0"):
    Link("x", 1e6, 1e6, **kwargs)


def test_predicted_vs_measured_puts_them_side_by_side():
  far = Link("far", 10e6, 10e6, rtt_s=0.1)
  cell = time_model.MeasuredCell(
    "x", far, 4, "all-gather", 1e4, compute_s=1.0, measured_s=2.0, hops=(Hop(),) * 10
  )
  (row,) = time_model.predicted_vs_measured([cell])
  transfer = 3e4 * 8 / 10e6
  assert row["predicted_s"] == pytest.approx(1.0 + transfer + 0.5)
  assert row["error"] == pytest.approx(row["predicted_s"] / 2.0 - 1)
  assert row["round_trips"] == 5
  table = time_model.comparison_markdown([row])
  assert "| x | 100 ms | 0% | 5 |" in table and f"{row['error']:+.1%}" in table


def test_the_recorded_far_cells_are_within_20_percent():
  rows = time_model.predicted_vs_measured(round_trips.recorded_cells())
  far = [r for r in rows if r["rtt_s"] > 0]
  # The before-cut cells, the after-cut cells and the floor's: every far cell ever measured.
  assert len(far) >= 9
  assert any("after" in r["label"] for r in far) and any("floor" in r["label"] for r in far)
  assert all(abs(r["error"]) < 0.2 for r in far), [(r["label"], r["error"]) for r in far]
  assert all(r["source"] for r in rows)


@pytest.mark.parametrize("module", [time_model, round_trips])
def test_docstring_examples(module):
  result = doctest.testmod(module)
  assert result.attempted > 0 and result.failed == 0
