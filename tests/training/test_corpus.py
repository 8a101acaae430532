"""Corpus archives: what `scripts/build_corpus.py` writes, the trainer reads, held-out files out."""

import pytest

from jaxspec.training import corpus

MEMBERS = [
  ("numpy/numpy/core.py", "def add(a, b):\n    return a + b\n"),
  ("stdlib/bisect.py", "def bisect(a, x):\n    pass\n"),
  ("stdlib/os.py", "import sys\n"),
]


def test_archive_round_trip_and_split(tmp_path):
  path = tmp_path / "corpus.tar.gz"
  corpus.write_archive(MEMBERS, {"python": "3.12"}, path)
  manifest, files = corpus.read_archive(path)
  assert manifest == {"python": "3.12"}
  # Stdlib files first, then the packages; each with its origin.
  assert [(f.origin, f.relative_path) for f in files] == [
    ("stdlib", "bisect.py"),
    ("stdlib", "os.py"),
    ("numpy", "numpy/core.py"),
  ]
  train_files, held_out = corpus.split_corpus(path)
  assert [f.relative_path for f in held_out] == ["bisect.py"]  # a HELD_OUT_FILES entry
  assert [f.relative_path for f in train_files] == ["os.py", "numpy/core.py"]
  # The same members give the same bytes.
  again = tmp_path / "again.tar.gz"
  corpus.write_archive(MEMBERS, {"python": "3.12"}, again)
  assert again.read_bytes() == path.read_bytes()


def test_a_held_out_name_outside_the_stdlib_is_training_data():
  assert corpus.SourceFile("bisect.py", "", origin="stdlib").held_out
  assert not corpus.SourceFile("bisect.py", "", origin="numpy").held_out


def test_an_archive_without_manifest_is_refused(tmp_path):
  import tarfile

  path = tmp_path / "plain.tar.gz"
  source = tmp_path / "x.py"
  source.write_text("x = 1\n")
  with tarfile.open(path, "w:gz") as tar:
    tar.add(source, arcname="stdlib/x.py")
  with pytest.raises(ValueError, match="MANIFEST.json"):
    corpus.read_archive(path)


def test_a_wheel_gives_its_python_files_version_and_licence(tmp_path, load_script):
  import hashlib
  import zipfile

  wheel = tmp_path / "demo_pkg-1.2.3-py3-none-any.whl"
  with zipfile.ZipFile(wheel, "w") as archive:
    archive.writestr("demo_pkg/__init__.py", "x = 1\n")
    archive.writestr("demo_pkg/sub/core.py", "def f():\n    return 2\n")
    archive.writestr("demo_pkg/__pycache__/core.cpython-312.py", "stale\n")
    archive.writestr("demo_pkg/data.json", "{}")
    archive.writestr("demo_pkg-1.2.3.data/scripts/tool.py", "print('script')\n")
    archive.writestr(
      "demo_pkg-1.2.3.dist-info/METADATA",
      "Metadata-Version: 2.4\nName: demo-pkg\nVersion: 1.2.3\nLicense-Expression: BSD-3-Clause\n",
    )
  described, sources = load_script("build_corpus").wheel_sources(wheel)
  assert described == {
    "version": "1.2.3",
    "licence": "BSD-3-Clause",
    "wheel": wheel.name,
    "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
  }
  assert sources == [
    ("demo_pkg/__init__.py", b"x = 1\n"),
    ("demo_pkg/sub/core.py", b"def f():\n    return 2\n"),
  ]
