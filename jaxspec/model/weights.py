"""Loading and saving GLM checkpoints in the Hugging Face safetensors layout.

The on-disk names are those of the published GLM checkpoints (and what transformers' `Glm4Moe`
classes read): one tensor per expert (`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`), linear
weights `[out, in]`, the MTP layer under `model.layers.{num_hidden_layers}.*`. In memory, linear
kernels are `[in, out]` and experts are stacked per projection (`[E, H, I]`), so every tensor is
transposed or stacked exactly once here (experts stacked on the host, slice by slice; transposes
and casts on the device).

Loading (`load_pretrained`) refuses a directory it cannot read one way only: a tensor stored in two
files, a safetensors file the index does not name, an index path outside the directory, a file that
does not match the manifest. With `sharding_for`, each parameter is built in its shards: every
device receives only its slice, read from the files by slice, so the host holds about one tensor at
a time.

Saving (`save_pretrained`) writes the whole checkpoint (config, weights, index, manifest, the
caller's extra files) into a staging directory beside the target and swaps it in with one atomic
rename, so that an interrupt leaves either the old or the new checkpoint, never a mix.
`jaxspec_manifest.json` records each file's size and SHA-256; it also says which files the save
owns, so that the next save removes those and keeps every other file in the directory.
"""

import ctypes
import dataclasses
import errno
import functools
import hashlib
import json
import math
import os
import secrets
import shutil
import stat
import struct
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path, PurePosixPath

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jaxspec.model import sharding as sharding_rules
from jaxspec.model.config import ModelConfig, read_config
from jaxspec.model.transformer import GlmForCausalLM

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MANIFEST_NAME = "jaxspec_manifest.json"
_MANIFEST_FORMAT = "jaxspec-checkpoint"
_MANIFEST_VERSION = 1

# Tensors a checkpoint may carry that the model does not use (RoPE caches some exporters write).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# `sharding_for(param_path, shape)`: where each parameter lives; None = the default device.
ShardingRule = Callable[[tuple, tuple[int, ...]], jax.sharding.Sharding | None]


class MissingMtpWarning(UserWarning):
  """The config declares an MTP layer that the checkpoint's weights do not contain."""


# --------------------------------------------------------------------------------------------------
# Parameter <-> checkpoint tensor mapping.


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One model parameter and the checkpoint tensor(s) it is made of.

  `layout` is "copy" (same layout), "transpose" (HF `[out, in]` -> `[in, out]`) or
  "stack_transpose" (one `[out, in]` tensor per expert -> `[E, in, out]`).
  """

  path: tuple
  names: tuple[str, ...]
  layout: str

  def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape in the checkpoint's layout (experts stacked) of a parameter of `shape`."""
    if self.layout == "copy":
      return tuple(shape)
    return tuple(shape[:-2]) + (shape[-1], shape[-2])


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
    prefix = _mtp_prefix(config)
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
    yield from _decoder_layer_entries(config, prefix, ("mtp", "layer"), config.num_hidden_layers)


def _mtp_prefix(config) -> str:
  """GLM stores its MTP layer as the decoder layer after the last one."""
  return f"model.layers.{config.num_hidden_layers}"


def _keeps_float32(path: tuple) -> bool:
  """Parameters transformers keeps in float32 whatever the model dtype: the router's correction
  bias (`_keep_in_fp32_modules_strict`) and the DSA indexer's `weights_proj`."""
  return path[-1] == "e_score_correction_bias" or "weights_proj" in path


# --------------------------------------------------------------------------------------------------
# Reading a checkpoint directory: config, manifest, which files hold the weights.


def _read_json(file: Path, what: str):
  """Parses a JSON file; any error names the file."""
  try:
    with open(file, "rb") as f:
      return json.load(f)
  except json.JSONDecodeError as err:
    raise ValueError(f"{file}: {what} is not valid JSON ({err})") from err
  except UnicodeDecodeError as err:
    raise ValueError(f"{file}: {what} is not UTF-8 text ({err})") from err


def _confinement_root(path: Path) -> Path:
  """The folder every weight file must resolve into: the checkpoint directory, or, for a
  Hugging Face hub cache snapshot (`models--org--name/snapshots/<rev>`, whose files are symlinks
  into `models--org--name/blobs`), the cache folder of that repository."""
  real = path.resolve()
  if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
    return real.parent.parent
  return real


def _plain_name(name, where: str) -> str:
  """A file name a checkpoint may refer to: relative, inside the directory, no `..`."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"{where}: file name must be a non-empty string, got {name!r}")
  pure = PurePosixPath(name)
  if pure.is_absolute() or "\\" in name or ".." in pure.parts:
    raise ValueError(f"{where}: file {name!r} is not inside the checkpoint directory")
  return name


def _confined_file(path: Path, root: Path, name: str, where: str) -> Path:
  """`path / name`, refused unless it (after following symlinks) lies inside `root`."""
  file = path / _plain_name(name, where)
  if not file.resolve().is_relative_to(root):
    raise ValueError(
      f"{where}: {name} resolves to {file.resolve()}, outside the checkpoint directory {root}; "
      "copy the file into the directory instead of linking to it"
    )
  return file


def _sha256(file: Path) -> str:
  with open(file, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def _read_manifest(path: Path) -> dict[str, dict] | None:
  """The manifest's `{file name: {"size", "sha256"}}`, or None when the directory has none."""
  file = path / MANIFEST_NAME
  if not file.exists():
    return None
  raw = _read_json(file, "the checkpoint manifest")
  files = raw.get("files") if isinstance(raw, dict) else None
  if not isinstance(files, dict) or raw.get("format") != _MANIFEST_FORMAT:
    raise ValueError(f"{file}: not a {_MANIFEST_FORMAT} manifest (expected 'format' and 'files')")
  if raw.get("version") != _MANIFEST_VERSION:
    raise ValueError(
      f"{file}: manifest version {raw.get('version')!r}; this jaxspec reads {_MANIFEST_VERSION}"
    )
  for name, record in files.items():
    _plain_name(name, str(file))
    if (
      not isinstance(record, dict)
      or not isinstance(record.get("size"), int)
      or not isinstance(record.get("sha256"), str)
    ):
      raise ValueError(f"{file}: entry {name!r} needs an integer 'size' and a 'sha256' string")
  return files


def _verify_manifest(path: Path, root: Path, files: dict[str, dict], verify_checksums: bool):
  """Checks the files the manifest lists (presence, size, then SHA-256); names the first bad one."""
  where = str(path / MANIFEST_NAME)
  listed = {name: _confined_file(path, root, name, where) for name in files}
  for name, file in listed.items():
    if not file.is_file():
      raise FileNotFoundError(f"{path}: {name} is listed in {MANIFEST_NAME} but missing")
    size = file.stat().st_size
    if size != files[name]["size"]:
      raise ValueError(
        f"{path}: {name} has {size} bytes but {MANIFEST_NAME} records {files[name]['size']}: "
        "the file is truncated or was changed after it was saved"
      )
  if not verify_checksums:
    return
  with ThreadPoolExecutor(max_workers=min(8, len(listed) or 1)) as pool:
    digests = dict(zip(listed, pool.map(_sha256, listed.values()), strict=True))
  for name, digest in digests.items():
    if digest != files[name]["sha256"]:
      raise ValueError(
        f"{path}: {name} does not match its SHA-256 in {MANIFEST_NAME} (file {digest[:16]}..., "
        f"manifest {files[name]['sha256'][:16]}...): the file is damaged or was changed after "
        f"it was saved (if the change is wanted, delete {MANIFEST_NAME})"
      )


def _checkpoint_files_present(path: Path) -> list[str]:
  """Names of the files in `path` that take part in loading a checkpoint."""
  names = []
  for entry in os.scandir(path):
    if entry.name in (CONFIG_NAME, INDEX_NAME) or entry.name.endswith(".safetensors"):
      names.append(entry.name)
  return sorted(names)


def _weight_files(path: Path, root: Path) -> tuple[list[Path], dict[str, str] | None]:
  """The safetensors files of the checkpoint and the index's weight map (None without an index).

  With an index, every `*.safetensors` file in the directory must be one it names (a backup or a
  stale single file beside a sharded checkpoint would be ambiguous); without one, every
  `*.safetensors` file is read, and a tensor stored twice is refused later.
  """
  present = sorted(n for n in _checkpoint_files_present(path) if n.endswith(".safetensors"))
  index_file = path / INDEX_NAME
  if not index_file.exists():
    if not present:
      raise FileNotFoundError(f"no *.safetensors files in {path}")
    return [_confined_file(path, root, n, str(path)) for n in present], None
  raw = _read_json(index_file, "the safetensors index")
  weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
  if not isinstance(weight_map, dict) or not all(
    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
  ):
    raise ValueError(f"{index_file}: expected a 'weight_map' object of tensor name -> file name")
  named = sorted(set(weight_map.values()))
  files = [_confined_file(path, root, n, str(index_file)) for n in named]
  for name, file in zip(named, files, strict=True):
    if not file.is_file():
      raise FileNotFoundError(f"{index_file} names {name}, which is not in {path}")
  unnamed = [n for n in present if (path / n) not in files]
  if unnamed:
    raise ValueError(
      f"{path} is ambiguous: safetensors file(s) {_preview(unnamed)} are not named by "
      f"{INDEX_NAME}; remove them, or the index if it is the stale one"
    )
  return files, weight_map


class _TensorFiles:
  """The open safetensors files of one checkpoint: tensor metadata, and reads by slice.

  Files are memory-mapped by safetensors; a read copies only the requested slice.
  """

  def __init__(self, files: list[Path], weight_map: dict[str, str] | None, stack: ExitStack):
    self._handles = {}
    self.file_of: dict[str, Path] = {}
    twice = []
    for file in files:
      try:
        handle = stack.enter_context(safetensors.safe_open(file, framework="numpy"))
      except (safetensors.SafetensorError, OSError) as err:
        raise ValueError(f"{file}: not a readable safetensors file ({err})") from err
      for name in handle.keys():
        if name in self.file_of:
          twice.append(f"{name} ({self.file_of[name].name} and {file.name})")
        self.file_of[name] = file
        self._handles[name] = handle
    if twice:
      raise ValueError(
        f"{files[0].parent} is ambiguous: {len(twice)} tensor(s) stored in two files: "
        f"{_preview(twice, 4)}; remove the stale file"
      )
    if weight_map is not None:
      self._check_index(weight_map, files[0].parent / INDEX_NAME)

  def _check_index(self, weight_map: dict[str, str], index_file: Path):
    """Every tensor must be stored where the index says, and every indexed tensor stored."""
    directory = index_file.parent
    wrong = [
      f"{name} (index: {weight_map.get(name)}, stored in {file.name})"
      for name, file in self.file_of.items()
      if name not in weight_map or directory / weight_map[name] != file
    ]
    absent = [f"{name} (index: {weight_map[name]})" for name in weight_map if name not in self]
    problems = []
    if wrong:
      problems.append(f"{len(wrong)} tensor(s) stored elsewhere: {_preview(wrong, 4)}")
    if absent:
      problems.append(f"{len(absent)} tensor(s) not in their file: {_preview(absent, 4)}")
    if problems:
      raise ValueError(f"{index_file} does not describe the files beside it: {'; '.join(problems)}")

  def __contains__(self, name: str) -> bool:
    return name in self.file_of

  def __iter__(self):
    return iter(self.file_of)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._handles[name].get_slice(name).get_shape())

  def dtype(self, name: str) -> str:
    return self._handles[name].get_slice(name).get_dtype()

  def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """`tensor[index]` read from the file, in the file's layout and dtype."""
    try:
      return self._handles[name].get_slice(name)[index]
    except safetensors.SafetensorError as err:
      raise ValueError(f"{self.file_of[name]}: cannot read tensor {name} ({err})") from err


# --------------------------------------------------------------------------------------------------
# load_pretrained


def _checked_path(path, function: str) -> Path:
  if not isinstance(path, str | os.PathLike):
    raise TypeError(f"{function}: path must be a str or os.PathLike, got {type(path).__name__}")
  return Path(path)


def _floating_dtype(dtype, function: str):
  """`dtype` as a jnp dtype; a `TypeError` naming the argument unless it is a floating dtype."""
  try:
    checked = jnp.dtype(dtype) if dtype is not None else None
  except TypeError:
    checked = None
  if checked is None or not jnp.issubdtype(checked, jnp.floating):
    raise TypeError(
      f"{function}: dtype must be a floating dtype (jnp.bfloat16, jnp.float32, ...), got {dtype!r}"
    )
  return checked


def missing_mtp_reason(model) -> str | None:
  """Why a loaded model has no MTP layer although its config declared one, else None.

  `load_pretrained` records it on the model (`model.missing_mtp_reason`) when the checkpoint's
  config says `num_nextn_predict_layers >= 1` but the weights have no MTP layer; the model is then
  built with `num_nextn_predict_layers = 0`. Speculative decoding quotes this reason.
  """
  return getattr(model, "missing_mtp_reason", None)


def load_pretrained(
  path: str | os.PathLike,
  dtype=jnp.bfloat16,
  *,
  config: ModelConfig | None = None,
  mesh: Mesh | None = None,
  sharding_for: ShardingRule | None = None,
  verify_checksums: bool = True,
) -> GlmForCausalLM:
  """Loads a Hugging Face GLM checkpoint directory into a `GlmForCausalLM`.

  The config's `model_type` picks the family (`jaxspec.model.config.FAMILIES`: `glm4_moe` for
  GLM-4.5, `glm_moe_dsa` for GLM-5), whose attention the model builds. Reads `config.json` and
  the `*.safetensors` files (through `model.safetensors.index.json` when present). Parameters
  are cast to `dtype`, except those transformers keeps in float32 (`_keeps_float32`).

  Args:
    path: the checkpoint directory.
    dtype: the parameter dtype.
    config: overrides the directory's `config.json`.
    mesh: a mesh of axes ("ep", "tp") (`jaxspec.make_mesh`): the model is built on it and every
      parameter is read straight into its shards by the rules of `jaxspec.model.sharding`.
    sharding_for: instead of `mesh`, for other layouts:
      `(param_path, shape) -> jax.sharding.Sharding | None`, where `param_path` is the
      parameter's NNX path (e.g. `("model", "layers", 0, "self_attn", "q_proj", "kernel")`) and
      `shape` its in-memory shape. Each device then receives only its slice of the parameter, read
      from the files by slice. It must return a `NamedSharding` or a fully replicated sharding;
      None (or no rule) puts the whole parameter on the default device.
    verify_checksums: check every file's SHA-256 against `jaxspec_manifest.json` when the
      directory has one (sizes are always checked).

  Raises:
    ValueError naming the offending file or tensor for: a directory that can be read more than one
    way (a tensor stored in two files, a safetensors file the index does not name, an index entry
    outside the directory), a file that does not match the manifest, unparsable JSON or
    safetensors, a missing, unexpected or mis-shaped tensor, a sharding that does not divide a
    parameter.

  A checkpoint whose config declares an MTP layer that its weights lack (what transformers'
  `save_pretrained` writes) loads without it, with a `MissingMtpWarning`; `missing_mtp_reason`
  then says why the model has no MTP layer.
  """
  path = _checked_path(path, "load_pretrained")
  dtype = _floating_dtype(dtype, "load_pretrained")
  if sharding_for is not None and not callable(sharding_for):
    raise TypeError(f"load_pretrained: sharding_for must be callable or None, got {sharding_for!r}")
  if mesh is not None and (not isinstance(mesh, Mesh) or sharding_for is not None):
    raise TypeError(
      f"load_pretrained: mesh must be a jax.sharding.Mesh, and not given with sharding_for; got "
      f"mesh={mesh!r}"
    )
  if not path.is_dir():
    raise FileNotFoundError(f"checkpoint directory not found: {path}")
  root = _confinement_root(path)
  manifest = _read_manifest(path)
  if manifest is not None:
    _verify_manifest(path, root, manifest, verify_checksums)
    unlisted = [n for n in _checkpoint_files_present(path) if n not in manifest]
    if unlisted:
      raise ValueError(
        f"{path} is ambiguous: {_preview(unlisted)} not listed in {MANIFEST_NAME}, which lists "
        "the files of the checkpoint saved here; remove them, or the manifest if they are the "
        "checkpoint"
      )
  if config is None:
    config = read_config(path / CONFIG_NAME)
  with ExitStack() as stack:
    tensors = _TensorFiles(*_weight_files(path, root), stack)
    config, reason = _without_absent_mtp(config, tensors, path)
    model = _build_model(config, tensors, dtype, mesh, sharding_for, path)
  model.missing_mtp_reason = reason
  return model


def _without_absent_mtp(config, tensors: _TensorFiles, path: Path):
  """(config, None), or, when the config declares an MTP layer that no tensor belongs to,
  (config without it, the reason) after a `MissingMtpWarning`."""
  if not config.num_nextn_predict_layers:
    return config, None
  prefix = _mtp_prefix(config) + "."
  if any(n.startswith(prefix) and not n.endswith(_IGNORED_SUFFIXES) for n in tensors):
    return config, None
  reason = (
    f"the checkpoint {path} has no MTP weights ({prefix}* tensors) although its config says "
    f"num_nextn_predict_layers = {config.num_nextn_predict_layers}; transformers' "
    "save_pretrained drops GLM's MTP layer, so checkpoints it wrote lack it. Loaded without the "
    "MTP layer: plain decoding works, speculative decoding (which drafts with the MTP layer) "
    "needs a checkpoint that has it, such as the original release"
  )
  warnings.warn(reason, MissingMtpWarning, stacklevel=3)
  return config.replace(num_nextn_predict_layers=0), reason


def _build_model(config, tensors: _TensorFiles, dtype, mesh, sharding_for, path: Path):
  mtp_prefix = _mtp_prefix(config)
  own_embedding = f"{mtp_prefix}.embed_tokens.weight" in tensors
  own_head = f"{mtp_prefix}.shared_head.head.weight" in tensors

  def build():
    return GlmForCausalLM(
      config,
      dtype=dtype,
      rngs=nnx.Rngs(0),
      mtp_own_embedding=own_embedding,
      mtp_own_head=own_head,
      mesh=mesh,
    )

  abstract_model = nnx.eval_shape(build)
  if mesh is not None:
    sharding_for = sharding_rules.sharding_for(abstract_model, mesh)
  graphdef, abstract_state = nnx.split(abstract_model)
  expected = dict(nnx.to_flat_state(abstract_state))
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
  loaded = {e.path for e in entries}
  not_loaded = [p for p in expected if p not in loaded]
  if not_loaded:
    raise ValueError(f"model parameters with no checkpoint tensor: {_preview(not_loaded)}")

  # Every check that needs no tensor data runs before the first read.
  plans = []
  for entry in entries:
    variable = expected[entry.path]
    shape = tuple(variable.shape)
    _check_stored_shapes(entry, tensors, shape)
    sharding = None if sharding_for is None else sharding_for(entry.path, shape)
    if sharding is not None:
      _check_sharding(sharding, entry, shape)
    target_dtype = variable.get_value().dtype if _keeps_float32(entry.path) else dtype
    plans.append((entry, shape, jnp.dtype(target_dtype), sharding))

  values = {}
  bar = tqdm(
    total=sum(len(e.names) for e in entries),
    desc="loading weights",
    unit="tensor",
    disable=True if len(entries) < 500 else None,
  )
  with bar:
    for entry, shape, target_dtype, sharding in plans:
      values[entry.path] = _load_parameter(tensors, entry, shape, target_dtype, sharding)
      bar.update(len(entry.names))
  state = nnx.from_flat_state([(p, expected[p].replace(values[p])) for p in expected])
  return nnx.merge(graphdef, state)


def _check_stored_shapes(entry: _Entry, tensors: _TensorFiles, shape: tuple[int, ...]):
  """Each stored tensor must have the shape the config implies (one expert's, for stacked ones)."""
  want = entry.stored_shape(shape)
  if entry.layout == "stack_transpose":
    want = want[1:]
  dtypes = {tensors.dtype(n) for n in entry.names}
  for name in entry.names:
    if tensors.shape(name) != want:
      raise ValueError(
        f"tensor {name} has shape {tensors.shape(name)} in the checkpoint, which does not match "
        f"the config (expected {want})"
      )
  if len(dtypes) > 1:
    raise ValueError(f"expert tensors {entry.names[0]}... have differing dtypes {sorted(dtypes)}")


def _dotted(path: tuple) -> str:
  return ".".join(map(str, path))


def _check_sharding(sharding, entry: _Entry, shape: tuple[int, ...]):
  """A `ValueError` naming the parameter unless `sharding` splits `shape` into equal shards."""
  what = f"parameter {_dotted(entry.path)} (checkpoint tensor {entry.names[0]}, shape {shape})"
  if not isinstance(sharding, jax.sharding.Sharding):
    raise TypeError(f"sharding_for returned {sharding!r} for {what}; expected a jax Sharding")
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = tuple(sharding.spec)
    if len(spec) > len(shape):
      raise ValueError(f"sharding {spec} for {what} has more entries than the parameter has dims")
    for dim, axes in enumerate(spec):
      axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
      parts = math.prod(sharding.mesh.shape[a] for a in axes)
      if shape[dim] % parts:
        raise ValueError(
          f"sharding {spec} for {what} splits dimension {dim} (size {shape[dim]}) over mesh "
          f"axes {axes} of total size {parts}, which does not divide it"
        )
  elif not sharding.is_fully_replicated:
    raise ValueError(
      f"sharding_for returned {sharding} for {what}; only a NamedSharding or a fully replicated "
      "sharding is supported"
    )
  try:
    sharding.shard_shape(shape)
  except (ValueError, TypeError) as err:
    raise ValueError(f"sharding {sharding} does not fit {what}: {err}") from err


def _load_parameter(
  tensors: _TensorFiles, entry: _Entry, shape, target_dtype, sharding
) -> jax.Array:
  """Reads one parameter in the stored layout (slices only, where sharded), then transposes and
  casts it on the device(s), where the layout change is cheap."""
  stored_shape = entry.stored_shape(shape)

  def read(index: tuple[slice, ...]) -> np.ndarray:
    if entry.layout != "stack_transpose":
      return tensors.read(entry.names[0], index)
    # One expert's slice at a time, straight into the stacked slice.
    experts = entry.names[index[0]]
    first = tensors.read(experts[0], index[1:])
    stacked = np.empty((len(experts), *first.shape), first.dtype)
    stacked[0] = first
    del first
    for i, name in enumerate(experts[1:], start=1):
      stacked[i] = tensors.read(name, index[1:])
    return stacked

  def convert(stored: jax.Array) -> jax.Array:
    if entry.layout == "copy" and stored.dtype == target_dtype:
      return stored  # already the parameter: no device copy
    return _converter(entry.layout, target_dtype, sharding)(stored)

  if sharding is None:
    return convert(jax.device_put(read(tuple(slice(None) for _ in stored_shape))))
  stored_sharding = (
    sharding if entry.layout == "copy" else _transposed_sharding(sharding, len(shape))
  )
  # One slice on the host at a time: each is read, put on its device and released before the
  # next is read (`jax.make_array_from_callback` holds every device's slice, the whole tensor, until
  # it places them together). Devices holding the same slice (replication) copy it from the first.
  shards, placed = [], {}
  for device, index in stored_sharding.addressable_devices_indices_map(stored_shape).items():
    key = tuple((s.start, s.stop, s.step) for s in index)
    if key in placed:
      shard = jax.device_put(placed[key], device)
    else:
      shard = placed[key] = jax.device_put(read(index), device).block_until_ready()
    shards.append(shard)
  stored = jax.make_array_from_single_device_arrays(stored_shape, stored_sharding, shards)
  return convert(stored)


def _transposed_sharding(sharding, ndim: int):
  """`sharding` with the partitioning of the last two dimensions swapped."""
  if sharding.is_fully_replicated:
    return sharding
  spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
  spec[-2], spec[-1] = spec[-1], spec[-2]
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


@functools.lru_cache(maxsize=256)
def _converter(layout: str, dtype, sharding):
  """A jitted `stored -> parameter` (swap the last two dims unless "copy", cast to `dtype`);
  with `sharding`, the output is placed by it (a local transpose, no communication)."""

  def convert(stored):
    value = stored if layout == "copy" else jnp.swapaxes(stored, -1, -2)
    return value.astype(dtype)

  return jax.jit(convert) if sharding is None else jax.jit(convert, out_shardings=sharding)


def _preview(names, limit: int = 8) -> str:
  names = [_dotted(n) if isinstance(n, tuple) else n for n in names]
  more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
  return ", ".join(names[:limit]) + more


# --------------------------------------------------------------------------------------------------
# save_pretrained

# numpy dtype name -> safetensors dtype tag.
_SAFETENSORS_DTYPES = {
  "float64": "F64",
  "float32": "F32",
  "float16": "F16",
  "bfloat16": "BF16",
  "int64": "I64",
  "int32": "I32",
  "int16": "I16",
  "int8": "I8",
  "uint8": "U8",
  "bool": "BOOL",
}


@dataclasses.dataclass(frozen=True)
class _StoredTensor:
  """One checkpoint tensor to write; `produce()` returns it in the file's layout and dtype."""

  name: str
  shape: tuple[int, ...]
  dtype: np.dtype
  produce: Callable[[], jax.Array]

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize


def _stored_tensors(model, dtype) -> list[_StoredTensor]:
  """The model's parameters as checkpoint tensors (transposed and split per expert lazily, so
  that only one tensor at a time is materialised on the host)."""
  own_embedding = model.mtp is not None and model.mtp.embed_tokens is not None
  own_head = model.mtp is not None and model.mtp.shared_head_head is not None
  flat = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  tensors = []
  for entry in _entries(model.config, own_embedding, own_head):
    value = flat[entry.path]
    cast = jnp.dtype(value.dtype if dtype is None or _keeps_float32(entry.path) else dtype)
    shape = entry.stored_shape(value.shape)
    if entry.layout == "stack_transpose":
      for e, name in enumerate(entry.names):
        produce = functools.partial(_file_layout, value, entry.layout, cast, e)
        tensors.append(_StoredTensor(name, shape[1:], np.dtype(cast), produce))
    else:
      produce = functools.partial(_file_layout, value, entry.layout, cast, None)
      tensors.append(_StoredTensor(entry.names[0], shape, np.dtype(cast), produce))
  return tensors


def _file_layout(value: jax.Array, layout: str, dtype, expert: int | None) -> jax.Array:
  if expert is not None:
    value = value[expert]
  if layout != "copy":
    value = jnp.swapaxes(value, -1, -2)
  return value.astype(dtype)


def _group_into_files(
  tensors: list[_StoredTensor], max_shard_bytes: int | None
) -> dict[str, list[_StoredTensor]]:
  """`model.safetensors`, or `model-0000i-of-0000n.safetensors` files of at most
  `max_shard_bytes` each (a larger tensor gets a file of its own)."""
  groups, current, size = [], [], 0
  for tensor in tensors:
    if current and max_shard_bytes is not None and size + tensor.nbytes > max_shard_bytes:
      groups.append(current)
      current, size = [], 0
    current.append(tensor)
    size += tensor.nbytes
  groups.append(current)
  if len(groups) == 1:
    return {WEIGHTS_NAME: groups[0]}
  return {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": g for i, g in enumerate(groups)}


def _write_file(file: Path, chunks: Iterable) -> dict:
  """Creates `file` (mode 0666 less the umask, like any new file) from byte chunks, flushes it to
  disk and returns its manifest record `{"size", "sha256"}`."""
  digest, size = hashlib.sha256(), 0
  with open(file, "xb") as f:
    for chunk in chunks:
      f.write(chunk)
      digest.update(chunk)
      size += memoryview(chunk).nbytes
    f.flush()
    os.fsync(f.fileno())
  return {"size": size, "sha256": digest.hexdigest()}


def _safetensors_chunks(tensors: list[_StoredTensor]) -> Iterator:
  """The safetensors format: an 8-byte little-endian header length, a JSON header (tensor ->
  dtype, shape, byte range of the data; padded with spaces to 8 bytes), then the raw
  little-endian C-order data of every tensor back to back. One tensor is on the host at a time."""
  header = {"__metadata__": {"format": "pt"}}
  offset = 0
  for tensor in tensors:
    if tensor.dtype.name not in _SAFETENSORS_DTYPES:
      raise ValueError(f"tensor {tensor.name}: dtype {tensor.dtype} has no safetensors tag")
    header[tensor.name] = {
      "dtype": _SAFETENSORS_DTYPES[tensor.dtype.name],
      "shape": list(tensor.shape),
      "data_offsets": [offset, offset + tensor.nbytes],
    }
    offset += tensor.nbytes
  encoded = json.dumps(header, separators=(",", ":")).encode()
  encoded += b" " * (-len(encoded) % 8)
  yield struct.pack("<Q", len(encoded)) + encoded
  for tensor in tensors:
    host = np.ascontiguousarray(jax.device_get(tensor.produce()))
    yield memoryview(host.reshape(-1).view(np.uint8))


def _json_bytes(value) -> bytes:
  return (json.dumps(value, indent=2) + "\n").encode()


def _source_chunks(source: bytes | Path) -> Iterator[bytes]:
  if isinstance(source, bytes):
    yield source
    return
  with open(source, "rb") as f:
    while chunk := f.read(1 << 24):
      yield chunk


def _check_extra_files(extra_files) -> dict[str, bytes | Path]:
  """`{file name: bytes or a path to copy}`; names must be plain and not the checkpoint's own."""
  if extra_files is None:
    return {}
  checked = {}
  for name, source in extra_files.items():
    if not isinstance(name, str) or name in ("", ".", "..") or set(name) & {"/", "\\", "\0"}:
      raise ValueError(f"extra_files: {name!r} is not a plain file name")
    if name in (CONFIG_NAME, INDEX_NAME, MANIFEST_NAME) or name.endswith(".safetensors"):
      raise ValueError(f"extra_files: {name!r} is a name the checkpoint itself uses")
    if isinstance(source, bytes | bytearray):
      checked[name] = bytes(source)
    elif isinstance(source, os.PathLike):
      if not Path(source).is_file():
        raise FileNotFoundError(f"extra_files[{name!r}]: no file {source}")
      checked[name] = Path(source)
    else:
      raise TypeError(
        f"extra_files[{name!r}] must be bytes (the contents) or a path-like (a file to copy), "
        f"got {type(source).__name__}"
      )
  return checked


def _owned_names(target: Path) -> set[str]:
  """The files of the checkpoint an earlier `save_pretrained` wrote into `target` and nobody
  changed since: listed in its manifest, with the recorded size, not newer than the manifest
  (written last). A file rewritten later (say a new `tokenizer.json`) belongs to the user."""
  manifest = _read_manifest(target)
  if manifest is None:
    return set()
  written = (target / MANIFEST_NAME).stat().st_mtime_ns
  owned = {MANIFEST_NAME}
  for name, record in manifest.items():
    try:
      info = (target / name).stat(follow_symlinks=False)
    except FileNotFoundError:
      continue
    if info.st_size == record["size"] and info.st_mtime_ns <= written:
      owned.add(name)
  return owned


def _new_sibling(target: Path, tag: str) -> Path:
  """A name beside `target`, hidden and unused: `.{name}.jaxspec-{tag}-{random}`."""
  while True:
    sibling = target.parent / f".{target.name}.jaxspec-{tag}-{secrets.token_hex(4)}"
    if not os.path.lexists(sibling):
      return sibling


def _make_staging_dir(target: Path) -> Path:
  while True:
    staging = _new_sibling(target, "staging")
    try:
      os.mkdir(staging, 0o777)  # the umask applies, as to any new directory
      return staging
    except FileExistsError:
      continue


def _fsync_dir(directory: Path):
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _link_or_copy(source, destination):
  """Carries a user's file into the new directory: a hard link (no copy, no window in which the
  file exists nowhere), or a copy where the filesystem has no hard links."""
  try:
    os.link(source, destination, follow_symlinks=False)
  except OSError:
    shutil.copy2(source, destination, follow_symlinks=False)


def _carry_over(target: Path, staging: Path, names: list[str]):
  """Puts the entries `names` of `target` (files the checkpoint does not own) into `staging`."""
  for name in names:
    source = target / name
    if source.is_dir() and not source.is_symlink():
      shutil.copytree(source, staging / name, symlinks=True, copy_function=_link_or_copy)
    else:
      _link_or_copy(source, staging / name)


@functools.cache
def _renameat2():
  """libc's `renameat2` (Linux >= 3.15, glibc >= 2.28), or None."""
  try:
    function = ctypes.CDLL(None, use_errno=True).renameat2
  except (OSError, AttributeError, TypeError):
    return None
  function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
  function.restype = ctypes.c_int
  return function


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_NO_EXCHANGE = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


def _exchange(first: Path, second: Path) -> bool:
  """Swaps two directories in one atomic step; False where the system cannot."""
  renameat2 = _renameat2()
  if renameat2 is None:
    return False
  names = os.fsencode(first), os.fsencode(second)
  if renameat2(_AT_FDCWD, names[0], _AT_FDCWD, names[1], _RENAME_EXCHANGE) == 0:
    return True
  code = ctypes.get_errno()
  if code in _NO_EXCHANGE:
    return False
  raise OSError(code, os.strerror(code), str(first), None, str(second))


def _swap_in(staging: Path, target: Path) -> Path:
  """Moves the directory `staging` to `target`; returns where the old `target` now lives."""
  if _exchange(staging, target):
    return staging
  # No atomic exchange here: two renames. Between them `target` is absent for an instant, and
  # each checkpoint is complete under its own name (the old one at `aside`).
  aside = _new_sibling(target, "old")
  os.rename(target, aside)
  try:
    os.rename(staging, target)
  except BaseException:
    os.rename(aside, target)
    raise
  return aside


def _retire(old: Path, target: Path, replaced: set[str]):
  """Empties and removes the previous checkpoint directory `old`: files the new checkpoint
  replaced or carried over go; anything else (made while the save ran) moves to `target`."""
  kept = []
  for name in os.listdir(old):
    entry = old / name
    if name in replaced:
      if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
      else:
        entry.unlink()
    elif not os.path.lexists(target / name):
      os.rename(entry, target / name)
    else:
      kept.append(name)
  if kept:
    warnings.warn(f"{old} keeps {_preview(kept)}, which also exist in {target}", stacklevel=3)
  else:
    os.rmdir(old)


def _inode(path: Path) -> tuple[int, int] | None:
  try:
    info = os.stat(path)
  except FileNotFoundError:
    return None
  return info.st_dev, info.st_ino


def save_pretrained(
  model: GlmForCausalLM,
  path: str | os.PathLike,
  dtype=None,
  *,
  extra_files: Mapping[str, bytes | os.PathLike] | None = None,
  max_shard_bytes: int | None = None,
) -> None:
  """Writes the checkpoint `load_pretrained` reads, all of it or nothing.

  Writes `config.json`, the weights (`model.safetensors`, or with `max_shard_bytes`
  `model-0000i-of-0000n.safetensors` files plus `model.safetensors.index.json`), the caller's
  `extra_files` (`{name: bytes | path to copy}`, e.g. `tokenizer.json`) and `jaxspec_manifest.json`
  (each file's size and SHA-256) into a staging directory beside `path`, then swaps it in with
  one atomic rename (Linux `renameat2(RENAME_EXCHANGE)`; elsewhere two renames). An interrupt
  leaves either the previous checkpoint or the new one, complete.

  Files of an earlier save (those its manifest lists, unless changed since) are removed; every
  other file in the directory is kept (hard-linked into the new directory before the swap). A
  directory holding safetensors files or an index that no earlier save owns and this save does
  not replace is refused before anything is written: beside the new checkpoint they would make
  it ambiguous.
  New files and directories get the usual permissions (0666 / 0777 less the umask); a replaced
  directory keeps its mode.

  `dtype` casts every tensor but the float32 ones (`_keeps_float32`); default: keep as is.
  """
  target = Path(os.path.realpath(_checked_path(path, "save_pretrained")))
  if dtype is not None:
    dtype = _floating_dtype(dtype, "save_pretrained")
  if not isinstance(model, GlmForCausalLM):
    raise TypeError(f"save_pretrained: model must be a GlmForCausalLM, got {type(model).__name__}")
  if target.exists() and not target.is_dir():
    raise NotADirectoryError(f"save_pretrained: {path} exists and is not a directory")
  if max_shard_bytes is not None and (
    isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1
  ):
    raise ValueError(f"max_shard_bytes must be a positive int or None, got {max_shard_bytes!r}")
  extras = _check_extra_files(extra_files)
  files = _group_into_files(_stored_tensors(model, dtype), max_shard_bytes)
  new_names = {CONFIG_NAME, MANIFEST_NAME, *files, *extras} | (
    {INDEX_NAME} if len(files) > 1 else set()
  )
  exists = target.is_dir()
  owned = _owned_names(target) if exists else set()
  foreign = sorted(set(os.listdir(target)) - owned - new_names) if exists else []
  stale = [n for n in foreign if n.endswith(".safetensors") or n == INDEX_NAME]
  if stale:
    raise ValueError(
      f"save_pretrained: {target} holds {_preview(stale)}, which no earlier save_pretrained "
      "owns (no manifest lists them) and this save does not replace; beside the new checkpoint "
      "they would make the directory ambiguous. Move or delete them, or save elsewhere"
    )

  target.parent.mkdir(parents=True, exist_ok=True)
  working_in_target = exists and _inode(Path.cwd()) == _inode(target)
  staging = _make_staging_dir(target)
  staging_inode = _inode(staging)
  try:
    if exists:
      os.chmod(staging, stat.S_IMODE(target.stat().st_mode))
    _write_checkpoint(staging, model.config, files, extras)
    if exists:
      _carry_over(target, staging, foreign)
      old = _swap_in(staging, target)
    else:
      os.rename(staging, target)
  except BaseException:
    if _inode(staging) == staging_inode:  # the new checkpoint was not swapped in
      shutil.rmtree(staging, ignore_errors=True)
    raise
  _fsync_dir(target.parent)
  if exists:
    if working_in_target:  # follow the path, not the directory about to be removed
      os.chdir(target)
    _retire(old, target, owned | set(foreign) | new_names)


def _write_checkpoint(
  directory: Path, config, files: dict[str, list[_StoredTensor]], extras: dict[str, bytes | Path]
):
  """Writes weights, index, config and extra files into `directory`, then the manifest."""
  records = {}
  for name, tensors in files.items():
    records[name] = _write_file(directory / name, _safetensors_chunks(tensors))
  if len(files) > 1:
    index = {
      "metadata": {"total_size": sum(t.nbytes for ts in files.values() for t in ts)},
      "weight_map": {t.name: name for name, ts in files.items() for t in ts},
    }
    records[INDEX_NAME] = _write_file(directory / INDEX_NAME, [_json_bytes(index)])
  records[CONFIG_NAME] = _write_file(directory / CONFIG_NAME, [_json_bytes(config.to_hf_dict())])
  for name, source in extras.items():
    records[name] = _write_file(directory / name, _source_chunks(source))
  manifest = {"format": _MANIFEST_FORMAT, "version": _MANIFEST_VERSION, "files": records}
  _write_file(directory / MANIFEST_NAME, [_json_bytes(manifest)])
  _fsync_dir(directory)
