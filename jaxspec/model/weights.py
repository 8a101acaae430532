"""Loading and saving GLM-4.5-family checkpoints in the Hugging Face safetensors layout.

The on-disk names are those of the published GLM checkpoints (and what transformers' `Glm4Moe`
classes read): one tensor per expert (`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`), linear
weights `[out, in]`, the MTP layer under `model.layers.{num_hidden_layers}.*`. In memory, linear
kernels are `[in, out]` and experts are stacked per projection (`[E, H, I]`), so every tensor is
transposed or stacked exactly once here.
"""

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import safetensors
import safetensors.flax
from flax import nnx
from tqdm.auto import tqdm

from jaxspec.model.config import ModelConfig, read_config
from jaxspec.model.transformer import GlmForCausalLM

# Tensors a checkpoint may carry that the model does not use (RoPE caches some exporters write).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One model parameter and the checkpoint tensor(s) it is made of.

  `layout` is "copy" (same layout), "transpose" (HF `[out, in]` -> `[in, out]`) or
  "stack_transpose" (one `[out, in]` tensor per expert -> `[E, in, out]`).
  """

  path: tuple
  names: tuple[str, ...]
  layout: str


def _decoder_layer_entries(config: ModelConfig, hf_prefix: str, path: tuple, layer: int):
  """Entries of decoder layer `layer` (`num_hidden_layers`: the MTP layer's block)."""

  def linear(name, sub):
    return _Entry(path + sub + ("kernel",), (f"{hf_prefix}.{name}.weight",), "transpose")

  def vector(name, sub):
    return _Entry(path + sub, (f"{hf_prefix}.{name}",), "copy")

  yield vector("input_layernorm.weight", ("input_layernorm", "weight"))
  yield vector("post_attention_layernorm.weight", ("post_attention_layernorm", "weight"))
  yield from _ATTENTION_ENTRIES[config.attention_kind](config, linear, vector, layer)
  yield from _mlp_entries(config, hf_prefix, path, linear, vector, config.is_moe_layer(layer))


def _gqa_entries(config, linear, vector, layer: int):
  del layer  # every GQA layer has the same tensors
  for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
    yield linear(f"self_attn.{proj}", ("self_attn", proj))
  if config.attention_bias:
    for proj in ("q_proj", "k_proj", "v_proj"):
      yield vector(f"self_attn.{proj}.bias", ("self_attn", proj, "bias"))
  if config.use_qk_norm:
    yield vector("self_attn.q_norm.weight", ("self_attn", "q_norm", "weight"))
    yield vector("self_attn.k_norm.weight", ("self_attn", "k_norm", "weight"))


def _mla_entries(config, linear, vector, layer: int):
  projections = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
  for proj in projections:
    yield linear(f"self_attn.{proj}", ("self_attn", proj))
  if config.attention_bias:
    for proj in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj"):
      yield vector(f"self_attn.{proj}.bias", ("self_attn", proj, "bias"))
  for norm in ("q_a_layernorm", "kv_a_layernorm"):
    yield vector(f"self_attn.{norm}.weight", ("self_attn", norm, "weight"))
  if config.has_indexer(layer):
    for proj in ("wq_b", "wk", "weights_proj"):
      yield linear(f"self_attn.indexer.{proj}", ("self_attn", "indexer", proj))
    for name in ("weight", "bias"):
      yield vector(f"self_attn.indexer.k_norm.{name}", ("self_attn", "indexer", "k_norm", name))


_ATTENTION_ENTRIES = {"gqa": _gqa_entries, "mla": _mla_entries}


def _mlp_entries(config, hf_prefix: str, path: tuple, linear, vector, moe: bool):
  if not moe:
    for proj in ("gate_proj", "up_proj", "down_proj"):
      yield linear(f"mlp.{proj}", ("mlp", proj))
    return
  yield vector("mlp.gate.weight", ("mlp", "gate", "weight"))
  yield vector("mlp.gate.e_score_correction_bias", ("mlp", "gate", "e_score_correction_bias"))
  for proj, stacked in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
    names = tuple(
      f"{hf_prefix}.mlp.experts.{e}.{proj}.weight" for e in range(config.n_routed_experts)
    )
    yield _Entry(path + ("mlp", "experts", stacked), names, "stack_transpose")
  for proj in ("gate_proj", "up_proj", "down_proj"):
    yield linear(f"mlp.shared_experts.{proj}", ("mlp", "shared_experts", proj))


def _entries(config: ModelConfig, mtp_own_embedding: bool, mtp_own_head: bool) -> Iterator[_Entry]:
  yield _Entry(("model", "embed_tokens", "embedding"), ("model.embed_tokens.weight",), "copy")
  yield _Entry(("model", "norm", "weight"), ("model.norm.weight",), "copy")
  if not config.tie_word_embeddings:
    yield _Entry(("lm_head", "kernel"), ("lm_head.weight",), "transpose")
  for i in range(config.num_hidden_layers):
    prefix = f"model.layers.{i}"
    yield from _decoder_layer_entries(config, prefix, ("model", "layers", i), i)
  if config.num_nextn_predict_layers:
    n = config.num_hidden_layers
    prefix = f"model.layers.{n}"
    yield _Entry(("mtp", "enorm", "weight"), (f"{prefix}.enorm.weight",), "copy")
    yield _Entry(("mtp", "hnorm", "weight"), (f"{prefix}.hnorm.weight",), "copy")
    yield _Entry(("mtp", "eh_proj", "kernel"), (f"{prefix}.eh_proj.weight",), "transpose")
    yield _Entry(
      ("mtp", "shared_head_norm", "weight"), (f"{prefix}.shared_head.norm.weight",), "copy"
    )
    if mtp_own_embedding:
      yield _Entry(("mtp", "embed_tokens", "embedding"), (f"{prefix}.embed_tokens.weight",), "copy")
    if mtp_own_head:
      yield _Entry(
        ("mtp", "shared_head_head", "kernel"), (f"{prefix}.shared_head.head.weight",), "transpose"
      )
    yield from _decoder_layer_entries(config, prefix, ("mtp", "layer"), n)


def _checkpoint_files(path: Path) -> list[Path]:
  index = path / "model.safetensors.index.json"
  if index.exists():
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    return sorted({path / name for name in weight_map.values()})
  files = sorted(path.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(f"no *.safetensors files in {path}")
  return files


def _read_tensors(files: list[Path]) -> dict[str, jax.Array]:
  tensors = {}
  for file in tqdm(files, desc="reading safetensors", unit="file", disable=len(files) < 2):
    with safetensors.safe_open(file, framework="flax") as f:
      for name in f.keys():
        tensors[name] = f.get_tensor(name)
  return tensors


def _keeps_float32(path: tuple) -> bool:
  """Parameters transformers keeps in float32 whatever the model dtype: the router's correction
  bias (`_keep_in_fp32_modules_strict`) and the DSA indexer's `weights_proj`."""
  return path[-1] == "e_score_correction_bias" or "weights_proj" in path


def load_pretrained(
  path: str | os.PathLike, dtype=jnp.bfloat16, *, config: ModelConfig | None = None
) -> GlmForCausalLM:
  """Loads a Hugging Face GLM checkpoint directory into a `GlmForCausalLM`.

  The config's `model_type` picks the family (`jaxspec.model.config.FAMILIES`: `glm4_moe` for
  GLM-4.5, `glm_moe_dsa` for GLM-5), whose attention the model builds. Reads `config.json` and
  every `*.safetensors` shard (through `model.safetensors.index.json` when present). Parameters
  are cast to `dtype`, except those transformers keeps in float32 (`_keeps_float32`). A missing,
  unexpected or mis-shaped tensor is a `ValueError` naming it.
  """
  path = Path(path)
  if not path.is_dir():
    raise FileNotFoundError(f"checkpoint directory not found: {path}")
  config = config or read_config(path / "config.json")
  tensors = _read_tensors(_checkpoint_files(path))
  mtp_prefix = f"model.layers.{config.num_hidden_layers}"
  own_embedding = f"{mtp_prefix}.embed_tokens.weight" in tensors
  own_head = f"{mtp_prefix}.shared_head.head.weight" in tensors
  if config.num_nextn_predict_layers and f"{mtp_prefix}.eh_proj.weight" not in tensors:
    # A checkpoint exported without its MTP layer still serves plain decoding.
    config = config.replace(num_nextn_predict_layers=0)

  def build():
    return GlmForCausalLM(
      config, dtype=dtype, rngs=nnx.Rngs(0), mtp_own_embedding=own_embedding, mtp_own_head=own_head
    )

  graphdef, abstract_state = nnx.split(nnx.eval_shape(build))
  expected = {p: v for p, v in nnx.to_flat_state(abstract_state)}
  entries = list(_entries(config, own_embedding, own_head))

  missing = [n for e in entries for n in e.names if n not in tensors]
  if missing:
    raise ValueError(f"checkpoint {path} lacks {len(missing)} tensor(s): {_preview(missing)}")
  used = {n for e in entries for n in e.names}
  unexpected = [n for n in tensors if n not in used and not n.endswith(_IGNORED_SUFFIXES)]
  if unexpected:
    raise ValueError(
      f"checkpoint {path} has {len(unexpected)} unexpected tensor(s): {_preview(unexpected)}"
    )

  values = {}
  for entry in tqdm(entries, desc="loading weights", unit="tensor", disable=len(entries) < 500):
    variable = expected[entry.path]
    value = _convert(entry, tensors, variable.shape)
    target_dtype = variable.get_value().dtype if _keeps_float32(entry.path) else dtype
    values[entry.path] = value.astype(target_dtype)
  not_loaded = [p for p in expected if p not in values]
  if not_loaded:
    raise ValueError(f"model parameters with no checkpoint tensor: {_preview(not_loaded)}")
  state = nnx.from_flat_state([(p, expected[p].replace(values[p])) for p in expected])
  return nnx.merge(graphdef, state)


def _convert(entry: _Entry, tensors, expected_shape) -> jax.Array:
  if entry.layout == "stack_transpose":
    shapes = {tensors[n].shape for n in entry.names}
    if len(shapes) != 1:
      raise ValueError(f"expert tensors {entry.names[0]}... have differing shapes {shapes}")
    value = jnp.stack([tensors[n].T for n in entry.names])
  else:
    value = tensors[entry.names[0]]
    if entry.layout == "transpose":
      value = value.T
  if value.shape != tuple(expected_shape):
    hf_shape = value.shape if entry.layout == "copy" else tuple(reversed(value.shape[-2:]))
    raise ValueError(
      f"tensor {entry.names[0]} has shape {hf_shape} in the checkpoint, which does not match the "
      f"config (expected {_hf_shape(entry, expected_shape)})"
    )
  return value


def _hf_shape(entry: _Entry, shape) -> tuple:
  if entry.layout == "copy":
    return tuple(shape)
  return tuple(reversed(shape[-2:]))


def _preview(names, limit: int = 8) -> str:
  names = [".".join(map(str, n)) if isinstance(n, tuple) else n for n in names]
  more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
  return ", ".join(names[:limit]) + more


def save_pretrained(model: GlmForCausalLM, path: str | os.PathLike, dtype=None) -> None:
  """Writes `config.json` and `model.safetensors` in the layout `load_pretrained` reads.

  `dtype` casts every tensor but the float32 ones (`_keeps_float32`); default: keep as is.
  """
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  config = model.config
  own_embedding = model.mtp is not None and model.mtp.embed_tokens is not None
  own_head = model.mtp is not None and model.mtp.shared_head_head is not None
  flat = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  tensors = {}
  for entry in _entries(config, own_embedding, own_head):
    value = flat[entry.path]
    if dtype is not None and not _keeps_float32(entry.path):
      value = value.astype(dtype)
    if entry.layout == "copy":
      tensors[entry.names[0]] = value
    elif entry.layout == "transpose":
      tensors[entry.names[0]] = value.T
    else:
      for e, name in enumerate(entry.names):
        tensors[name] = value[e].T
  safetensors.flax.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
  with open(path / "config.json", "w") as f:
    json.dump(config.to_hf_dict(), f, indent=2)
