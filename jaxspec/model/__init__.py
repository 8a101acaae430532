"""Flax NNX GLM models: config, layers, attention, MoE, transformer, checkpoint I/O."""

from jaxspec.model.config import GlmConfig, glm45, glm45_air, tiny
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.model.weights import load_pretrained, save_pretrained

__all__ = [
  "GlmConfig",
  "GlmForCausalLM",
  "glm45",
  "glm45_air",
  "load_pretrained",
  "save_pretrained",
  "tiny",
]
