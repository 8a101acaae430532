"""The GLM-4.5 decoder (`GlmForCausalLM`) and the layout of its MTP layer, as Flax NNX modules.

Mirrors transformers' `Glm4MoeForCausalLM`: embeddings, `num_hidden_layers` pre-norm decoder layers
(dense SwiGLU MLP for the first `first_k_dense_replace`, MoE after), a final RMSNorm, the lm head.
The multi-token-prediction layer that GLM checkpoints store as `model.layers.{num_hidden_layers}`
lives in `GlmForCausalLM.mtp` (DeepSeek-V3 MTP module, arXiv:2412.19437 section 2.2).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.model.attention import AttentionBatch, GqaAttention
from jaxspec.model.config import GlmConfig
from jaxspec.model.layers import Embedding, Linear, RMSNorm, SwiGluMlp
from jaxspec.model.moe import MoE, MoeImpl

KVPages = tuple[jax.Array, jax.Array]  # (k, v), each [Hkv, num_pages, page_size, D]


class DecoderLayer(nnx.Module):
  """Pre-norm block: `x + attn(norm(x))`, then `h + mlp(norm(h))`.

  `attend` and `feed_forward` are separate so that the MTP draft step can gather rows between them
  (row pruning: attention needs every row, the MLP only the rows that produce a token).
  """

  def __init__(self, config: GlmConfig, *, moe: bool, dtype, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
    self.self_attn = GqaAttention(config, dtype=dtype, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(
      config.hidden_size, eps=config.rms_norm_eps, dtype=dtype
    )
    if moe:
      self.mlp = MoE(config, dtype=dtype, rngs=rngs)
    else:
      self.mlp = SwiGluMlp(config.hidden_size, config.intermediate_size, dtype=dtype, rngs=rngs)

  def attend(self, x, positions, kv_pages=None, batch=None):
    """x: [B, T, H] -> (x + attention, kv_pages)."""
    attn_out, kv_pages = self.self_attn(self.input_layernorm(x), positions, kv_pages, batch)
    return x + attn_out, kv_pages

  def feed_forward(self, h, *, moe_impl: MoeImpl):
    """h: [..., H] -> h + mlp(norm(h))."""
    normed = self.post_attention_layernorm(h)
    if isinstance(self.mlp, MoE):
      return h + self.mlp(normed, moe_impl=moe_impl)
    return h + self.mlp(normed)

  def __call__(self, x, positions, kv_pages=None, batch=None, *, moe_impl: MoeImpl):
    h, kv_pages = self.attend(x, positions, kv_pages, batch)
    return self.feed_forward(h, moe_impl=moe_impl), kv_pages


class GlmModel(nnx.Module):
  """Embeddings, decoder layers and final norm (transformers' `Glm4MoeModel`)."""

  def __init__(self, config: GlmConfig, *, dtype, rngs: nnx.Rngs):
    self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
    self.layers = nnx.List(
      [
        DecoderLayer(config, moe=config.is_moe_layer(i), dtype=dtype, rngs=rngs)
        for i in range(config.num_hidden_layers)
      ]
    )
    self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)


class MtpLayer(nnx.Module):
  """GLM's multi-token-prediction layer (checkpoint prefix `model.layers.{num_hidden_layers}`).

  `h = eh_proj(concat(enorm(embed(next_token)), hnorm(target_hidden)))`, one full decoder layer,
  then `shared_head.norm` and the target's lm head. Embedding and lm head are shared with the
  target unless the checkpoint carries its own `embed_tokens` / `shared_head.head`.
  `make_layer` builds the decoder block (GQA for GLM-4.5, MLA + indexer for GLM-5); GLM's MTP
  block always uses the MoE MLP, whatever `first_k_dense_replace` says.
  """

  def __init__(
    self,
    config,
    *,
    make_layer: Callable[[], nnx.Module],
    dtype,
    rngs: nnx.Rngs,
    own_embedding: bool = False,
    own_head: bool = False,
  ):
    h = config.hidden_size
    self.embed_tokens = (
      Embedding(config.vocab_size, h, dtype=dtype, rngs=rngs) if own_embedding else None
    )
    self.shared_head_head = (
      Linear(h, config.vocab_size, bias=False, dtype=dtype, rngs=rngs) if own_head else None
    )
    self.enorm = RMSNorm(h, eps=config.rms_norm_eps, dtype=dtype)
    self.hnorm = RMSNorm(h, eps=config.rms_norm_eps, dtype=dtype)
    self.eh_proj = Linear(2 * h, h, bias=False, dtype=dtype, rngs=rngs)
    self.layer = make_layer()
    self.shared_head_norm = RMSNorm(h, eps=config.rms_norm_eps, dtype=dtype)


class GlmForCausalLM(nnx.Module):
  """GLM-4.5-family causal LM; `model(input_ids)` is the plain causal forward `[B, T] -> [B, T, V]`.

  Serving code calls `forward` with a paged cache (see `jaxspec.serving`) and `logits` on the rows
  it needs.
  """

  def __init__(
    self,
    config: GlmConfig,
    *,
    dtype=jnp.float32,
    rngs: nnx.Rngs | None = None,
    mtp_own_embedding: bool = False,
    mtp_own_head: bool = False,
  ):
    rngs = rngs if rngs is not None else nnx.Rngs(0)
    self.config = config
    self.dtype = dtype
    self.model = self._make_trunk(config, dtype, rngs)
    if config.tie_word_embeddings:
      self.lm_head = None
    else:
      self.lm_head = Linear(
        config.hidden_size, config.vocab_size, bias=False, dtype=dtype, rngs=rngs
      )
    self.mtp = (
      MtpLayer(
        config,
        make_layer=lambda: self._make_mtp_block(config, dtype, rngs),
        dtype=dtype,
        rngs=rngs,
        own_embedding=mtp_own_embedding,
        own_head=mtp_own_head,
      )
      if config.num_nextn_predict_layers
      else None
    )

  def _make_trunk(self, config, dtype, rngs) -> nnx.Module:
    """Embeddings, decoder layers and final norm (subclasses swap in another architecture)."""
    return GlmModel(config, dtype=dtype, rngs=rngs)

  def _make_mtp_block(self, config, dtype, rngs) -> nnx.Module:
    """The MTP layer's decoder block: always the MoE MLP, whatever `first_k_dense_replace` says."""
    return DecoderLayer(config, moe=True, dtype=dtype, rngs=rngs)

  def __call__(self, input_ids: jax.Array, *, moe_impl: MoeImpl = "grouped") -> jax.Array:
    """input_ids: int [B, T] -> float32 logits [B, T, V] (causal, positions 0..T-1)."""
    if input_ids.ndim != 2:
      raise ValueError(f"input_ids must be [B, T], got shape {input_ids.shape}")
    positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
    hidden, _ = self.forward(input_ids, positions, moe_impl=moe_impl)
    return self.logits(hidden)

  def forward(
    self,
    input_ids,
    positions,
    kv_pages=None,
    batch: AttentionBatch | None = None,
    *,
    moe_impl: MoeImpl,
  ):
    """Runs the decoder stack.

    input_ids, positions: int32 [B, T]; kv_pages: per-layer (k, v) tuple or None.
    Returns (hidden states after the final norm [B, T, H], updated kv_pages or None).
    """
    x = self.model.embed_tokens(input_ids)
    new_pages = []
    for i, layer in enumerate(self.model.layers):
      layer_pages = None if kv_pages is None else kv_pages[i]
      x, layer_pages = layer(x, positions, layer_pages, batch, moe_impl=moe_impl)
      new_pages.append(layer_pages)
    hidden = self.model.norm(x)
    return hidden, (None if kv_pages is None else tuple(new_pages))

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden: [..., H] -> float32 logits [..., V] through the lm head (or tied embeddings)."""
    if self.lm_head is None:
      return self.model.embed_tokens.attend(hidden)
    kernel = self.lm_head.kernel[...]
    return jnp.dot(hidden.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)

  # ------------------------------------------------------------------------------------------------
  # Multi-token prediction (the draft head).

  def mtp_forward(
    self,
    next_ids: jax.Array,  # int32 [B, T]: token at position t + 1 for row t
    previous_hidden: jax.Array,  # [B, T, H]: hidden state of position t
    positions: jax.Array,  # int32 [B, T]: RoPE position of each row (t + 1)
    kv_pages: KVPages | None = None,
    batch: AttentionBatch | None = None,
    *,
    moe_impl: MoeImpl,
    last_token_indices: jax.Array | None = None,  # int32 [R]: flat rows (b * T + t) to keep
  ):
    """Runs the MTP layer: `eh_proj([enorm(embed(next)), hnorm(hidden)])`, one decoder layer.

    Attention (and its KV writes) runs on every row. With `last_token_indices`, the rows are
    gathered right after attention, so the post-attention norm and MoE run on `R` rows only
    (row pruning, as vLLM's GLM MTP draft step); `moe_impl` is decided by the caller from the
    unpruned token count. Returns (hidden [B, T, H] or [R, H] *before* `shared_head.norm`, which
    is what the next draft step consumes, and kv_pages). `mtp_logits` applies the norm and head.

    The hidden state of position t is the target's output after its final norm; the embedding
    comes first in the concatenation (transformers' `MtpLayer`, vLLM's `glm4_moe_mtp`).
    """
    if self.mtp is None:
      raise ValueError("this model has no MTP layer (num_nextn_predict_layers = 0)")
    mtp = self.mtp
    embed = mtp.embed_tokens if mtp.embed_tokens is not None else self.model.embed_tokens
    x = jnp.concatenate([mtp.enorm(embed(next_ids)), mtp.hnorm(previous_hidden)], axis=-1)
    x = mtp.eh_proj(x)
    h, kv_pages = mtp.layer.attend(x, positions, kv_pages, batch)
    if last_token_indices is not None:
      h = jnp.take(h.reshape(-1, h.shape[-1]), last_token_indices, axis=0)  # [R, H]
    return mtp.layer.feed_forward(h, moe_impl=moe_impl), kv_pages

  def mtp_logits(self, mtp_hidden: jax.Array) -> jax.Array:
    """`shared_head.norm` then the lm head (the MTP's own copy when the checkpoint has one)."""
    normed = self.mtp.shared_head_norm(mtp_hidden)
    if self.mtp.shared_head_head is not None:
      kernel = self.mtp.shared_head_head.kernel[...]
      return jnp.dot(normed.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)
    return self.logits(normed)
