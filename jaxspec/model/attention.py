"""GLM-4.5 GQA attention (partial RoPE, optional q/k RMSNorm and q/k/v bias) over a paged cache.

Three ways to run it, picked by the static `AttentionBatch.mode`:

- no batch (`batch=None`): a plain causal forward over the given tokens, nothing cached;
- `"prefill"`: the request's first tokens (positions 0..T-1). New keys/values are written to the
  paged cache and attention runs densely over them, keys past `seq_lens[b]` masked;
- `"decode"`: 1..8 new rows per request (plain decode, speculative verify, MTP draft). Keys and
  values are written first, then `jaxspec.kernels.paged_decode_attention` reads the whole request
  from the cache with the multi-row causal mask.
"""

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.kernels import paged_decode_attention
from jaxspec.model.config import GlmConfig
from jaxspec.model.layers import Linear, RMSNorm, apply_partial_rope

AttentionMode = Literal["prefill", "decode"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionBatch:
  """Where this step's tokens sit in the paged cache. All fields are device arrays but `mode`.

  `slot_mapping` holds flat cache slots (`page * page_size + offset`); -1 marks a row whose key and
  value must not be written (padding). `seq_lens[b]` is request b's KV length *after* this step's
  rows are written; 0 marks a padding request.
  """

  positions: jax.Array  # int32 [B, T]
  slot_mapping: jax.Array  # int32 [B, T]
  block_tables: jax.Array  # int32 [B, max_pages_per_req]
  seq_lens: jax.Array  # int32 [B]
  mode: AttentionMode = dataclasses.field(default="decode", metadata=dict(static=True))
  attention_impl: str = dataclasses.field(default="auto", metadata=dict(static=True))


def write_kv_pages(pages: jax.Array, new: jax.Array, slot_mapping: jax.Array) -> jax.Array:
  """Scatters new rows into one layer's pages; rows with slot -1 are dropped.

  pages: [Hkv, num_pages, page_size, D]; new: [B, T, Hkv, D]; slot_mapping: int32 [B, T].
  """
  _, num_pages, page_size, _ = pages.shape
  page = jnp.where(slot_mapping >= 0, slot_mapping // page_size, num_pages)  # OOB -> dropped
  offset = jnp.where(slot_mapping >= 0, slot_mapping % page_size, 0)
  update = jnp.moveaxis(new, 2, 0).astype(pages.dtype)  # [Hkv, B, T, D]
  return pages.at[:, page, offset].set(update, mode="drop")


def dense_causal_attention(q, k, v, valid_lens, sm_scale):
  """Causal attention among T fresh tokens at positions 0..T-1.

  q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; valid_lens: int32 [B] (keys >= valid_lens[b] are
  padding). Float32 softmax; a row with no visible key returns zeros.
  """
  batch, num_tokens, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  qg = q.reshape(batch, num_tokens, num_kv_heads, group, head_dim)
  scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * sm_scale
  query_pos = jnp.arange(num_tokens)[:, None]
  key_pos = jnp.arange(num_tokens)[None, :]
  visible = (key_pos <= query_pos)[None] & (key_pos[None] < valid_lens[:, None, None])  # [B, T, T]
  visible = visible[:, None, None]  # [B, 1, 1, T, T]
  scores = jnp.where(visible, scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  probs = jnp.where(visible, jnp.exp(scores - row_max), 0.0)
  denom = jnp.sum(probs, axis=-1, keepdims=True)
  probs = probs / jnp.where(denom > 0, denom, 1.0)
  out = jnp.einsum(
    "bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
  )
  return out.reshape(batch, num_tokens, num_heads, head_dim).astype(q.dtype)


class GqaAttention(nnx.Module):
  def __init__(self, config: GlmConfig, *, dtype, rngs: nnx.Rngs):
    h, d = config.hidden_size, config.head_dim
    self.num_heads = config.num_attention_heads
    self.num_kv_heads = config.num_key_value_heads
    self.head_dim = d
    self.rotary_dim = config.rotary_dim
    self.rope_theta = config.rope_theta
    bias = config.attention_bias
    self.q_proj = Linear(h, self.num_heads * d, bias=bias, dtype=dtype, rngs=rngs)
    self.k_proj = Linear(h, self.num_kv_heads * d, bias=bias, dtype=dtype, rngs=rngs)
    self.v_proj = Linear(h, self.num_kv_heads * d, bias=bias, dtype=dtype, rngs=rngs)
    self.o_proj = Linear(self.num_heads * d, h, bias=False, dtype=dtype, rngs=rngs)
    if config.use_qk_norm:
      self.q_norm = RMSNorm(d, eps=config.rms_norm_eps, dtype=dtype)
      self.k_norm = RMSNorm(d, eps=config.rms_norm_eps, dtype=dtype)
    else:
      self.q_norm = self.k_norm = None

  def __call__(self, x, positions, kv_pages=None, batch: AttentionBatch | None = None):
    """x: [B, T, H]; positions: int32 [B, T]; kv_pages: (k, v) each [Hkv, P, page, D] or None.

    Returns (out [B, T, H], updated kv_pages or None).
    """
    bsz, num_tokens, _ = x.shape
    q = self.q_proj(x).reshape(bsz, num_tokens, self.num_heads, self.head_dim)
    k = self.k_proj(x).reshape(bsz, num_tokens, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(bsz, num_tokens, self.num_kv_heads, self.head_dim)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q = apply_partial_rope(q, positions, self.rotary_dim, self.rope_theta)
    k = apply_partial_rope(k, positions, self.rotary_dim, self.rope_theta)
    sm_scale = self.head_dim**-0.5

    if batch is None:
      valid = jnp.full((bsz,), num_tokens, jnp.int32)
      out = dense_causal_attention(q, k, v, valid, sm_scale)
    else:
      k_pages = write_kv_pages(kv_pages[0], k, batch.slot_mapping)
      v_pages = write_kv_pages(kv_pages[1], v, batch.slot_mapping)
      kv_pages = (k_pages, v_pages)
      if batch.mode == "prefill":
        out = dense_causal_attention(q, k, v, batch.seq_lens, sm_scale)
      else:
        out = paged_decode_attention(
          q,
          k_pages,
          v_pages,
          batch.block_tables,
          batch.seq_lens,
          sm_scale=sm_scale,
          impl=batch.attention_impl,
        )
    return self.o_proj(out.reshape(bsz, num_tokens, -1)), kv_pages
