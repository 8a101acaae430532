"""Attention modules over the paged cache, and GLM-4.5's GQA attention.

Every attention module satisfies the `Attention` protocol: it declares and creates its own page
pytree (`init_pages`) and runs one step, `(x, pages, step, selection) -> (out, pages, selection)`,
in the three modes of `StepMetadata` (plain, prefill, decode). `selection` is the sparse-attention
key choice an index group hands from layer to layer (GLM-5's `IndexSelection`); attention without
an indexer passes None through.

GLM-4.5's GQA (partial RoPE, optional q/k RMSNorm and q/k/v bias) caches per-head keys and values,
`GqaPages`; in decode steps `jaxspec.kernels.paged_decode_attention` reads the whole request from
the cache with the multi-row causal mask.
"""

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxspec.kernels import paged_decode_attention
from jaxspec.model.cache import Pages
from jaxspec.model.config import GlmConfig
from jaxspec.model.layers import Linear, RMSNorm, apply_partial_rope
from jaxspec.model.metadata import StepMetadata


class Attention(Protocol):
  """What the decoder layer needs of an attention module (GQA, MLA + DSA, ...)."""

  def init_pages(self, num_pages: int, page_size: int, dtype) -> Pages:
    """Zeroed pages of this layer for a pool of `num_pages` pages of `page_size` tokens."""
    ...

  def __call__(
    self, x: jax.Array, pages: Pages | None, step: StepMetadata, selection: Any
  ) -> tuple[jax.Array, Pages | None, Any]:
    """x: [B, T, H] -> (out [B, T, H], updated pages (None in plain mode), selection)."""
    ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GqaPages:
  """One GQA layer's paged keys and values, HND like `paged_decode_attention` reads them."""

  # Logical axes of `k` and `v` (jaxspec.model.sharding): split by KV head under tensor parallelism.
  axes = ("kv_heads", None, None, None)

  k: jax.Array  # [Hkv, num_pages, page_size, D]
  v: jax.Array  # [Hkv, num_pages, page_size, D]
  # fp8 pages only: the real value of a stored entry is entry * scale, per KV head.
  k_scale: jax.Array | None = None  # float32 [Hkv]
  v_scale: jax.Array | None = None  # float32 [Hkv]

  @property
  def quantized(self) -> bool:
    """Whether the pages hold fp8 values with a scale per KV head."""
    return self.k_scale is not None

  @property
  def num_pages(self) -> int:
    """Pages in the pool."""
    return self.k.shape[1]

  @property
  def page_size(self) -> int:
    """Token slots per page."""
    return self.k.shape[2]


FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448


def _quantize(new: jax.Array, scale: jax.Array | None) -> jax.Array:
  """new: [B, T, Hkv, D] -> new / scale per KV head (fp8 pages), or `new` as it is.

  Saturating, as vLLM's and FlashInfer's fp8 KV writers convert (CUDA's `__NV_SATFINITE`): a
  value beyond +-448 * scale is stored as +-448, where a plain cast to float8_e4m3fn (no
  infinities) would store NaN and turn every later attention output of its request into NaN.
  """
  if scale is None:
    return new
  return jnp.clip(new.astype(jnp.float32) / scale[None, None, :, None], -FP8_MAX, FP8_MAX)


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
  """GLM-4.5 grouped-query attention (transformers' `Glm4MoeAttention`).

  On a mesh the query heads are split over `tp`, and so are the KV heads and their pages unless
  `tp` exceeds their number (then every rank keeps all of them, as vLLM does); the paged decode
  kernel then runs per shard under `jax.shard_map`.
  """

  def __init__(self, config: GlmConfig, *, dtype, rngs: nnx.Rngs, mesh: Mesh | None = None):
    h, d = config.hidden_size, config.head_dim
    self.num_heads = config.num_attention_heads
    self.num_kv_heads = config.num_key_value_heads
    self.head_dim = d
    self.rotary_dim = config.rotary_dim
    self.rope_theta = config.rope_theta
    self.mesh = mesh
    bias = config.attention_bias
    kwargs = dict(bias=bias, dtype=dtype, rngs=rngs)
    self.q_proj = Linear(h, self.num_heads * d, axes=(None, "heads"), **kwargs)
    self.k_proj = Linear(h, self.num_kv_heads * d, axes=(None, "kv_heads"), **kwargs)
    self.v_proj = Linear(h, self.num_kv_heads * d, axes=(None, "kv_heads"), **kwargs)
    self.o_proj = Linear(
      self.num_heads * d, h, bias=False, dtype=dtype, rngs=rngs, axes=("heads", None)
    )
    if config.use_qk_norm:
      self.q_norm = RMSNorm(d, eps=config.rms_norm_eps, dtype=dtype)
      self.k_norm = RMSNorm(d, eps=config.rms_norm_eps, dtype=dtype)
    else:
      self.q_norm = self.k_norm = None

  def init_pages(self, num_pages: int, page_size: int, dtype, kv_scale: float = 1.0) -> GqaPages:
    """Zeroed pages; with dtype float8_e4m3fn every KV head stores values divided by `kv_scale`
    (quantised on write, as FlashInfer and vLLM serve fp8 KV caches; beyond +-448 * `kv_scale`
    a value saturates)."""
    shape = (self.num_kv_heads, num_pages, page_size, self.head_dim)
    pages = GqaPages(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    if jnp.dtype(dtype) == jnp.float8_e4m3fn:
      # Two buffers: the cache is donated to every step, and one buffer cannot be donated twice.
      k_scale, v_scale = (jnp.full((self.num_kv_heads,), kv_scale, jnp.float32) for _ in range(2))
      pages = dataclasses.replace(pages, k_scale=k_scale, v_scale=v_scale)
    return pages

  def __call__(self, x, pages: GqaPages | None, step: StepMetadata, selection=None):
    """x: [B, T, H]; pages: this layer's `GqaPages` (None in plain mode).

    Returns (out [B, T, H], updated pages or None, `selection` passed through).
    """
    positions = step.positions
    bsz, num_tokens, _ = x.shape
    q = self.q_proj(x).reshape(bsz, num_tokens, self.num_heads, self.head_dim)
    k = self.k_proj(x).reshape(bsz, num_tokens, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(bsz, num_tokens, self.num_kv_heads, self.head_dim)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q = apply_partial_rope(q, positions, self.rotary_dim, self.rope_theta)
    k = apply_partial_rope(k, positions, self.rotary_dim, self.rope_theta)
    sm_scale = self.head_dim**-0.5

    if not step.cached and step.kernels.causal_attention == "cudnn":
      out = jax.nn.dot_product_attention(
        q, k, v, scale=sm_scale, is_causal=True, implementation="cudnn"
      )
    elif not step.cached:
      valid = jnp.full((bsz,), num_tokens, jnp.int32)
      out = dense_causal_attention(q, k, v, valid, sm_scale)
    else:
      pages = dataclasses.replace(
        pages,
        k=write_kv_pages(pages.k, _quantize(k, pages.k_scale), step.slot_mapping),
        v=write_kv_pages(pages.v, _quantize(v, pages.v_scale), step.slot_mapping),
      )
      if step.mode == "prefill":
        out = dense_causal_attention(q, k, v, step.seq_lens, sm_scale)
      else:
        out = self._paged_attention(q, pages, step, sm_scale)
    return self.o_proj(out.reshape(bsz, num_tokens, -1)), pages, selection

  def _paged_attention(self, q, pages: GqaPages, step: StepMetadata, sm_scale: float):
    """q: [B, q_len, Hq, D] -> [B, q_len, Hq, D] over the paged cache (per shard on a mesh)."""

    def attend(q, k, v, block_tables, seq_lens, k_scale=None, v_scale=None, impl=None):
      return paged_decode_attention(
        q,
        k,
        v,
        block_tables,
        seq_lens,
        sm_scale=sm_scale,
        impl=impl or step.kernels.attention,
        interpret=step.kernels.interpret,
        k_scale=k_scale,
        v_scale=v_scale,
      )

    args = (q, pages.k, pages.v, step.block_tables, step.seq_lens)
    if pages.quantized:
      args += (pages.k_scale, pages.v_scale)
    tp = 1 if self.mesh is None else self.mesh.shape["tp"]
    if tp == 1:
      return attend(*args)
    if tp > self.num_kv_heads:
      # Every rank keeps all KV heads: XLA partitions the reference by query head.
      if step.kernels.attention == "pallas":
        raise ValueError(
          f"the paged attention kernel runs per shard and needs tp = {tp} <= "
          f"num_key_value_heads = {self.num_kv_heads}; use attention 'auto' or 'xla'"
        )
      return attend(*args, impl="xla")
    heads, kv_heads = P(None, None, "tp", None), P("tp", None, None, None)
    scales = (P("tp"), P("tp")) if pages.quantized else ()
    return jax.shard_map(
      attend,
      mesh=self.mesh,
      in_specs=(heads, kv_heads, kv_heads, P(), P(), *scales),
      out_specs=heads,
      check_vma=False,  # Pallas kernels do not type their outputs' varying mesh axes
    )(*args)
