"""Every setting is checked before anything compiles: one line naming the flag and the fix.

The commands report a ``ConfigError`` through ``cli.report_user_errors`` (one
``error:`` line, exit status 2); these tests call the same functions in
process, so each case costs milliseconds. ``test_cli_errors.py`` runs a few
through the real commands.
"""

import dataclasses
import math

import pytest

from experiments.bench import memory_report
from experiments.run import checks, cli, config, methods, trainer
from experiments.run.config import ConfigError, TrainConfig
from experiments.study import sweep

TINY = {"preset": "tiny", "workers": 4, "batch_size": 8, "seq_len": 32, "steps": 10}

# (overrides, what the line must name, the fix it must give)
BAD = [
  ({"clip_norm": -1.0}, "--clip_norm=-1.0", "--clip_norm=0 to turn clipping off"),
  ({"clip_norm": math.inf}, "--clip_norm=inf", "--clip_norm=0 to turn clipping off"),
  ({"learning_rate": math.nan}, "--learning_rate=nan", "positive rate"),
  ({"learning_rate": -3e-3}, "--learning_rate=-0.003", "positive rate"),
  ({"learning_rate": 0.0}, "--learning_rate=0.0", "positive rate"),
  ({"warmup_steps": -5}, "--warmup_steps=-5", "--warmup_steps=0 for no warmup"),
  ({"warmup_steps": 10}, "--warmup_steps=10", "--warmup_steps<10"),
  ({"checkpoint_every": -1}, "--checkpoint_every=-1", "--checkpoint_every=0 to never"),
  ({"eval_every": -1}, "--eval_every=-1", "--eval_every=0 to validate only after the last"),
  ({"eval_batches": 0}, "--eval_batches=0", "--eval_batches=1 or more"),
  ({"log_every": 0}, "--log_every=0", "--log_every=1 or more"),
  ({"keep_checkpoints": -2}, "--keep_checkpoints=-2", "--keep_checkpoints=0 to keep every"),
  ({"stop_at_step": 11}, "--stop_at_step=11 is beyond --steps=10", "--stop_at_step<=10"),
  ({"stop_at_step": -1}, "--stop_at_step=-1", "--stop_at_step=0 to run all"),
  ({"steps": 0}, "--steps=0", "--steps=1 or more"),
  ({"seed": -1}, "--seed=-1", "[0, 2**32)"),
  ({"seed": 2**32}, "--seed=4294967296", "[0, 2**32)"),
  ({"compression_decay": 1.0}, "--compression_decay=1.0", "0 is stateless"),
  ({"compression_decay": math.nan}, "--compression_decay=nan", "0 is stateless"),
  ({"weight_decay": -0.1}, "--weight_decay=-0.1", "--weight_decay=0 for none"),
  ({"weight_decay": 1000.0, "learning_rate": 3e-3}, "--weight_decay=1000", "--weight_decay<333"),
  ({"diloco_outer_lr": -0.7}, "--diloco_outer_lr=-0.7", "0.7"),
  ({"diloco_outer_momentum": 1.0}, "--diloco_outer_momentum=1.0", "0.9"),
  ({"seq_len": 1024}, "--seq_len=1024", "--seq_len<=256"),
  ({"inject_nan_worker": 4, "inject_nan_step": 2}, "--inject_nan_worker=4", "[0, 4)"),
  ({"inject_nan_step": 11}, "--inject_nan_step=11", "[1, 10]"),
  ({"batch_size": 6}, "--batch_size=6 does not divide by --workers=4", "--batch_size=4 or 8"),
  ({"compression_topk": 5000}, "--compression_topk=5000", "--compression_topk<=4096"),
  ({"frequency_bias": 1.0}, "--frequency_bias=1", "add --random_positions"),
  ({"frequency_bias": -1.0}, "--frequency_bias=-1.0", "0 draws uniformly"),
  ({"normalize": "l2"}, "--normalize='l2'", "--normalize=rms"),
  ({"optimizer": "adamw", "normalize": "rms"}, "--normalize=rms", "--optimizer=demo"),
  ({"optimizer": "diloco", "skip_nonfinite": True}, "--skip_nonfinite", "--optimizer=adamw"),
  ({"compression_groups": "'attn'"}, "--compression_groups: \"'attn'\"", "REGEX=CHUNK:TOPK"),
  ({"compression_groups": "'attn'=8:0"}, "'attn'=8:0", "TOPK are 1 or more"),
  ({"compression_groups": "(=8:1"}, "'(' is not a regular expression", "e.g. --compression_"),
  ({"compression_groups": "'conv'=8:1"}, "\"'conv'\" matches no param", "'attn'=8:2"),
  ({"compression_groups": "'attn'=8:65"}, "'attn'=8:65", "top-k <=64"),
  (
    {"compression_groups": "'attn'=8:2", "delayed_apply": True},
    "--compression_groups",
    "Drop --delayed_apply",
  ),
  (
    {"optimizer": "distro_adamw", "compression_groups": "'attn'=8:2"},
    "--compression_groups",
    "--optimizer=demo",
  ),
  ({"optimizer": "adamw", "compression_groups": "'attn'=8:2"}, "not adamw", "--optimizer=demo"),
  (
    {"compression_topk": 100, "compression_chunk": 8},
    "--compression_topk=100",
    "--compression_topk<=64",
  ),
  (
    {
      "optimizer": "sparseloco",
      "sparseloco_sync_every": 5,
      "sparseloco_chunk": 8,
      "sparseloco_topk": 65,
    },
    "--sparseloco_topk=65",
    "--sparseloco_topk<=64",
  ),
  ({"sparseloco_chunk": 0}, "--sparseloco_chunk=0", "--sparseloco_chunk=1 or more"),
  (
    {"optimizer": "diloco", "diloco_sync_every": 50},
    "--steps=10 is shorter than --diloco_sync_every=50",
    "--diloco_sync_every<=10",
  ),
  ({"steps": "10"}, "--steps must be an integer", "'10'"),
  ({"learning_rate": "fast"}, "--learning_rate must be a number", "'fast'"),
  ({"quantize_1bit": "yes"}, "--quantize_1bit must be true or false", "'yes'"),
  ({"preset": "huge"}, "unknown --preset 'huge'", "tiny"),
  ({"optimizer": "sgd"}, "--optimizer= one of", "adamw"),
  ({"out_dir": ""}, "--out_dir is empty", "name a directory"),
]


@pytest.mark.parametrize(("overrides", "names", "fix"), BAD, ids=[repr(b[0]) for b in BAD])
def test_a_bad_setting_is_one_line_naming_the_flag_and_the_fix(overrides, names, fix):
  with pytest.raises(ConfigError) as e:
    checks.validate(TrainConfig(**{**TINY, **overrides}))
  message = str(e.value)
  assert names in message and fix in message, message
  assert "\n" not in message


def test_the_command_prints_one_error_line_and_exits_2(capsys):
  # What experiments.train does with a ConfigError (its _main calls validate the same way).
  with pytest.raises(SystemExit) as e:
    cli.report_user_errors(checks.validate, TrainConfig(**TINY, clip_norm=-1.0))
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.splitlines() == [
    "error: --clip_norm=-1.0 must be a finite number in [0, inf); use --clip_norm=0 to turn "
    "clipping off, or e.g. 1.0."
  ]


def test_settings_that_plainly_mean_something_are_accepted():
  # 0 disables clipping, checkpoints and periodic evaluation; a stop at the last step is no stop.
  for ok in [
    {"clip_norm": 0.0},
    {"checkpoint_every": 0},
    {"eval_every": 0},
    {"stop_at_step": 10},
    {"warmup_steps": 0},
    {"compression_topk": 4096},
    {"learning_rate": 1},  # an int where a float is expected
    {"optimizer": "diloco", "diloco_sync_every": 10},
    {"optimizer": "adamw", "compression_topk": 10**6},  # AdamW sends no top-k
  ]:
    checks.validate(TrainConfig(**{**TINY, **ok}))


def test_the_largest_chunk_bounds_topk_per_preset_and_chunk():
  assert methods.largest_chunk("tiny", 64) == 64 * 64
  assert methods.largest_chunk("tiny", 8) == 8 * 8
  assert methods.largest_chunk("tiny", 1) == 1


def test_method_checks_live_in_the_registry():
  # checks.validate calls the entry's hook; no name is compared outside methods.py.
  assert methods.get("diloco").check is not methods.get("adamw").check
  assert methods.get("demo").check is not methods.get("adamw").check
  # DeMo checks its groups of message sizes too; DisTrO-AdamW cannot have them.
  assert methods.get("demo").check is not methods.get("distro_adamw").check


def test_resolve_takes_runtime_settings_from_the_checkpoint_unless_given():
  saved = {"checkpoint_every": 7, "eval_every": 3, "log_every": 2, "check_replicas": True}
  resumed = checks.resolve(TrainConfig(**TINY, resume=True), saved=saved)
  assert (resumed.checkpoint_every, resumed.eval_every, resumed.log_every) == (7, 3, 2)
  assert resumed.check_replicas is True
  assert resumed.eval_batches == 4 and resumed.keep_checkpoints == 0  # not saved: fallbacks
  given = checks.resolve(
    TrainConfig(**TINY, resume=True, checkpoint_every=5, check_replicas=False), saved=saved
  )
  assert (given.checkpoint_every, given.check_replicas, given.eval_every) == (5, False, 3)
  fresh = checks.resolve(TrainConfig(**TINY))
  assert (fresh.checkpoint_every, fresh.eval_every, fresh.log_every) == (0, 100, 10)


def test_runtime_settings_are_what_a_checkpoint_records():
  cfg = checks.resolve(TrainConfig(**TINY, checkpoint_every=4))
  assert config.runtime_settings(cfg)["checkpoint_every"] == 4
  assert set(config.runtime_settings(cfg)) == set(config.RESUMED_FIELDS)
  assert set(config.RESUMED_FIELDS) <= config.RUNTIME_FIELDS
  # Every resumed field says in its help what a resume does with it.
  for f in dataclasses.fields(TrainConfig):
    if f.name in config.RESUMED_FIELDS:
      assert f.default is None and "on --resume" in f.metadata["help"], f.name


@pytest.mark.parametrize(
  ("text", "expected"),
  [
    ("steps=5,10", [{"steps": 5}, {"steps": 10}]),
    ("learning_rate=1e-3", [{"learning_rate": 1e-3}]),
    ("quantize_1bit=true,no", [{"quantize_1bit": True}, {"quantize_1bit": False}]),
    ("clip_norm=none,0", [{"clip_norm": None}, {"clip_norm": 0.0}]),
    ("optimizer=adamw;steps=4", [{"optimizer": "adamw", "steps": 4}]),
  ],
)
def test_grid_values_take_their_field_type(text, expected):
  assert sweep.parse_grid(text) == expected


@pytest.mark.parametrize(
  ("grid", "says"),
  [
    ("learning_rate=1e-3,3e-3,abc", "learning_rate='abc' is not a number"),
    ("steps=10,2.5", "steps='2.5' is not an integer"),
    ("quantize_1bit=maybe", "quantize_1bit='maybe' is not true or false"),
    ("out_dir=a,b", "out_dir is the sweep's to set"),
    ("steps=10;steps=20", "'steps' appears twice"),
    ("steps=10,", "'steps' has an empty value"),
    ("steps=10,10", "'steps' repeats a value"),
    ("stepz=10", "unknown field 'stepz'"),
    ("optimizer=adamw,demoo", "--grid point optimizer=demoo: unknown optimizer 'demoo'"),
    ("learning_rate=3e-3,nan", "--grid point learning_rate=nan: --learning_rate=nan"),
    ("clip_norm=1,-1", "--grid point clip_norm=-1.0: --clip_norm=-1.0"),
  ],
)
def test_the_whole_grid_is_checked_before_the_first_point(grid, says):
  with pytest.raises(ConfigError) as e:
    sweep.check_grid(TrainConfig(**TINY), grid, "/nonexistent/sweep")
  assert says in str(e.value), str(e.value)


def test_a_failing_point_leaves_the_table_of_finished_points(tmp_path, monkeypatch, capsys):
  calls = []

  def fake_run(cfg):
    calls.append(cfg.learning_rate)
    if len(calls) == 2:
      raise trainer.CheckpointError("the second point failed")
    return dataclasses.make_dataclass(
      "S", ["final_train_loss", "final_train_loss_avg10", "final_val_loss"]
    )(2.5, 2.6, None)

  monkeypatch.setattr(trainer, "run", fake_run)
  with pytest.raises(trainer.CheckpointError):
    sweep.run_sweep(TrainConfig(**TINY), "learning_rate=1e-3,2e-3,3e-3", str(tmp_path))
  assert calls == [1e-3, 2e-3]
  table = (tmp_path / "sweep.md").read_text().splitlines()
  assert len(table) == 3 and table[2].startswith("| 0.001 | 2.5000 | 2.6000 | - |")
  assert "stopped after 1 of 3 points" in capsys.readouterr().err


@pytest.mark.parametrize(
  ("args", "says"),
  [
    (("tiny", ["a"], 64), "--fsdp=a must be comma-separated integers"),
    (("tiny", ["0", "2"], 64), "--fsdp=0,2 needs positive sizes"),
    (("tiny", [], 64), "needs positive sizes"),
    (("tiny", ["1"], 0), "--compression_chunk=0 must be 1 or more"),
    (("huge", ["1"], 64), "unknown --preset 'huge'"),
  ],
)
def test_memory_report_arguments_are_one_line(args, says):
  with pytest.raises(ConfigError, match=says):
    memory_report._checked(*args)


def test_ratios_below_one_print_as_more_than_the_baseline():
  assert trainer._times(857.2) == "857x less than"
  assert trainer._times(2.5) == "2.50x less than"
  assert trainer._times(0.4) == "2.50x more than"
