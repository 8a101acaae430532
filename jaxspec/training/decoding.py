"""The model's own greedy continuations of prefixes, decoded inside a jitted train step.

Two training losses need text the model itself would generate: sequence-level unlikelihood
(`unlikelihood`) penalises the loops in it, and the draft head (`TrainConfig.draft_text =
"greedy"`) learns to draft it, as the draft loop meets it when decoding greedily.
"""

import jax
import jax.numpy as jnp

from jaxspec.model.metadata import StepMetadata

# The forwards run over buffers padded to a multiple of this (causal: the padding after a
# position does not change it), the sequence lengths cuDNN's flash attention accepts.
PAD_TO = 64


def padded(tokens: jax.Array) -> jax.Array:
  """tokens: int [U, L] -> [U, L rounded up to PAD_TO], zeros after the tokens."""
  return jnp.pad(tokens, ((0, 0), (0, -tokens.shape[1] % PAD_TO)))


def greedy_rollouts(model, prefixes: jax.Array, new_tokens: int, kernels) -> jax.Array:
  """prefixes: int32 [U, P] -> int32 [U, P + new_tokens], the prefixes and their greedy
  continuations, by re-running the causal forward over the whole buffer for every new token (no
  cache: the tokens after a position do not affect it). Traced inside the train step, one
  `fori_loop`; no gradient flows through the decoded tokens."""
  prefix = prefixes.shape[1]
  buffer = padded(jnp.pad(prefixes, ((0, 0), (0, new_tokens))))  # [U, >= P + N]
  step = StepMetadata.plain(buffer, kernels)

  def decode(i, buffer):
    hidden, _ = model.forward(buffer, step)  # [U, P + N padded, H]
    position = prefix - 1 + i
    logits = model.logits(jax.lax.dynamic_index_in_dim(hidden, position, axis=1, keepdims=False))
    next_token = jnp.argmax(logits, axis=-1).astype(buffer.dtype)  # [U]
    return jax.lax.dynamic_update_index_in_dim(buffer, next_token, position + 1, axis=1)

  buffer = jax.lax.fori_loop(0, new_tokens, decode, buffer)
  return jax.lax.stop_gradient(buffer[:, : prefix + new_tokens])
