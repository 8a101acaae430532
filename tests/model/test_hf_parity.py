"""Parity with Hugging Face transformers' `Glm4MoeForCausalLM` on tiny random checkpoints.

The checkpoints and reference outputs in tests/fixtures were written by
scripts/make_hf_fixtures.py (transformers 5.23.0, float32, eager attention); torch is not needed
here. Each fixture varies qk-norm, bias, grouping, dense layers, top-k normalisation, the head
ratio G (3, 1, 4) and the rotary fraction (0.5, 1.0, 0.25).
"""

from pathlib import Path

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.serving.engine import EngineConfig, Generator

FIXTURES = Path(__file__).parents[1] / "fixtures"
GLM4_MOE = ["glm4_moe_a", "glm4_moe_b", "glm4_moe_c"]


def _load(name):
  model = jaxspec.load_pretrained(FIXTURES / name, dtype=jnp.float32)
  return model, np.load(FIXTURES / name / "reference.npz")


def _relative_error(actual, expected):
  return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


@pytest.mark.parametrize("name", GLM4_MOE)
@pytest.mark.parametrize("moe_impl", ["grouped", "per_route"])
def test_logits_match_transformers(name, moe_impl):
  model, ref = _load(name)
  logits = np.asarray(model(jnp.asarray(ref["input_ids"], jnp.int32), moe_impl=moe_impl))
  chex.assert_shape(logits, ref["logits"].shape)
  assert _relative_error(logits, ref["logits"]) < 1e-4
  chex.assert_trees_all_close(
    logits, ref["logits"], rtol=1e-4, atol=1e-4 * np.abs(ref["logits"]).max()
  )


@pytest.mark.parametrize("name", GLM4_MOE)
def test_greedy_generation_matches_transformers(name):
  model, ref = _load(name)
  engine = Generator(
    model,
    EngineConfig(
      max_batch_size=1, max_seq_len=32, page_size=4, attention_impl="xla", shuffle_pages_seed=0
    ),
  )
  out = engine.generate(ref["prompt_ids"].tolist(), max_new_tokens=24, stop_token_ids=())
  assert out.tokens[0] == ref["greedy_ids"][0].tolist()


def test_mtp_weights_loaded_from_both_layouts():
  """glm4_moe_c stores the MTP layer's own embed_tokens / shared_head.head; the others do not."""
  with_copies, _ = _load("glm4_moe_c")
  without, _ = _load("glm4_moe_a")
  assert with_copies.mtp.embed_tokens is not None and with_copies.mtp.shared_head_head is not None
  assert without.mtp.embed_tokens is None and without.mtp.shared_head_head is None
  np.testing.assert_array_equal(
    with_copies.mtp.embed_tokens.embedding[...], with_copies.model.embed_tokens.embedding[...]
  )
