"""Model configs: one base with the shared Hugging Face I/O, one subclass per family.

`ModelConfig` holds what every GLM family shares (sizes, RoPE, norms, the MoE and MTP fields) and
reads/writes transformers' `config.json`. A family is a subclass that names its `model_type`, its
attention (`attention_kind`: "gqa" or "mla") and adds its own fields; subclasses register
themselves, so `config_from_hf_dict` picks the family from `model_type` alone. Per-layer kinds are
data (`is_moe_layer`, `has_indexer`, `reuses_index`), which the model reads to build each layer.

`GlmConfig` (`glm4_moe`: GLM-4.5, 4.5-Air, 4.6, 4.7) mirrors transformers' `Glm4MoeConfig` field
for field; `GlmDsaConfig` (`glm_moe_dsa`: GLM-5) lives in `dsa_config.py`. To add a family: a
config subclass here (or beside), an attention module (`jaxspec.model.attention.Attention`), and
its checkpoint names in `weights.py`.
"""

import dataclasses
import json
import math
import os
from typing import Any, ClassVar, Literal

from jaxspec.checks import is_int, is_number

AttentionKind = Literal["gqa", "mla"]

# model_type -> config class, filled by `ModelConfig.__init_subclass__`.
FAMILIES: dict[str, type["ModelConfig"]] = {}


def eos_token_tuple(eos_token_id) -> tuple[int, ...]:
  """config.json's `eos_token_id` (absent, one id or a list) as a tuple of ids."""
  if eos_token_id is None:
    return ()
  if isinstance(eos_token_id, int):
    return (eos_token_id,)
  return tuple(eos_token_id)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Fields every GLM family shares; defaults are transformers' `Glm4MoeConfig` defaults.

  Subclasses set `model_type`, `hf_architecture` and `attention_kind`, may override defaults, add
  fields, and extend `_validate_family`, `_parse_family` and `_write_family`.
  """

  model_type: ClassVar[str]
  hf_architecture: ClassVar[str]
  attention_kind: ClassVar[AttentionKind]
  # Fields a config.json must carry; everything else has a default.
  required_fields: ClassVar[tuple[str, ...]] = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
  )
  # Float fields and the open interval (low, high) each must lie in; None = unbounded.
  _float_ranges: ClassVar[dict[str, tuple[float | None, float | None]]] = {
    "rms_norm_eps": (0.0, 1.0),
    "rope_theta": (0.0, None),
    "routed_scaling_factor": (0.0, None),
  }

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  hidden_act: str = "silu"
  max_position_embeddings: int = 131072
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  attention_bias: bool = False
  first_k_dense_replace: int = 1
  moe_intermediate_size: int = 1408
  num_experts_per_tok: int = 8
  n_shared_experts: int = 1
  n_routed_experts: int = 128
  routed_scaling_factor: float = 1.0
  n_group: int = 1
  topk_group: int = 1
  norm_topk_prob: bool = True
  num_nextn_predict_layers: int = 0
  tie_word_embeddings: bool = False
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if "model_type" in cls.__dict__:
      FAMILIES[cls.model_type] = cls

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if isinstance(getattr(self, field.name), list):
        object.__setattr__(self, field.name, tuple(getattr(self, field.name)))
    self._complete()
    self._validate()

  def _complete(self) -> None:
    """Fills fields whose default depends on others (subclasses extend it)."""

  # ----------------------------------------------------------------------------------------------
  # Validation: every field a ValueError naming it, before any model is built.

  def _validate(self) -> None:
    for name in self.required_fields + ("max_position_embeddings", "moe_intermediate_size"):
      value = getattr(self, name)
      if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    for name in ("first_k_dense_replace", "num_nextn_predict_layers"):
      value = getattr(self, name)
      if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    for name, (low, high) in self._float_ranges.items():
      value = getattr(self, name)
      if not is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
      if (low is not None and value <= low) or (high is not None and value >= high):
        bounds = f"({low}, {'inf' if high is None else high})"
        raise ValueError(f"{name} must be in {bounds}, got {value!r}")
    for name in ("attention_bias", "norm_topk_prob", "tie_word_embeddings"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
    for name in ("bos_token_id", "pad_token_id"):
      value = getattr(self, name)
      if value is not None and (not is_int(value) or not 0 <= value < self.vocab_size):
        raise ValueError(
          f"{name} must be None or a token id in [0, {self.vocab_size}), got {value!r}"
        )
    for token in self.eos_token_ids:
      if not is_int(token) or not 0 <= token < self.vocab_size:
        raise ValueError(
          f"eos_token_id must hold token ids in [0, {self.vocab_size}), got {token!r}"
        )
    if self.hidden_act != "silu":
      raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; GLM uses 'silu'")
    if self.has_moe:
      self._validate_moe()
    self._validate_family()

  def _validate_moe(self) -> None:
    for name in ("num_experts_per_tok", "n_shared_experts", "n_routed_experts", "n_group"):
      value = getattr(self, name)
      if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if self.n_routed_experts % self.n_group:
      raise ValueError(
        f"n_routed_experts ({self.n_routed_experts}) must be a multiple of n_group ({self.n_group})"
      )
    if not is_int(self.topk_group) or not 1 <= self.topk_group <= self.n_group:
      raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
    if self.n_routed_experts // self.n_group < 2 and self.n_group > 1:
      raise ValueError(
        "group-limited routing scores each group by its top-2 experts: need >= 2 per group"
      )
    if self.num_experts_per_tok > self.n_routed_experts:
      raise ValueError(
        f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
        f"({self.n_routed_experts})"
      )

  def _validate_family(self) -> None:
    """Checks of the family's own fields (subclasses)."""

  # ----------------------------------------------------------------------------------------------
  # Per-layer kinds. Layer `num_hidden_layers` is the MTP block (checkpoint prefix
  # `model.layers.{num_hidden_layers}`): always MoE, and a full indexer layer where there is one.

  @property
  def has_moe(self) -> bool:
    """Whether any decoder layer or the MTP block uses MoE."""
    layers = range(self.num_hidden_layers)
    return any(self.is_moe_layer(i) for i in layers) or self.num_nextn_predict_layers > 0

  def is_moe_layer(self, layer: int) -> bool:
    """Decoder layers from `first_k_dense_replace` on use MoE, and so does the MTP block."""
    return layer >= min(self.first_k_dense_replace, self.num_hidden_layers)

  def has_indexer(self, layer: int) -> bool:
    """Whether layer `layer` selects its own sparse-attention keys (families with an indexer)."""
    return False

  def reuses_index(self, layer: int) -> bool:
    """Whether layer `layer` attends to the keys an earlier layer selected."""
    return False

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    """The end-of-sequence token ids, as a tuple."""
    return eos_token_tuple(self.eos_token_id)

  def replace(self, **changes) -> "ModelConfig":
    """A copy with the given fields replaced, checked again."""
    return dataclasses.replace(self, **changes)

  # ----------------------------------------------------------------------------------------------
  # Hugging Face config.json.

  @classmethod
  def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
    """Parses a transformers `config.json` dictionary; the wrong `model_type` is a `ValueError`.

    On `ModelConfig` itself the family is picked from `model_type` (see `config_from_hf_dict`).
    """
    if not isinstance(raw, dict):
      raise ValueError(f"config.json must hold a JSON object, got {type(raw).__name__}")
    if cls is ModelConfig:
      return config_from_hf_dict(raw)
    model_type = raw.get("model_type")
    if model_type != cls.model_type:
      raise ValueError(
        f"config.json has model_type {model_type!r}; {cls.__name__} reads {cls.model_type!r}"
      )
    missing = [name for name in cls.required_fields if name not in raw]
    if missing:
      raise ValueError(f"config.json lacks required field(s): {', '.join(missing)}")
    names = {f.name for f in dataclasses.fields(cls)}
    values = {name: raw[name] for name in names if name in raw}
    # transformers 5 moves rope settings into `rope_parameters`; older files keep them top level.
    rope = raw.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
      raise ValueError(f"rope_type {rope_type!r} is not supported; GLM uses 'default' RoPE")
    if raw.get("rope_scaling"):
      raise ValueError("rope_scaling is not supported; GLM uses plain RoPE")
    for key in ("rope_theta", "partial_rotary_factor"):
      if key in rope and key in names:
        values[key] = rope[key]
    return cls(**cls._parse_family(raw, values))

  @classmethod
  def _parse_family(cls, raw: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """Family-specific aliases and derived fields of `config.json` (subclasses)."""
    return values

  @classmethod
  def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
    """Reads a transformers `config.json` (`from_hf_dict`); a file that is not JSON is a
    `ValueError` naming it."""
    with open(path) as f:
      try:
        raw = json.load(f)
      except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    return cls.from_hf_dict(raw)

  def to_hf_dict(self) -> dict[str, Any]:
    """The `config.json` dictionary transformers reads back."""
    values = dataclasses.asdict(self)
    rope = {"rope_type": "default", "rope_theta": values.pop("rope_theta")}
    if "partial_rotary_factor" in values:
      rope["partial_rotary_factor"] = values.pop("partial_rotary_factor")
    values["rope_parameters"] = rope
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
    values["model_type"] = self.model_type
    values["architectures"] = [self.hf_architecture]
    return self._write_family(values)

  def _write_family(self, values: dict[str, Any]) -> dict[str, Any]:
    """Family-specific fields transformers expects in `config.json` (subclasses)."""
    return values


def config_from_hf_dict(raw: dict[str, Any]) -> ModelConfig:
  """The registered family of `raw["model_type"]` parses `raw`; other types are a `ValueError`."""
  model_type = raw.get("model_type") if isinstance(raw, dict) else None
  if model_type not in FAMILIES:
    raise ValueError(
      f"config.json has model_type {model_type!r}; jaxspec reads {tuple(sorted(FAMILIES))}"
    )
  return FAMILIES[model_type].from_hf_dict(raw)


def read_config(path: str | os.PathLike) -> ModelConfig:
  """Parses a checkpoint's `config.json` into its family's config class; every error (bad JSON,
  a field the config classes reject) names the file."""
  try:
    with open(path, "rb") as f:
      raw = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as error:
    raise ValueError(f"{path}: the model config is not valid JSON ({error})") from error
  try:
    return config_from_hf_dict(raw)
  except (ValueError, TypeError) as error:
    raise type(error)(f"{path}: {error}") from error


@dataclasses.dataclass(frozen=True, kw_only=True)
class GlmConfig(ModelConfig):
  """GLM-4.5 family (`glm4_moe`): GQA attention with partial RoPE, dense then MoE MLP layers.

  `head_dim` defaults to `hidden_size // num_attention_heads`; RoPE rotates the first
  `rotary_dim = int(head_dim * partial_rotary_factor)` channels of each head.
  """

  model_type: ClassVar[str] = "glm4_moe"
  hf_architecture: ClassVar[str] = "Glm4MoeForCausalLM"
  attention_kind: ClassVar[AttentionKind] = "gqa"
  required_fields: ClassVar[tuple[str, ...]] = ModelConfig.required_fields + (
    "num_key_value_heads",
  )

  num_key_value_heads: int
  head_dim: int | None = None
  partial_rotary_factor: float = 0.5
  use_qk_norm: bool = False

  def _complete(self) -> None:
    if self.head_dim is None and is_int(self.num_attention_heads) and self.num_attention_heads:
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

  def _validate_family(self) -> None:
    if not is_int(self.head_dim) or self.head_dim <= 0:
      raise ValueError(f"head_dim must be a positive integer, got {self.head_dim!r}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
        f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
        f"num_key_value_heads ({self.num_key_value_heads})"
      )
    factor = self.partial_rotary_factor
    if not is_number(factor) or not 0.0 < factor <= 1.0:
      raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor!r}")
    if self.rotary_dim % 2 or self.rotary_dim == 0:
      raise ValueError(
        f"rotary_dim (head_dim * partial_rotary_factor = {self.rotary_dim}) must be even and > 0"
      )
    if not isinstance(self.use_qk_norm, bool):
      raise ValueError(f"use_qk_norm must be a bool, got {self.use_qk_norm!r}")

  @property
  def group_size(self) -> int:
    """G: query heads per KV head."""
    return self.num_attention_heads // self.num_key_value_heads

  @property
  def rotary_dim(self) -> int:
    """Channels of a head that RoPE rotates: `head_dim * partial_rotary_factor`."""
    return int(self.head_dim * self.partial_rotary_factor)

  @classmethod
  def _parse_family(cls, raw, values):
    if "num_mtp_layers" in raw and "num_nextn_predict_layers" not in raw:
      values["num_nextn_predict_layers"] = raw["num_mtp_layers"]
    if values.get("head_dim") is None:
      values.pop("head_dim", None)
    return values


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
