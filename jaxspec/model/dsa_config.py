"""`GlmDsaConfig`: the architecture of a GLM-5-family model (MLA attention + DSA indexer).

The field names follow Hugging Face transformers' `GlmMoeDsaConfig` (model_type `glm_moe_dsa`), so
a checkpoint's `config.json` maps onto it one to one. The MoE fields are those of `GlmConfig`, so
`jaxspec.model.moe` serves both families.

Index groups: only "full" layers run the DSA indexer; each following run of "shared" layers reuses
the full layer's top-k (GLM-5's cross-layer top-k sharing). A group is one full layer and the
shared layers after it; in a decode step the top-k is converted to physical cache slots once per
group.
"""

import dataclasses
from typing import Any, ClassVar

from jaxspec.checks import is_int
from jaxspec.model.config import AttentionKind, ModelConfig

MODEL_TYPE = "glm_moe_dsa"
INDEXER_TYPES = ("full", "shared")


def derive_indexer_types(
  num_layers: int, *, freq: int = 1, offset: int = 2, pattern: str | None = None
) -> tuple[str, ...]:
  """transformers' schedule when `indexer_types` is absent (configuration_glm_moe_dsa.py).

  A pattern string ("F"/"S" per layer) wins; else layer i is full iff
  `max(i - offset + 1, 0) % freq == 0` (freq clamped to >= 1). The defaults make every layer full.
  """
  if pattern is not None:
    letters = {"F": "full", "S": "shared"}
    if len(pattern) != num_layers or set(pattern) - set(letters):
      raise ValueError(
        f"index_topk_pattern must be {num_layers} letters of 'F'/'S', got {pattern!r}"
      )
    return tuple(letters[c] for c in pattern)
  freq = max(freq, 1)
  return tuple(
    "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)
  )


@dataclasses.dataclass(frozen=True, kw_only=True)
class GlmDsaConfig(ModelConfig):
  """GLM-5 family (`glm_moe_dsa`): MLA attention with the DSA indexer, dense then MoE MLP layers.

  Attributes mirror transformers' `GlmMoeDsaConfig`; defaults are that class's defaults. Layer
  kinds are explicit tuples: `indexer_types[i]` in {"full", "shared"}, `mlp_layer_types[i]` in
  {"dense", "sparse"} (derived from `first_k_dense_replace` when not given).
  """

  model_type: ClassVar[str] = MODEL_TYPE
  hf_architecture: ClassVar[str] = "GlmMoeDsaForCausalLM"
  attention_kind: ClassVar[AttentionKind] = "mla"
  _positive_fields: ClassVar[tuple[str, ...]] = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
  )

  num_key_value_heads: int | None = None
  q_lora_rank: int = 2048
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 192
  qk_rope_head_dim: int = 64
  v_head_dim: int = 256
  index_n_heads: int = 32
  index_head_dim: int = 128
  index_topk: int = 2048
  indexer_types: tuple[str, ...] | None = None
  mlp_layer_types: tuple[str, ...] | None = None
  first_k_dense_replace: int = 3
  max_position_embeddings: int = 202752
  moe_intermediate_size: int = 2048
  n_routed_experts: int = 256
  routed_scaling_factor: float = 2.5
  bos_token_id: int | None = 0
  eos_token_id: int | tuple[int, ...] | None = 1

  def _complete(self) -> None:
    if self.num_key_value_heads is None:
      object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
    if self.indexer_types is None and is_int(self.num_hidden_layers):
      object.__setattr__(self, "indexer_types", derive_indexer_types(self.num_hidden_layers))
    if self.mlp_layer_types is None and is_int(self.num_hidden_layers):
      dense = min(self.first_k_dense_replace, self.num_hidden_layers)
      kinds = ("dense",) * dense + ("sparse",) * (self.num_hidden_layers - dense)
      object.__setattr__(self, "mlp_layer_types", kinds)

  def _validate_family(self) -> None:
    for name in self._positive_fields:
      value = getattr(self, name)
      if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if self.num_key_value_heads != self.num_attention_heads:
      raise ValueError(
        "MLA expands every head from the latent: num_key_value_heads "
        f"({self.num_key_value_heads}) must equal num_attention_heads ({self.num_attention_heads})"
      )
    if self.qk_rope_head_dim % 2:
      raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
    if self.index_head_dim < self.qk_rope_head_dim:
      raise ValueError(
        f"index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim "
        f"({self.qk_rope_head_dim}): the indexer ropes its first qk_rope_head_dim channels"
      )
    for name, kinds, allowed in (
      ("indexer_types", self.indexer_types, INDEXER_TYPES),
      ("mlp_layer_types", self.mlp_layer_types, ("dense", "sparse")),
    ):
      if len(kinds) != self.num_hidden_layers or set(kinds) - set(allowed):
        raise ValueError(
          f"{name} must list {self.num_hidden_layers} entries from {allowed}, got {kinds!r}"
        )
    if self.indexer_types[0] != "full":
      raise ValueError("indexer_types[0] must be 'full': a shared layer reuses an earlier top-k")

  # ----------------------------------------------------------------------------------------------
  # Derived quantities.

  @property
  def qk_head_dim(self) -> int:
    """Width of a query or key head: its non-rotary part, then its rotary part."""
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def latent_dim(self) -> int:
    """Width of one latent cache row: the normed KV latent, then the roped shared key."""
    return self.kv_lora_rank + self.qk_rope_head_dim

  def is_moe_layer(self, layer: int) -> bool:
    """The MTP block and the layers `mlp_layer_types` marks "sparse" use MoE."""
    return layer >= self.num_hidden_layers or self.mlp_layer_types[layer] == "sparse"

  def has_indexer(self, layer: int) -> bool:
    """Full layers and the MTP block (a full layer of its own) run the indexer."""
    return layer >= self.num_hidden_layers or self.indexer_types[layer] == "full"

  def reuses_index(self, layer: int) -> bool:
    """Shared layers (those without an indexer) attend to their group's selection."""
    return not self.has_indexer(layer)

  @property
  def index_groups(self) -> tuple[tuple[int, ...], ...]:
    """Layer indices per index group: each full layer followed by the shared layers after it."""
    groups = []
    for i, kind in enumerate(self.indexer_types):
      if kind == "full":
        groups.append([i])
      else:
        groups[-1].append(i)
    return tuple(map(tuple, groups))

  # ----------------------------------------------------------------------------------------------
  # Hugging Face config.json.

  @classmethod
  def _parse_family(cls, raw: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    if raw.get("num_experts") is not None:
      values["n_routed_experts"] = raw["num_experts"]
    if raw.get("indexer_types") is None:
      values["indexer_types"] = derive_indexer_types(
        raw["num_hidden_layers"],
        freq=raw.get("index_topk_freq", 1),
        offset=raw.get("index_skip_topk_offset", 2),
        pattern=raw.get("index_topk_pattern"),
      )
    return values

  def _write_family(self, values: dict[str, Any]) -> dict[str, Any]:
    values["head_dim"] = self.qk_rope_head_dim  # what transformers stores (the rotary width)
    return values

  def replace(self, **changes) -> "GlmDsaConfig":
    """A copy with `changes`; `mlp_layer_types` is re-derived when `first_k_dense_replace` or
    `num_hidden_layers` changes and the new value is not given."""
    if {"first_k_dense_replace", "num_hidden_layers"} & changes.keys():
      changes.setdefault("mlp_layer_types", None)
    return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------------------------------
# Presets.


def glm53_grouping(num_layers: int = 78) -> tuple[str, ...]:
  """GLM-5.3's index schedule: frequency 4, offset 3 (78 layers -> 21 groups)."""
  return derive_indexer_types(num_layers, freq=4, offset=3)


def glm53_small(**changes) -> GlmDsaConfig:
  """GLM-5.3's layer stack (78 layers, its index grouping, 3 dense layers first) at a small width,
  for tests and benchmarks of per-group work. Every width is shrunk; the real model's widths are
  much larger (hidden 6144, kv_lora_rank 512, top-k 2048)."""
  base = GlmDsaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=78,
    num_attention_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=16,
    indexer_types=glm53_grouping(78),
    first_k_dense_replace=3,
    moe_intermediate_size=16,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_routed_experts=8,
    num_nextn_predict_layers=1,
    eos_token_id=None,
  )
  return base.replace(**changes)


def tiny_dsa(**changes) -> GlmDsaConfig:
  """A few-kilobyte GLM-5-style model for tests: 3 layers (full, shared, full; 1 dense first)."""
  base = GlmDsaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=4,
    indexer_types=("full", "shared", "full"),
    first_k_dense_replace=1,
    attention_bias=True,
    moe_intermediate_size=16,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=1.5,
    n_group=2,
    topk_group=1,
    num_nextn_predict_layers=1,
    eos_token_id=None,
  )
  return base.replace(**changes)
