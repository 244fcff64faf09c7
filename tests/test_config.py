"""One config: flags built from its fields, checks, and the resume fingerprint."""

import dataclasses

import pytest
import tiny_runs
from absl import flags

from experiments.run import checks, cli, config, methods, trainer
from experiments.run.config import ELASTIC_FIELDS, RUNTIME_FIELDS, TrainConfig
from experiments.run.launch import LaunchConfig

FIELDS = [f.name for f in dataclasses.fields(TrainConfig)]


def _changed(value):
  if isinstance(value, bool):
    return not value
  if isinstance(value, int):
    return value + 1
  if isinstance(value, float):
    return value + 0.5
  return "other"


@pytest.mark.parametrize("name", FIELDS)
def test_fingerprint_covers_every_field_but_the_runtime_and_elastic_ones(name):
  base = checks.resolve(TrainConfig())
  other = dataclasses.replace(base, **{name: _changed(getattr(base, name))})
  differs = config.fingerprint(base) != config.fingerprint(other)
  assert differs == (name not in RUNTIME_FIELDS | ELASTIC_FIELDS), name


def test_fingerprint_compares_data_paths_as_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  a = config.fingerprint(TrainConfig(data_path="book.txt"))
  b = config.fingerprint(TrainConfig(data_path=str(tmp_path / "book.txt")))
  assert a == b


def test_flags_are_built_from_the_fields_with_their_help():
  fv = flags.FlagValues()
  holders = cli.define_flags(defaults={"preset": "small"}, flag_values=fv)
  launch = cli.define_flags(LaunchConfig, flag_values=fv)
  assert set(holders) == set(FIELDS)
  fv(["prog", "--steps=7", "--nouse_dct", "--learning_rate=0.01", "--num_processes=2"])
  cfg = cli.config_from_flags(holders)
  assert (cfg.preset, cfg.steps, cfg.use_dct, cfg.learning_rate) == ("small", 7, False, 0.01)
  assert cfg.compression_decay is None  # unset: the recipe decides
  assert cli.config_from_flags(launch, LaunchConfig).num_processes == 2
  for f in dataclasses.fields(TrainConfig):
    assert fv[f.name].help.endswith(f.metadata["help"])


def test_unknown_default_is_refused():
  with pytest.raises(ValueError, match="no field"):
    cli.define_flags(defaults={"stepz": 3}, flag_values=flags.FlagValues())


@pytest.mark.slow
def test_resume_with_other_data_preset_or_method_names_the_field(tmp_path):
  text = tmp_path / "a.txt"
  text.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 400)
  other = tmp_path / "b.txt"
  other.write_bytes(b"pack my box with five dozen liquor jugs. " * 400)
  common = {"steps": 4, "checkpoint_every": 2, "seq_len": 16, "data_path": str(text)}
  tiny_runs.run_tiny(tmp_path / "run", stop_at_step=2, **common)
  # Each refusal comes before anything is built, and leaves the run as it was.
  for changed, field in [
    ({"data_path": str(other)}, "data_path"),
    ({"preset": "mini", "seq_len": 16}, "preset"),
    ({"optimizer": "distro_adamw"}, "optimizer"),
  ]:
    with pytest.raises(trainer.CheckpointError, match=f"different run \\({field}: ") as e:
      tiny_runs.run_tiny(tmp_path / "run", resume=True, **{**common, **changed})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["adamw", "demo", "sparseloco"])
def test_a_long_run_on_small_takes_the_long_recipe(name):
  method = methods.get(name)
  min_steps, long = method.long_recipes["small"]
  short = checks.resolve(TrainConfig(optimizer=name, preset="small", steps=min_steps - 1))
  full = checks.resolve(TrainConfig(optimizer=name, preset="small", steps=min_steps))
  assert short.learning_rate == method.recipe.learning_rate
  assert full.learning_rate == long.learning_rate != short.learning_rate
  # A flag given wins; other presets keep the recipe they had.
  given = TrainConfig(optimizer=name, preset="small", steps=min_steps, learning_rate=1e-2)
  assert checks.resolve(given).learning_rate == 1e-2
  tiny = checks.resolve(TrainConfig(optimizer=name, preset="tiny", steps=min_steps))
  assert tiny.learning_rate == method.recipe.learning_rate


def test_the_orthogonalized_demo_step_keeps_its_rate_in_long_runs():
  min_steps, long = methods.get("demo").long_recipes["small"]
  for steps in (min_steps - 1, min_steps, 3 * min_steps):
    orth = TrainConfig(optimizer="demo", preset="small", steps=steps, normalize="orth")
    assert checks.resolve(orth).learning_rate == methods.get("demo").recipe.learning_rate
  sign = TrainConfig(optimizer="demo", preset="small", steps=min_steps, normalize="sign")
  assert checks.resolve(sign).learning_rate == long.learning_rate
