"""Flax NNX GLM models: config, layers, attention, MoE, transformer, checkpoint I/O."""

from jaxspec.model.config import GlmConfig, glm45, glm45_air, tiny
from jaxspec.model.dsa_config import GlmDsaConfig, glm53_small, tiny_dsa
from jaxspec.model.dsa_transformer import GlmDsaForCausalLM
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.model.weights import load_pretrained, save_pretrained

__all__ = [
  "GlmConfig",
  "GlmDsaConfig",
  "GlmDsaForCausalLM",
  "GlmForCausalLM",
  "glm45",
  "glm45_air",
  "glm53_small",
  "load_pretrained",
  "save_pretrained",
  "tiny",
  "tiny_dsa",
]
