"""GLM-5 paged latent cache: prefill then sparse absorbed decode reproduces the plain forward.

Runs on the transformers fixtures, whose indexer top-k has no near-ties on their `input_ids`
(tests/fixtures/README.md), so a float32 rounding difference between the expanded (plain) and the
absorbed (decode) form cannot flip a selection. `glm_moe_dsa_a` prunes (top-k 4 of up to 11 keys,
groups (full, shared), (full)); `glm_moe_dsa_b` has one group of three layers. Caches are poisoned
with NaN and page tables shuffled.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec.model.attention import AttentionBatch
from jaxspec.model.dsa_config import tiny_dsa
from jaxspec.serving.kv_cache import BlockAllocator, PagedKVCache, slot_mapping
from jaxspec.serving.latent_cache import create_latent_cache
from jaxspec.serving.steps import decode_batch

FIXTURES = Path(__file__).parents[1] / "fixtures"


def _forward_logits(graphdef, params, cache, tokens, batch):
  model = nnx.merge(graphdef, params)
  hidden, layers = model.forward(tokens, batch.positions, cache.layers, batch, moe_impl="grouped")
  return model.logits(hidden), PagedKVCache(layers)


_forward = jax.jit(_forward_logits, static_argnums=0)


def _setup(name, page_size, num_tokens, seed):
  model = jaxspec.load_pretrained(FIXTURES / name, dtype=jnp.float32)
  tokens = np.load(FIXTURES / name / "reference.npz")["input_ids"][:, :num_tokens].astype(np.int32)
  expected = np.asarray(model(jnp.asarray(tokens)))  # [B, T, V]
  batch_size = tokens.shape[0]
  max_pages = -(-num_tokens // page_size)
  allocator = BlockAllocator(batch_size * max_pages + 3, page_size, shuffle_seed=seed)
  block_tables = np.array([allocator.allocate(max_pages) for _ in range(batch_size)], np.int32)
  config = model.config
  cache = create_latent_cache(
    config, config.num_hidden_layers, allocator.num_pages, page_size, jnp.float32
  )
  # Poison the cache: any read of a slot that was not written shows up as NaN.
  cache = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), cache)
  return model, tokens, expected, jnp.asarray(block_tables), cache


def _prefill(graphdef, params, cache, tokens, prompt_lens, block_tables, page_size):
  batch_size, prefill_len = tokens.shape
  positions = np.broadcast_to(np.arange(prefill_len, dtype=np.int32), tokens.shape)
  valid = positions < prompt_lens[:, None]
  batch = AttentionBatch(
    positions=jnp.asarray(positions),
    slot_mapping=slot_mapping(block_tables, jnp.asarray(positions), jnp.asarray(valid), page_size),
    block_tables=block_tables,
    seq_lens=jnp.asarray(prompt_lens),
    mode="prefill",
    attention_impl="xla",
  )
  return _forward(graphdef, params, cache, jnp.asarray(tokens), batch)


@pytest.mark.parametrize(
  "name, page_size", [("glm_moe_dsa_a", 2), ("glm_moe_dsa_a", 4), ("glm_moe_dsa_b", 64)]
)
def test_prefill_then_decode_matches_plain_forward(name, page_size):
  total = 11
  model, tokens, expected, block_tables, cache = _setup(name, page_size, total, page_size)
  graphdef, params = nnx.split(model)
  prompt_lens = np.array([6, 2], np.int32)
  logits, cache = _prefill(
    graphdef, params, cache, tokens[:, :6], prompt_lens, block_tables, page_size
  )
  for b in range(2):
    np.testing.assert_allclose(
      np.asarray(logits)[b, : prompt_lens[b]], expected[b, : prompt_lens[b]], rtol=1e-5, atol=1e-5
    )
  lengths = prompt_lens.copy()
  while (lengths < total).any():
    step_tokens = tokens[np.arange(2), np.minimum(lengths, total - 1)][:, None]
    seq_lens = np.where(lengths < total, lengths + 1, 0).astype(np.int32)
    batch = decode_batch(cache, jnp.asarray(seq_lens), block_tables, 1, "xla")
    logits, cache = _forward(graphdef, params, cache, jnp.asarray(step_tokens), batch)
    logits = np.asarray(logits)
    assert np.isfinite(logits).all()  # padding rows included
    for b in np.flatnonzero(lengths < total):
      np.testing.assert_allclose(logits[b, 0], expected[b, lengths[b]], rtol=1e-5, atol=1e-5)
    lengths = np.where(lengths < total, lengths + 1, lengths)


@pytest.mark.parametrize("q_len", [3, 5])
def test_multi_row_decode_matches_plain_forward(q_len):
  """A verify-style step with q_len rows per request: each row selects over its causal prefix."""
  page_size, total = 4, 11
  model, tokens, expected, block_tables, cache = _setup("glm_moe_dsa_a", page_size, total, q_len)
  graphdef, params = nnx.split(model)
  prompt = total - q_len
  _, cache = _prefill(
    graphdef,
    params,
    cache,
    tokens[:, :prompt],
    np.full((2,), prompt, np.int32),
    block_tables,
    page_size,
  )
  batch = decode_batch(cache, jnp.full((2,), total, jnp.int32), block_tables, q_len, "xla")
  logits, _ = _forward(graphdef, params, cache, jnp.asarray(tokens[:, prompt:]), batch)
  np.testing.assert_allclose(np.asarray(logits), expected[:, prompt:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["glm_moe_dsa_a", "glm_moe_dsa_b"])
def test_shared_group_conversion_equals_per_layer_conversion(name):
  """Shared layers reusing their full layer's physical slots give the logits of converting in
  every layer (and both match the plain forward)."""
  page_size, total, q_len = 4, 11, 4
  model, tokens, expected, block_tables, cache = _setup(name, page_size, total, 3)
  prompt = total - q_len
  results = []
  for index_conversion in ("per_group", "per_layer"):
    model.index_conversion = index_conversion
    graphdef, params = nnx.split(model)
    prompt_lens = np.full((2,), prompt, np.int32)
    _, filled = _prefill(
      graphdef, params, cache, tokens[:, :prompt], prompt_lens, block_tables, page_size
    )
    batch = decode_batch(filled, jnp.full((2,), total, jnp.int32), block_tables, q_len, "xla")
    logits, _ = _forward(graphdef, params, filled, jnp.asarray(tokens[:, prompt:]), batch)
    results.append(np.asarray(logits))
  np.testing.assert_array_equal(results[0], results[1])
  np.testing.assert_allclose(results[0], expected[:, prompt:], rtol=1e-5, atol=1e-5)


def test_cache_layout():
  config = tiny_dsa()
  cache = create_latent_cache(config, config.num_hidden_layers + 1, 5, 64)
  shapes = [tuple(p.shape for p in layer) for layer in cache.layers]
  latent, keys = (1, 5, 64, config.latent_dim), (1, 5, 64, config.index_head_dim)
  # full, shared, full, then the MTP layer (always full).
  assert shapes == [(latent, keys), (latent,), (latent, keys), (latent, keys)]
  assert cache.page_size == 64 and cache.num_pages == 5
