"""Paged prefill followed by token-by-token decode reproduces the plain causal forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.model.attention import AttentionBatch
from jaxspec.model.config import tiny
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.serving.kv_cache import BlockAllocator, PagedKVCache, slot_mapping
from jaxspec.serving.steps import decode_batch


def _forward_logits(graphdef, params, cache, tokens, batch):
  model = nnx.merge(graphdef, params)
  hidden, layers = model.forward(tokens, batch.positions, cache.layers, batch, moe_impl="grouped")
  return model.logits(hidden), PagedKVCache(layers)


_forward = jax.jit(_forward_logits, static_argnums=0)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_prefill_then_decode_matches_plain_forward(page_size):
  config = tiny(num_attention_heads=6, num_key_value_heads=2)
  model = GlmForCausalLM(config, rngs=nnx.Rngs(page_size))
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(page_size)
  prompt_lens = np.array([5, 1, 9], np.int32)
  total = 13  # every request decodes up to 13 tokens
  tokens = rng.integers(0, config.vocab_size, (3, total)).astype(np.int32)
  expected = np.asarray(model(jnp.asarray(tokens)))  # [B, total, V]

  max_pages = -(-total // page_size)
  allocator = BlockAllocator(3 * max_pages + 5, page_size, shuffle_seed=page_size)
  block_tables = np.array([allocator.allocate(max_pages) for _ in range(3)], np.int32)
  cache = PagedKVCache.create(
    config, config.num_hidden_layers, allocator.num_pages, page_size, jnp.float32
  )
  # Poison the cache: any read of a slot that was not written shows up as NaN.
  cache = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), cache)

  prefill_len = 9
  positions = np.broadcast_to(np.arange(prefill_len, dtype=np.int32), (3, prefill_len))
  valid = positions < prompt_lens[:, None]
  batch = AttentionBatch(
    positions=jnp.asarray(positions),
    slot_mapping=slot_mapping(
      jnp.asarray(block_tables), jnp.asarray(positions), jnp.asarray(valid), page_size
    ),
    block_tables=jnp.asarray(block_tables),
    seq_lens=jnp.asarray(prompt_lens),
    mode="prefill",
    attention_impl="xla",
  )
  logits, cache = _forward(graphdef, params, cache, jnp.asarray(tokens[:, :prefill_len]), batch)
  for b in range(3):
    np.testing.assert_allclose(
      np.asarray(logits)[b, : prompt_lens[b]], expected[b, : prompt_lens[b]], rtol=2e-5, atol=2e-5
    )

  lengths = prompt_lens.copy()
  while (lengths < total).any():
    step_tokens = tokens[np.arange(3), np.minimum(lengths, total - 1)][:, None]
    seq_lens = np.where(lengths < total, lengths + 1, 0).astype(np.int32)
    batch = decode_batch(cache, jnp.asarray(seq_lens), jnp.asarray(block_tables), 1, "xla")
    logits, cache = _forward(graphdef, params, cache, jnp.asarray(step_tokens), batch)
    for b in np.flatnonzero(lengths < total):
      np.testing.assert_allclose(
        np.asarray(logits)[b, 0], expected[b, lengths[b]], rtol=2e-5, atol=2e-5
      )
    lengths = np.where(lengths < total, lengths + 1, lengths)


@pytest.mark.parametrize("q_len", [2, 4])
def test_multi_row_decode_matches_plain_forward(q_len):
  """A verify-style step with q_len rows per request gives the plain forward's logits."""
  config = tiny()
  model = GlmForCausalLM(config, rngs=nnx.Rngs(7))
  graphdef, params = nnx.split(model)
  page_size, total = 4, 11
  tokens = np.random.default_rng(q_len).integers(0, config.vocab_size, (2, total)).astype(np.int32)
  expected = np.asarray(model(jnp.asarray(tokens)))
  allocator = BlockAllocator(16, page_size, shuffle_seed=1)
  block_tables = np.array([allocator.allocate(3) for _ in range(2)], np.int32)
  cache = PagedKVCache.create(config, config.num_hidden_layers, 16, page_size, jnp.float32)
  cache = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), cache)
  prompt = total - q_len
  positions = np.broadcast_to(np.arange(prompt, dtype=np.int32), (2, prompt))
  prefill = AttentionBatch(
    positions=jnp.asarray(positions),
    slot_mapping=slot_mapping(
      jnp.asarray(block_tables), jnp.asarray(positions), jnp.ones((2, prompt), bool), page_size
    ),
    block_tables=jnp.asarray(block_tables),
    seq_lens=jnp.full((2,), prompt, jnp.int32),
    mode="prefill",
    attention_impl="xla",
  )
  _, cache = _forward(graphdef, params, cache, jnp.asarray(tokens[:, :prompt]), prefill)
  batch = decode_batch(
    cache, jnp.full((2,), total, jnp.int32), jnp.asarray(block_tables), q_len, "xla"
  )
  logits, _ = _forward(graphdef, params, cache, jnp.asarray(tokens[:, prompt:]), batch)
  np.testing.assert_allclose(np.asarray(logits), expected[:, prompt:], rtol=2e-5, atol=2e-5)
