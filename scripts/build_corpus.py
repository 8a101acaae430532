"""Builds the training corpus archive of the default model: Python sources in one `.tar.gz`.

The archive holds `stdlib/<path>` for every `.py` file of the running interpreter's standard
library (the held-out files included: training leaves them out by name, evaluation reads them),
`<distribution>/<path>` for the `.py` files of a fixed list of permissively licensed packages
installed beside it and of a second list pinned to exact versions and read from their wheels
(downloaded with pip; nothing is installed), and `MANIFEST.json` (Python and package versions,
licences, wheel digests, file counts and what was left out and why). Packages are left out
file by file when the file is generated data rather than code (very long lines, huge files,
`*_pb2.py`), vendored (`_vendor/`), an exact duplicate of a file already taken, or shares lines
with a held-out stdlib file (a copy or a fork of it, such as `simplejson`'s decoder), so that the
held-out files stay unseen.

The archive is deterministic (sorted members, fixed times and owners, gzip without a timestamp):
two machines with the same interpreter and package versions write the same bytes. It is not
committed (tens of megabytes); build it here and carry it to the training machine:

  python scripts/build_corpus.py corpus/python_sources.tar.gz [--wheel-dir DIR]
  python -m jaxspec train --corpus corpus/python_sources.tar.gz --output-dir DIR ...

The pinned wheels double the source text (223 MB in all): a 540 s run on an H200 reads
the first list's 38M tokens 24 times over, and its held-out loss stopped falling at 2.06 while
the training loss reached 1.35.
"""

import argparse
import email.parser
import hashlib
import importlib.metadata
import platform
import subprocess
import sys
import tempfile
import zipfile
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

# Read from their wheels at these versions (the `.py` files of a wheel are the same on every
# platform), so that a machine without them installed builds the same archive.
WHEELS = (
  ("sympy", "1.14.0"),
  ("pandas", "3.1.1"),
  ("statsmodels", "0.15.0"),
  ("astropy", "8.0.2"),
  ("scikit-learn", "1.9.1"),
  ("SQLAlchemy", "2.1.9"),
  ("networkx", "3.7"),
  ("Django", "6.1.3"),
  ("Sphinx", "9.1.1"),
  ("Werkzeug", "3.1.9"),
  ("Jinja2", "3.1.6"),
  ("requests", "2.34.2"),
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


def _installed_sources(name: str) -> tuple[dict, list[tuple[str, bytes]]]:
  """(version and licence, [(POSIX path relative to site-packages, bytes)]) of an installed
  distribution's `.py` files."""
  dist = importlib.metadata.distribution(name)
  sources = []
  for entry in dist.files or []:
    if entry.suffix == ".py" and "__pycache__" not in entry.parts:
      path = Path(entry.locate())
      if path.is_file():
        sources.append((entry.as_posix(), path.read_bytes()))
  return {"version": dist.version, "licence": _licence(dist.metadata)}, sorted(sources)


def wheel_sources(wheel: Path) -> tuple[dict, list[tuple[str, bytes]]]:
  """(version, licence and sha256 of the wheel, [(path relative to site-packages, bytes)]) of
  the `.py` files a wheel installs (its `.dist-info` and `.data` directories left out)."""
  with zipfile.ZipFile(wheel) as archive:
    names = archive.namelist()
    info = next(n for n in names if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
    metadata = email.parser.BytesParser().parsebytes(archive.read(info))
    sources = [
      (name, archive.read(name))
      for name in names
      if name.endswith(".py")
      and "__pycache__/" not in name
      and not name.split("/")[0].endswith((".dist-info", ".data"))
    ]
  described = {
    "version": metadata["Version"],
    "licence": _licence(metadata),
    "wheel": wheel.name,
    "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
  }
  return described, sorted(sources)


def _wheels_starting(directory: Path, prefix: str) -> list[Path]:
  return [w for w in directory.glob("*.whl") if w.name.lower().startswith(prefix)]


def download_wheels(directory: Path) -> list[Path]:
  """The `WHEELS` pinned wheels in `directory`, downloaded with pip where missing."""
  wheels = []
  for name, version in WHEELS:
    prefix = f"{name.lower().replace('-', '_')}-{version}-"
    found = _wheels_starting(directory, prefix)
    if not found:
      subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
        + ["--dest", str(directory), f"{name}=={version}"],
        check=True,
      )
      found = _wheels_starting(directory, prefix)
    if len(found) != 1:
      raise RuntimeError(f"expected one wheel of {name}=={version} in {directory}, found {found}")
    wheels.append(found[0])
  return wheels


def _licence(metadata) -> str:
  classifiers = [c.split("::")[-1].strip() for c in metadata.get_all("Classifier") or []]
  licences = [c for c in classifiers if "License" in c]
  return metadata.get("License-Expression") or (licences[0] if licences else "see the package")


def collect(wheels: list[Path]) -> tuple[list[tuple[str, str]], dict]:
  """[(archive path, text)] sorted by path, and the manifest: the stdlib, `DISTRIBUTIONS` as
  installed, then the given wheels."""
  stdlib = corpus.read_sources(corpus.list_sources())
  held_out = [f for f in stdlib if f.relative_path in corpus.HELD_OUT_FILES]
  held_out_lines = {f.relative_path: _normalized_lines(f.text) for f in held_out}
  members = [(f"{corpus.STDLIB}/{f.relative_path}", f.text) for f in stdlib]
  seen_hashes = {hashlib.sha256(f.text.encode()).hexdigest() for f in stdlib}
  skipped: dict[str, list[str]] = {}
  distributions = {}
  sources = [(name, *_installed_sources(name)) for name in DISTRIBUTIONS]
  sources += [(name, *wheel_sources(w)) for (name, _), w in zip(WHEELS, wheels, strict=True)]
  for name, described, files in sources:
    kept = 0
    for relative, data in files:
      try:
        text = data.decode("utf-8")
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
    distributions[name] = described | {"files": kept}
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
  parser.add_argument(
    "--wheel-dir",
    type=Path,
    help="where the pinned wheels are, or are downloaded to (default: a temporary directory)",
  )
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as scratch:
    wheel_dir = args.wheel_dir or Path(scratch)
    wheel_dir.mkdir(parents=True, exist_ok=True)
    members, manifest = collect(download_wheels(wheel_dir))
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
