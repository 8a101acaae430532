"""The GLM decoder of both families, `GlmForCausalLM`, and its MTP layer, as Flax NNX modules.

Mirrors transformers' `Glm4MoeForCausalLM` (GLM-4.5) and `GlmMoeDsaForCausalLM` (GLM-5): token
embeddings, `num_hidden_layers` pre-norm decoder layers (dense SwiGLU MLP where
`config.is_moe_layer` says so, MoE after), a final RMSNorm, the lm head. The attention of every
layer comes from the config's family (`config.attention_kind`): GQA for GLM-4.5, MLA with the DSA
indexer for GLM-5. The multi-token-prediction layer that GLM checkpoints store as
`model.layers.{num_hidden_layers}` lives in `GlmForCausalLM.mtp` (DeepSeek-V3 MTP module,
arXiv:2412.19437 section 2.2).

Index groups (GLM-5): the forward pass hands each full layer's `IndexSelection` to the shared
layers that follow it. In decode steps the full layer converts its top-k to physical cache slots
once and the shared layers reuse them (`KernelChoices.index_sharing="per_group"`).

The model owns its cache (`init_cache`) and reads everything about a step from its
`StepMetadata`: `forward(input_ids, step, cache)` and `mtp_forward(...)` return the hidden states
and the cache with their own layers' pages replaced.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxspec.contracts import require
from jaxspec.model import sharding
from jaxspec.model.attention import Attention, GqaAttention
from jaxspec.model.cache import ModelCache
from jaxspec.model.config import ModelConfig
from jaxspec.model.layers import Embedding, Linear, RMSNorm, SwiGluMlp
from jaxspec.model.metadata import DEFAULT_KERNELS, KernelChoices, StepMetadata
from jaxspec.model.mla import MlaAttention
from jaxspec.model.moe import MoE, MoeImpl, resolve_moe_impl


def make_attention(
  config: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs, mesh: Mesh | None = None
) -> Attention:
  """The attention module of layer `layer` (`num_hidden_layers` = the MTP block)."""
  if config.attention_kind == "gqa":
    return GqaAttention(config, dtype=dtype, rngs=rngs, mesh=mesh)
  if config.attention_kind == "mla":
    return MlaAttention(config, indexer=config.has_indexer(layer), dtype=dtype, rngs=rngs)
  raise ValueError(f"unknown attention kind {config.attention_kind!r}")


class DecoderLayer(nnx.Module):
  """Pre-norm block: `x + attn(norm(x))`, then `h + mlp(norm(h))`.

  `attend` and `feed_forward` are separate so that the MTP draft step can gather rows between them
  (row pruning: attention needs every row, the MLP only the rows that produce a token).
  """

  def __init__(
    self, config: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs, mesh: Mesh | None = None
  ):
    eps = config.rms_norm_eps
    self.input_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
    self.self_attn = make_attention(config, layer, dtype=dtype, rngs=rngs, mesh=mesh)
    self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
    if config.is_moe_layer(layer):
      self.mlp = MoE(config, dtype=dtype, rngs=rngs, mesh=mesh)
    else:
      self.mlp = SwiGluMlp(config.hidden_size, config.intermediate_size, dtype=dtype, rngs=rngs)

  def init_pages(self, num_pages: int, page_size: int, dtype, kv_scale: float = 1.0):
    """Zeroed pages of the layer's attention (its attention module's `init_pages`)."""
    return self.self_attn.init_pages(num_pages, page_size, dtype, kv_scale)

  def attend(self, x, pages, step: StepMetadata, selection=None):
    """x: [B, T, H] -> (x + attention, updated pages, the index selection used)."""
    out, pages, selection = self.self_attn(self.input_layernorm(x), pages, step, selection)
    return x + out, pages, selection

  def feed_forward(self, h, moe_impl: MoeImpl, interpret: bool = False):
    """h: [..., H] -> h + mlp(norm(h)); `moe_impl` is already decided (never "auto")."""
    normed = self.post_attention_layernorm(h)
    if isinstance(self.mlp, MoE):
      return h + self.mlp(normed, moe_impl=moe_impl, interpret=interpret)
    return h + self.mlp(normed)


class GlmModel(nnx.Module):
  """Embeddings, decoder layers and final norm (transformers' `Glm4MoeModel` / `GlmMoeDsaModel`)."""

  def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs, mesh: Mesh | None = None):
    self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
    self.layers = nnx.List(
      [
        DecoderLayer(config, i, dtype=dtype, rngs=rngs, mesh=mesh)
        for i in range(config.num_hidden_layers)
      ]
    )
    self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)


class MtpLayer(nnx.Module):
  """GLM's multi-token-prediction layer (checkpoint prefix `model.layers.{num_hidden_layers}`).

  `h = eh_proj(concat(enorm(embed(next_token)), hnorm(target_hidden)))`, one full decoder layer
  (always MoE; on GLM-5 a full indexer layer of its own), then `shared_head.norm` and the
  target's lm head. Embedding and lm head are shared with the target unless the checkpoint
  carries its own `embed_tokens` / `shared_head.head`.
  """

  def __init__(
    self,
    config: ModelConfig,
    *,
    dtype,
    rngs: nnx.Rngs,
    own_embedding: bool = False,
    own_head: bool = False,
    mesh: Mesh | None = None,
  ):
    h = config.hidden_size
    self.embed_tokens = (
      Embedding(config.vocab_size, h, dtype=dtype, rngs=rngs) if own_embedding else None
    )
    self.shared_head_head = (
      Linear(h, config.vocab_size, bias=False, dtype=dtype, rngs=rngs, axes=(None, "vocab"))
      if own_head
      else None
    )
    self.enorm = RMSNorm(h, eps=config.rms_norm_eps, dtype=dtype)
    self.hnorm = RMSNorm(h, eps=config.rms_norm_eps, dtype=dtype)
    self.eh_proj = Linear(2 * h, h, bias=False, dtype=dtype, rngs=rngs)
    self.layer = DecoderLayer(config, config.num_hidden_layers, dtype=dtype, rngs=rngs, mesh=mesh)
    self.shared_head_norm = RMSNorm(h, eps=config.rms_norm_eps, dtype=dtype)


class GlmForCausalLM(nnx.Module):
  """GLM causal LM of either family; `model(input_ids)` is the plain causal forward.

  Serving code builds the cache with `init_cache`, runs `forward` / `mtp_forward` with a
  `StepMetadata` per step, and `logits` / `mtp_logits` on the rows it needs.

  With `mesh` (`jaxspec.make_mesh`), the parameters are placed in their shards
  (`jaxspec.model.sharding`) once built, the cache is created sharded, and the Pallas kernels run
  per shard. A model larger than one device's memory must be created directly in its shards:
  `jaxspec.model.sharding.init_sharded` (random weights) or `load_pretrained(..., mesh=mesh)`.
  """

  def __init__(
    self,
    config: ModelConfig,
    *,
    dtype=jnp.float32,
    rngs: nnx.Rngs | None = None,
    mtp_own_embedding: bool = False,
    mtp_own_head: bool = False,
    mesh: Mesh | None = None,
  ):
    if not isinstance(config, ModelConfig):
      raise TypeError(f"config must be a jaxspec ModelConfig, got {type(config).__name__}")
    if mesh is not None and not isinstance(mesh, Mesh):
      raise TypeError(f"mesh must be a jax.sharding.Mesh (jaxspec.make_mesh), got {mesh!r}")
    rules = None if mesh is None else sharding.sharding_rules(config, mesh)  # checks the mesh
    rngs = rngs if rngs is not None else nnx.Rngs(0)
    self.config = config
    self.dtype = dtype
    self.mesh = mesh
    self.model = GlmModel(config, dtype=dtype, rngs=rngs, mesh=mesh)
    if config.tie_word_embeddings:
      self.lm_head = None
    else:
      self.lm_head = Linear(
        config.hidden_size,
        config.vocab_size,
        bias=False,
        dtype=dtype,
        rngs=rngs,
        axes=(None, "vocab"),
      )
    self.mtp = (
      MtpLayer(
        config,
        dtype=dtype,
        rngs=rngs,
        own_embedding=mtp_own_embedding,
        own_head=mtp_own_head,
        mesh=mesh,
      )
      if config.num_nextn_predict_layers
      else None
    )
    if mesh is not None:
      specs = sharding.param_specs(self, rules)
      nnx.update(self, sharding.shard_state(nnx.state(self, nnx.Param), specs, mesh))

  # ------------------------------------------------------------------------------------------------
  # The cache.

  def init_cache(
    self, num_pages: int, page_size: int, *, dtype=None, draft: bool = False, kv_scale: float = 1.0
  ) -> ModelCache:
    """Zeroed pages for every decoder layer (and the MTP layer with `draft=True`).

    `dtype` defaults to the model's parameter dtype; `float8_e4m3fn` gives fp8 KV pages (GQA),
    written as value / `kv_scale` and read back times it.
    """
    if not isinstance(kv_scale, (int, float)) or not 0 < kv_scale < float("inf"):
      raise ValueError(f"kv_scale must be a positive finite number, got {kv_scale!r}")
    for name, value in (("num_pages", num_pages), ("page_size", page_size)):
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if draft and self.mtp is None:
      raise ValueError("draft=True needs a model with an MTP layer (num_nextn_predict_layers >= 1)")
    dtype = self.dtype if dtype is None else dtype

    def create():
      layers = tuple(
        layer.init_pages(num_pages, page_size, dtype, kv_scale) for layer in self.model.layers
      )
      draft_pages = (
        self.mtp.layer.init_pages(num_pages, page_size, dtype, kv_scale) if draft else None
      )
      return ModelCache(layers, draft_pages)

    if self.mesh is None:
      return create()
    # Created in its shards (never whole on one device).
    shardings = sharding.cache_shardings(jax.eval_shape(create), self.config, self.mesh)
    return jax.jit(create, out_shardings=shardings)()

  # ------------------------------------------------------------------------------------------------
  # The target.

  def __call__(
    self, input_ids: jax.Array, *, kernels: KernelChoices = DEFAULT_KERNELS
  ) -> jax.Array:
    """input_ids: int [B, T] -> float32 logits [B, T, V] (causal, positions 0..T-1).

    Token ids are a device-value contract: every id must be in `[0, vocab_size)` (checked when
    the ids are concrete; see `jaxspec.contracts`).
    """
    if input_ids.ndim != 2:
      raise ValueError(f"input_ids must be [B, T], got shape {input_ids.shape}")
    hidden, _ = self.forward(input_ids, StepMetadata.plain(input_ids, kernels))
    return self.logits(hidden)

  def forward(self, input_ids: jax.Array, step: StepMetadata, cache: ModelCache | None = None):
    """Runs the decoder stack over `input_ids` int32 [B, T] as `step` describes.

    Returns (hidden states after the final norm [B, T, H], `cache` with the target's layers
    replaced, or None in plain mode).
    """
    _check_step(step, cache, input_ids.shape)
    _require_token_ids(input_ids, self.config.vocab_size, "input_ids")
    moe_impl = resolve_moe_impl(step.kernels.moe, input_ids.size, self.config, self.dtype)
    x = self.model.embed_tokens(input_ids, step.kernels.embedding_grad)
    new_layers = []
    selection = None
    for i, layer in enumerate(self.model.layers):
      pages = cache.layers[i] if step.cached else None
      shared = selection if self.config.reuses_index(i) else None
      if shared is not None and step.kernels.index_sharing == "per_layer":
        # The barrier gives this layer's conversion inputs of its own: XLA would otherwise merge
        # the identical conversions of a group (common-subexpression elimination) and quietly run
        # the per-layer baseline as per_group.
        shared, x = jax.lax.optimization_barrier((shared.logical_only(), x))
      x, pages, selection = layer.attend(x, pages, step, shared)
      x = layer.feed_forward(x, moe_impl, step.kernels.interpret)
      new_layers.append(pages)
    hidden = self.model.norm(x)
    return hidden, (cache.replace(layers=tuple(new_layers)) if step.cached else None)

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
    step: StepMetadata,  # positions: t, the position of the hidden state each row consumes
    cache: ModelCache | None = None,
    *,
    last_token_indices: jax.Array | None = None,  # int32 [R]: flat rows (b * T + t) to keep
  ):
    """Runs the MTP layer: `eh_proj([enorm(embed(next)), hnorm(hidden)])`, one decoder layer.

    Row t consumes the target's hidden state of position t (after its final norm) and the token
    of position t + 1, at RoPE position t + 1; its cache slot is t's (`step.slot_mapping`), so
    the MTP cache's valid length equals the target's. The embedding comes first in the
    concatenation (transformers' `MtpLayer`, vLLM's `glm4_moe_mtp`).

    Attention (and its KV writes) runs on every row. With `last_token_indices`, the rows are
    gathered right after attention, so the post-attention norm and MoE run on `R` rows only
    (row pruning, as vLLM's GLM MTP draft step); the MoE implementation is decided from the
    unpruned row count `B * T` (or taken from `step.kernels.moe`). Returns (hidden [B, T, H] or
    [R, H] *before* `shared_head.norm`, which is what the next draft step consumes, and `cache`
    with the draft pages replaced, or None in plain mode). `mtp_logits` applies the norm and head.
    """
    if self.mtp is None:
      raise ValueError("this model has no MTP layer (num_nextn_predict_layers = 0)")
    _check_step(step, cache, next_ids.shape)
    _require_token_ids(next_ids, self.config.vocab_size, "next_ids")
    # Decided from the rows before pruning, so pruned and unpruned passes run the same MoE.
    moe_impl = resolve_moe_impl(step.kernels.moe, next_ids.size, self.config, self.dtype)
    if step.cached and cache.draft is None:
      raise ValueError("the cache has no draft pages: build it with init_cache(..., draft=True)")
    mtp = self.mtp
    embed = mtp.embed_tokens if mtp.embed_tokens is not None else self.model.embed_tokens
    next_rows = embed(next_ids, step.kernels.embedding_grad)
    x = jnp.concatenate([mtp.enorm(next_rows), mtp.hnorm(previous_hidden)], axis=-1)
    shifted = step.replace(positions=step.positions + 1)
    pages = cache.draft if step.cached else None
    h, pages, _ = mtp.layer.attend(mtp.eh_proj(x), pages, shifted)
    if last_token_indices is not None:
      h = jnp.take(h.reshape(-1, h.shape[-1]), last_token_indices, axis=0)  # [R, H]
    hidden = mtp.layer.feed_forward(h, moe_impl, step.kernels.interpret)
    return hidden, (cache.replace(draft=pages) if step.cached else None)

  def mtp_logits(self, mtp_hidden: jax.Array) -> jax.Array:
    """`shared_head.norm` then the lm head (the MTP's own copy when the checkpoint has one)."""
    normed = self.mtp.shared_head_norm(mtp_hidden)
    if self.mtp.shared_head_head is not None:
      kernel = self.mtp.shared_head_head.kernel[...]
      return jnp.dot(normed.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)
    return self.logits(normed)


# GLM-5 checkpoints build the same class (the attention follows the config); the name stays for
# code written against the earlier per-family classes.
GlmDsaForCausalLM = GlmForCausalLM


def _require_token_ids(ids: jax.Array, vocab_size: int, name: str) -> None:
  """Token ids are a device-value contract: in [0, vocab_size). Checked eagerly on concrete ids
  (and under jit in checked mode); an id outside gives NaN logits, never another token's."""
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
  require((ids >= 0) & (ids < vocab_size), f"{name} must be token ids in [0, {vocab_size})")


def _check_step(step: StepMetadata, cache: ModelCache | None, ids_shape) -> None:
  """Host-side consistency of a step's arguments (shapes are static even under jit)."""
  if not isinstance(step, StepMetadata):
    raise TypeError(f"step must be a StepMetadata, got {type(step).__name__}")
  if step.positions.shape != tuple(ids_shape):
    raise ValueError(
      f"step.positions must be [B, T] = {tuple(ids_shape)}, got {step.positions.shape}"
    )
  if step.cached and cache is None:
    raise ValueError(f"a {step.mode!r} step needs a cache (model.init_cache)")
