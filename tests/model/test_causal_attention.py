"""The plain forward's causal attention choice (`KernelChoices.causal_attention`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.model.config import tiny
from jaxspec.model.dsa_config import tiny_dsa
from jaxspec.model.metadata import KernelChoices, StepMetadata
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.training.trainer import training_kernels


def _logits(model, ids, kernels):
  hidden, _ = model.forward(ids, StepMetadata.plain(ids, kernels))
  return np.asarray(model.logits(hidden), np.float32)


def test_an_unknown_choice_is_a_clear_error():
  with pytest.raises(ValueError, match="KernelChoices.causal_attention"):
    KernelChoices(causal_attention="flash")


def test_mla_attention_refuses_the_cudnn_path_instead_of_ignoring_it():
  model = GlmForCausalLM(tiny_dsa(), dtype=jnp.float32, rngs=nnx.Rngs(0))
  ids = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="causal_attention must be 'xla' for MLA"):
    model.forward(ids, StepMetadata.plain(ids, KernelChoices(causal_attention="cudnn")))


def test_training_uses_dense_experts_everywhere_and_cudnn_only_on_a_gpu():
  common = dict(moe="dense", embedding_grad="one_hot")
  assert training_kernels("cpu") == KernelChoices(causal_attention="xla", **common)
  assert training_kernels("gpu") == KernelChoices(causal_attention="cudnn", **common)


@pytest.mark.gpu
def test_cudnn_matches_the_float32_softmax_reference_on_a_gqa_model():
  config = tiny(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
  model = GlmForCausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
  ids = jax.random.randint(jax.random.key(1), (3, 96), 0, config.vocab_size)
  reference = _logits(model, ids, KernelChoices(causal_attention="xla"))
  fused = _logits(model, ids, KernelChoices(causal_attention="cudnn"))
  # bf16 activations: the paths differ by where P is rounded (cuDNN feeds bf16 P to P @ V).
  np.testing.assert_allclose(fused, reference, rtol=3e-2, atol=3e-2 * np.abs(reference).max())
  assert np.mean(np.argmax(fused, -1) == np.argmax(reference, -1)) > 0.97
