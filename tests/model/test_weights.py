"""Checkpoint round trips, the errors a broken or ambiguous checkpoint must give, and saves that
leave either the old or the new checkpoint whole."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.flax
from flax import nnx

import jaxspec
from jaxspec.model import weights
from jaxspec.model.config import tiny
from jaxspec.serving.engine import EngineConfig
from jaxspec.serving.speculative import SpeculativeGenerator

FIXTURES = Path(__file__).parents[1] / "fixtures"
MANIFEST = "jaxspec_manifest.json"


@pytest.fixture
def checkpoint(tmp_path):
  path = tmp_path / "ckpt"
  shutil.copytree(FIXTURES / "glm4_moe_a", path)
  return path


@pytest.fixture(scope="module")
def small_models():
  """Two different tiny models (the "old" and the "new" checkpoint of a directory)."""
  config = tiny(tie_word_embeddings=False)
  return tuple(
    jaxspec.GlmForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(seed)) for seed in (1, 2)
  )


def _rewrite(path, edit, file="model.safetensors"):
  tensors = safetensors.flax.load_file(path / file)
  edit(tensors)
  safetensors.flax.save_file(tensors, path / file)


def _split_into_shards(path, num_files=2):
  """Rewrites `path`'s single model.safetensors as `num_files` files plus an index."""
  tensors = safetensors.flax.load_file(path / "model.safetensors")
  names = sorted(tensors)
  (path / "model.safetensors").unlink()
  weight_map = {}
  for i in range(num_files):
    file = f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
    part = names[i::num_files]
    safetensors.flax.save_file({n: tensors[n] for n in part}, path / file)
    weight_map.update({n: file for n in part})
  (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  return weight_map


def _file_digests(path: Path) -> dict[str, str]:
  """Every file under `path` (recursively) -> its SHA-256: the whole state of a directory."""
  return {
    str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
    for f in sorted(path.rglob("*"))
    if f.is_file()
  }


def _assert_same_params(a, b):
  jax.tree.map(np.testing.assert_array_equal, nnx.state(a, nnx.Param), nnx.state(b, nnx.Param))


# --------------------------------------------------------------------------------------------------
# Round trips and tensor-level errors.


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_save_then_load_round_trips(tmp_path, dtype):
  model = jaxspec.GlmForCausalLM(tiny(tie_word_embeddings=True), dtype=dtype, rngs=nnx.Rngs(3))
  jaxspec.save_pretrained(model, tmp_path)
  loaded = jaxspec.load_pretrained(tmp_path, dtype=dtype)
  _assert_same_params(model, loaded)
  assert loaded.config == model.config


def test_sharded_save_writes_index_and_round_trips(tmp_path, small_models):
  model = small_models[0]
  jaxspec.save_pretrained(model, tmp_path / "ckpt", max_shard_bytes=20_000)
  files = sorted(p.name for p in (tmp_path / "ckpt").glob("*.safetensors"))
  assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
  index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
  assert sorted(set(index["weight_map"].values())) == files
  _assert_same_params(model, jaxspec.load_pretrained(tmp_path / "ckpt", dtype=jnp.float32))


def test_saved_file_is_read_by_safetensors_itself(tmp_path, small_models):
  jaxspec.save_pretrained(small_models[0], tmp_path, dtype=jnp.bfloat16)
  tensors = safetensors.flax.load_file(tmp_path / "model.safetensors")
  kernel = small_models[0].model.layers[0].self_attn.q_proj.kernel[...]
  stored = tensors["model.layers.0.self_attn.q_proj.weight"]
  assert stored.dtype == jnp.bfloat16
  np.testing.assert_array_equal(stored, kernel.T.astype(jnp.bfloat16))
  bias = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
  assert bias.dtype == jnp.float32  # kept in float32, as transformers does


def test_sharded_checkpoint_with_index(checkpoint):
  _split_into_shards(checkpoint)
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


def test_misshaped_expert_is_named(checkpoint):
  def shrink(t):
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    t[name] = t[name][:, :-1]

  _rewrite(checkpoint, shrink)
  with pytest.raises(ValueError, match=r"experts\.5\.down_proj\.weight has shape \(48, 23\)"):
    jaxspec.load_pretrained(checkpoint)


@pytest.mark.parametrize("dtype", [jnp.int32, "foo", None, 3])
def test_non_floating_dtype_is_a_type_error(dtype):
  with pytest.raises(TypeError, match=r"load_pretrained: dtype must be a floating dtype"):
    jaxspec.load_pretrained(FIXTURES / "glm4_moe_a", dtype=dtype)


def test_bad_arguments_name_themselves(tmp_path, small_models):
  with pytest.raises(TypeError, match=r"load_pretrained: path must be a str or os.PathLike"):
    jaxspec.load_pretrained(3)
  with pytest.raises(TypeError, match=r"sharding_for must be callable"):
    jaxspec.load_pretrained(FIXTURES / "glm4_moe_a", sharding_for="tp")
  with pytest.raises(TypeError, match=r"save_pretrained: dtype must be a floating dtype"):
    jaxspec.save_pretrained(small_models[0], tmp_path, dtype=jnp.int8)
  with pytest.raises(TypeError, match=r"save_pretrained: model must be a GlmForCausalLM"):
    jaxspec.save_pretrained(object(), tmp_path)
  with pytest.raises(ValueError, match=r"max_shard_bytes must be a positive int"):
    jaxspec.save_pretrained(small_models[0], tmp_path, max_shard_bytes=0)
  assert list(tmp_path.iterdir()) == []


def test_missing_directory_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="checkpoint directory"):
    jaxspec.load_pretrained(tmp_path / "nope")


# --------------------------------------------------------------------------------------------------
# Issue 14, "lost or mixed checkpoints": loading refuses ambiguous directories.


def test_backup_file_with_old_weights_is_refused_not_loaded(checkpoint):
  """A backup `model_old.safetensors` beside `model.safetensors` holds every tensor a second
  time; sorted last, it used to win silently."""
  _rewrite(checkpoint, lambda t: t.update({k: v + 1 for k, v in t.items()}))
  shutil.copy(checkpoint / "model.safetensors", checkpoint / "model_old.safetensors")
  _rewrite(checkpoint, lambda t: t.update({k: v - 1 for k, v in t.items()}))
  with pytest.raises(ValueError, match=r"tensor\(s\) stored in two files.*model_old\.safetensors"):
    jaxspec.load_pretrained(checkpoint)


def test_tensor_stored_in_two_files_is_refused(checkpoint):
  name = "model.layers.0.self_attn.q_proj.weight"
  tensors = safetensors.flax.load_file(checkpoint / "model.safetensors")
  safetensors.flax.save_file({name: tensors[name]}, checkpoint / "extra.safetensors")
  with pytest.raises(ValueError, match=rf"ambiguous.*{name} \(extra\.safetensors and model\."):
    jaxspec.load_pretrained(checkpoint)


def test_stale_index_beside_new_single_file_is_refused(checkpoint):
  """A sharded checkpoint replaced by a single `model.safetensors` without removing the index:
  the index used to decide, so the OLD shards were loaded."""
  _split_into_shards(checkpoint)
  shutil.copy(FIXTURES / "glm4_moe_a" / "model.safetensors", checkpoint / "model.safetensors")
  with pytest.raises(ValueError, match=r"model\.safetensors are not named by .*index\.json"):
    jaxspec.load_pretrained(checkpoint)


def test_file_outside_the_index_is_refused(checkpoint):
  _split_into_shards(checkpoint)
  (checkpoint / "model-00003-of-00003.safetensors").write_bytes(b"")
  with pytest.raises(ValueError, match=r"model-00003-of-00003\.safetensors are not named by"):
    jaxspec.load_pretrained(checkpoint)


@pytest.mark.parametrize("escape", ["dotdot", "absolute", "symlink"])
def test_index_paths_are_confined_to_the_directory(checkpoint, tmp_path, escape):
  weight_map = _split_into_shards(checkpoint)
  outside = tmp_path / "outside.safetensors"
  shutil.move(checkpoint / "model-00002-of-00002.safetensors", outside)
  target = {
    "dotdot": "../outside.safetensors",
    "absolute": str(outside),
    "symlink": "model-00002-of-00002.safetensors",
  }[escape]
  if escape == "symlink":
    (checkpoint / target).symlink_to(outside)
  moved = {n: target for n, f in weight_map.items() if f == "model-00002-of-00002.safetensors"}
  index = {"weight_map": {**weight_map, **moved}}
  (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(
    ValueError, match=r"outside the checkpoint directory|not inside the checkpoint"
  ):
    jaxspec.load_pretrained(checkpoint)


def test_index_that_misplaces_a_tensor_is_refused(checkpoint):
  weight_map = _split_into_shards(checkpoint)
  name = "model.norm.weight"
  other = {f for f in weight_map.values() if f != weight_map[name]}.pop()
  index = {"weight_map": {**weight_map, name: other}}
  (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(ValueError, match=r"index\.json does not describe.*model\.norm\.weight"):
    jaxspec.load_pretrained(checkpoint)


def test_hub_cache_snapshot_with_symlinks_into_blobs_loads(tmp_path):
  """Hugging Face's hub cache stores `snapshots/<rev>/x` as symlinks to `../../blobs/<hash>`: an
  escape from the snapshot folder that is not one from the repository's cache folder."""
  repo = tmp_path / "models--org--tiny"
  snapshot = repo / "snapshots" / "abc123"
  (repo / "blobs").mkdir(parents=True)
  snapshot.mkdir(parents=True)
  for name in ("config.json", "model.safetensors"):
    blob = repo / "blobs" / hashlib.sha256(name.encode()).hexdigest()
    shutil.copy(FIXTURES / "glm4_moe_a" / name, blob)
    (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
  model = jaxspec.load_pretrained(snapshot, dtype=jnp.float32)
  _assert_same_params(model, jaxspec.load_pretrained(FIXTURES / "glm4_moe_a", dtype=jnp.float32))


# Every parse error names the file.


def test_bad_json_in_config_names_the_file(checkpoint):
  (checkpoint / "config.json").write_text('{"model_type": "glm4_moe",')
  with pytest.raises(ValueError, match=r"ckpt/config\.json: the model config is not valid JSON"):
    jaxspec.load_pretrained(checkpoint)


def test_bad_config_value_names_the_file(checkpoint):
  raw = json.loads((checkpoint / "config.json").read_text())
  raw["num_attention_heads"] = 5
  (checkpoint / "config.json").write_text(json.dumps(raw))
  with pytest.raises(ValueError, match=r"ckpt/config\.json: num_attention_heads \(5\) must be"):
    jaxspec.load_pretrained(checkpoint)


def test_bad_json_in_index_names_the_file(checkpoint):
  _split_into_shards(checkpoint)
  (checkpoint / "model.safetensors.index.json").write_text("{'weight_map': {}}")
  with pytest.raises(ValueError, match=r"index\.json: the safetensors index is not valid JSON"):
    jaxspec.load_pretrained(checkpoint)


def test_index_without_weight_map_names_the_file(checkpoint):
  _split_into_shards(checkpoint)
  (checkpoint / "model.safetensors.index.json").write_text('{"metadata": {}}')
  with pytest.raises(ValueError, match=r"index\.json: expected a 'weight_map'"):
    jaxspec.load_pretrained(checkpoint)


@pytest.mark.parametrize("damage", ["header", "truncated"])
def test_corrupt_safetensors_names_the_file(checkpoint, damage):
  data = (checkpoint / "model.safetensors").read_bytes()
  if damage == "header":
    data = data[:8] + b"#" + data[9:]
  else:
    data = data[: len(data) - 1000]
  (checkpoint / "model.safetensors").write_bytes(data)
  with pytest.raises(ValueError, match=r"ckpt/model\.safetensors: not a readable safetensors"):
    jaxspec.load_pretrained(checkpoint)


# --------------------------------------------------------------------------------------------------
# Issue 14: a checkpoint without MTP weights (as transformers' save_pretrained writes it).


def test_checkpoint_without_mtp_weights_loads_with_a_warning_that_says_why(checkpoint):
  _rewrite(checkpoint, lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.3.")])
  with pytest.warns(UserWarning, match=r"no MTP weights.*transformers' save_pretrained drops"):
    model = jaxspec.load_pretrained(checkpoint, dtype=jnp.float32)
  assert isinstance(model.config, jaxspec.GlmConfig)
  assert model.mtp is None and model.config.num_nextn_predict_layers == 0
  reason = weights.missing_mtp_reason(model)
  assert "num_nextn_predict_layers = 1" in reason and "speculative decoding" in reason
  full = jaxspec.load_pretrained(FIXTURES / "glm4_moe_a", dtype=jnp.float32)
  assert weights.missing_mtp_reason(full) is None
  ids = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
  np.testing.assert_array_equal(model(ids), full(ids))
  # Asking for speculative decoding says the MTP weights are missing, not that the config is bad.
  with pytest.raises(ValueError, match=r"MTP layer.*no MTP weights.*transformers' save_pretrained"):
    SpeculativeGenerator(model, EngineConfig(max_seq_len=32, attention_impl="xla"))


def test_partial_mtp_layer_is_a_missing_tensor_error(checkpoint):
  _rewrite(checkpoint, lambda t: t.pop("model.layers.3.eh_proj.weight"))
  with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.layers\.3\.eh_proj\.weight"):
    jaxspec.load_pretrained(checkpoint)


# --------------------------------------------------------------------------------------------------
# Issue 14: the manifest.


def test_save_writes_a_manifest_of_every_file(tmp_path, small_models):
  tokenizer = b'{"model": "a tokenizer"}'
  jaxspec.save_pretrained(
    small_models[0], tmp_path / "ckpt", extra_files={"tokenizer.json": tokenizer}
  )
  manifest = json.loads((tmp_path / "ckpt" / MANIFEST).read_text())
  on_disk = _file_digests(tmp_path / "ckpt")
  assert set(manifest["files"]) == set(on_disk) - {MANIFEST}
  assert set(on_disk) == {"config.json", "model.safetensors", "tokenizer.json", MANIFEST}
  for name, record in manifest["files"].items():
    assert record["sha256"] == on_disk[name]
    assert record["size"] == (tmp_path / "ckpt" / name).stat().st_size
  assert (tmp_path / "ckpt" / "tokenizer.json").read_bytes() == tokenizer


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_manifest_mismatch_names_the_file(tmp_path, small_models, name):
  jaxspec.save_pretrained(small_models[0], tmp_path)
  data = bytearray((tmp_path / name).read_bytes())
  data[-3] ^= 0x01  # same size, different content
  (tmp_path / name).write_bytes(bytes(data))
  with pytest.raises(ValueError, match=rf"{name} does not match its SHA-256 in {MANIFEST}"):
    jaxspec.load_pretrained(tmp_path)


def test_manifest_size_mismatch_names_the_file_even_without_checksums(tmp_path, small_models):
  jaxspec.save_pretrained(small_models[0], tmp_path)
  with open(tmp_path / "model.safetensors", "ab") as f:
    f.write(b"\0")
  with pytest.raises(ValueError, match=r"model\.safetensors has \d+ bytes but .* records"):
    jaxspec.load_pretrained(tmp_path, verify_checksums=False)


def test_weights_file_the_manifest_does_not_list_is_refused(tmp_path, small_models):
  jaxspec.save_pretrained(small_models[0], tmp_path)
  shutil.copy(tmp_path / "model.safetensors", tmp_path / "model_old.safetensors")
  with pytest.raises(ValueError, match=r"model_old\.safetensors not listed in jaxspec_manifest"):
    jaxspec.load_pretrained(tmp_path)


@pytest.mark.parametrize(
  "text, error",
  [
    ("{", "the checkpoint manifest is not valid JSON"),
    ('{"format": "jaxspec-checkpoint", "version": 2, "files": {}}', "manifest version 2"),
    ('{"format": "jaxspec-checkpoint", "version": 1, "files": {"../x": {}}}', "not inside"),
  ],
)
def test_bad_manifest_names_the_file(tmp_path, small_models, text, error):
  jaxspec.save_pretrained(small_models[0], tmp_path)
  (tmp_path / MANIFEST).write_text(text)
  with pytest.raises(ValueError, match=rf"{MANIFEST}: .*{error}"):
    jaxspec.load_pretrained(tmp_path)


# --------------------------------------------------------------------------------------------------
# Issue 14: saving replaces a checkpoint whole, keeps the user's files, uses usual permissions.


def test_save_uses_the_usual_permissions(tmp_path, small_models):
  previous = os.umask(0o022)
  try:
    jaxspec.save_pretrained(small_models[0], tmp_path / "ckpt", extra_files={"t.json": b"{}"})
  finally:
    os.umask(previous)
  assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o755
  modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "ckpt").iterdir()}
  assert modes == dict.fromkeys(modes, 0o644) and "model.safetensors" in modes


def test_save_over_a_checkpoint_removes_only_what_it_owned(tmp_path, small_models):
  old, new = small_models
  path = tmp_path / "ckpt"
  jaxspec.save_pretrained(old, path, max_shard_bytes=20_000, extra_files={"vocab.txt": b"old"})
  (path / "README.md").write_text("my notes")
  (path / "runs").mkdir()
  (path / "runs" / "log.txt").write_text("a log")
  os.chmod(path, 0o750)
  jaxspec.save_pretrained(new, path)
  assert sorted(p.name for p in path.iterdir()) == [
    "README.md",
    "config.json",
    MANIFEST,
    "model.safetensors",
    "runs",
  ]
  assert (path / "README.md").read_text() == "my notes"
  assert (path / "runs" / "log.txt").read_text() == "a log"
  assert path.stat().st_mode & 0o777 == 0o750
  assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging directory left
  _assert_same_params(new, jaxspec.load_pretrained(path, dtype=jnp.float32))


def test_save_keeps_a_file_the_user_rewrote_after_the_previous_save(tmp_path, small_models):
  path = tmp_path / "ckpt"
  jaxspec.save_pretrained(small_models[0], path, extra_files={"tokenizer.json": b"saved"})
  (path / "tokenizer.json").write_bytes(b"user's")
  later = (path / MANIFEST).stat().st_mtime_ns + 10**9
  os.utime(path / "tokenizer.json", ns=(later, later))
  jaxspec.save_pretrained(small_models[1], path)
  assert (path / "tokenizer.json").read_bytes() == b"user's"
  assert "tokenizer.json" not in json.loads((path / MANIFEST).read_text())["files"]


def test_save_refuses_weight_files_it_does_not_own(tmp_path, small_models):
  path = tmp_path / "ckpt"
  shutil.copytree(FIXTURES / "glm4_moe_a", path)
  shutil.copy(path / "model.safetensors", path / "model_old.safetensors")
  before = _file_digests(path)
  with pytest.raises(ValueError, match=r"holds model_old\.safetensors, which no earlier save"):
    jaxspec.save_pretrained(small_models[0], path)
  assert _file_digests(path) == before
  assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_save_over_a_foreign_checkpoint_replaces_same_named_files(tmp_path, small_models):
  path = tmp_path / "ckpt"
  shutil.copytree(FIXTURES / "glm4_moe_a", path)
  jaxspec.save_pretrained(small_models[0], path)
  assert (path / "reference.npz").exists() and (path / "generation_config.json").exists()
  _assert_same_params(small_models[0], jaxspec.load_pretrained(path, dtype=jnp.float32))


def test_save_through_a_symlinked_directory_keeps_the_link(tmp_path, small_models):
  jaxspec.save_pretrained(small_models[0], tmp_path / "real")
  (tmp_path / "link").symlink_to(tmp_path / "real")
  jaxspec.save_pretrained(small_models[1], tmp_path / "link")
  assert (tmp_path / "link").is_symlink()
  _assert_same_params(
    small_models[1], jaxspec.load_pretrained(tmp_path / "real", dtype=jnp.float32)
  )


def test_save_into_the_working_directory_leaves_the_process_in_the_new_one(
  tmp_path, small_models, monkeypatch
):
  path = tmp_path / "ckpt"
  jaxspec.save_pretrained(small_models[0], path)
  monkeypatch.chdir(path)
  jaxspec.save_pretrained(small_models[1], ".")
  assert os.path.samefile(os.getcwd(), path)
  Path("notes.txt").write_text("written after the save")
  assert (path / "notes.txt").exists()


_SAVE_STEPS = ("_write_file", "_carry_over", "_swap_in", "_retire")


def _count_save_steps(monkeypatch, fail_at: int | None, error: BaseException):
  """Wraps every step of a save; the call number `fail_at` raises `error` instead of running."""
  calls = []
  for step in _SAVE_STEPS:
    original = getattr(weights, step)

    def wrapped(*args, _original=original, _step=step, **kwargs):
      calls.append(_step)
      if len(calls) - 1 == fail_at:
        raise error
      return _original(*args, **kwargs)

    monkeypatch.setattr(weights, step, wrapped)
  return calls


def _save_scenario(path, model, **kwargs):
  jaxspec.save_pretrained(
    model, path, max_shard_bytes=100_000, extra_files={"tokenizer.json": b"tok"}, **kwargs
  )


@pytest.fixture(scope="module")
def interrupt_states(tmp_path_factory, small_models):
  """The directory states an interrupted save may leave: the old checkpoint (with a user file) and
  the new one (with the same user file), and the steps of a full save."""
  base = tmp_path_factory.mktemp("states")
  old, new = base / "old", base / "new"
  _save_scenario(old, small_models[0])
  (old / "notes.txt").write_text("user file")
  shutil.copytree(old, new)
  with pytest.MonkeyPatch.context() as monkeypatch:
    steps = _count_save_steps(monkeypatch, None, RuntimeError())
    _save_scenario(new, small_models[1])
  return _file_digests(old), _file_digests(new), list(steps)


def test_interrupt_at_any_step_leaves_the_old_or_the_new_checkpoint(
  tmp_path, small_models, interrupt_states, monkeypatch
):
  """Ctrl-C (a BaseException, so also any Exception) before each write, the carrying over of the
  user's files, the swap and the clean-up."""
  old_state, new_state, steps = interrupt_states
  assert steps.count("_write_file") == len(old_state) - 1 and "_swap_in" in steps
  assert len([f for f in old_state if f.endswith(".safetensors")]) > 2
  error = KeyboardInterrupt()
  for fail_at, step in enumerate(steps):
    path = tmp_path / f"ckpt{fail_at}"
    _save_scenario(path, small_models[0])
    (path / "notes.txt").write_text("user file")
    with monkeypatch.context() as m:
      _count_save_steps(m, fail_at, error)
      with pytest.raises(type(error)):
        _save_scenario(path, small_models[1])
    state = _file_digests(path)
    expected = new_state if step == "_retire" else old_state
    assert state == expected, f"interrupted at step {fail_at} ({step})"
  leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
  assert len(leftovers) == 1 and "jaxspec-staging" in leftovers[0]  # the old dir, at _retire


def test_interrupted_first_save_leaves_nothing(tmp_path, small_models, monkeypatch):
  _count_save_steps(monkeypatch, 2, KeyboardInterrupt())
  with pytest.raises(KeyboardInterrupt):
    _save_scenario(tmp_path / "ckpt", small_models[0])
  assert list(tmp_path.iterdir()) == []


def test_save_without_atomic_exchange_falls_back_to_two_renames(
  tmp_path, small_models, monkeypatch
):
  monkeypatch.setattr(weights, "_exchange", lambda first, second: False)
  path = tmp_path / "ckpt"
  jaxspec.save_pretrained(small_models[0], path)
  (path / "notes.txt").write_text("user file")
  old_state = _file_digests(path)
  renames = []
  real_rename = os.rename

  def second_rename_fails(source, destination):
    renames.append(source)
    if len(renames) == 2:
      raise KeyboardInterrupt
    real_rename(source, destination)

  monkeypatch.setattr(weights.os, "rename", second_rename_fails)
  with pytest.raises(KeyboardInterrupt):
    jaxspec.save_pretrained(small_models[1], path)
  assert _file_digests(path) == old_state
  monkeypatch.setattr(weights.os, "rename", real_rename)
  jaxspec.save_pretrained(small_models[1], path)
  assert (path / "notes.txt").read_text() == "user file"
  assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
  _assert_same_params(small_models[1], jaxspec.load_pretrained(path, dtype=jnp.float32))


@pytest.mark.parametrize("name", ["config.json", "model-1.safetensors", "../x", "a/b", ""])
def test_extra_file_names_are_checked(tmp_path, small_models, name):
  with pytest.raises(ValueError, match="extra_files"):
    jaxspec.save_pretrained(small_models[0], tmp_path / "ckpt", extra_files={name: b""})
  assert not (tmp_path / "ckpt").exists()
