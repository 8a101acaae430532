"""Plain-jnp float32 reference for paged multi-row decode attention.

Semantics (shared by every implementation of the op): request ``b`` has
``S = seq_lens[b]`` KV positions, the last ``q_len`` of them belonging to the
query rows. Row ``j`` sees KV positions ``p < S - q_len + j + 1`` (causal among
the draft rows). Query head ``h`` reads KV head ``h // G`` with
``G = Hq // Hkv``. Rows that see nothing (``S - q_len + j + 1 <= 0``, which
includes padding slots with ``S = 0``) return zeros.

The pages of each request are gathered into a contiguous
``[B, Hkv, max_pages * page_size, D]`` view and attended to with one masked
softmax. Masking is done with ``where`` (never by multiplying with 0) so that
NaN or garbage in pages a request does not own cannot leak into its output.
"""

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def paged_decode_attention_reference(
  q: jax.Array,  # [B, q_len, Hq, D]
  k_pages: jax.Array,  # [Hkv, num_pages, page_size, D]
  v_pages: jax.Array,  # [Hkv, num_pages, page_size, D]
  block_tables: jax.Array,  # int32 [B, max_pages_per_req]
  seq_lens: jax.Array,  # int32 [B]
  *,
  sm_scale: float,
) -> jax.Array:  # [B, q_len, Hq, D], q.dtype
  """Masked softmax attention over the gathered pages, in float32."""
  batch, q_len, num_q_heads, head_dim = q.shape
  num_kv_heads, num_pages, page_size, _ = k_pages.shape
  max_pages = block_tables.shape[1]
  group = num_q_heads // num_kv_heads
  kv_len = max_pages * page_size

  # Entries past a request's pages may hold garbage ids: clamp them so the
  # gather stays in bounds; the length mask below removes what they fetch.
  page_ids = jnp.clip(block_tables, 0, num_pages - 1)  # [B, P]

  def gather(pages):  # [Hkv, N, page, D] -> [B, Hkv, P * page, D]
    gathered = pages[:, page_ids]  # [Hkv, B, P, page, D]
    return jnp.swapaxes(gathered, 0, 1).reshape(batch, num_kv_heads, kv_len, head_dim)

  keys = gather(k_pages).astype(jnp.float32)
  values = gather(v_pages).astype(jnp.float32)

  positions = jnp.arange(kv_len, dtype=jnp.int32)  # [L]
  in_length = positions[None, :] < seq_lens[:, None]  # [B, L]
  # Zero values outside the request: their probability is 0, but 0 * NaN = NaN.
  values = jnp.where(in_length[:, None, :, None], values, 0.0)

  # Row j sees positions < S - q_len + j + 1.
  row_limits = seq_lens[:, None] - q_len + 1 + jnp.arange(q_len, dtype=jnp.int32)  # [B, q_len]
  visible = positions[None, None, :] < row_limits[:, :, None]  # [B, q_len, L]

  queries = q.astype(jnp.float32).reshape(batch, q_len, num_kv_heads, group, head_dim)
  scores = jnp.einsum("bjhgd,bhld->bhgjl", queries, keys) * sm_scale  # [B, Hkv, G, q_len, L]
  mask = visible[:, None, None, :, :]
  scores = jnp.where(mask, scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  # Rows that see nothing have max -inf; shift by 0 instead so exp stays finite.
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  probs = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
  denom = jnp.sum(probs, axis=-1, keepdims=True)
  out = jnp.einsum("bhgjl,bhld->bjhgd", probs, values)  # [B, q_len, Hkv, G, D]
  denom = jnp.moveaxis(denom, 3, 1)  # [B, q_len, Hkv, G, 1]
  out = out / jnp.where(denom > 0.0, denom, 1.0)
  return out.reshape(batch, q_len, num_q_heads, head_dim).astype(q.dtype)
