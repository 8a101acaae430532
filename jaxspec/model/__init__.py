"""Flax NNX GLM models: configs, layers, attention, MoE, the decoder, its cache, checkpoint I/O."""

from jaxspec.model.cache import ModelCache
from jaxspec.model.config import FAMILIES, GlmConfig, ModelConfig, glm45, glm45_air, tiny
from jaxspec.model.dsa_config import GlmDsaConfig, glm53_small, tiny_dsa
from jaxspec.model.metadata import KernelChoices, StepMetadata
from jaxspec.model.transformer import GlmDsaForCausalLM, GlmForCausalLM
from jaxspec.model.weights import load_pretrained, save_pretrained

__all__ = [
  "FAMILIES",
  "GlmConfig",
  "GlmDsaConfig",
  "GlmDsaForCausalLM",
  "GlmForCausalLM",
  "KernelChoices",
  "ModelCache",
  "ModelConfig",
  "StepMetadata",
  "glm45",
  "glm45_air",
  "glm53_small",
  "load_pretrained",
  "save_pretrained",
  "tiny",
  "tiny_dsa",
]
