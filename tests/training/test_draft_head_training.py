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


def _target_logits(model, kernels):
  """`model`'s target logits as one jitted function, ids [B, L] -> [B, L, V] (eager forwards
  take seconds each on a CPU)."""

  @jax.jit
  def logits(ids):
    hidden, _ = model.forward(ids, StepMetadata.plain(ids, kernels))
    return model.logits(hidden)

  return logits


def test_draft_teacher_is_the_targets_prediction_of_the_drafted_token():
  model = _model()
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 1, VOCAB)  # [B, T]
  target_logits = _target_logits(model, trainer.training_kernels("cpu"))
  logits = target_logits(tokens)  # [B, T, V]

  def predicted_after(length):  # the target's prediction after the first `length` tokens
    return jax.nn.softmax(target_logits(tokens[:, :length])[:, -1], axis=-1)

  for depth in (1, 2, 3):
    teacher = trainer.draft_teacher(logits, depth)
    assert teacher.shape == (2, 12 - depth, VOCAB)
    for t in (0, 4, 11 - depth):
      # MTP row t at this depth drafts token t + depth + 1: the target predicts it from the
      # prefix up to token t + depth.
      expected = predicted_after(t + depth + 1)
      np.testing.assert_allclose(teacher[:, t], expected, rtol=1e-4, atol=1e-6)


def _draft_head_config(**changes) -> trainer.TrainConfig:
  return dataclasses.replace(
    cli.SMOKE,
    init_from="a trained checkpoint",  # the trainer takes the model below; only checked set
    draft_head_only=True,
    **changes,
  )


_STEPS = 3
_SEQ_LEN = 32


def _stream() -> jax.Array:
  return jax.random.randint(jax.random.key(2), (4096,), 1, VOCAB)


@pytest.fixture(scope="module")
def jointly_trained():
  """The parameters before training, and the names of those that the test's steps move without
  the freeze (joint training, data labels; the router's correction bias has no gradient)."""
  config = dataclasses.replace(cli.SMOKE, seq_len=_SEQ_LEN)
  run = trainer.Trainer(trainer.smoke_model_config(VOCAB), config, _model())
  before, stream = _leaves(run.params), _stream()
  for step in range(_STEPS):
    run.train_step(stream, jax.random.key(step), 1e-3)
  after = _leaves(run.params)
  return before, {name for name, value in before.items() if not np.array_equal(after[name], value)}


@pytest.mark.parametrize("mtp_labels", trainer.MTP_LABELS)
def test_draft_head_only_trains_the_mtp_layer_and_leaves_the_rest_bit_for_bit(
  mtp_labels, jointly_trained
):
  # Greedy text is checked end to end in test_training.py (the CLI phase, bit for bit).
  before, trained = jointly_trained
  config = _draft_head_config(mtp_labels=mtp_labels, seq_len=_SEQ_LEN)
  frozen_run = trainer.Trainer(trainer.smoke_model_config(VOCAB), config, _model())
  start = _leaves(frozen_run.params)  # the joint run's start too, so its trained names apply
  assert start.keys() == before.keys()
  assert all(np.array_equal(start[name], value) for name, value in before.items())
  stream = _stream()
  for step in range(_STEPS):
    metrics = frozen_run.train_step(stream, jax.random.key(step), 1e-3)
    assert np.isfinite(float(metrics["loss"]))
  frozen = _leaves(frozen_run.params)
  # Without the freeze the same steps move the target too: the checks below can fail.
  assert any(not name.startswith("['mtp']") for name in trained)
  for name, value in before.items():
    if not name.startswith("['mtp']"):
      assert np.array_equal(frozen[name], value), f"{name} changed under draft_head_only"
    elif name in trained:
      assert not np.array_equal(frozen[name], value), f"{name} did not train"


def test_greedy_draft_text_is_the_targets_own_continuation_of_a_corpus_prefix():
  prefix = 8
  config = _draft_head_config(draft_text="greedy", seq_len=32, greedy_prefix_tokens=prefix)
  run = trainer.Trainer(trainer.smoke_model_config(VOCAB), config, _model())
  stream = jnp.arange(4096, dtype=jnp.int32) % (VOCAB - 1) + 1  # each prefix placed by its start
  windows, repeats, rollouts = jax.jit(run.sample_batch)(run.params, stream, jax.random.key(5))
  windows = np.asarray(windows)
  assert windows.shape == (config.batch_size, config.seq_len + 1 + config.mtp_depth)
  assert repeats is None and rollouts is None
  for row in windows[:, :prefix]:  # a slice of the stream
    np.testing.assert_array_equal(np.diff(row) % (VOCAB - 1), 1)
  # Every token after the prefix is the target's argmax given the tokens before it, as the
  # training forward (bfloat16 compute copy) sees them.
  model = nnx.merge(run.graphdef, trainer._compute_params(run.params))
  logits = _target_logits(model, run.kernels)(windows)  # [B, T + 1 + depth, V]
  greedy = np.asarray(jnp.argmax(logits[:, prefix - 1 : -1], axis=-1))
  np.testing.assert_array_equal(windows[:, prefix:], greedy)
  assert len(set(map(tuple, windows[:, prefix:]))) > 1  # not one constant continuation


@pytest.mark.parametrize("mtp_labels", trainer.MTP_LABELS)
def test_the_greedy_draft_loss_covers_the_rows_that_draft_the_continuation(mtp_labels):
  """The loss is the mean CE of the MTP rows t >= P - 1 (row t at depth d drafts token t + d + 1,
  the first draft after a P-token prefill comes from row P - 1), computed here row by row; with
  target labels the last d rows have no target row to learn from."""
  prefix = 8
  config = _draft_head_config(
    draft_text="greedy", mtp_labels=mtp_labels, seq_len=32, greedy_prefix_tokens=prefix
  )
  run = trainer.Trainer(trainer.smoke_model_config(VOCAB), config, _model())
  windows = jax.random.randint(jax.random.key(6), (2, 32 + 1 + config.mtp_depth), 1, VOCAB)
  loss, (_, _, mtp_losses, _) = jax.jit(run._loss)(run.params, windows, None, None)
  model = nnx.merge(run.graphdef, trainer._compute_params(run.params))
  logits, mtp_logits = jax.jit(
    lambda w: trainer._joint_logits(model, w, config.mtp_depth, run.kernels)
  )(windows)
  log_probs = [jax.nn.log_softmax(x.astype(jnp.float32), axis=-1) for x in mtp_logits]
  expected = []
  for d in range(1, config.mtp_depth + 1):
    rows = []
    for t in range(prefix - 1, 32 - d if mtp_labels == "target" else 32):
      if mtp_labels == "target":
        teacher = jax.nn.softmax(logits[:, t + d].astype(jnp.float32), axis=-1)
        rows.append(-jnp.sum(teacher * log_probs[d - 1][:, t], axis=-1))
      else:
        rows.append(-log_probs[d - 1][jnp.arange(2), t, windows[:, t + d + 1]])
    expected.append(np.mean(np.stack(rows)))
  np.testing.assert_allclose(mtp_losses, expected, rtol=1e-5)
  np.testing.assert_allclose(loss, np.mean(expected), rtol=1e-5)


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(draft_head_only=True), "set init_from"),
    (dict(draft_head_only=True, init_from="x", repetition_rows=2), "repetition_rows trains"),
    (dict(draft_head_only=True, init_from="x", unlikelihood_rows=1), "unlikelihood_rows trains"),
    (dict(mtp_labels="teacher"), "mtp_labels must be one of"),
    (dict(draft_text="sampled"), "draft_text must be one of"),
    (dict(keep="best"), "keep must be one of"),
    (dict(draft_text="greedy"), "draft_text='greedy' decodes from a frozen target"),
    (
      dict(draft_text="greedy", draft_head_only=True, init_from="x", greedy_prefix_tokens=63),
      r"greedy_prefix_tokens must be in \[1, seq_len - mtp_depth\] = \[1, 62\]",
    ),
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
  with pytest.raises(SystemExit):
    cli.main(parser_args + ["--draft-text", "greedy", "--greedy-prefix-tokens", "16"])
  assert "draft_text='greedy' decodes from a frozen target" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main(parser_args + ["--greedy-prefix-tokens", "16"])
  assert "--greedy-prefix-tokens sets the prefix of --draft-text greedy" in capsys.readouterr().err
