"""GLM-5 attention: multi-head latent attention (MLA) with the DeepSeek sparse-attention indexer.

MLA (DeepSeek-V2, arXiv:2405.04434 section 2.1): keys and values of all heads come from one
normed latent `c = kv_a_layernorm(x W_DKV)` of width `kv_lora_rank` plus one shared roped key
`k_rope` of width `qk_rope_head_dim`; `kv_b_proj` expands `c` into per-head `k_nope` and `v`.
The cache keeps only `[c, k_rope]`, one latent row per token.

DSA (DeepSeek-V3.2): a light indexer scores every past token,
`I[t, s] = sum_h w[t, h] * relu(q_I[t, h] . k_I[s] / sqrt(index_head_dim))`, and attention sees
only the `index_topk` best keys of each query. GLM-5 runs the indexer on "full" layers only; the
"shared" layers of its index group reuse that top-k (`IndexSelection`).

Numerics follow transformers' `glm_moe_dsa` (tests/fixtures/README.md lists the details): latent
norms use eps 1e-6, the rope channels are the last `qk_rope_head_dim` of a query head but the
first of an indexer head, and RoPE is interleaved (pairs `(2i, 2i + 1)`), written de-interleaved.

Three ways to run, picked like `GqaAttention` by `StepMetadata.mode`:

- `"plain"`: causal forward over the given tokens;
- `"prefill"`: the request's first tokens; latent rows and indexer keys are written to the pages,
  attention runs densely over the fresh tokens in the expanded form;
- `"decode"`: 1..8 new rows per request. Rows are written first, the indexer scores the request's
  cached keys, its top-k is converted to physical slots (`convert_topk_to_physical`), and attention
  runs in the absorbed form (`q_nope W_UK` against the gathered latent rows, output through
  `W_UV`), so it reads only latent rows.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.kernels import convert_topk_to_physical
from jaxspec.model.attention import write_kv_pages
from jaxspec.model.dsa_config import GlmDsaConfig
from jaxspec.model.layers import Linear, RMSNorm, rope_inverse_frequencies
from jaxspec.model.metadata import StepMetadata

# transformers builds the latent RMSNorms and the indexer LayerNorm with eps 1e-6, whatever
# `rms_norm_eps` says (modeling_glm_moe_dsa.py, GlmMoeDsaRMSNorm default and nn.LayerNorm).
LATENT_NORM_EPS = 1e-6


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MlaPages:
  """One MLA layer's paged latent rows, plus its indexer keys on full layers.

  Stored with a single head axis so that the `[H, num_pages, page_size, D]` layout of the GQA
  cache (page pool, slot mapping, rollback by length) is unchanged.
  """

  latent: jax.Array  # [1, num_pages, page_size, kv_lora_rank + qk_rope_head_dim]
  index_keys: jax.Array | None = None  # [1, num_pages, page_size, index_head_dim]; full layers

  @property
  def num_pages(self) -> int:
    """Pages in the pool."""
    return self.latent.shape[1]

  @property
  def page_size(self) -> int:
    """Token slots per page."""
    return self.latent.shape[2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class IndexSelection:
  """The top-k of an index group, handed from its full layer to its shared layers.

  `topk` holds logical key positions (-1 = nothing selected there; valid entries come first).
  In decode steps the full layer also converts them once to physical latent-cache slots;
  `physical` / `valid_counts` are None in plain and prefill runs, or when the shared layers must
  convert for themselves.
  """

  topk: jax.Array  # int32 [B, T, K]
  physical: jax.Array | None = None  # int32 [B * T, K]
  valid_counts: jax.Array | None = None  # int32 [B * T]

  def logical_only(self) -> "IndexSelection":
    """The same top-k without the physical slots, for layers that convert it themselves."""
    return IndexSelection(self.topk)


def apply_interleaved_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """RoPE over all channels of x, pairing channels (2i, 2i + 1) with frequency `inv_freq[i]`.

  The output is de-interleaved, `[rotated evens, rotated odds]`, as transformers'
  `apply_rotary_pos_emb_interleave` writes it; q and k get the same permutation, so their dot
  products equal those of in-place interleaved RoPE. x: [..., T, H, R]; positions: int32 [..., T].
  """
  inv_freq = rope_inverse_frequencies(x.shape[-1], theta)
  angles = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [..., T, 1, R / 2]
  cos = jnp.cos(angles).astype(x.dtype).astype(jnp.float32)
  sin = jnp.sin(angles).astype(x.dtype).astype(jnp.float32)
  even = x[..., 0::2].astype(jnp.float32)
  odd = x[..., 1::2].astype(jnp.float32)
  return jnp.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1).astype(x.dtype)


class LayerNorm(nnx.Module):
  """Affine LayerNorm (the indexer's key norm): `(x - mean) / sqrt(var + eps) * weight + bias`."""

  def __init__(self, features: int, *, eps: float, dtype):
    self.weight = nnx.Param(jnp.ones((features,), dtype))
    self.bias = nnx.Param(jnp.zeros((features,), dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    weight = self.weight[...].astype(jnp.float32)
    return (normed * weight + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def _paged_rows(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
  """Every cache row of each request, in logical order. pages: [1, P, page, W];
  block_tables: int32 [B, max_pages] -> [B, max_pages * page, W]."""
  rows = pages[0][block_tables]  # [B, max_pages, page, W]
  return rows.reshape(rows.shape[0], -1, rows.shape[-1])


class Indexer(nnx.Module):
  """The DSA lightning indexer of a "full" layer (transformers' `GlmMoeDsaIndexer`)."""

  def __init__(self, config: GlmDsaConfig, *, dtype, rngs: nnx.Rngs):
    self.num_heads = config.index_n_heads
    self.head_dim = config.index_head_dim
    self.rope_dim = config.qk_rope_head_dim
    self.rope_theta = config.rope_theta
    self.index_topk = config.index_topk
    q_width = self.num_heads * self.head_dim
    self.wq_b = Linear(config.q_lora_rank, q_width, bias=False, dtype=dtype, rngs=rngs)
    self.wk = Linear(config.hidden_size, self.head_dim, bias=False, dtype=dtype, rngs=rngs)
    self.k_norm = LayerNorm(self.head_dim, eps=LATENT_NORM_EPS, dtype=dtype)
    # Kept in float32 like transformers' `_keep_in_fp32_modules` (the loader keeps it so).
    self.weights_proj = Linear(
      config.hidden_size, self.num_heads, bias=False, dtype=jnp.float32, rngs=rngs
    )

  def _rope_first(self, x, positions):
    """Ropes the first `qk_rope_head_dim` channels (the indexer's rope part comes first)."""
    rot = apply_interleaved_rope(x[..., : self.rope_dim], positions, self.rope_theta)
    return jnp.concatenate([rot, x[..., self.rope_dim :]], axis=-1)

  def keys(self, x, positions):
    """x: [B, T, H] -> roped, normed index keys [B, T, index_head_dim]."""
    k = self.k_norm(self.wk(x))[:, :, None]  # [B, T, 1, Di]
    return self._rope_first(k, positions)[:, :, 0]

  def scores(self, x, q_resid, positions, keys, visible):
    """Index scores of every query row against `keys`, -inf where not `visible`.

    x: [B, T, H]; q_resid: [B, T, q_lora_rank]; keys: [B, S, Di]; visible: bool [B, T, S].
    Returns float32 [B, T, S].
    """
    bsz, num_tokens, _ = x.shape
    q = self.wq_b(q_resid).reshape(bsz, num_tokens, self.num_heads, self.head_dim)
    q = self._rope_first(q, positions)
    logits = jnp.einsum(
      "bthd,bsd->bths",
      q.astype(jnp.float32),
      keys.astype(jnp.float32),
      precision=jax.lax.Precision.HIGHEST,
    )
    relu = jax.nn.relu(logits * self.head_dim**-0.5)
    weights = self.weights_proj(x.astype(jnp.float32)) * self.num_heads**-0.5  # [B, T, Hi]
    index = jnp.einsum("bth,bths->bts", weights, relu, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(visible, index, -jnp.inf)

  def top_k(self, scores: jax.Array) -> jax.Array:
    """float32 [B, T, S] -> int32 [B, T, min(index_topk, S)] key positions, best first; -1
    where fewer keys are visible than selected.

    Tie rule: among equal scores the lowest position is selected first (`jax.lax.top_k` is
    stable). Ties are common: the indexer's ReLU makes many scores exactly 0. transformers'
    `torch.topk` breaks ties in an unspecified order, so where scores tie at the cut-off the two
    can select different keys; parity fixtures are generated without such ties.
    """
    values, positions = jax.lax.top_k(scores, min(self.index_topk, scores.shape[-1]))
    return jnp.where(values > -jnp.inf, positions, -1).astype(jnp.int32)


def masked_attention(q, k, v, visible, sm_scale):
  """Softmax attention with an explicit mask, float32 softmax; a row with no key returns zeros.

  q: [B, T, H, Dqk]; k: [B, S, H, Dqk]; v: [B, S, H, Dv]; visible: bool [B, T, S].
  Returns [B, T, H, Dv] in q's dtype.
  """
  scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * sm_scale
  mask = visible[:, None]
  probs = _masked_softmax(scores, mask)
  out = jnp.einsum("bhts,bshd->bthd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return out.astype(q.dtype)


def _masked_softmax(scores, mask):
  scores = jnp.where(mask, scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  probs = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
  denom = jnp.sum(probs, axis=-1, keepdims=True)
  return probs / jnp.where(denom > 0, denom, 1.0)


def selection_mask(topk: jax.Array, num_keys: int) -> jax.Array:
  """int32 [B, T, K] key positions (-1 = none) -> bool [B, T, num_keys]."""
  keys = jnp.arange(num_keys, dtype=jnp.int32)
  return jnp.any(topk[..., :, None] == keys, axis=-2)


def convert_selection(
  selection: IndexSelection, block_tables, page_size: int, impl: str, interpret: bool = False
) -> IndexSelection:
  """Converts a decode step's logical top-k to physical latent-cache slots (one kernel call).

  topk [B, q_len, K] of request b reads block table row b.
  """
  bsz, q_len, k = selection.topk.shape
  req_ids = jnp.repeat(jnp.arange(bsz, dtype=jnp.int32), q_len)  # [B * q_len]
  physical, valid_counts = convert_topk_to_physical(
    req_ids,
    block_tables,
    selection.topk.reshape(bsz * q_len, k),
    block_size=page_size,
    impl=impl,
    interpret=interpret,
  )
  return IndexSelection(selection.topk, physical, valid_counts)


class MlaAttention(nnx.Module):
  """GLM-5 MLA attention; full layers own an `Indexer`, shared layers reuse a selection.

  On a mesh the heads (`q_b_proj`, `kv_b_proj`, `o_proj`) are split over `tp`; the latent
  projections, the indexer and the latent cache are replicated (as vLLM runs MLA under TP).
  """

  def __init__(self, config: GlmDsaConfig, *, indexer: bool, dtype, rngs: nnx.Rngs):
    h = config.hidden_size
    self.num_heads = config.num_attention_heads
    self.kv_lora_rank = config.kv_lora_rank
    self.nope_dim = config.qk_nope_head_dim
    self.rope_dim = config.qk_rope_head_dim
    self.v_dim = config.v_head_dim
    self.rope_theta = config.rope_theta
    self.sm_scale = config.qk_head_dim**-0.5
    bias = config.attention_bias
    self.q_a_proj = Linear(h, config.q_lora_rank, bias=bias, dtype=dtype, rngs=rngs)
    self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPS, dtype=dtype)
    self.q_b_proj = Linear(
      config.q_lora_rank,
      self.num_heads * config.qk_head_dim,
      bias=False,
      dtype=dtype,
      rngs=rngs,
      axes=(None, "heads"),
    )
    self.kv_a_proj_with_mqa = Linear(h, config.latent_dim, bias=bias, dtype=dtype, rngs=rngs)
    self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, eps=LATENT_NORM_EPS, dtype=dtype)
    self.kv_b_proj = Linear(
      config.kv_lora_rank,
      self.num_heads * (self.nope_dim + self.v_dim),
      bias=False,
      dtype=dtype,
      rngs=rngs,
      axes=(None, "heads"),
    )
    self.o_proj = Linear(
      self.num_heads * self.v_dim, h, bias=bias, dtype=dtype, rngs=rngs, axes=("heads", None)
    )
    self.indexer = Indexer(config, dtype=dtype, rngs=rngs) if indexer else None
    self.latent_dim = config.latent_dim
    self.index_head_dim = config.index_head_dim

  def init_pages(self, num_pages: int, page_size: int, dtype, kv_scale: float = 1.0) -> MlaPages:
    """Zeroed latent pages (and index-key pages where the layer runs the indexer) for a pool
    of `num_pages` pages of `page_size` tokens. fp8 is refused: the latent cache stays 16-bit."""
    del kv_scale  # the latent cache is kept in 16 bits
    if jnp.dtype(dtype) == jnp.float8_e4m3fn:
      raise ValueError("fp8 KV pages serve GQA attention; the MLA latent cache stays 16-bit")
    latent = jnp.zeros((1, num_pages, page_size, self.latent_dim), dtype)
    if self.indexer is None:
      return MlaPages(latent)
    return MlaPages(latent, jnp.zeros((1, num_pages, page_size, self.index_head_dim), dtype))

  def __call__(
    self,
    x,
    pages: MlaPages | None,
    step: StepMetadata,
    selection: IndexSelection | None = None,
  ):
    """x: [B, T, H]; pages: this layer's `MlaPages` (None in plain mode); `selection`: the
    group's top-k (shared layers only).

    Returns (out [B, T, H], updated pages or None, the selection this layer used).
    """
    if (self.indexer is None) == (selection is None):
      raise ValueError("a full layer computes its own selection; a shared layer needs one")
    positions = step.positions
    bsz, num_tokens, _ = x.shape
    q_resid = self.q_a_layernorm(self.q_a_proj(x))  # [B, T, q_lora_rank]
    q = self.q_b_proj(q_resid).reshape(bsz, num_tokens, self.num_heads, -1)
    q_nope = q[..., : self.nope_dim]
    q_rope = apply_interleaved_rope(q[..., self.nope_dim :], positions, self.rope_theta)
    compressed = self.kv_a_proj_with_mqa(x)
    latent = self.kv_a_layernorm(compressed[..., : self.kv_lora_rank])  # [B, T, C]
    k_rope = apply_interleaved_rope(
      compressed[..., None, self.kv_lora_rank :], positions, self.rope_theta
    )[:, :, 0]  # [B, T, R]
    index_keys = None if self.indexer is None else self.indexer.keys(x, positions)

    if step.cached:
      rows = jnp.concatenate([latent, k_rope], axis=-1)[:, :, None]  # [B, T, 1, C + R]
      pages = MlaPages(
        write_kv_pages(pages.latent, rows, step.slot_mapping),
        None
        if index_keys is None
        else write_kv_pages(pages.index_keys, index_keys[:, :, None], step.slot_mapping),
      )

    if step.mode == "decode":
      out, selection = self._decode(x, q_resid, q_nope, q_rope, pages, step, selection)
    else:
      if step.kernels.causal_attention != "xla":
        raise ValueError(
          "KernelChoices.causal_attention must be 'xla' for MLA attention (GLM-5): only GQA "
          f"models have a {step.kernels.causal_attention!r} path"
        )
      valid_lens = jnp.full((bsz,), num_tokens) if not step.cached else step.seq_lens
      key_pos = jnp.arange(num_tokens)
      causal = (key_pos[None, :] <= key_pos[:, None])[None] & (
        key_pos[None, None, :] < valid_lens[:, None, None]
      )  # [B, T, T]
      if self.indexer is not None:
        scores = self.indexer.scores(x, q_resid, positions, index_keys, causal)
        selection = IndexSelection(self.indexer.top_k(scores))
      visible = causal & selection_mask(selection.topk, num_tokens)
      out = self._expanded(q_nope, q_rope, latent, k_rope, visible)
    return self.o_proj(out.reshape(bsz, num_tokens, -1)), pages, selection

  def _split_kv_b(self):
    """kv_b_proj as W_UK [C, Hq, nope] and W_UV [C, Hq, v]."""
    w = self.kv_b_proj.kernel[...].reshape(self.kv_lora_rank, self.num_heads, -1)
    return w[..., : self.nope_dim], w[..., self.nope_dim :]

  def _expanded(self, q_nope, q_rope, latent, k_rope, visible):
    """Attention over fresh tokens with per-head keys and values expanded from the latent."""
    bsz, num_tokens = latent.shape[:2]
    kv = self.kv_b_proj(latent).reshape(bsz, num_tokens, self.num_heads, -1)
    k_nope, v = kv[..., : self.nope_dim], kv[..., self.nope_dim :]
    k_rope = jnp.broadcast_to(k_rope[:, :, None], (*k_nope.shape[:3], self.rope_dim))
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    k = jnp.concatenate([k_nope, k_rope], axis=-1)
    return masked_attention(q, k, v, visible, self.sm_scale)

  def _decode(self, x, q_resid, q_nope, q_rope, pages: MlaPages, step: StepMetadata, selection):
    """Sparse absorbed attention over the latent rows of the selected physical slots."""
    bsz, q_len = x.shape[:2]
    if self.indexer is not None:
      keys = _paged_rows(pages.index_keys, step.block_tables)  # [B, S_max, Di]
      visible = jnp.arange(keys.shape[1])[None, None, :] <= step.positions[:, :, None]
      visible = visible & (step.seq_lens > 0)[:, None, None]  # [B, q_len, S_max]
      scores = self.indexer.scores(x, q_resid, step.positions, keys, visible)
      selection = IndexSelection(self.indexer.top_k(scores))
    if selection.physical is None:
      selection = convert_selection(
        selection,
        step.block_tables,
        pages.page_size,
        step.kernels.index_conversion,
        step.kernels.interpret,
      )
    k = selection.topk.shape[-1]
    flat_pages = pages.latent[0].reshape(-1, pages.latent.shape[-1])  # [P * page, C + R]
    rows = flat_pages[jnp.maximum(selection.physical, 0)]  # [B * q_len, K, C + R]
    used = jnp.arange(k)[None, :] < selection.valid_counts[:, None]  # [B * q_len, K]
    # Unselected slots may hold garbage (even NaN): zero them so that p * v stays finite.
    rows = jnp.where(used[..., None], rows, 0).reshape(bsz, q_len, k, -1)
    used = used.reshape(bsz, q_len, k)
    w_uk, w_uv = self._split_kv_b()
    q_latent = jnp.einsum(
      "bthn,chn->bthc", q_nope, w_uk.astype(q_nope.dtype), preferred_element_type=jnp.float32
    )
    rows32 = rows.astype(jnp.float32)
    scores = jnp.einsum("bthc,btkc->bthk", q_latent, rows32[..., : self.kv_lora_rank])
    scores = scores + jnp.einsum(
      "bthr,btkr->bthk", q_rope.astype(jnp.float32), rows32[..., self.kv_lora_rank :]
    )
    probs = _masked_softmax(scores * self.sm_scale, used[:, :, None, :])
    out_latent = jnp.einsum("bthk,btkc->bthc", probs, rows32[..., : self.kv_lora_rank])
    out = jnp.einsum("bthc,chv->bthv", out_latent, w_uv.astype(jnp.float32))
    return out.astype(x.dtype), selection
