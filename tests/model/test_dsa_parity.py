"""Parity with Hugging Face transformers' `GlmMoeDsaForCausalLM` (MLA + DSA indexer, shared layers).

Fixtures from scripts/make_hf_fixtures.py (transformers 5.23.0, float32, eager attention).
`glm_moe_dsa_a` has top-k 4 < 11 tokens (the indexer prunes in the plain forward) and groups
(full, shared), (full); `glm_moe_dsa_b` has top-k 16 (pruning starts during generation), one group
of three layers, attention biases and group-limited routing.
"""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.model.dsa_transformer import GlmDsaForCausalLM
from jaxspec.serving.engine import EngineConfig, Generator

FIXTURES = Path(__file__).parents[1] / "fixtures"
DSA = ["glm_moe_dsa_a", "glm_moe_dsa_b"]


def _load(name):
  model = jaxspec.load_pretrained(FIXTURES / name, dtype=jnp.float32)
  return model, np.load(FIXTURES / name / "reference.npz")


def _relative_error(actual, expected):
  return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


@pytest.mark.parametrize("name", DSA)
@pytest.mark.parametrize("moe_impl", ["grouped", "per_route"])
def test_logits_match_transformers(name, moe_impl):
  model, ref = _load(name)
  assert isinstance(model, GlmDsaForCausalLM)
  logits = np.asarray(model(jnp.asarray(ref["input_ids"], jnp.int32), moe_impl=moe_impl))
  assert logits.shape == ref["logits"].shape
  assert _relative_error(logits, ref["logits"]) < 1e-4
  np.testing.assert_allclose(
    logits, ref["logits"], rtol=1e-4, atol=1e-4 * np.abs(ref["logits"]).max()
  )


@pytest.mark.parametrize("name", DSA)
def test_mtp_logits_match_reference(name):
  model, ref = _load(name)
  input_ids = jnp.asarray(ref["input_ids"], jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
  target_hidden, _ = model.forward(input_ids, positions, moe_impl="grouped")
  np.testing.assert_allclose(target_hidden, ref["mtp_hidden"], rtol=1e-4, atol=1e-5)
  hidden, _ = model.mtp_forward(
    jnp.asarray(ref["mtp_next_ids"], jnp.int32),
    jnp.asarray(ref["mtp_hidden"]),
    jnp.asarray(ref["mtp_positions"], jnp.int32),
    moe_impl="grouped",
  )
  logits = np.asarray(model.mtp_logits(hidden))
  assert _relative_error(logits, ref["mtp_logits"]) < 1e-4
  np.testing.assert_allclose(
    logits, ref["mtp_logits"], rtol=1e-4, atol=1e-4 * np.abs(ref["mtp_logits"]).max()
  )


@pytest.mark.parametrize("name", DSA)
def test_greedy_generation_matches_transformers(name):
  """24 greedy tokens through the paged latent cache (prefill, then sparse absorbed decode)."""
  model, ref = _load(name)
  prompt = ref["prompt_ids"][0].tolist()
  engine = Generator(
    model,
    EngineConfig(
      max_batch_size=1, max_seq_len=32, page_size=4, attention_impl="xla", shuffle_pages_seed=0
    ),
  )
  out = engine.generate([prompt], max_new_tokens=24, stop_token_ids=())
  assert out.tokens[0] == ref["greedy_ids"][0].tolist()


def test_save_then_load_round_trips(tmp_path):
  model, ref = _load("glm_moe_dsa_a")
  jaxspec.save_pretrained(model, tmp_path / "copy")
  again = jaxspec.load_pretrained(tmp_path / "copy", dtype=jnp.float32)
  input_ids = jnp.asarray(ref["input_ids"], jnp.int32)
  np.testing.assert_array_equal(np.asarray(again(input_ids)), np.asarray(model(input_ids)))
  # The indexer's weights_proj stays float32 in a bfloat16 model, as in transformers.
  bf16 = jaxspec.load_pretrained(tmp_path / "copy", dtype=jnp.bfloat16)
  indexer = bf16.model.layers[0].self_attn.indexer
  assert indexer.weights_proj.kernel[...].dtype == jnp.float32
  assert indexer.wq_b.kernel[...].dtype == jnp.bfloat16
  assert bf16.model.layers[1].self_attn.indexer is None  # a shared layer
