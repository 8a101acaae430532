"""Shared test set-up: GPU-only tests are skipped on the CPU; `load_script` for scripts/."""

import importlib.util
import os
import pkgutil
import shutil
import tempfile
from pathlib import Path

import jax
import pytest

from jaxspec.kernels.dispatch import INTERPRET_POOL_THREADS
from jaxspec.testing import appended_xla_flags

# One persistent compilation cache for the whole run, in a temporary directory: the
# `python -m jaxspec` subprocesses and the notebook kernels compile the default model's step
# programs again and again, and with the cache each is compiled once per run (the CLI, notebook
# and compile-cache tests: 184 s of test time against 218 s without). The controller sets the
# variables before it starts the pytest-xdist workers, which inherit them, as do the
# subprocesses (jax reads them when it is imported; this process, which has imported jax
# already, is configured below). The command line's own cache then stays off
# (`compile_cache_dir` leaves jax's cache alone), and `count_compiles` still counts cache hits:
# jax records its compile event around the lookup.
_RUN_CACHE = "JAXSPEC_TEST_RUN_CACHE"
_OWNS_RUN_CACHE = _RUN_CACHE not in os.environ  # the controller, or a run without workers
if _OWNS_RUN_CACHE:
  os.environ[_RUN_CACHE] = tempfile.mkdtemp(prefix="jaxspec-tests-compile-cache-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_RUN_CACHE]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
jax.config.update("jax_compilation_cache_dir", os.environ[_RUN_CACHE])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def pytest_sessionfinish(session, exitstatus):
  del session, exitstatus
  if _OWNS_RUN_CACHE:
    shutil.rmtree(os.environ[_RUN_CACHE], ignore_errors=True)


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

# Interpreted kernels can hang on a CPU pool of one thread per core (`INTERPRET_POOL_THREADS`
# says why); XLA sizes the pool from `PJRT_NPROC` when the backend starts, and the subprocesses
# and notebook kernels that tests start inherit it.
os.environ.setdefault("PJRT_NPROC", str(max(INTERPRET_POOL_THREADS, os.cpu_count() or 1)))


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


@pytest.fixture
def record_instances(monkeypatch):
  """`record_instances(module, "Name")`: `module.Name` becomes a subclass that appends every
  instance it builds to the returned list (to see what the code under test constructed)."""

  def record(module, name: str) -> list:
    built = []

    class Recording(getattr(module, name)):
      def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        built.append(self)

    monkeypatch.setattr(module, name, Recording)
    return built

  return record
