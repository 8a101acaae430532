"""The training corpus: Python sources, from a standard library folder or a corpus archive.

Two sources, one split:

- a standard library folder (default: `sysconfig.get_paths()["stdlib"]` of the running
  interpreter): its `.py` files, in sorted order of their path relative to that folder;
- a corpus archive written by `scripts/build_corpus.py`: a `.tar.gz` with `stdlib/<path>` for a
  standard library's files and `<distribution>/<path>` for the sources of a fixed list of
  packages, plus `MANIFEST.json`. The archive is the same bytes on every machine, so a training
  run does not depend on which stdlib files the training machine's image happens to ship.

`definition_documents` cuts training files into their top-level functions and classes, each a
document of its own, for the trainer to add to its stream.

`HELD_OUT_FILES` is a fixed list of ordinary library modules of the standard library, kept out of
training and used only for evaluation (`jaxspec.evaluation` reads them from the running
interpreter); a held-out file missing from a source is skipped (the ones listed exist in CPython
3.12 and later).
"""

import ast
import concurrent.futures
import dataclasses
import gzip
import io
import json
import multiprocessing
import os
import sysconfig
import tarfile
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

STDLIB = "stdlib"  # origin of standard library files (and their folder inside an archive)
MANIFEST = "MANIFEST.json"  # the archive member that describes it

# Folders of the stdlib tree that are not the standard library's own code.
_EXCLUDED_PARTS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclasses.dataclass(frozen=True)
class SourceFile:
  """One Python source of the corpus: its path inside its origin, its text, and its origin
  (the standard library or the distribution it comes from)."""

  relative_path: str  # POSIX path inside its origin, e.g. "json/decoder.py"
  text: str
  origin: str = STDLIB  # "stdlib" or the distribution the file comes from, e.g. "numpy"

  @property
  def held_out(self) -> bool:
    """Whether the file is a standard-library file kept out of training for evaluation
    (`HELD_OUT_FILES`)."""
    return self.origin == STDLIB and self.relative_path in HELD_OUT_FILES


def stdlib_dir() -> Path:
  """This interpreter's standard-library directory."""
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


def write_archive(members: list[tuple[str, str]], manifest: dict, path: str | Path) -> None:
  """Writes a corpus archive: `MANIFEST.json`, then (`<origin>/<path>`, text) members in order.

  Deterministic bytes (fixed times, owners and modes; gzip without a timestamp), written to a
  temporary file beside `path` and renamed over it.
  """
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  partial = path.with_name(path.name + ".partial")
  with (
    open(partial, "wb") as raw,
    gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as zipped,
  ):
    with tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar:
      entries = [(MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))] + members
      for name, text in entries:
        data = text.encode("utf-8")
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o644, 0
        tar.addfile(info, io.BytesIO(data))
  partial.replace(path)


def read_archive(path: str | Path) -> tuple[dict, list[SourceFile]]:
  """(manifest, files in archive order) of a corpus archive written by `scripts/build_corpus.py`.

  The tar may be recompressed with any compression Python's `tarfile` reads, or none (gzip as
  written; xz is smaller to carry to a training machine).
  Stdlib files come first, then the packages' (stable within each origin by path).
  """
  manifest = None
  files = []
  try:
    tar = tarfile.open(path, mode="r:*")
  except tarfile.ReadError as error:
    raise ValueError(f"corpus archive {path} is not a tar archive: {error}") from None
  with tar:
    for member in tar:
      if not member.isfile():
        continue
      text = tar.extractfile(member).read().decode("utf-8")
      if member.name == MANIFEST:
        manifest = json.loads(text)
        continue
      origin, _, relative = member.name.partition("/")
      if not relative.endswith(".py"):
        raise ValueError(f"corpus archive {path}: unexpected member {member.name}")
      files.append(SourceFile(relative, text, origin))
  if manifest is None:
    raise ValueError(f"corpus archive {path} has no {MANIFEST}: build it with build_corpus.py")
  files.sort(key=lambda f: (f.origin != STDLIB, f.origin, f.relative_path))
  return manifest, files


def split_corpus(
  source: Path | None = None, max_files: int | None = None
) -> tuple[list[SourceFile], list[SourceFile]]:
  """(train files, held-out files) of a stdlib folder (default the interpreter's) or an archive.

  `max_files` keeps the first n training files (smoke runs).
  """
  if source is not None and Path(source).is_file():
    _, files = read_archive(source)
  else:
    files = read_sources(list_sources(source), source)
  train_files = [f for f in files if not f.held_out]
  if max_files is not None:
    train_files = train_files[:max_files]
  return train_files, [f for f in files if f.held_out]


PARALLEL_PARSE_CHARS = 16 << 20  # below this much text `definition_documents` parses in-process


def top_level_definitions(text: str) -> list[str]:
  """The source of each top-level function and class of a Python file, decorators included, each
  ending in a newline; [] for a file that does not parse.

  Lines are counted as `ast` counts them, on "\\n" after "\\r\\n" is folded; a file with a lone
  "\\r" (which `ast` also counts) is skipped rather than cut at the wrong lines.
  """
  text = text.replace("\r\n", "\n")
  if "\r" in text:
    return []
  try:
    tree = ast.parse(text)
  except (SyntaxError, ValueError, RecursionError):  # ValueError: a null byte
    return []
  lines = text.split("\n")
  definitions = []
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
      definitions.append("\n".join(lines[first - 1 : node.end_lineno]) + "\n")
  return definitions


def definition_documents(files: list[SourceFile], workers: int | None = None) -> list[SourceFile]:
  """Each top-level function and class of `files` as a file of its own, in file order.

  `relative_path` is the file's path plus `::` and the definition's index in it. Training on
  these beside the whole files shows the model, after a document separator, one definition and
  then the separator again: where a function or class ends when nothing else follows it, which a
  stream of whole files never shows (after a top-level function comes another one). Parsing runs
  in `workers` processes (default: one per CPU, at most 16, from `PARALLEL_PARSE_CHARS`
  characters of text up; 1: in this process): `ast.parse` reads about 5 MB/s, 45 s for the
  223 MB corpus on one core, and a worker takes about two seconds to start.
  """
  texts = [f.text for f in files]
  if workers is None:
    workers = 1 if sum(map(len, texts)) < PARALLEL_PARSE_CHARS else min(16, os.cpu_count() or 1)
  if workers > 1 and len(files) > 1:
    # A fresh interpreter per worker ("spawn"): the caller may run threads (jax) that fork breaks.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
      chunk = max(1, len(texts) // (8 * workers))
      definitions = list(pool.map(top_level_definitions, texts, chunksize=chunk))
  else:
    definitions = [top_level_definitions(t) for t in texts]
  return [
    SourceFile(f"{f.relative_path}::{i}", text, f.origin)
    for f, found in zip(files, definitions, strict=True)
    for i, text in enumerate(found)
  ]
