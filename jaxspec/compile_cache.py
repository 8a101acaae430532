"""A persistent compilation cache for the command line, so that a second run skips compiling.

`python -m jaxspec generate` compiles a handful of step programs (prefill, decode, the
speculative cycle, the draft prefill); on a 2-core CPU that is most of a short run's time. jax
can keep compiled programs on disk (its persistent compilation cache, keyed by the program, the
backend, the device and the compile options): the command line turns it on for itself, in
`$XDG_CACHE_HOME/jaxspec/jax` (`~/.cache/jaxspec/jax` by default), caching every program
whatever its compile time (the default model's take well under jax's 1 s threshold each, a few
hundred KB in all). Library users are not affected: only the command line's entry point calls
`enable_compile_cache`.

`JAXSPEC_COMPILE_CACHE` overrides the place (a directory) or turns the cache off (`off`); a cache
the user set up for jax itself (`JAX_COMPILATION_CACHE_DIR`, or `jax_compilation_cache_dir` in
jax's config) is left as it is.
"""

import os
from collections.abc import Mapping
from pathlib import Path

import jax

ENV_VAR = "JAXSPEC_COMPILE_CACHE"
OFF_VALUES = ("off", "0", "false", "no", "")


def compile_cache_dir(environ: Mapping[str, str] = os.environ) -> Path | None:
  """The directory the command line caches compiled programs in, or None for no cache of ours
  (turned off, or jax's own cache configured through its environment variable)."""
  if "JAX_COMPILATION_CACHE_DIR" in environ:
    return None
  if ENV_VAR in environ:
    value = environ[ENV_VAR].strip()
    return None if value.lower() in OFF_VALUES else Path(value).expanduser()
  base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return Path(base) / "jaxspec" / "jax"


def enable_compile_cache(environ: Mapping[str, str] = os.environ) -> Path | None:
  """Points jax's persistent compilation cache at `compile_cache_dir(environ)` and caches every
  program there; returns the directory, or None when no cache of ours is used (turned off, jax's
  cache already configured, or a directory that cannot be created: the run goes on without)."""
  directory = compile_cache_dir(environ)
  if directory is None or jax.config.jax_compilation_cache_dir:
    return None
  try:
    directory.mkdir(parents=True, exist_ok=True)
  except OSError:
    return None
  jax.config.update("jax_compilation_cache_dir", str(directory))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return directory
