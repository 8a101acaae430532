"""`GlmConfig`: the architecture of a GLM-4.5-family MoE model, parsed from a HF `config.json`.

The field names follow Hugging Face transformers' `Glm4MoeConfig` (model_type `glm4_moe`, used by
GLM-4.5, 4.5-Air, 4.6 and 4.7), so a checkpoint's `config.json` maps onto it one to one.
"""

import dataclasses
import json
import os
from typing import Any

SUPPORTED_MODEL_TYPES = ("glm4_moe",)

# Fields a config.json must carry; everything else has the transformers default.
_REQUIRED = (
  "vocab_size",
  "hidden_size",
  "intermediate_size",
  "num_hidden_layers",
  "num_attention_heads",
  "num_key_value_heads",
)


def eos_token_tuple(eos_token_id) -> tuple[int, ...]:
  """config.json's `eos_token_id` (absent, one id or a list) as a tuple of ids."""
  if eos_token_id is None:
    return ()
  if isinstance(eos_token_id, int):
    return (eos_token_id,)
  return tuple(eos_token_id)


def validate_moe_fields(config) -> None:
  """Checks the routed-expert fields GLM-4.5 and GLM-5 configs share; `ValueError` if broken."""
  if config.n_routed_experts % config.n_group:
    raise ValueError(
      f"n_routed_experts ({config.n_routed_experts}) must be a multiple of "
      f"n_group ({config.n_group})"
    )
  if not 1 <= config.topk_group <= config.n_group:
    raise ValueError(
      f"topk_group must be in [1, n_group={config.n_group}], got {config.topk_group}"
    )
  if config.n_routed_experts // config.n_group < 2 and config.n_group > 1:
    raise ValueError(
      "group-limited routing scores each group by its top-2 experts: need >= 2 per group"
    )
  if config.num_experts_per_tok > config.n_routed_experts:
    raise ValueError(
      f"num_experts_per_tok ({config.num_experts_per_tok}) exceeds n_routed_experts "
      f"({config.n_routed_experts})"
    )


@dataclasses.dataclass(frozen=True)
class GlmConfig:
  """Static description of a GLM-4.5-style decoder (GQA attention, dense then MoE MLP layers).

  Attributes mirror transformers' `Glm4MoeConfig`; defaults are that class's defaults.
  `head_dim` defaults to `hidden_size // num_attention_heads`; RoPE rotates the first
  `rotary_dim = int(head_dim * partial_rotary_factor)` channels of each head.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int | None = None
  hidden_act: str = "silu"
  max_position_embeddings: int = 131072
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  partial_rotary_factor: float = 0.5
  attention_bias: bool = False
  use_qk_norm: bool = False
  moe_intermediate_size: int = 1408
  num_experts_per_tok: int = 8
  n_shared_experts: int = 1
  n_routed_experts: int = 128
  routed_scaling_factor: float = 1.0
  n_group: int = 1
  topk_group: int = 1
  first_k_dense_replace: int = 1
  norm_topk_prob: bool = True
  num_nextn_predict_layers: int = 0
  tie_word_embeddings: bool = False
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None
  model_type: str = "glm4_moe"

  def __post_init__(self):
    if self.head_dim is None:
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
    if isinstance(self.eos_token_id, list):
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
    self._validate()

  def _validate(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
        f"model_type {self.model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
      )
    for name in _REQUIRED:
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
        f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
        f"num_key_value_heads ({self.num_key_value_heads})"
      )
    if self.hidden_act != "silu":
      raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; GLM uses 'silu'")
    if not 0.0 < self.partial_rotary_factor <= 1.0:
      raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
    if self.rotary_dim % 2:
      raise ValueError(
        f"rotary_dim (head_dim * partial_rotary_factor = {self.rotary_dim}) must be even"
      )
    if self.has_moe:
      validate_moe_fields(self)

  # ----------------------------------------------------------------------------------------------
  # Derived quantities.

  @property
  def group_size(self) -> int:
    """G: query heads per KV head."""
    return self.num_attention_heads // self.num_key_value_heads

  @property
  def rotary_dim(self) -> int:
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def has_moe(self) -> bool:
    return self.first_k_dense_replace < self.num_hidden_layers or self.num_nextn_predict_layers > 0

  def is_moe_layer(self, layer_index: int) -> bool:
    """Decoder layers from `first_k_dense_replace` on use MoE (the MTP layer always does)."""
    return layer_index >= self.first_k_dense_replace

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    return eos_token_tuple(self.eos_token_id)

  # ----------------------------------------------------------------------------------------------
  # Hugging Face config.json.

  @classmethod
  def from_hf_dict(cls, raw: dict[str, Any]) -> "GlmConfig":
    """Parses a transformers `config.json` dictionary; unknown model types are a `ValueError`."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
        f"config.json has model_type {model_type!r}; "
        f"jaxspec.GlmConfig reads {SUPPORTED_MODEL_TYPES}"
      )
    missing = [name for name in _REQUIRED if name not in raw]
    if missing:
      raise ValueError(f"config.json lacks required field(s): {', '.join(missing)}")
    values = {f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw}
    # transformers 5 moves rope settings into `rope_parameters`; older files keep them top level.
    rope = raw.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
      raise ValueError(f"rope_type {rope_type!r} is not supported; GLM-4.5 uses 'default'")
    if raw.get("rope_scaling"):
      raise ValueError("rope_scaling is not supported; GLM-4.5 uses plain RoPE")
    for key in ("rope_theta", "partial_rotary_factor"):
      if key in rope:
        values[key] = rope[key]
    if "num_mtp_layers" in raw and "num_nextn_predict_layers" not in raw:
      values["num_nextn_predict_layers"] = raw["num_mtp_layers"]
    if values.get("head_dim") is None:
      values.pop("head_dim", None)
    return cls(**values)

  @classmethod
  def from_json_file(cls, path: str | os.PathLike) -> "GlmConfig":
    with open(path) as f:
      return cls.from_hf_dict(json.load(f))

  def to_hf_dict(self) -> dict[str, Any]:
    """The `config.json` dictionary transformers' `Glm4MoeConfig` reads back."""
    values = dataclasses.asdict(self)
    rope_theta = values.pop("rope_theta")
    partial = values.pop("partial_rotary_factor")
    values["rope_parameters"] = {
      "rope_type": "default",
      "rope_theta": rope_theta,
      "partial_rotary_factor": partial,
    }
    if isinstance(values["eos_token_id"], tuple):
      values["eos_token_id"] = list(values["eos_token_id"])
    values["architectures"] = ["Glm4MoeForCausalLM"]
    return values

  def replace(self, **changes) -> "GlmConfig":
    return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------------------------------
# Presets. The real shapes come from the published config.json files of zai-org/GLM-4.5 and
# zai-org/GLM-4.5-Air; `num_hidden_layers` can be cut with `.replace()` for benchmarks.


def glm45() -> GlmConfig:
  """GLM-4.5 (355B total, 32B active): 92 layers, 160 routed experts, top-8."""
  return GlmConfig(
    vocab_size=151552,
    hidden_size=5120,
    intermediate_size=12288,
    num_hidden_layers=92,
    num_attention_heads=96,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=1000000.0,
    partial_rotary_factor=0.5,
    attention_bias=True,
    use_qk_norm=True,
    moe_intermediate_size=1536,
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_routed_experts=160,
    routed_scaling_factor=2.5,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    num_nextn_predict_layers=1,
    eos_token_id=(151329, 151336, 151338),
    pad_token_id=151329,
  )


def glm45_air() -> GlmConfig:
  """GLM-4.5-Air (106B total, 12B active): 46 layers, 128 routed experts, top-8."""
  return GlmConfig(
    vocab_size=151552,
    hidden_size=4096,
    intermediate_size=10944,
    num_hidden_layers=46,
    num_attention_heads=96,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=1000000.0,
    partial_rotary_factor=0.5,
    attention_bias=True,
    use_qk_norm=False,
    moe_intermediate_size=1408,
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_routed_experts=128,
    routed_scaling_factor=1.0,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    num_nextn_predict_layers=1,
    eos_token_id=(151329, 151336, 151338),
    pad_token_id=151329,
  )


def tiny(**changes) -> GlmConfig:
  """A few-kilobyte model for tests: 2 layers (1 dense, 1 MoE), 8 experts in 2 groups, G = 2."""
  base = GlmConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    partial_rotary_factor=0.5,
    attention_bias=True,
    use_qk_norm=True,
    moe_intermediate_size=16,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=1.5,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    num_nextn_predict_layers=1,
  )
  return base.replace(**changes)


PRESETS = {"glm45": glm45, "glm45_air": glm45_air, "tiny": tiny}
