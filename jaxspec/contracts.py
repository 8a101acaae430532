"""Contracts on values that live on the device (lengths, page ids, token ids).

Host-side values (shapes, dtypes, Python numbers) are checked by every public entry point before
any compilation. Values inside device arrays cannot always be: under ``jit`` they are tracers.
Each such value has a documented contract, checked by ``require``:

* when the array is concrete (an eager call), a violation raises ``ValueError`` at once, with the
  message naming the argument;
* under a trace, nothing is checked unless checked mode is on (``checked()``), in which case a
  ``jax.experimental.checkify`` check is emitted: wrap the traced function with
  ``checkify.checkify`` (``checked_jit`` does both) and ``.throw()`` the error it returns.

Checks are emitted by plain-Python code that runs on every trace (the kernels' ``api.py``
functions, the model's entry points), never inside a cached ``jax.jit``, so switching checked
mode on always takes effect on the next trace.
"""

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from jax.experimental import checkify

_CHECKED = contextvars.ContextVar("jaxspec_checked", default=False)


@contextlib.contextmanager
def checked(enabled: bool = True):
  """Emits device-value checks into the functions traced inside this block."""
  token = _CHECKED.set(enabled)
  try:
    yield
  finally:
    _CHECKED.reset(token)


def is_checked() -> bool:
  """Whether functions traced now carry device-value checks."""
  return _CHECKED.get()


def require(predicate: jax.Array, message: str) -> None:
  """Enforces a device-value contract: ``predicate`` (a bool array) must be all True.

  Raises ``ValueError(message)`` when ``predicate`` is concrete and not all True; under a trace,
  emits a checkify check when checked mode is on, and nothing otherwise.
  """
  predicate = jnp.all(predicate)
  if isinstance(predicate, jax.core.Tracer):
    if is_checked():
      checkify.check(predicate, message)
    return
  if not bool(predicate):
    raise ValueError(message)


def checked_jit(fun, **jit_kwargs):
  """``jax.jit`` of ``fun`` traced in checked mode; a breach raises ``checkify.JaxRuntimeError``
  (a ``ValueError``).

  The result behaves like ``fun``: the checkify error is thrown after each call.
  """

  def traced(*args, **kwargs):
    with checked():
      return fun(*args, **kwargs)

  compiled = jax.jit(checkify.checkify(traced), **jit_kwargs)

  @functools.wraps(fun)
  def run(*args, **kwargs):
    error, out = compiled(*args, **kwargs)
    error.throw()
    return out

  return run
