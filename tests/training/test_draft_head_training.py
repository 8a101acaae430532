"""Training the MTP draft head alone and on the target's own predictions (self-distillation)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.model.metadata import StepMetadata
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.training import cli, trainer

VOCAB = 64


def _model(seed: int = 0) -> GlmForCausalLM:
  return GlmForCausalLM(trainer.smoke_model_config(VOCAB), dtype=jnp.float32, rngs=nnx.Rngs(seed))


def _leaves(params) -> dict[str, np.ndarray]:
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {jax.tree_util.keystr(path): np.array(value) for path, value in flat}


def test_draft_teacher_is_the_targets_prediction_of_the_drafted_token():
  model = _model()
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 1, VOCAB)  # [B, T]
  kernels = trainer.training_kernels("cpu")
  hidden, _ = model.forward(tokens, StepMetadata.plain(tokens, kernels))
  logits = model.logits(hidden)  # [B, T, V]
  for depth in (1, 2, 3):
    teacher = trainer.draft_teacher(logits, depth)
    assert teacher.shape == (2, 12 - depth, VOCAB)
    for t in (0, 4, 11 - depth):
      # MTP row t at this depth drafts token t + depth + 1: the target predicts it from the
      # prefix up to token t + depth.
      prefix = tokens[:, : t + depth + 1]
      prefix_hidden, _ = model.forward(prefix, StepMetadata.plain(prefix, kernels))
      expected = jax.nn.softmax(model.logits(prefix_hidden)[:, -1], axis=-1)
      np.testing.assert_allclose(teacher[:, t], expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mtp_labels", trainer.MTP_LABELS)
def test_draft_head_only_trains_the_mtp_layer_and_leaves_the_rest_bit_for_bit(mtp_labels):
  config = dataclasses.replace(
    cli.SMOKE,
    init_from="a trained checkpoint",  # the trainer takes the model below; only checked set
    draft_head_only=True,
    mtp_labels=mtp_labels,
  )
  stream = jax.random.randint(jax.random.key(2), (4096,), 1, VOCAB)
  frozen_run = trainer.Trainer(trainer.smoke_model_config(VOCAB), config, _model())
  joint_run = trainer.Trainer(
    trainer.smoke_model_config(VOCAB),
    dataclasses.replace(config, draft_head_only=False, init_from=None),
    _model(),
  )
  before = _leaves(frozen_run.params)
  for step in range(3):
    key = jax.random.key(step)
    metrics = frozen_run.train_step(stream, key, 1e-3)
    assert np.isfinite(float(metrics["loss"]))
    joint_run.train_step(stream, key, 1e-3)
  frozen, joint = _leaves(frozen_run.params), _leaves(joint_run.params)
  trained = {name for name, value in before.items() if not np.array_equal(joint[name], value)}
  # Without the freeze the same steps move the target too (the router's correction bias has no
  # gradient and moves in neither run): the checks below can fail.
  assert any(not name.startswith("['mtp']") for name in trained)
  for name, value in before.items():
    if not name.startswith("['mtp']"):
      assert np.array_equal(frozen[name], value), f"{name} changed under draft_head_only"
    elif name in trained:
      assert not np.array_equal(frozen[name], value), f"{name} did not train"


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(draft_head_only=True), "set init_from"),
    (dict(draft_head_only=True, init_from="x", repetition_rows=2), "repetition_rows trains"),
    (dict(draft_head_only=True, init_from="x", unlikelihood_rows=1), "unlikelihood_rows trains"),
    (dict(mtp_labels="teacher"), "mtp_labels must be one of"),
  ],
)
def test_bad_draft_head_settings_are_a_clear_error(changes, message):
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(cli.SMOKE, **changes)


def test_the_command_line_takes_the_draft_head_options(capsys, tmp_path):
  parser_args = ["train", "--smoke", "--output-dir", str(tmp_path / "x"), "--no-progress"]
  with pytest.raises(SystemExit) as exit_info:
    cli.main(parser_args + ["--draft-head-only"])
  assert exit_info.value.code == 2
  assert "draft_head_only trains the MTP layer of a trained target" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main(parser_args + ["--mtp-labels", "teacher"])
  assert "invalid choice: 'teacher'" in capsys.readouterr().err
