"""The GLM-5 decoder (`GlmDsaForCausalLM`): MLA + DSA attention, dense then MoE MLP, MTP layer.

Mirrors transformers' `GlmMoeDsaForCausalLM`. The decoder blocks are `DecoderLayer`s of the
GLM-4.5 model with MLA attention in place of GQA; the MLP, norms, lm head, MoE and MTP logic are
shared with `GlmForCausalLM`.

Index groups: the forward pass hands each full layer's `IndexSelection` to the shared layers that
follow it. In decode steps the full layer converts its top-k to physical cache slots once and the
shared layers reuse them (`index_conversion="per_group"`); `"per_layer"` makes every layer convert
for itself (what a serving stack without sharing does; kept to measure and test the saving).
"""

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.model.attention import AttentionBatch
from jaxspec.model.dsa_config import GlmDsaConfig
from jaxspec.model.layers import Embedding, RMSNorm, SwiGluMlp
from jaxspec.model.mla import MlaAttention
from jaxspec.model.moe import MoE, MoeImpl
from jaxspec.model.transformer import DecoderLayer, GlmForCausalLM

IndexConversion = Literal["per_group", "per_layer"]


class DsaDecoderLayer(DecoderLayer):
  """Pre-norm block with MLA attention; `feed_forward` is `DecoderLayer`'s."""

  def __init__(self, config: GlmDsaConfig, *, moe: bool, indexer: bool, dtype, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
    self.self_attn = MlaAttention(config, indexer=indexer, dtype=dtype, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(
      config.hidden_size, eps=config.rms_norm_eps, dtype=dtype
    )
    if moe:
      self.mlp = MoE(config, dtype=dtype, rngs=rngs)
    else:
      self.mlp = SwiGluMlp(config.hidden_size, config.intermediate_size, dtype=dtype, rngs=rngs)

  def attend(self, x, positions, kv_pages=None, batch=None, selection=None):
    """x: [B, T, H] -> (x + attention, kv_pages, the index selection used)."""
    out, kv_pages, selection = self.self_attn(
      self.input_layernorm(x), positions, kv_pages, batch, selection
    )
    return x + out, kv_pages, selection

  def __call__(self, x, positions, kv_pages=None, batch=None, selection=None, *, moe_impl):
    h, kv_pages, selection = self.attend(x, positions, kv_pages, batch, selection)
    return self.feed_forward(h, moe_impl=moe_impl), kv_pages, selection


class GlmDsaModel(nnx.Module):
  """Embeddings, decoder layers and final norm (transformers' `GlmMoeDsaModel`)."""

  def __init__(self, config: GlmDsaConfig, *, dtype, rngs: nnx.Rngs):
    self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
    self.layers = nnx.List(
      [
        DsaDecoderLayer(
          config,
          moe=config.is_moe_layer(i),
          indexer=config.has_indexer(i),
          dtype=dtype,
          rngs=rngs,
        )
        for i in range(config.num_hidden_layers)
      ]
    )
    self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)


class GlmDsaForCausalLM(GlmForCausalLM):
  """GLM-5-family causal LM; `model(input_ids)` is the plain causal forward `[B, T] -> [B, T, V]`.

  Same serving interface as `GlmForCausalLM` (`forward`, `logits`, `mtp_forward`, `mtp_logits`);
  per-layer cache entries are `(latent pages,)` on shared layers and `(latent pages, indexer key
  pages)` on full layers (`jaxspec.serving.latent_cache`).
  """

  def __init__(
    self,
    config: GlmDsaConfig,
    *,
    dtype=jnp.float32,
    rngs: nnx.Rngs | None = None,
    mtp_own_embedding: bool = False,
    mtp_own_head: bool = False,
    index_conversion: IndexConversion = "per_group",
  ):
    if index_conversion not in ("per_group", "per_layer"):
      raise ValueError(
        f"index_conversion must be 'per_group' or 'per_layer', got {index_conversion!r}"
      )
    self.index_conversion = index_conversion
    super().__init__(
      config, dtype=dtype, rngs=rngs, mtp_own_embedding=mtp_own_embedding, mtp_own_head=mtp_own_head
    )

  def _make_trunk(self, config, dtype, rngs):
    return GlmDsaModel(config, dtype=dtype, rngs=rngs)

  def _make_mtp_block(self, config, dtype, rngs):
    # The MTP block runs its own indexer (it is a "full" layer of its own).
    return DsaDecoderLayer(config, moe=True, indexer=True, dtype=dtype, rngs=rngs)

  def forward(
    self,
    input_ids,
    positions,
    kv_pages=None,
    batch: AttentionBatch | None = None,
    *,
    moe_impl: MoeImpl,
  ):
    """Runs the decoder stack, handing each group's selection from its full layer on.

    input_ids, positions: int32 [B, T]; kv_pages: per-layer page tuples or None.
    Returns (hidden states after the final norm [B, T, H], updated kv_pages or None).
    """
    x = self.model.embed_tokens(input_ids)
    new_pages = []
    selection = None
    for i, layer in enumerate(self.model.layers):
      layer_pages = None if kv_pages is None else kv_pages[i]
      shared = None if self.config.has_indexer(i) else selection
      if shared is not None and self.index_conversion == "per_layer":
        # The barrier gives this layer's conversion inputs of its own: XLA would otherwise merge
        # the identical conversions of a group (common-subexpression elimination) and quietly run
        # the per-layer baseline as per_group.
        shared, x = jax.lax.optimization_barrier((shared.logical_only(), x))
      x, layer_pages, selection = layer(x, positions, layer_pages, batch, shared, moe_impl=moe_impl)
      new_pages.append(layer_pages)
    hidden = self.model.norm(x)
    return hidden, (None if kv_pages is None else tuple(new_pages))

  def mtp_forward(
    self,
    next_ids: jax.Array,  # int32 [B, T]: token at position t + 1 for row t
    previous_hidden: jax.Array,  # [B, T, H]: hidden state of position t
    positions: jax.Array,  # int32 [B, T]: RoPE position of each row (t + 1)
    kv_pages=None,
    batch: AttentionBatch | None = None,
    *,
    moe_impl: MoeImpl,
    last_token_indices: jax.Array | None = None,  # int32 [R]: flat rows (b * T + t) to keep
  ):
    """`GlmForCausalLM.mtp_forward` for the MLA block (its indexer selects for itself)."""
    if self.mtp is None:
      raise ValueError("this model has no MTP layer (num_nextn_predict_layers = 0)")
    mtp = self.mtp
    embed = mtp.embed_tokens if mtp.embed_tokens is not None else self.model.embed_tokens
    x = jnp.concatenate([mtp.enorm(embed(next_ids)), mtp.hnorm(previous_hidden)], axis=-1)
    h, kv_pages, _ = mtp.layer.attend(mtp.eh_proj(x), positions, kv_pages, batch)
    if last_token_indices is not None:
      h = jnp.take(h.reshape(-1, h.shape[-1]), last_token_indices, axis=0)  # [R, H]
    return mtp.layer.feed_forward(h, moe_impl=moe_impl), kv_pages
