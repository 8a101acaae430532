"""GlmDsaConfig: parsing glm_moe_dsa config.json files, the indexer schedule, index groups."""

import json
from pathlib import Path

import pytest

from jaxspec.model.config import read_config
from jaxspec.model.dsa_config import GlmDsaConfig, derive_indexer_types, glm53_small, tiny_dsa

FIXTURES = Path(__file__).parents[1] / "fixtures"


def _raw(name="glm_moe_dsa_a"):
  return json.loads((FIXTURES / name / "config.json").read_text())


def test_reads_the_fixture_configs():
  a = GlmDsaConfig.from_hf_dict(_raw("glm_moe_dsa_a"))
  assert a.indexer_types == ("full", "shared", "full")
  assert a.mlp_layer_types == ("dense", "sparse", "sparse")
  assert (a.q_lora_rank, a.kv_lora_rank, a.latent_dim, a.qk_head_dim) == (32, 24, 32, 24)
  assert a.index_groups == ((0, 1), (2,))
  b = GlmDsaConfig.from_hf_dict(_raw("glm_moe_dsa_b"))
  assert b.index_groups == ((0, 1, 2),) and b.rope_theta == 1e6 and b.attention_bias
  assert isinstance(read_config(FIXTURES / "glm_moe_dsa_b" / "config.json"), GlmDsaConfig)


def test_indexer_types_derived_like_transformers_when_absent():
  raw = _raw("glm_moe_dsa_a")
  del raw["indexer_types"]  # keeps index_topk_freq 2, index_skip_topk_offset 1
  assert GlmDsaConfig.from_hf_dict(raw).indexer_types == ("full", "shared", "full")
  del raw["index_topk_freq"], raw["index_skip_topk_offset"]
  assert GlmDsaConfig.from_hf_dict(raw).indexer_types == ("full",) * 3  # defaults: all full
  raw["index_topk_pattern"] = "FSS"
  assert GlmDsaConfig.from_hf_dict(raw).indexer_types == ("full", "shared", "shared")


def test_glm53_grouping_has_21_groups():
  # Layer i is full iff max(i - 2, 0) % 4 == 0: layers 0, 1, 2, then every 4th from 6.
  kinds = derive_indexer_types(78, freq=4, offset=3)
  full = [i for i, kind in enumerate(kinds) if kind == "full"]
  assert full == [0, 1, 2] + list(range(6, 78, 4))
  config = glm53_small()
  groups = config.index_groups
  assert len(groups) == 21 and [g[0] for g in groups] == full
  assert sorted(i for g in groups for i in g) == list(range(78))
  assert groups[-1] == (74, 75, 76, 77)


def test_round_trips_through_hf_dict():
  config = GlmDsaConfig.from_hf_dict(_raw("glm_moe_dsa_b"))
  assert GlmDsaConfig.from_hf_dict(config.to_hf_dict()) == config
  assert config.to_hf_dict()["head_dim"] == config.qk_rope_head_dim


def test_replace_rederives_dense_layers():
  assert tiny_dsa(first_k_dense_replace=0).mlp_layer_types == ("sparse",) * 3


@pytest.mark.parametrize(
  "change, message",
  [
    (dict(model_type="glm4_moe"), "model_type"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(indexer_types=["shared", "full", "full"]), "indexer_types\\[0\\]"),
    (dict(indexer_types=["full", "sparse", "full"]), "indexer_types must list"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(index_head_dim=4), "index_head_dim"),
    (dict(kv_lora_rank=0), "kv_lora_rank"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_type"),
  ],
)
def test_bad_configs_are_rejected(change, message):
  raw = _raw()
  raw.update(change)
  with pytest.raises(ValueError, match=message):
    GlmDsaConfig.from_hf_dict(raw)


def test_missing_field_is_named():
  raw = _raw()
  del raw["hidden_size"]
  with pytest.raises(ValueError, match="hidden_size"):
    GlmDsaConfig.from_hf_dict(raw)
