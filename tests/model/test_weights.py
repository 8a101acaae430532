"""Checkpoint round trips and the errors a broken checkpoint must give."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.flax
from flax import nnx

import jaxspec
from jaxspec.model.config import tiny

FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.fixture
def checkpoint(tmp_path):
  path = tmp_path / "ckpt"
  shutil.copytree(FIXTURES / "glm4_moe_a", path)
  return path


def _rewrite(path, edit):
  tensors = safetensors.flax.load_file(path / "model.safetensors")
  edit(tensors)
  safetensors.flax.save_file(tensors, path / "model.safetensors")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_save_then_load_round_trips(tmp_path, dtype):
  model = jaxspec.GlmForCausalLM(tiny(tie_word_embeddings=True), dtype=dtype, rngs=nnx.Rngs(3))
  jaxspec.save_pretrained(model, tmp_path)
  loaded = jaxspec.load_pretrained(tmp_path, dtype=dtype)
  before, after = nnx.state(model, nnx.Param), nnx.state(loaded, nnx.Param)
  jax.tree.map(np.testing.assert_array_equal, before, after)
  assert loaded.config == model.config


def test_sharded_checkpoint_with_index(checkpoint):
  tensors = safetensors.flax.load_file(checkpoint / "model.safetensors")
  names = sorted(tensors)
  halves = {
    "model-00001-of-00002.safetensors": names[::2],
    "model-00002-of-00002.safetensors": names[1::2],
  }
  (checkpoint / "model.safetensors").unlink()
  weight_map = {}
  for file, part in halves.items():
    safetensors.flax.save_file({n: tensors[n] for n in part}, checkpoint / file)
    weight_map.update({n: file for n in part})
  (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  sharded = jaxspec.load_pretrained(checkpoint, dtype=jnp.float32)
  single = jaxspec.load_pretrained(FIXTURES / "glm4_moe_a", dtype=jnp.float32)
  ids = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
  np.testing.assert_array_equal(sharded(ids), single(ids))


def test_missing_tensor_is_named(checkpoint):
  _rewrite(checkpoint, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
  with pytest.raises(ValueError, match=r"lacks 1 tensor.*layers\.1\.mlp\.experts\.3\.up_proj"):
    jaxspec.load_pretrained(checkpoint)


def test_unexpected_tensor_is_named(checkpoint):
  _rewrite(checkpoint, lambda t: t.update({"model.layers.0.extra.weight": jnp.ones(3)}))
  with pytest.raises(ValueError, match=r"unexpected tensor.*model\.layers\.0\.extra\.weight"):
    jaxspec.load_pretrained(checkpoint)


def test_misshaped_tensor_is_named(checkpoint):
  def shrink(t):
    name = "model.layers.0.self_attn.q_proj.weight"
    t[name] = t[name][:-1]

  _rewrite(checkpoint, shrink)
  with pytest.raises(ValueError, match=r"q_proj\.weight has shape \(47, 48\).*expected \(48, 48\)"):
    jaxspec.load_pretrained(checkpoint)


def test_missing_directory_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="checkpoint directory"):
    jaxspec.load_pretrained(tmp_path / "nope")
