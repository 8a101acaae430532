"""Shared test set-up: GPU-only tests are skipped on the CPU; `load_script` for scripts/."""

import importlib.util
import os
import pkgutil
from pathlib import Path

import jax
import pytest

from jaxspec.testing import appended_xla_flags

# `python -m jaxspec` run by a test writes no compilation cache of its own (tests of the cache
# set the variable themselves).
os.environ.setdefault("JAXSPEC_COMPILE_CACHE", "off")


def _gpu_plugin_installed() -> bool:
  try:
    import jax_plugins
  except ImportError:
    return False
  return any(
    "cuda" in m.name or "rocm" in m.name for m in pkgutil.iter_modules(jax_plugins.__path__)
  )


# On the CPU most of a test's time is XLA compiling small programs that then run for milliseconds,
# and LLVM without its optimisation passes compiles them faster. Whole suite (`make test`, 2-core
# machine, same day): 13.8 min against 17.7 with the default level and 16.1 with level 1; the
# training tests, which run more steps, lose a little (215 s against 195 at level 1), the rest
# gain more. XLA emits the same programs at every level; without fast-math LLVM does not reorder
# float arithmetic. Set before any backend starts, appended to the caller's flags, inherited by
# the subprocesses and notebook kernels that tests start; GPU runs keep the default.
FAST_COMPILE_FLAGS = (
  "--xla_backend_optimization_level=0",
  "--xla_llvm_disable_expensive_passes=true",
)
if not _gpu_plugin_installed():
  os.environ["XLA_FLAGS"] = appended_xla_flags(*FAST_COMPILE_FLAGS)


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
