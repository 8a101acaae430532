"""The MTP draft head against transformers' `MtpModel` (fixtures from scripts/make_hf_fixtures.py).

Row t of the MTP layer sees the target's hidden state of position t (after the final norm) and the
token of position t + 1, at RoPE position t + 1.
"""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec

FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.mark.parametrize("name", ["glm4_moe_a", "glm4_moe_b", "glm4_moe_c"])
@pytest.mark.parametrize("moe_impl", ["grouped", "per_route"])
def test_mtp_logits_match_transformers(name, moe_impl):
  model = jaxspec.load_pretrained(FIXTURES / name, dtype=jnp.float32)
  ref = np.load(FIXTURES / name / "reference.npz")
  input_ids = jnp.asarray(ref["input_ids"], jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
  target_hidden, _ = model.forward(input_ids, positions, moe_impl=moe_impl)
  np.testing.assert_allclose(target_hidden, ref["mtp_hidden"], rtol=1e-4, atol=1e-5)

  hidden, _ = model.mtp_forward(
    jnp.asarray(ref["mtp_next_ids"], jnp.int32),
    jnp.asarray(ref["mtp_hidden"]),
    jnp.asarray(ref["mtp_positions"], jnp.int32),
    moe_impl=moe_impl,
  )
  logits = np.asarray(model.mtp_logits(hidden))
  expected = ref["mtp_logits"]
  assert np.linalg.norm(logits - expected) / np.linalg.norm(expected) < 1e-4
  np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_pruned_rows_equal_the_same_rows_of_the_full_pass():
  model = jaxspec.load_pretrained(FIXTURES / "glm4_moe_a", dtype=jnp.float32)
  ref = np.load(FIXTURES / "glm4_moe_a" / "reference.npz")
  args = (
    jnp.asarray(ref["mtp_next_ids"], jnp.int32),
    jnp.asarray(ref["mtp_hidden"]),
    jnp.asarray(ref["mtp_positions"], jnp.int32),
  )
  full, _ = model.mtp_forward(*args, moe_impl="grouped")
  rows = jnp.array([3, 11 + 10], jnp.int32)  # request 0 row 3, request 1 row 10
  pruned, _ = model.mtp_forward(*args, moe_impl="grouped", last_token_indices=rows)
  assert pruned.shape == (2, full.shape[-1])
  np.testing.assert_allclose(pruned, full.reshape(-1, full.shape[-1])[rows], rtol=1e-6, atol=1e-6)
