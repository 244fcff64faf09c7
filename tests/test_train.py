"""The train driver: exact resume, determinism, clear errors, safe checkpoints, multi-host."""

import json
import pathlib
import subprocess
import sys

import forked_runs
import numpy as np
import portpicker
import pytest
import tiny_runs

from experiments.run import cli, trainer

ROOT = pathlib.Path(__file__).parent.parent
TINY = {**tiny_runs.TINY, "eval_every": 3}


def _config(out_dir, optimizer="demo", **fields):
  return trainer.TrainConfig(
    optimizer=optimizer, steps=6, checkpoint_every=3, out_dir=str(out_dir), **TINY, **fields
  )


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
  """DeMo's 6 steps never stopped, checkpointed at 3 and 6: ``(out_dir, summary)``."""
  out_dir = tmp_path_factory.mktemp("demo_run")
  return out_dir, trainer.run(_config(out_dir))


# One group: the tests that read demo_run share a worker and the run.
RUNS_DEMO = pytest.mark.xdist_group("train_demo_run")


@pytest.mark.slow
@pytest.mark.parametrize(
  "optimizer", [pytest.param("demo", marks=RUNS_DEMO), "adamw"], ids=["demo", "adamw"]
)
def test_resume_is_exact(tmp_path, optimizer, request):
  if optimizer == "demo":
    straight_dir, straight = request.getfixturevalue("demo_run")
  else:
    straight_dir = tmp_path / "a"
    straight = trainer.run(_config(straight_dir, optimizer))
  trainer.run(_config(tmp_path / "b", optimizer, stop_at_step=3))
  # What an interrupted save leaves: orbax's temporary directory, never
  # renamed into place. The resume must pass it by.
  partial = tmp_path / "b" / "checkpoints" / "6.orbax-checkpoint-tmp-1234"
  partial.mkdir()
  (partial / "junk").write_bytes(b"\x00" * 10)
  resumed = trainer.run(_config(tmp_path / "b", optimizer, resume=True))

  a, b = tiny_runs.read_metrics(straight_dir), tiny_runs.read_metrics(tmp_path / "b")
  assert [r.step for r in b] == list(range(1, 7))
  assert [r.loss for r in a] == [r.loss for r in b]  # bit-identical floats
  assert [r.val_loss for r in a] == [r.val_loss for r in b]
  assert straight.params_digest == resumed.params_digest
  # Another run's settings on the same checkpoints are refused.
  with pytest.raises(trainer.CheckpointError, match="different run"):
    trainer.run(_config(tmp_path / "b", optimizer, resume=True, learning_rate=0.5))


@pytest.mark.slow
@RUNS_DEMO
def test_metrics_summary_and_plot(demo_run):
  out_dir, summary = demo_run
  records = tiny_runs.read_metrics(out_dir)
  assert records[0].step == 1 and records[-1].step == 6
  assert any(r.val_loss is not None for r in records)
  assert all(r.bytes_sent == summary.payload_bytes_per_step for r in records)
  # The figure sent per step is what the compiled step's all-gather carries.
  assert summary.measured_by_kind["all-gather"] == summary.payload_bytes_per_step
  assert summary.measured_by_kind.get("all-reduce", 0) <= 8  # the loss metric only
  assert summary.total_bytes_sent_per_worker == 6 * summary.payload_bytes_per_step
  assert summary.ratio_vs_ring_allreduce > 10
  assert (out_dir / "loss.png").stat().st_size > 1000
  assert (out_dir / "summary.json").exists()


@pytest.mark.slow
@RUNS_DEMO
def test_another_seed_gives_another_run(tmp_path, demo_run):
  # The same seed gives the same run to the bit: test_resume_is_exact's run
  # starts afresh at demo_run's seed, and its every loss and its params equal
  # demo_run's. SIGKILL mid-run and the resume after it are in
  # test_interrupted_runs.py.
  straight_dir, straight = demo_run
  other = trainer.run(_config(tmp_path, seed=1))
  a, b = tiny_runs.read_metrics(straight_dir), tiny_runs.read_metrics(tmp_path)
  # The seed reaches both the init and the data order, so every loss moves.
  assert len(a) == len(b) == 6 and all(x.loss != y.loss for x, y in zip(a, b))
  assert other.params_digest != straight.params_digest


@pytest.mark.slow
@RUNS_DEMO
def test_fresh_run_refuses_to_overwrite_checkpoints(demo_run):
  out_dir, _ = demo_run
  before = sorted(p.name for p in (out_dir / "checkpoints").iterdir())
  with pytest.raises(trainer.CheckpointError, match="pass --resume"):
    trainer.run(_config(out_dir))
  assert sorted(p.name for p in (out_dir / "checkpoints").iterdir()) == before


def _cli(args, timeout=120):
  return subprocess.run(
    [sys.executable, "-m", "experiments.train", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )


def _error_line(out):
  assert out.returncode != 0
  assert "Traceback" not in out.stderr, out.stderr[-2000:]
  errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, out.stderr[-2000:]
  return errors[0]


def _flag_error_line(out):
  assert out.returncode == 1, out.stderr[-2000:]
  assert "Traceback" not in out.stderr, out.stderr[-2000:]
  errors = [line for line in out.stderr.splitlines() if line.startswith("FATAL")]
  assert len(errors) == 1 and errors[0].startswith("FATAL Flags parsing error:"), out.stderr
  return errors[0]


def _reported(capsys, **fields):
  """The one ``error:`` line the command prints for a run of ``fields``, run in this process.

  What ``python -m experiments.train`` does once its flags are parsed (less
  starting the backend, which this process has): two of the errors below go
  through the command itself, in a fresh process.
  """
  cfg = trainer.TrainConfig(**{**_CLI_SMALL, **fields})
  with pytest.raises(SystemExit) as e:
    cli.report_user_errors(trainer.run, cfg)  # which validates first, as the command
  assert e.value.code == 2
  err = capsys.readouterr().err
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "Traceback" not in err, err[-2000:]
  return errors[0]


_CLI_SMALL = {
  "preset": "tiny",
  "workers": 2,
  "batch_size": 4,
  "seq_len": 16,
  "steps": 2,
  "progress": False,
}


@pytest.mark.slow  # two fresh processes: a few seconds of imports each
def test_cli_errors_are_one_clear_line(tmp_path):
  small = [f"--{k}={v}" for k, v in _CLI_SMALL.items() if k != "progress"]
  small += ["--noprogress", f"--out_dir={tmp_path / 'run'}"]
  line = _error_line(_cli([*small, f"--data_path={tmp_path / 'missing.txt'}"]))
  assert "does not exist" in line and "--data_path" in line
  # A value outside a flag's choices is refused by absl's flag parser, before
  # the driver's own errors: its one line, and exit status 1.
  line = _flag_error_line(_cli([*small, "--optimizer=sgd"]))
  assert "--optimizer=sgd" in line and "<demo|distro_adamw|adamw|" in line


def test_driver_errors_are_one_clear_line(tmp_path, capsys):
  run = str(tmp_path / "run")
  bad = tmp_path / "bad.npy"
  np.save(bad, np.array([1, 2, 300, 4] * 100, np.int32))
  line = _reported(capsys, data_path=str(bad), out_dir=run)
  assert "300" in line and "vocab" in line

  line = _reported(capsys, batch_size=5, out_dir=run)
  assert "--batch_size=5" in line and "--workers=2" in line

  line = _reported(capsys, preset="huge", out_dir=run)
  assert "unknown --preset 'huge'" in line and "tiny" in line

  line = _reported(capsys, resume=True, out_dir=str(tmp_path / "nothing"))
  assert "--resume" in line and "does not exist" in line

  corrupt = tmp_path / "corrupt"
  (corrupt / "checkpoints" / "2").mkdir(parents=True)
  (corrupt / "checkpoints" / "2" / "state").write_text("not a checkpoint")
  line = _reported(capsys, resume=True, out_dir=str(corrupt))
  assert "--resume" in line and "checkpoint" in line


def _srun_env(port, task):
  """What srun sets for task ``task`` of a 2-task step on this machine."""
  return {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "127.0.0.1",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": str(task),
    "SLURM_LOCALID": str(task),
    "JAX_COORDINATOR_PORT": str(port),
  }


@pytest.mark.slow
def test_two_processes_with_gloo_end_identical_and_learn(tmp_path):
  # One run proves two things: started as srun starts it (SLURM's variables
  # and no process flag at all), and delayed, with the all-gather as a program
  # of its own on a thread of its own (experiments.run.threaded_step), across
  # the processes.
  port = portpicker.pick_unused_port()
  common = [
    "--workers=4",
    "--preset=tiny",
    "--steps=10",
    "--batch_size=8",
    "--seq_len=32",
    "--eval_every=5",
    "--check_replicas",
    "--log_every=2",
    "--noprogress",
    f"--out_dir={tmp_path}",
    "--delayed_apply",
    "--overlap_exchange=thread",
  ]
  # Forked from tests/forked_runs.py's server: real processes, without their imports.
  argv = ["experiments.train", *common]
  procs = [forked_runs.start(argv, env=_srun_env(port, i)) for i in range(2)]
  try:
    outs = [p.communicate(timeout=240)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outs)
  digests = [(tmp_path / f"params_digest.process{i}").read_text() for i in range(2)]
  assert digests[0] == digests[1]
  losses = [r.loss for r in tiny_runs.read_metrics(tmp_path)]
  assert len(losses) == 10 and losses[-1] < losses[0]


def test_resume_drops_a_torn_metrics_line(tmp_path):
  from experiments.run.records import StepRecord
  from experiments.run.reporting import MetricsWriter

  def record(step):
    return StepRecord(
      step=step, loss=2.0 / step, wall_time=0.0, bytes_sent=1, lr=0.1, tokens_per_s=1
    )

  path = tmp_path / "metrics.jsonl"
  lines = [json.dumps(record(s).to_json()) for s in (1, 2, 3)]
  path.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:20])  # a torn third line
  writer = MetricsWriter(str(tmp_path), enabled=True, truncate_after=2)
  writer.write(record(3))
  writer.close()
  assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]
  assert [r.step for r in tiny_runs.read_metrics(tmp_path)] == [1, 2, 3]


@pytest.mark.slow
def test_a_corpus_directory_trains_on_its_split_and_says_how_much_it_read(tmp_path, caplog):
  from experiments.corpus import build
  from experiments.corpus.nltk_sources import Document

  docs = {
    k: [Document(f"{k}/{i}", f"{k} text {i}. ".encode() * 30) for i in range(6)] for k in "ab"
  }
  corpus = str(tmp_path / "corpus")
  build.write_corpus(corpus, docs, {k: {"name": k} for k in docs}, val_fraction=0.2)
  windows = (tmp_path / "corpus" / "train.txt").stat().st_size // 33
  summary = trainer.run(
    trainer.TrainConfig(
      steps=12, data_path=corpus, out_dir=str(tmp_path / "run"), **{**TINY, "eval_every": 0}
    )
  )
  # 12 steps of 8 windows of 33 bytes, against a split of fewer windows than that.
  assert summary.train_windows == windows < 96
  assert summary.train_epochs == 96 / windows and summary.rereads_data
  assert "warning: data: 12 steps read the training split" in caplog.text
  saved = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert saved["train_epochs"] == summary.train_epochs and saved["rereads_data"] is True
  assert np.isfinite(summary.final_val_loss)
