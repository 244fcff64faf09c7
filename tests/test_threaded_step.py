"""The overlapped step as three programs, its all-gather on a thread of its own."""

import collections
import threading

import jax.numpy as jnp
import numpy as np
import pytest
import tiny_runs

import distro_jax as dj
from experiments.run import checks, trainer
from experiments.run.threaded_step import ThreadedStep


@pytest.mark.slow
@pytest.mark.parametrize(
  ("flags", "excluded"),
  [
    # Worker 1's gradient is NaN at step 3: its message is marked invalid
    # (made in the gradient's program) and left out when it lands at step 4.
    ({"inject_nan_step": 3, "inject_nan_worker": 1}, [4, 0, 0, 1, 0]),
    # Partially overlapped, worker 1 fails at step 4: that step's synchronous
    # message is void, and so is the overlapped message it made, applied at
    # step 5. Each step reports the worse of its two exchanges.
    (
      {"synchronous_params": "'attn'", "inject_nan_step": 4, "inject_nan_worker": 1},
      [4, 0, 0, 1, 1, 0, 0],
    ),
  ],
  ids=["overlapped-a-worker-fails", "partially-overlapped-a-worker-fails"],
)
def test_the_threaded_step_trains_as_the_fused_one(tmp_path, monkeypatch, flags, excluded):
  steps = len(excluded)
  # The threaded run's three compiled programs, for their HLO.
  compiled = []
  compile_step = ThreadedStep.compile

  def keep(self, *args):
    out = compile_step(self, *args)
    compiled.append((out.hlo_texts(), out.early))
    return out

  monkeypatch.setattr(ThreadedStep, "compile", keep)
  # --time_optimizer times the threaded step after the run, so the
  # overlapped run's records are what they would be without it.
  timed = "synchronous_params" not in flags
  flags = dict(delayed_apply=True, steps=steps, **flags)
  runs = {}
  for mode in ("fused", "thread"):
    runs[mode] = tiny_runs.run_tiny(
      tmp_path / mode,
      overlap_exchange=mode,
      check_replicas=True,
      log_every=1,
      time_optimizer=timed and mode == "thread",
      **flags,
    )
  fused, thread = (tiny_runs.read_metrics(tmp_path / m) for m in ("fused", "thread"))
  a, b = [r.loss for r in fused], [r.loss for r in thread]
  # Step 1 applies nothing and step 2 the first aggregate, from the same
  # gradients; compiled apart, the update may round differently after that.
  np.testing.assert_array_equal(b[:2], a[:2])
  np.testing.assert_allclose(b, a, rtol=1e-3)
  assert a[-1] < a[0] and np.all(np.isfinite(a))
  assert [r.excluded_contributions for r in fused] == excluded
  assert [r.excluded_contributions for r in thread] == excluded
  for field in ("measured_exchange_bytes_per_step", "measured_by_kind", "measured_by_axes"):
    assert getattr(runs["thread"], field) == getattr(runs["fused"], field)
  assert runs["thread"].measured_exchange_bytes_per_step == runs["thread"].payload_bytes_per_step
  if timed:
    # --time_optimizer times the threaded step: the full step is three
    # programs, the gradient-only step one of them.
    summary = runs["thread"]
    assert summary.step_seconds > 0 and summary.gradient_seconds > 0
    assert 0 <= summary.optimizer_time_fraction < 1
  ((texts, early),) = compiled
  _assert_only_the_exchange_program_crosses_the_workers(texts, "synchronous_params" in flags)
  # A message's all-gather starts as soon as it is made, behind the update
  # and the next gradient, unless the update crosses the workers itself.
  assert early == ("synchronous_params" not in flags)


def _top_ks(hlo: str) -> int:
  return hlo.count('custom_call_target="TopK"')


def test_in_one_process_auto_keeps_the_fused_step():
  # Nothing crosses a network, so there is no transfer to hide.
  fields = {**tiny_runs.TINY, "delayed_apply": True, "out_dir": "unused"}
  assert trainer.build(checks.resolve(trainer.TrainConfig(**fields))).threaded_step is None


def _assert_only_the_exchange_program_crosses_the_workers(texts, synchronous):
  # What lets the gradient and its compression run beside the all-gather:
  # they have no collective, and the exchange has nothing else.
  exchange, gradient, apply = (dj.parse_collective_bytes(t) for t in texts)
  assert gradient.total == 0
  assert {k for k, v in exchange.by_kind.items() if v} == {"all-gather"}
  # The overlapped params' top-k runs in the gradient's program, during the
  # transfer; the last program keeps only a synchronous group's.
  _, gradient_hlo, apply_hlo = texts
  assert _top_ks(gradient_hlo) > 0
  if synchronous:
    assert _top_ks(apply_hlo) > 0 and apply.by_kind["all-gather"] > 0
  else:
    assert _top_ks(apply_hlo) == 0


@pytest.mark.parametrize(
  ("overrides", "message"),
  [
    ({"overlap_exchange": "thread"}, "only --delayed_apply has one"),
    (
      {"overlap_exchange": "thread", "delayed_apply": True, "replicas": 2, "fsdp": 2},
      "use --overlap_exchange=fused",
    ),
    ({"overlap_exchange": "threads"}, "use auto, thread or fused"),
  ],
)
def test_bad_overlap_flags_name_the_fix(tmp_path, overrides, message):
  with pytest.raises(trainer.ConfigError, match=message):
    tiny_runs.run_tiny(tmp_path, **overrides)


class _Programs:
  """Stand-ins for the three programs; each records what it was given, in order."""

  def __init__(self, early):
    self.early = early
    self.events: list[str] = []
    self.gathering = collections.defaultdict(threading.Event)  # by message

  def exchange(self, message):
    self.gathering[int(message)].set()
    self.events.append(f"gather {int(message)}")
    return message * 10

  def gradient(self, params, opt_state, step, inputs, targets):
    self.events.append(f"gradient {step}")
    return "loss", "grads", [(opt_state.momentum, jnp.int32(step))], jnp.int32(step)

  def apply(self, params, opt_state, step, loss, grads, gathered):
    if self.early:  # this step's message is already on its way
      assert self.gathering[step].wait(timeout=10)
    self.events.append(f"apply {step} with {int(gathered)}")
    return params, opt_state, {}


def _run_calls(early):
  programs = _Programs(early)
  threaded = ThreadedStep(programs.exchange, programs.gradient, programs.apply, early=early)
  state = dj.DemoState(jnp.int32(0), jnp.zeros(()), jnp.int32(0), pending=jnp.int32(0))
  for step in (1, 2, 3):
    _, state, _ = threaded(None, state, step, None, None)
    threaded.settle()
  return programs.events


@pytest.mark.parametrize("early", [True, False])
def test_each_update_decodes_the_message_before_it_and_early_sends_it_before_the_update(early):
  # Step t's update decodes step t - 1's message (at the first step, the
  # state's pending), whenever its all-gather started. Early, the gather of
  # step t's message starts before step t's update (the stand-in waits for
  # it); otherwise with the next call, after it.
  events = _run_calls(early)
  assert [e for e in events if e.startswith("apply")] == [
    "apply 1 with 0",
    "apply 2 with 10",
    "apply 3 with 20",
  ]
  gathers = [e for e in events if e.startswith("gather")]
  assert gathers == ["gather 0", "gather 1", "gather 2", "gather 3"][: 4 if early else 3]
  if not early:
    for t in (1, 2):
      assert events.index(f"apply {t} with {10 * (t - 1)}") < events.index(f"gather {t}")


def test_a_state_other_than_the_last_one_returned_decodes_its_own_message():
  programs = _Programs(early=True)
  threaded = ThreadedStep(programs.exchange, programs.gradient, programs.apply, early=True)
  start = dj.DemoState(jnp.int32(0), jnp.zeros(()), jnp.int32(0), pending=jnp.int32(0))
  threaded(None, start, 1, None, None)
  threaded(None, start, 2, None, None)  # the start again, as a timing loop might pass it
  threaded.settle()
  # Step 1's message (1) was gathered early, but step 2 was given the start,
  # whose message (0) is the one its update decodes.
  assert [e for e in programs.events if e.startswith("apply")] == [
    "apply 1 with 0",
    "apply 2 with 0",
  ]
