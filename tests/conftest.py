"""Shared test set-up: GPU-only tests are skipped on the CPU; `load_script` for scripts/."""

import importlib.util
import os
from pathlib import Path

import jax
import pytest

# `python -m jaxspec` run by a test writes no compilation cache of its own (tests of the cache
# set the variable themselves).
os.environ.setdefault("JAXSPEC_COMPILE_CACHE", "off")


def _on_gpu() -> bool:
  return jax.devices()[0].platform == "gpu"


def pytest_collection_modifyitems(config, items):
  if _on_gpu():
    return
  skip_gpu = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def load_script():
  """`load_script(name)`: the module of `scripts/<name>.py` (the scripts are not a package)."""

  def load(name: str):
    path = Path(__file__).parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

  return load
