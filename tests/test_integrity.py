"""Checkpoints that guard themselves: digests, damaged ones set aside, nothing deleted."""

import glob
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.run import data, integrity
from experiments.run.checkpointing import Checkpointer, CheckpointError

FINGERPRINT = {"preset": "tiny", "optimizer": "demo", "data_identity": {"bytes": 10}}


def _iterator():
  return data.make_train_iterator(
    np.arange(2000) % 256, seq_len=8, global_batch_size=4, num_workers=1
  )


def _state(step):
  return {"params": {"w": jnp.arange(64.0) * step}, "opt_state": {"m": jnp.ones(8) * step}}


def _abstract():
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _state(1))


def _saved(directory, steps, runtime=None):
  ck = Checkpointer(str(directory), fingerprint=FINGERPRINT)
  ck.configure(save_every=2, keep=0, runtime=runtime or {"checkpoint_every": 2})
  it = _iterator()
  for step in range(1, max(steps) + 1):
    next(it)
    if step in steps:
      ck.save(step, _state(step), it)
  ck.close()


def _largest_file(step_dir):
  files = glob.glob(os.path.join(step_dir, "state", "**", "*"), recursive=True)
  return max((f for f in files if os.path.isfile(f)), key=os.path.getsize)


def _flip(path):
  raw = bytearray(pathlib.Path(path).read_bytes())
  raw[len(raw) // 2] ^= 0x01
  pathlib.Path(path).write_bytes(bytes(raw))


def _truncate(path):
  os.truncate(path, os.path.getsize(path) // 2)


def test_digest_names_what_changed(tmp_path):
  step = tmp_path / "4"
  (step / "a").mkdir(parents=True)
  (step / "a" / "x").write_bytes(b"0123456789")
  (step / "y").write_bytes(b"abc")
  integrity.write_digest(str(step))
  assert integrity.verify(str(step)) is None
  _flip(step / "a" / "x")
  assert integrity.verify(str(step)) == "a/x does not match its SHA-256"
  _truncate(step / "a" / "x")
  assert integrity.verify(str(step)) == "a/x has 5 bytes, not 10"
  os.remove(step / "y")
  assert integrity.verify(str(step)) == "a/x has 5 bytes, not 10"  # sorted: a/x comes first
  (step / "a" / "x").write_bytes(b"0123456789")
  assert integrity.verify(str(step)) == "y is missing"
  (step / integrity.DIGEST_NAME).write_text("{not json")
  assert "digest is unreadable" in integrity.verify(str(step))


def test_set_aside_renames_and_never_overwrites(tmp_path):
  for _ in range(2):
    (tmp_path / "checkpoints" / "6").mkdir(parents=True)
    (tmp_path / "checkpoints" / "6" / "f").write_text("kept")
    integrity.set_aside(str(tmp_path / "checkpoints" / "6"), str(tmp_path))
  aside = tmp_path / integrity.SET_ASIDE_DIR
  assert sorted(p.name for p in aside.iterdir()) == ["step_6", "step_6.2"]
  assert all((p / "f").read_text() == "kept" for p in aside.iterdir())


@pytest.mark.parametrize("damage", [_flip, _truncate], ids=["flipped", "truncated"])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_next_save_finds_the_way_clear(
  tmp_path, capsys, damage
):
  ckpts = tmp_path / "run" / "checkpoints"
  _saved(ckpts, [2, 4])
  assert integrity.verify(str(ckpts / "4")) is None
  damage(_largest_file(str(ckpts / "4")))
  ck = Checkpointer(str(ckpts), fingerprint=FINGERPRINT)
  point = ck.find_resume_point()
  assert (point.step, point.verified) == (2, True)
  assert point.meta["runtime"] == {"checkpoint_every": 2}
  notice = capsys.readouterr().err
  assert notice.count("\n") == 1 and "checkpoint of step 4 is damaged" in notice
  aside = tmp_path / "run" / integrity.SET_ASIDE_DIR / "step_4"
  assert aside.is_dir() and str(aside) in notice
  it = _iterator()
  restored = ck.restore(point, _abstract(), it)
  np.testing.assert_array_equal(restored["params"]["w"], np.arange(64.0) * 2)
  assert it.get_state() == {"next_index": 2}
  # The run continues past the damaged step: saving step 4 again works.
  ck.configure(save_every=2, keep=0, runtime={})
  next(it), next(it)
  ck.save(4, _state(4), it)
  ck.close()
  assert sorted(os.listdir(ckpts)) == ["2", "4"] and aside.is_dir()
  assert integrity.verify(str(ckpts / "4")) is None


def test_every_checkpoint_damaged_is_an_error_and_nothing_is_deleted(tmp_path):
  ckpts = tmp_path / "checkpoints"
  _saved(ckpts, [2])
  _flip(_largest_file(str(ckpts / "2")))
  with pytest.raises(CheckpointError, match="no intact checkpoint .*set aside"):
    Checkpointer(str(ckpts), fingerprint=FINGERPRINT).find_resume_point()
  assert os.listdir(tmp_path / integrity.SET_ASIDE_DIR) == ["step_2"]


def test_a_flipped_byte_in_the_metadata_is_damage_not_another_run(tmp_path):
  ckpts = tmp_path / "checkpoints"
  _saved(ckpts, [2, 4])
  meta = ckpts / "4" / "meta" / "metadata"
  meta.write_text(meta.read_text().replace('"demo"', '"demX"'))
  assert Checkpointer(str(ckpts), fingerprint=FINGERPRINT).find_resume_point().step == 2


def test_a_checkpoint_from_other_settings_or_data_is_refused(tmp_path):
  ckpts = tmp_path / "checkpoints"
  _saved(ckpts, [2])
  other = {**FINGERPRINT, "data_identity": {"bytes": 11}}
  with pytest.raises(CheckpointError, match="different run \\(the data file changed: 10 bytes"):
    Checkpointer(str(ckpts), fingerprint=other).find_resume_point()
  # A checkpoint older than data identities is compared on the rest only.
  legacy = {k: v for k, v in FINGERPRINT.items() if k != "data_identity"}
  meta = ckpts / "2" / "meta" / "metadata"
  meta.write_text(json.dumps({"step": 2, **legacy}))
  integrity.write_digest(str(ckpts / "2"))
  assert Checkpointer(str(ckpts), fingerprint=FINGERPRINT).find_resume_point().step == 2


def test_a_checkpoint_without_a_digest_is_restored_with_a_notice(tmp_path, capsys):
  ckpts = tmp_path / "checkpoints"
  _saved(ckpts, [2])
  os.remove(ckpts / "2" / integrity.DIGEST_NAME)
  point = Checkpointer(str(ckpts), fingerprint=FINGERPRINT).find_resume_point()
  assert (point.step, point.verified) == (2, False)
  assert "has no digest" in capsys.readouterr().err


def test_no_checkpoint_is_deleted_unless_asked(tmp_path):
  _saved(tmp_path / "all", [1, 2, 3, 4, 5])
  assert sorted(os.listdir(tmp_path / "all")) == ["1", "2", "3", "4", "5"]
  ck = Checkpointer(str(tmp_path / "two"), fingerprint=FINGERPRINT)
  ck.configure(save_every=1, keep=2, runtime={})
  it = _iterator()
  for step in range(1, 5):
    ck.save(step, _state(step), it)
  ck.close()
  assert sorted(os.listdir(tmp_path / "two")) == ["3", "4"]


@pytest.mark.parametrize(
  "saved, field, default, other",
  [
    # Before --synchronous_params every param was overlapped.
    ({"optimizer": "demo", "delayed_apply": True}, "synchronous_params", "", "'attn'"),
    # Before --sparseloco_chunk SparseLoCo always chunked 64x64.
    ({"optimizer": "sparseloco"}, "sparseloco_chunk", 64, 8),
    # Before --random_positions every message carried its top-k's indices.
    ({"optimizer": "demo"}, "random_positions", False, True),
    ({"optimizer": "demo", "random_positions": True}, "frequency_bias", 0.0, 1.0),
    # Before --normalize every DeMo step was the sign.
    ({"optimizer": "demo"}, "normalize", "sign", "rms"),
    # Before --compression_groups every param had the same message sizes.
    ({"optimizer": "demo"}, "compression_groups", "", "'attn'=8:2"),
  ],
)
def test_a_setting_added_since_a_checkpoint_compares_as_its_default(
  tmp_path, saved, field, default, other
):
  # A checkpoint that lacks the field was made with its default: it resumes a
  # run with the default, and refuses one with another value.
  now = dict(saved, **{field: default})
  Checkpointer(str(tmp_path), fingerprint=now)._check_fingerprint(1, saved)
  changed = dict(saved, **{field: other})
  with pytest.raises(CheckpointError, match=field):
    Checkpointer(str(tmp_path), fingerprint=changed)._check_fingerprint(1, saved)


# Orbax abandons its other reads once one fails, and Python reports those
# coroutines as unraisable (when collected late, at exit, in the log only);
# the failure itself is what this test asserts.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_state_laid_out_by_an_older_version_is_refused_and_kept(tmp_path):
  # Optimizer states have changed layout between versions (DeMo's momentum and
  # SparseLoCo's error feedback once held chunk rows, now the param's shape).
  # Restoring such a checkpoint must name the cause and leave it as it was.
  ckpts = tmp_path / "checkpoints"
  _saved(ckpts, [2])
  ck = Checkpointer(str(ckpts), fingerprint=FINGERPRINT)
  point = ck.find_resume_point()
  newer = _abstract()
  newer["opt_state"]["m"] = jax.ShapeDtypeStruct((2, 4), jnp.float32)
  refused = "intact but cannot be restored .*version of the program that wrote it"
  with pytest.raises(CheckpointError, match=refused):
    ck.restore(point, newer, _iterator())
  ck.close()
  assert integrity.verify(str(ckpts / "2")) is None
  again = Checkpointer(str(ckpts), fingerprint=FINGERPRINT)
  restored = again.restore(point, _abstract(), _iterator())
  again.close()
  np.testing.assert_array_equal(restored["opt_state"]["m"], np.ones(8) * 2)
