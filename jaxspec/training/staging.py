"""Whole-directory outputs: build in a temporary directory beside the target, then swap it in.

A training run writes its checkpoint (config, weights, tokenizer, log, plot) into a fresh
directory next to the target and renames it into place only when everything is written, so an
interrupt or an error leaves the previous checkpoint exactly as it was, and a reader never sees
new weights with an old tokenizer. Renames stay on one file system because the temporary
directory is a sibling of the target.
"""

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path


def check_output_dir(target: str | os.PathLike, overwrite: bool) -> None:
  """Raises `FileExistsError` unless `target` is absent, an empty directory, or `overwrite`."""
  target = Path(target)
  if target.exists() and not target.is_dir():
    raise FileExistsError(f"{target} exists and is not a directory")
  if target.is_dir() and not overwrite:
    contents = sorted(p.name for p in target.iterdir())
    if contents:
      shown = ", ".join(contents[:4]) + (" ..." if len(contents) > 4 else "")
      raise FileExistsError(
        f"{target} is not empty ({shown}); pass --overwrite (overwrite=True) to replace it"
      )


def _sibling(target: Path, tag: str) -> Path:
  return target.with_name(f".{target.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}")


@contextlib.contextmanager
def staged_directory(target: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
  """Yields an empty directory beside `target`; when the block ends normally, it becomes `target`.

  The previous `target` (if any, and only with `overwrite` when it is not empty) is moved aside,
  the new directory renamed into place, and the old one removed. If the block raises (a
  KeyboardInterrupt included), the temporary directory is removed and `target` is untouched.
  """
  target = Path(target).resolve()
  check_output_dir(target, overwrite)
  target.parent.mkdir(parents=True, exist_ok=True)
  staging = _sibling(target, "partial")
  staging.mkdir()  # default permissions (0777 & ~umask), like any directory the user creates
  try:
    yield staging
    check_output_dir(target, overwrite)  # still allowed: nobody wrote there in the meantime
    if target.exists():
      previous = _sibling(target, "previous")
      target.rename(previous)
      try:
        staging.rename(target)
      except BaseException:
        previous.rename(target)
        raise
      shutil.rmtree(previous)
    else:
      staging.rename(target)
  finally:
    if staging.exists():
      shutil.rmtree(staging, ignore_errors=True)
