"""The command line's persistent compilation cache: where it goes, how it is turned off, and
that a second `python -m jaxspec generate` finds the first one's programs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxspec.compile_cache import compile_cache_dir, enable_compile_cache

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
  "environ, expected",
  [
    ({"HOME": "/h"}, Path("/h/.cache/jaxspec/jax")),
    ({"HOME": "/h", "XDG_CACHE_HOME": "/x"}, Path("/x/jaxspec/jax")),
    ({"HOME": "/h", "JAXSPEC_COMPILE_CACHE": "/c/d"}, Path("/c/d")),
    ({"HOME": "/h", "JAXSPEC_COMPILE_CACHE": "off"}, None),
    ({"HOME": "/h", "JAXSPEC_COMPILE_CACHE": "OFF "}, None),
    ({"HOME": "/h", "JAXSPEC_COMPILE_CACHE": "0"}, None),
    ({"HOME": "/h", "JAX_COMPILATION_CACHE_DIR": "/j"}, None),  # jax's own cache stays
    ({"HOME": "/h", "JAX_COMPILATION_CACHE_DIR": "/j", "JAXSPEC_COMPILE_CACHE": "/c"}, None),
  ],
)
def test_cache_directory_follows_the_environment(environ, expected, monkeypatch):
  monkeypatch.setenv("HOME", environ["HOME"])  # expanduser reads the process's HOME
  assert compile_cache_dir(environ) == expected


def _generate(environ):
  # Sampled: the two runs are also the command line's check that a seed reproduces its tokens
  # in a fresh `python -m jaxspec` (each run costs seconds; tests/test_cli.py generates in process).
  # After "ab" the embedded model's 4 sampled tokens vary with the key (5 sequences for seeds
  # 0-5), so sampling keyed by anything but the seed would show as two different runs.
  command = [sys.executable, "-m", "jaxspec", "generate", "--prompt", "ab"]
  command += ["--max-new-tokens", "4", "--temperature", "0.8", "--seed", "3", "--json"]
  return subprocess.run(command, cwd=ROOT, env=environ, check=True, capture_output=True, text=True)


def test_a_second_run_reads_the_programs_the_first_one_cached(tmp_path):
  cache = tmp_path / "cache"
  # The command line's own cache: the suite's shared cache (tests/conftest.py) is left out.
  environ = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  environ["JAXSPEC_COMPILE_CACHE"] = str(cache)
  first = _generate(environ)
  entries = sorted(p.name for p in cache.iterdir())
  assert len(entries) >= 4, entries  # prefill, draft prefill, cycle, ... at the least
  second = _generate(environ)
  # The same tokens and acceptance from the cached programs and the same seed (the timings
  # differ).
  for key in ("tokens", "text", "per_position_acceptance"):
    assert json.loads(first.stdout)[key] == json.loads(second.stdout)[key], key
  # Every program of the second run was found: it added no entry.
  assert sorted(p.name for p in cache.iterdir()) == entries


def test_off_leaves_jax_untouched(tmp_path):
  before = jax.config.jax_compilation_cache_dir
  assert enable_compile_cache({"JAXSPEC_COMPILE_CACHE": "off", "HOME": str(tmp_path)}) is None
  assert jax.config.jax_compilation_cache_dir == before
  assert not any(tmp_path.iterdir())
