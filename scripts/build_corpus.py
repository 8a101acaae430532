"""Builds the training corpus archive of the default model: Python sources in one `.tar.gz`.

The archive holds `stdlib/<path>` for every `.py` file of the running interpreter's standard
library (the held-out files included: training leaves them out by name, evaluation reads them),
`<distribution>/<path>` for the `.py` files of a fixed list of permissively licensed packages
installed beside it, and `MANIFEST.json` (Python and package versions, licences, file counts and
what was left out and why). Packages are left out file by file when the file is generated data
rather than code (very long lines, huge files, `*_pb2.py`), vendored (`_vendor/`), an exact
duplicate of a file already taken, or shares lines with a held-out stdlib file (a copy or a fork
of it, such as `simplejson`'s decoder), so that the held-out files stay unseen.

The archive is deterministic (sorted members, fixed times and owners, gzip without a timestamp):
two machines with the same interpreter and package versions write the same bytes. It is not
committed (tens of megabytes); build it here and carry it to the training machine:

  python scripts/build_corpus.py corpus/python_sources.tar.gz
  python -m jaxspec train --corpus corpus/python_sources.tar.gz --output-dir DIR ...
"""

import argparse
import hashlib
import importlib.metadata
import platform
import sys
from pathlib import Path

from jaxspec.training import corpus

# Distributions whose sources join the corpus: library code with docstrings, under permissive
# licences (BSD, MIT, Apache-2.0, PSF, MIT-CMU). Left out on purpose: copyleft or MPL packages,
# packages that are mostly generated tables (fonttools, wcwidth, pygments' lexers, jaxlib's MLIR
# bindings, debugpy's vendored debugger) and `simplejson` (a fork of the held-out `json` code).
DISTRIBUTIONS = (
  "numpy",
  "scipy",
  "matplotlib",
  "contourpy",
  "jax",
  "flax",
  "optax",
  "chex",
  "orbax-checkpoint",
  "opt_einsum",
  "etils",
  "absl-py",
  "treescope",
  "toolz",
  "ipython",
  "ipykernel",
  "jupyter_client",
  "traitlets",
  "nbformat",
  "tornado",
  "pytest",
  "pip",
  "packaging",
  "prompt_toolkit",
  "rich",
  "pillow",
  "jedi",
  "parso",
  "huggingface_hub",
  "fsspec",
  "anyio",
  "h11",
  "click",
  "attrs",
  "jsonschema",
  "markdown-it-py",
  "pyparsing",
  "python-dateutil",
  "platformdirs",
  "filelock",
  "sortedcontainers",
)

MAX_FILE_BYTES = 400_000  # larger package files are tables or generated code
MAX_LINE_CHARS = 400  # a line this long marks embedded data, not code
SHARED_LINE_CHARS = 30  # lines at least this long (stripped) count for held-out overlap
MAX_SHARED_LINES = 5  # more shared lines than this with a held-out file: a copy or a fork


def _normalized_lines(text: str) -> set[str]:
  return {s for line in text.splitlines() if len(s := line.strip()) >= SHARED_LINE_CHARS}


def _reason_to_skip(relative: str, text: str) -> str | None:
  if relative.endswith("_pb2.py"):
    return "generated protobuf"
  if "/_vendor/" in f"/{relative}":
    return "vendored copy"
  if len(text.encode("utf-8")) > MAX_FILE_BYTES:
    return "over the size limit"
  if any(len(line) > MAX_LINE_CHARS for line in text.splitlines()):
    return "embedded data (a very long line)"
  return None


def _package_files(name: str) -> list[tuple[str, Path]]:
  """(POSIX path relative to site-packages, absolute path) of a distribution's `.py` files."""
  dist = importlib.metadata.distribution(name)
  files = []
  for entry in dist.files or []:
    if entry.suffix == ".py" and "__pycache__" not in entry.parts:
      path = Path(entry.locate())
      if path.is_file():
        files.append((entry.as_posix(), path))
  return sorted(files)


def _licence(dist) -> str:
  metadata = dist.metadata
  classifiers = [c.split("::")[-1].strip() for c in metadata.get_all("Classifier") or []]
  licences = [c for c in classifiers if "License" in c]
  return metadata.get("License-Expression") or (licences[0] if licences else "see the package")


def collect() -> tuple[list[tuple[str, str]], dict]:
  """[(archive path, text)] sorted by path, and the manifest."""
  stdlib = corpus.read_sources(corpus.list_sources())
  held_out = [f for f in stdlib if f.relative_path in corpus.HELD_OUT_FILES]
  held_out_lines = {f.relative_path: _normalized_lines(f.text) for f in held_out}
  members = [(f"{corpus.STDLIB}/{f.relative_path}", f.text) for f in stdlib]
  seen_hashes = {hashlib.sha256(f.text.encode()).hexdigest() for f in stdlib}
  skipped: dict[str, list[str]] = {}
  distributions = {}
  for name in DISTRIBUTIONS:
    dist = importlib.metadata.distribution(name)
    kept = 0
    for relative, path in _package_files(name):
      try:
        text = path.read_text(encoding="utf-8")
      except UnicodeDecodeError:
        skipped.setdefault("not UTF-8", []).append(f"{name}/{relative}")
        continue
      reason = _reason_to_skip(relative, text)
      digest = hashlib.sha256(text.encode()).hexdigest()
      if reason is None and digest in seen_hashes:
        reason = "exact duplicate"
      if reason is None:
        lines = _normalized_lines(text)
        for held_out_path, held_lines in held_out_lines.items():
          if len(lines & held_lines) > MAX_SHARED_LINES:
            reason = f"shares lines with held-out {held_out_path}"
            break
      if reason is not None:
        skipped.setdefault(reason, []).append(f"{name}/{relative}")
        continue
      seen_hashes.add(digest)
      members.append((f"{name}/{relative}", text))
      kept += 1
    distributions[name] = {"version": dist.version, "licence": _licence(dist), "files": kept}
  members.sort()
  manifest = {
    "python": platform.python_version(),
    "stdlib_files": len(stdlib),
    "held_out_files": [f.relative_path for f in held_out],
    "distributions": distributions,
    "files": len(members),
    "bytes": sum(len(text.encode()) for _, text in members),
    "skipped": {reason: sorted(paths) for reason, paths in sorted(skipped.items())},
  }
  return members, manifest


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("output", type=Path, help="archive to write, e.g. corpus/python.tar.gz")
  args = parser.parse_args(argv)
  members, manifest = collect()
  corpus.write_archive(members, manifest, args.output)
  digest = hashlib.sha256(args.output.read_bytes()).hexdigest()
  skipped = {reason: len(paths) for reason, paths in manifest["skipped"].items()}
  print(
    f"{args.output}: {manifest['files']} files, {manifest['bytes'] / 1e6:.1f} MB of source "
    f"({manifest['stdlib_files']} from the Python {manifest['python']} stdlib), "
    f"{args.output.stat().st_size / 1e6:.1f} MB compressed, sha256 {digest[:16]}"
  )
  print(f"skipped: {skipped}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
