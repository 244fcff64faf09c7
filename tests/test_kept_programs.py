"""The trainer keeps the programs it built: a second run of the same settings compiles nothing."""

import dataclasses

import jax
from tiny_runs import TINY, run_tiny

import distro_jax as dj
from experiments.run import checks, trainer


def _cfg(tmp_path, **overrides):
  return checks.resolve(trainer.TrainConfig(out_dir=str(tmp_path), **{**TINY, **overrides}))


def test_settings_of_reporting_saving_and_stopping_share_one_program(tmp_path):
  cfg = _cfg(tmp_path / "a", steps=4)
  first = trainer.build(cfg)
  again = trainer.build(
    dataclasses.replace(
      cfg, out_dir=str(tmp_path / "b"), eval_every=1, checkpoint_every=1, stop_at_step=2
    )
  )
  assert again.train_step is first.train_step and again.eval_step is first.eval_step
  # The kept program carries the run's own settings.
  assert again.cfg.out_dir == str(tmp_path / "b") and again.cfg.stop_at_step == 2
  # What enters the step builds another: a rate, a seed, the kernels' switches.
  for other in (
    dataclasses.replace(cfg, learning_rate=cfg.learning_rate / 2),
    dataclasses.replace(cfg, seed=cfg.seed + 1),
  ):
    assert trainer.build(other).train_step is not first.train_step
  with dj.cpu_kernels.disabled():
    assert trainer.build(cfg).train_step is not first.train_step
  assert trainer.build(cfg).train_step is first.train_step  # four kept: still there
  with dj.pallas_kernels.interpreted():
    assert trainer.build(cfg).train_step is not first.train_step


def test_a_second_run_compiles_nothing_and_ends_as_the_first(tmp_path):
  compiles = []

  def count(event, duration, **kwargs):
    del duration, kwargs
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(event)

  settings = {"steps": 3, "eval_every": 3, "optimizer": "adamw"}
  first = run_tiny(tmp_path / "a", **settings)
  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    second = run_tiny(tmp_path / "b", **settings)
  finally:
    jax.monitoring.unregister_event_duration_listener(count)
  assert compiles == []
  assert second.final_train_loss == first.final_train_loss
  assert second.params_digest == first.params_digest
