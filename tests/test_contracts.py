"""Device-value contracts: eager errors, nothing under a plain trace, checkify in checked mode."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import checkify

from jaxspec.contracts import checked_jit, require


def _double_below(x, *, limit):
  require(x < limit, f"x must be < {limit}")
  return 2 * x


def test_concrete_breach_raises_at_once():
  with pytest.raises(ValueError, match="x must be < 3"):
    _double_below(jnp.arange(5), limit=3)
  assert _double_below(jnp.arange(3), limit=3).tolist() == [0, 2, 4]


def test_plain_jit_carries_no_check_and_checked_jit_does():
  unchecked = jax.jit(_double_below, static_argnames="limit")
  assert unchecked(jnp.arange(5), limit=3).tolist() == [0, 2, 4, 6, 8]
  checked = checked_jit(_double_below, static_argnames="limit")
  assert checked(jnp.arange(3), limit=3).tolist() == [0, 2, 4]
  with pytest.raises(checkify.JaxRuntimeError, match="x must be < 3"):
    checked(jnp.arange(5), limit=3)
