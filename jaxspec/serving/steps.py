"""Static-shape step functions, each one `jit` boundary with the KV cache donated.

Every step takes the model as `(graphdef, params)` (static graph, array state), so the compiled
program depends only on the shape bucket and the static options, never on lengths or positions,
which stay device arrays.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.model.attention import AttentionBatch
from jaxspec.serving.kv_cache import PagedKVCache, slot_mapping
from jaxspec.serving.sampling import SamplingParams, sample

_STATIC = ("graphdef", "sampling", "moe_impl", "attention_impl")


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache",))
def prefill_step(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  cache: PagedKVCache,
  input_ids: jax.Array,  # int32 [B, T], request b's prompt in [:prompt_lens[b]]
  prompt_lens: jax.Array,  # int32 [B], 0 = padding request
  block_tables: jax.Array,  # int32 [B, max_pages]
  key: jax.Array,
  *,
  sampling: SamplingParams,
  moe_impl: str,
  attention_impl: str,
):
  """Runs the prompts, fills the cache, samples each request's first new token.

  Returns (next_tokens int32 [B], hidden [B, T, H] after the final norm, cache).
  """
  model = nnx.merge(graphdef, params)
  positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
  valid = positions < prompt_lens[:, None]
  batch = AttentionBatch(
    positions=positions,
    slot_mapping=slot_mapping(block_tables, positions, valid, cache.page_size),
    block_tables=block_tables,
    seq_lens=prompt_lens,
    mode="prefill",
    attention_impl=attention_impl,
  )
  hidden, layers = model.forward(
    input_ids, positions, target_layers(model, cache), batch, moe_impl=moe_impl
  )
  last = jnp.clip(prompt_lens - 1, 0, input_ids.shape[1] - 1)
  last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [B, H]
  next_tokens = sample(model.logits(last_hidden), key, sampling)
  return next_tokens, hidden, cache.replace_prefix(layers)


def target_layers(model, cache: PagedKVCache):
  """The target's layers of a cache that may also hold the MTP layer's (the last one)."""
  return cache.layers[: model.config.num_hidden_layers]


def decode_batch(
  cache: PagedKVCache, seq_lens, block_tables, q_len: int, attention_impl: str
) -> AttentionBatch:
  """Attention metadata for `q_len` new rows per request ending at `seq_lens` (0 = padding)."""
  positions = seq_lens[:, None] - q_len + jnp.arange(q_len, dtype=jnp.int32)[None]  # [B, q_len]
  valid = (seq_lens[:, None] > 0) & (positions >= 0)
  return AttentionBatch(
    positions=jnp.maximum(positions, 0),
    slot_mapping=slot_mapping(block_tables, positions, valid, cache.page_size),
    block_tables=block_tables,
    seq_lens=seq_lens,
    mode="decode",
    attention_impl=attention_impl,
  )


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache",))
def decode_step(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  cache: PagedKVCache,
  tokens: jax.Array,  # int32 [B, 1]
  seq_lens: jax.Array,  # int32 [B], KV length including this token; 0 = padding
  block_tables: jax.Array,  # int32 [B, max_pages]
  key: jax.Array,
  *,
  sampling: SamplingParams,
  moe_impl: str,
  attention_impl: str,
):
  """One plain decode step: writes each request's newest token, samples the next.

  Returns (next_tokens int32 [B], cache).
  """
  model = nnx.merge(graphdef, params)
  batch = decode_batch(cache, seq_lens, block_tables, tokens.shape[1], attention_impl)
  hidden, layers = model.forward(
    tokens, batch.positions, target_layers(model, cache), batch, moe_impl=moe_impl
  )
  next_tokens = sample(model.logits(hidden[:, -1]), key, sampling)
  return next_tokens, cache.replace_prefix(layers)
