"""The training corpus: the Python standard library's own `.py` sources, present on every machine.

Files are read from `sysconfig.get_paths()["stdlib"]` of the running interpreter, in sorted
order of their path relative to that folder, so that two machines with the same Python version
see the same corpus in the same order. `HELD_OUT_FILES` is a fixed list of ordinary library
modules kept out of training and used only for evaluation; a held-out file missing from an
interpreter is skipped (the ones listed exist in CPython 3.12 and later).
"""

import dataclasses
import sysconfig
from pathlib import Path

HELD_OUT_FILES = (
  "bisect.py",
  "calendar.py",
  "colorsys.py",
  "csv.py",
  "fractions.py",
  "heapq.py",
  "json/decoder.py",
  "json/encoder.py",
  "shlex.py",
  "statistics.py",
  "textwrap.py",
  "uuid.py",
)

# Folders of the stdlib tree that are not the standard library's own code.
_EXCLUDED_PARTS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclasses.dataclass(frozen=True)
class SourceFile:
  relative_path: str  # POSIX path relative to the stdlib folder, e.g. "json/decoder.py"
  text: str


def stdlib_dir() -> Path:
  return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path | None = None) -> list[str]:
  """Sorted POSIX paths (relative to `root`, default the stdlib) of every `.py` source."""
  root = root or stdlib_dir()
  paths = []
  for path in root.rglob("*.py"):
    relative = path.relative_to(root)
    if _EXCLUDED_PARTS.isdisjoint(relative.parts) and path.is_file():
      paths.append(relative.as_posix())
  return sorted(paths)


def read_sources(relative_paths, root: Path | None = None) -> list[SourceFile]:
  """Reads the files as UTF-8; the few test files in other encodings are skipped."""
  root = root or stdlib_dir()
  files = []
  for relative in relative_paths:
    try:
      text = (root / relative).read_text(encoding="utf-8")
    except (UnicodeDecodeError, FileNotFoundError):
      continue
    files.append(SourceFile(relative, text))
  return files


def split_corpus(
  root: Path | None = None, max_files: int | None = None
) -> tuple[list[SourceFile], list[SourceFile]]:
  """(train files, held-out files). `max_files` keeps the first n training files (smoke runs)."""
  paths = list_sources(root)
  held_out = set(HELD_OUT_FILES)
  train_paths = [p for p in paths if p not in held_out]
  if max_files is not None:
    train_paths = train_paths[:max_files]
  held_out_paths = [p for p in paths if p in held_out]
  return read_sources(train_paths, root), read_sources(held_out_paths, root)
