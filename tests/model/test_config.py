"""GlmConfig parsing from Hugging Face config.json dictionaries."""

import json
from pathlib import Path

import pytest

from jaxspec.model.config import GlmConfig, glm45, glm45_air, tiny

FIXTURES = Path(__file__).parents[1] / "fixtures"


def _raw(name="glm4_moe_a"):
  return json.loads((FIXTURES / name / "config.json").read_text())


def test_reads_rope_parameters_and_legacy_top_level_rope():
  new_style = GlmConfig.from_hf_dict(_raw("glm4_moe_a"))
  assert (
    new_style.partial_rotary_factor
    == _raw("glm4_moe_a")["rope_parameters"]["partial_rotary_factor"]
  )
  legacy = GlmConfig.from_hf_dict(_raw("glm4_moe_b"))
  assert legacy.rope_theta == 1e6 and legacy.partial_rotary_factor == 1.0
  assert legacy.head_dim == 16 and legacy.group_size == 1 and legacy.tie_word_embeddings


def test_round_trips_through_hf_dict():
  config = GlmConfig.from_hf_dict(_raw("glm4_moe_c"))
  assert GlmConfig.from_hf_dict(config.to_hf_dict()) == config


def test_head_dim_defaults_to_hidden_over_heads():
  raw = _raw()
  del raw["head_dim"]
  config = GlmConfig.from_hf_dict(raw)
  assert config.head_dim == raw["hidden_size"] // raw["num_attention_heads"]


def test_unknown_model_type_is_rejected():
  with pytest.raises(ValueError, match="model_type 'llama'"):
    GlmConfig.from_hf_dict({**_raw(), "model_type": "llama"})


def test_missing_required_field_is_named():
  raw = _raw()
  del raw["num_key_value_heads"]
  with pytest.raises(ValueError, match="num_key_value_heads"):
    GlmConfig.from_hf_dict(raw)


@pytest.mark.parametrize(
  "change, message",
  [
    (dict(num_key_value_heads=5), "multiple of num_key_value_heads"),
    (dict(n_group=3), "multiple of n_group"),
    (dict(topk_group=3), "topk_group"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(partial_rotary_factor=0.0625), "rotary_dim"),
  ],
)
def test_inconsistent_fields_are_rejected(change, message):
  with pytest.raises(ValueError, match=message):
    tiny(**change)


def test_presets_have_published_shapes():
  air = glm45_air()
  assert (air.hidden_size, air.num_hidden_layers, air.n_routed_experts, air.group_size) == (
    4096,
    46,
    128,
    12,
  )
  assert air.rotary_dim == 64
  full = glm45()
  assert (full.hidden_size, full.num_hidden_layers, full.n_routed_experts) == (5120, 92, 160)
  assert full.use_qk_norm and full.first_k_dense_replace == 3


@pytest.mark.parametrize(
  "field, value",
  [
    ("rope_theta", 0),
    ("rope_theta", float("nan")),
    ("rms_norm_eps", -1.0),
    ("rms_norm_eps", float("inf")),
    ("routed_scaling_factor", 0.0),
    ("vocab_size", 12.0),
    ("num_hidden_layers", True),
    ("max_position_embeddings", 0),
    ("attention_bias", 1),
    ("eos_token_id", 500),
    ("pad_token_id", -1),
    ("first_k_dense_replace", -2),
  ],
)
def test_values_that_would_give_nan_or_wrong_models_are_rejected(field, value):
  """A config.json with rope_theta 0 or rms_norm_eps -1 used to load and give all-NaN logits."""
  raw = {**_raw(), field: value}
  if field == "rope_theta":
    raw["rope_parameters"] = {**raw["rope_parameters"], "rope_theta": value}
  with pytest.raises(ValueError, match=field):
    GlmConfig.from_hf_dict(raw)


def test_the_family_is_picked_from_model_type():
  from jaxspec.model.config import FAMILIES, ModelConfig, config_from_hf_dict
  from jaxspec.model.dsa_config import GlmDsaConfig

  assert FAMILIES == {"glm4_moe": GlmConfig, "glm_moe_dsa": GlmDsaConfig}
  assert type(config_from_hf_dict(_raw("glm4_moe_a"))) is GlmConfig
  assert type(ModelConfig.from_hf_dict(_raw("glm4_moe_a"))) is GlmConfig
  with pytest.raises(ValueError, match="jaxspec reads"):
    config_from_hf_dict({**_raw(), "model_type": "llama"})
