"""Helpers for tests and notebooks that check jaxspec's promises (e.g. zero recompiles)."""

import contextlib
import dataclasses
import os

from jax import monitoring

# Recorded by jax once per XLA backend compilation (jax/_src/dispatch.py, BACKEND_COMPILE_EVENT).
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass
class CompileCount:
  """Number of XLA compilations seen so far inside a `count_compiles` block."""

  compiles: int = 0


@contextlib.contextmanager
def count_compiles():
  """Counts the XLA compilations that run inside the block, through jax's public monitoring
  events (jax has no public per-function cache size). Yields a `CompileCount`."""
  count = CompileCount()

  def listener(event: str, duration_secs: float, **kwargs) -> None:
    del duration_secs, kwargs
    if event == _BACKEND_COMPILE_EVENT:
      count.compiles += 1

  monitoring.register_event_duration_secs_listener(listener)
  try:
    yield count
  finally:
    monitoring.unregister_event_duration_listener(listener)


def appended_xla_flags(*flags: str) -> str:
  """This process's `XLA_FLAGS` with `flags` appended, for `os.environ` or a subprocess's
  environment (XLA reads the variable once, when a backend starts)."""
  return " ".join(filter(None, (os.environ.get("XLA_FLAGS"), *flags)))
