"""Parity with Hugging Face transformers on tiny random checkpoints of both families.

The checkpoints and reference outputs in tests/fixtures were written by
scripts/make_hf_fixtures.py (transformers 5.23.0, float32, eager attention); torch is not needed
here. GLM-4.5 (`Glm4MoeForCausalLM`): each fixture varies qk-norm, bias, grouping, dense layers,
top-k normalisation, the head ratio G (3, 1, 4) and the rotary fraction (0.5, 1.0, 0.25). GLM-5
(`GlmMoeDsaForCausalLM`, MLA + DSA indexer): `glm_moe_dsa_a` has top-k 4 < 11 tokens (the indexer
prunes in the plain forward) and index groups (full, shared), (full); `glm_moe_dsa_b` has top-k 16
(pruning starts during generation), one group of three layers, attention biases and group-limited
routing. The MTP head is compared with transformers' `MtpModel`: row t sees the target's hidden
state of position t (after the final norm) and the token of position t + 1, at RoPE position
t + 1.
"""

from pathlib import Path

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.model.attention import GqaAttention
from jaxspec.model.config import GlmConfig
from jaxspec.model.dsa_config import GlmDsaConfig
from jaxspec.model.metadata import KernelChoices, StepMetadata
from jaxspec.model.mla import MlaAttention
from jaxspec.serving.engine import EngineConfig, Generator

FIXTURES = Path(__file__).parents[1] / "fixtures"
GLM4_MOE = ["glm4_moe_a", "glm4_moe_b", "glm4_moe_c"]
GLM_MOE_DSA = ["glm_moe_dsa_a", "glm_moe_dsa_b"]
ALL = GLM4_MOE + GLM_MOE_DSA
MOE_IMPLS = ["grouped", "per_route", "dense"]


def _load(name):
  model = jaxspec.load_pretrained(FIXTURES / name, dtype=jnp.float32)
  return model, np.load(FIXTURES / name / "reference.npz")


def _assert_close(actual, expected):
  """Relative Frobenius error below 1e-4, and elementwise within 1e-4 of the largest value."""
  chex.assert_shape(actual, expected.shape)
  assert np.linalg.norm(actual - expected) / np.linalg.norm(expected) < 1e-4
  chex.assert_trees_all_close(actual, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("name", ALL)
def test_the_config_picks_the_family_and_its_attention(name):
  model, _ = _load(name)
  config_class, attention = (
    (GlmConfig, GqaAttention)
    if "dsa" not in name
    else (
      GlmDsaConfig,
      MlaAttention,
    )
  )
  assert type(model.config) is config_class
  assert all(isinstance(layer.self_attn, attention) for layer in model.model.layers)
  assert isinstance(model.mtp.layer.self_attn, attention)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("moe_impl", MOE_IMPLS)
def test_logits_match_transformers(name, moe_impl):
  model, ref = _load(name)
  logits = model(jnp.asarray(ref["input_ids"], jnp.int32), kernels=KernelChoices(moe=moe_impl))
  _assert_close(np.asarray(logits), ref["logits"])


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("moe_impl", MOE_IMPLS)
def test_mtp_logits_match_transformers(name, moe_impl):
  model, ref = _load(name)
  input_ids = jnp.asarray(ref["input_ids"], jnp.int32)
  kernels = KernelChoices(moe=moe_impl)
  target_hidden, _ = model.forward(input_ids, StepMetadata.plain(input_ids, kernels))
  chex.assert_trees_all_close(np.asarray(target_hidden), ref["mtp_hidden"], rtol=1e-4, atol=1e-5)
  hidden, _ = model.mtp_forward(
    jnp.asarray(ref["mtp_next_ids"], jnp.int32),
    jnp.asarray(ref["mtp_hidden"]),
    _mtp_step(ref, kernels),
  )
  _assert_close(np.asarray(model.mtp_logits(hidden)), ref["mtp_logits"])


def _mtp_step(ref, kernels):
  """Row t consumes the hidden state of position t, at RoPE position t + 1 (`mtp_positions`)."""
  return StepMetadata(positions=jnp.asarray(ref["mtp_positions"], jnp.int32) - 1, kernels=kernels)


@pytest.mark.parametrize("name", ALL)
def test_greedy_generation_matches_transformers(name):
  """24 greedy tokens through the paged cache (GLM-5: the latent cache, prefill then sparse
  absorbed decode), pages shuffled."""
  model, ref = _load(name)
  engine = Generator(
    model,
    EngineConfig(
      max_batch_size=1, max_seq_len=32, page_size=4, attention_impl="xla", shuffle_pages_seed=0
    ),
  )
  out = engine.generate(ref["prompt_ids"].tolist(), max_new_tokens=24, stop_token_ids=())
  assert out.tokens[0] == ref["greedy_ids"][0].tolist()


def test_pruned_mtp_rows_equal_the_same_rows_of_the_full_pass():
  model, ref = _load("glm4_moe_a")
  args = (
    jnp.asarray(ref["mtp_next_ids"], jnp.int32),
    jnp.asarray(ref["mtp_hidden"]),
    _mtp_step(ref, KernelChoices(moe="grouped")),
  )
  full, _ = model.mtp_forward(*args)
  rows = jnp.array([3, 11 + 10], jnp.int32)  # request 0 row 3, request 1 row 10
  pruned, _ = model.mtp_forward(*args, last_token_indices=rows)
  chex.assert_shape(pruned, (2, full.shape[-1]))
  chex.assert_trees_all_close(pruned, full.reshape(-1, full.shape[-1])[rows], rtol=1e-6, atol=1e-6)


def test_mtp_weights_loaded_from_both_layouts():
  """glm4_moe_c stores the MTP layer's own embed_tokens / shared_head.head; the others do not."""
  with_copies, _ = _load("glm4_moe_c")
  without, _ = _load("glm4_moe_a")
  assert with_copies.mtp.embed_tokens is not None and with_copies.mtp.shared_head_head is not None
  assert without.mtp.embed_tokens is None and without.mtp.shared_head_head is None
  np.testing.assert_array_equal(
    with_copies.mtp.embed_tokens.embedding[...], with_copies.model.embed_tokens.embedding[...]
  )


def test_dsa_save_then_load_round_trips(tmp_path):
  model, ref = _load("glm_moe_dsa_a")
  jaxspec.save_pretrained(model, tmp_path / "copy")
  again = jaxspec.load_pretrained(tmp_path / "copy", dtype=jnp.float32)
  input_ids = jnp.asarray(ref["input_ids"], jnp.int32)
  np.testing.assert_array_equal(np.asarray(again(input_ids)), np.asarray(model(input_ids)))
  # The indexer's weights_proj stays float32 in a bfloat16 model, as in transformers.
  bf16 = jaxspec.load_pretrained(tmp_path / "copy", dtype=jnp.bfloat16)
  indexer = bf16.model.layers[0].self_attn.indexer
  chex.assert_type(indexer.weights_proj.kernel[...], jnp.float32)
  chex.assert_type(indexer.wq_b.kernel[...], jnp.bfloat16)
  assert bf16.model.layers[1].self_attn.indexer is None  # a shared layer
