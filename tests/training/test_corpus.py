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


@pytest.mark.parametrize("compression", ["xz", "none"])
def test_a_recompressed_archive_reads_the_same(tmp_path, compression):
  import gzip
  import lzma

  path = tmp_path / "corpus.tar.gz"
  corpus.write_archive(MEMBERS, {"python": "3.12"}, path)
  tar_bytes = gzip.decompress(path.read_bytes())
  other = tmp_path / f"corpus.{compression}"
  other.write_bytes(lzma.compress(tar_bytes) if compression == "xz" else tar_bytes)
  assert corpus.read_archive(other) == corpus.read_archive(path)


def test_a_file_that_is_no_tar_archive_is_refused(tmp_path):
  path = tmp_path / "corpus.tar.gz"
  path.write_bytes(b"not an archive")
  with pytest.raises(ValueError, match="is not a tar archive"):
    corpus.read_archive(path)


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


DEFINITIONS = """\"\"\"A module.\"\"\"
import functools

CONSTANT = 1


@functools.cache
@staticmethod
def cached(x):
    return x


class Point:
    \"\"\"A point.\"\"\"

    def norm(self):
        text = \"\"\"
a string at column 0
\"\"\"
        return text


async def fetch():
    pass
if __name__ == "__main__":
    cached(1)
"""


def test_top_level_definitions_are_cut_with_their_decorators_and_nothing_else():
  cached = "@functools.cache\n@staticmethod\ndef cached(x):\n    return x\n"
  point = DEFINITIONS[DEFINITIONS.index("class Point") : DEFINITIONS.index("\n\n\nasync")] + "\n"
  assert corpus.top_level_definitions(DEFINITIONS) == [
    cached,
    point,
    "async def fetch():\n    pass\n",
  ]
  # Windows line ends are folded first; the cut texts then use "\n".
  assert corpus.top_level_definitions(DEFINITIONS.replace("\n", "\r\n"))[0] == cached


@pytest.mark.parametrize(
  "text",
  ["def broken(:\n    pass\n", "def f():\r    pass\r", "x = 1\n", "def f():\n    return '\0'\n"],
)
def test_files_without_definitions_or_that_cannot_be_cut_give_none(text):
  assert corpus.top_level_definitions(text) == []


def test_definition_documents_name_their_origin_and_are_the_same_in_worker_processes():
  files = [
    corpus.SourceFile("a.py", DEFINITIONS, "stdlib"),
    corpus.SourceFile("b.py", "x = 1\n", "stdlib"),
    corpus.SourceFile("pkg/c.py", "def g():\n    pass\n", "numpy"),
  ]
  documents = corpus.definition_documents(files, workers=1)
  assert [(d.origin, d.relative_path) for d in documents] == [
    ("stdlib", "a.py::0"),
    ("stdlib", "a.py::1"),
    ("stdlib", "a.py::2"),
    ("numpy", "pkg/c.py::0"),
  ]
  assert [d.text for d in documents[:3]] == corpus.top_level_definitions(DEFINITIONS)
  assert not any(d.held_out for d in documents)
  assert corpus.definition_documents(files, workers=2) == documents
