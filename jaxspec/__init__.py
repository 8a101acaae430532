"""jaxspec: speculative decoding of GLM-style mixture-of-experts models in JAX and Pallas."""

from jaxspec.model import (
  GlmConfig,
  GlmDsaConfig,
  GlmDsaForCausalLM,
  GlmForCausalLM,
  load_pretrained,
  save_pretrained,
)
from jaxspec.model.sharding import make_mesh

__version__ = "0.1.0"

__all__ = [
  "GlmConfig",
  "GlmDsaConfig",
  "GlmDsaForCausalLM",
  "GlmForCausalLM",
  "load_pretrained",
  "make_mesh",
  "save_pretrained",
]
