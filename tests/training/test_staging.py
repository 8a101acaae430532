"""Training outputs are written whole or not at all: staged beside the target, then swapped in."""

import os
import stat

import pytest

from jaxspec.training import staging


def _old_checkpoint(directory):
  directory.mkdir()
  (directory / "config.json").write_text('{"old": true}')
  (directory / "model.safetensors").write_bytes(b"old weights")
  return {p.name: p.read_bytes() for p in directory.iterdir()}


def _leftovers(parent):
  return [p.name for p in parent.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
def test_an_interrupt_while_writing_leaves_the_old_checkpoint_untouched(tmp_path, interrupt):
  target = tmp_path / "model"
  before = _old_checkpoint(target)
  with pytest.raises(interrupt):
    with staging.staged_directory(target, overwrite=True) as directory:
      (directory / "tokenizer.json").write_text("new tokenizer")
      (directory / "model.safetensors").write_bytes(b"new weights, half writ")
      raise interrupt()
  assert {p.name: p.read_bytes() for p in target.iterdir()} == before
  assert _leftovers(tmp_path) == []


def test_a_finished_block_replaces_the_whole_directory(tmp_path):
  target = tmp_path / "model"
  _old_checkpoint(target)
  with staging.staged_directory(target, overwrite=True) as directory:
    assert directory.parent == tmp_path and directory != target
    (directory / "model.safetensors").write_bytes(b"new weights")
  # config.json of the old checkpoint is gone with it: no mixed checkpoint.
  assert {p.name: p.read_bytes() for p in target.iterdir()} == {"model.safetensors": b"new weights"}
  assert _leftovers(tmp_path) == []


def test_a_new_directory_gets_the_usual_permissions(tmp_path):
  target = tmp_path / "nested" / "model"
  with staging.staged_directory(target) as directory:
    (directory / "config.json").write_text("{}")
  umask = os.umask(0)
  os.umask(umask)
  assert stat.S_IMODE(target.stat().st_mode) == 0o777 & ~umask


def test_a_non_empty_directory_is_refused_without_overwrite(tmp_path):
  target = tmp_path / "model"
  before = _old_checkpoint(target)
  with pytest.raises(FileExistsError, match="not empty .*config.json.*--overwrite"):
    with staging.staged_directory(target):
      pytest.fail("the block must not run")
  assert {p.name: p.read_bytes() for p in target.iterdir()} == before
  assert _leftovers(tmp_path) == []
  (tmp_path / "empty").mkdir()
  staging.check_output_dir(tmp_path / "empty", overwrite=False)  # an empty directory is fine
  (tmp_path / "file").write_text("x")
  with pytest.raises(FileExistsError, match="not a directory"):
    staging.check_output_dir(tmp_path / "file", overwrite=True)
