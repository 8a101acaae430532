"""`scripts/interpolate_checkpoints.py`: WiSE-FT weight interpolation between two checkpoints."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec.__main__ import DEFAULT_MODEL


@pytest.fixture(scope="module")
def script(load_script):
  return load_script("interpolate_checkpoints")


def _leaves(model):
  return [np.asarray(x, np.float32) for x in jax.tree.leaves(nnx.state(model))]


@pytest.fixture(scope="module")
def tuned_dir(tmp_path_factory):
  """The embedded model with every parameter moved by noise: a stand-in second phase."""
  model = jaxspec.load_pretrained(DEFAULT_MODEL, dtype=jnp.float32)
  graph, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state)
  # Noise drawn in NumPy: jax.random and the eager sums compile a program per parameter shape.
  rng = np.random.default_rng(0)
  moved = [
    jnp.asarray((np.asarray(x) + 0.05 * rng.standard_normal(x.shape)).astype(x.dtype))
    for x in leaves
  ]
  path = tmp_path_factory.mktemp("tuned") / "ckpt"
  jaxspec.save_pretrained(
    nnx.merge(graph, jax.tree.unflatten(treedef, moved)),
    path,
    dtype=jnp.bfloat16,
    extra_files={"tokenizer.json": DEFAULT_MODEL / "tokenizer.json"},
  )
  return path


def test_interpolate_weights_each_parameter_and_leaves_the_inputs_unchanged(script, tuned_dir):
  base = jaxspec.load_pretrained(DEFAULT_MODEL, dtype=jnp.float32)
  tuned = jaxspec.load_pretrained(tuned_dir, dtype=jnp.float32)
  base_before, tuned_before = _leaves(base), _leaves(tuned)
  assert any(not np.array_equal(a, b) for a, b in zip(base_before, tuned_before, strict=True))
  for alpha in (0.0, 0.3, 1.0):
    mixed = _leaves(script.interpolate(base, tuned, alpha))
    for m, a, b in zip(mixed, base_before, tuned_before, strict=True):
      np.testing.assert_allclose(m, (1 - alpha) * a + alpha * b, rtol=1e-6, atol=1e-7)
  for a, b in zip(_leaves(base), base_before, strict=True):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="alpha must be in"):
    script.interpolate(base, tuned, 1.5)


def test_main_writes_a_checkpoint_of_the_interpolated_weights_with_the_base_tokenizer(
  script, tuned_dir, tmp_path
):
  out = tmp_path / "mixed"
  assert script.main([str(DEFAULT_MODEL), str(tuned_dir), "--alpha", "0.4", "--out", str(out)]) == 0
  assert (out / "tokenizer.json").read_bytes() == (DEFAULT_MODEL / "tokenizer.json").read_bytes()
  written = _leaves(jaxspec.load_pretrained(out, dtype=jnp.float32))
  base = jaxspec.load_pretrained(DEFAULT_MODEL, dtype=jnp.float32)
  tuned = jaxspec.load_pretrained(tuned_dir, dtype=jnp.float32)
  expected = script.interpolate(base, tuned, 0.4)
  expected = _leaves(expected)
  for w, e in zip(written, expected, strict=True):  # written in bf16 but float32 parameters
    np.testing.assert_allclose(w, e, rtol=2**-8, atol=1e-6)


def test_main_refuses_checkpoints_of_different_models_and_a_bad_alpha(
  script, tuned_dir, tmp_path, capsys
):
  other = tmp_path / "other"
  shutil.copytree(tuned_dir, other)
  config = json.loads((other / "config.json").read_text())
  config["num_hidden_layers"] += 1
  (other / "config.json").write_text(json.dumps(config))
  for args, message in [
    ([str(DEFAULT_MODEL), str(other), "--alpha", "0.5"], "differ: not two checkpoints"),
    ([str(DEFAULT_MODEL), str(tuned_dir), "--alpha", "1.5"], "--alpha must be in"),
    ([str(DEFAULT_MODEL), str(tmp_path / "none"), "--alpha", "0.5"], "does not exist"),
  ]:
    with pytest.raises(SystemExit):
      script.main([*args, "--out", str(tmp_path / "out")])
    assert message in capsys.readouterr().err
  assert not (tmp_path / "out").exists()
