"""Helpers shared by the serving tests."""

import jax.numpy as jnp
import pytest

from jaxspec.model import moe as moe_module


def _scale(variable, factor):
  variable[...] = variable[...] * factor


def make_mostly_bigram(model, scale):
  """Turns a model (either family) into one whose MTP head nearly knows the next-next token.

  With the attention and MLP outputs scaled by `scale`, the target's next token depends mostly
  on the current token (a bigram map f). The MTP layer sees the embedding of token t + 1 through
  an `eh_proj` that passes it straight on, so it predicts f(token t + 1): the target's next
  token. The small attention and MLP contributions keep the caches in play: a cache bug changes
  tokens. Returns the model, modified in place.
  """
  for layer in [*model.model.layers, model.mtp.layer]:
    _scale(layer.self_attn.o_proj.kernel, scale)
    mlp = layer.mlp
    if isinstance(mlp, moe_module.MoE):
      _scale(mlp.experts.down, scale)
      _scale(mlp.shared_experts.down_proj.kernel, scale)
    else:
      _scale(mlp.down_proj.kernel, scale)
  hidden = model.config.hidden_size
  pass_embedding = jnp.concatenate([jnp.eye(hidden), 0.02 * jnp.ones((hidden, hidden))], axis=0)
  model.mtp.eh_proj.kernel[...] = pass_embedding
  return model


@pytest.fixture(scope="session")
def mostly_bigram():
  return make_mostly_bigram
