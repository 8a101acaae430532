"""Paged latent cache of GLM-5 (MLA + DSA) models, in the `PagedKVCache` container.

MLA caches one latent row per token: the normed KV latent and the roped shared key,
`kv_lora_rank + qk_rope_head_dim` wide, instead of per-head keys and values. A "full" layer also
caches its indexer's keys (`index_head_dim` wide). Both use the same pages and block tables as the
GQA cache, stored with a single head axis so that the `[H, num_pages, page_size, D]` layout (and
`PagedKVCache.num_pages` / `page_size`, slot mappings, rollback by length) is unchanged:

- full layer `i`: `(latent [1, P, page, kv_lora_rank + qk_rope_head_dim],
  index_keys [1, P, page, index_head_dim])`;
- shared layer `i`: `(latent,)`.

Layer `num_hidden_layers` (the MTP layer of a speculative cache) is a full layer.
"""

import jax.numpy as jnp

from jaxspec.model.config import GlmConfig
from jaxspec.model.dsa_config import GlmDsaConfig
from jaxspec.serving.kv_cache import PagedKVCache


def create_latent_cache(
  config: GlmDsaConfig, num_layers: int, num_pages: int, page_size: int, dtype=jnp.bfloat16
) -> PagedKVCache:
  """Zeroed latent (and indexer key) pages for the first `num_layers` layers (MTP layer last)."""
  if not 1 <= num_layers <= config.num_hidden_layers + 1:
    raise ValueError(f"num_layers must be in 1..{config.num_hidden_layers + 1}, got {num_layers}")
  latent_shape = (1, num_pages, page_size, config.latent_dim)
  index_shape = (1, num_pages, page_size, config.index_head_dim)
  layers = []
  for i in range(num_layers):
    latent = jnp.zeros(latent_shape, dtype)
    full = i == config.num_hidden_layers or config.has_indexer(i)
    layers.append((latent, jnp.zeros(index_shape, dtype)) if full else (latent,))
  return PagedKVCache(tuple(layers))


def create_cache(
  config: GlmConfig | GlmDsaConfig,
  num_layers: int,
  num_pages: int,
  page_size: int,
  dtype=jnp.bfloat16,
) -> PagedKVCache:
  """The paged cache a model family needs: latent rows for GLM-5, keys and values for GLM-4.5."""
  if isinstance(config, GlmDsaConfig):
    return create_latent_cache(config, num_layers, num_pages, page_size, dtype)
  return PagedKVCache.create(config, num_layers, num_pages, page_size, dtype)
