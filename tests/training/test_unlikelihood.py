"""Sequence-level unlikelihood on greedy continuations (`jaxspec.training.unlikelihood`)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.model.metadata import KernelChoices
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.training import cli, decoding, trainer, unlikelihood


def _numpy_mask(tokens, start, n):
  mask = np.zeros(tokens.shape, bool)
  for row in range(tokens.shape[0]):
    grams = {}
    for t in range(n - 1, tokens.shape[1]):
      gram = tuple(tokens[row, t - n + 1 : t + 1])
      mask[row, t] = t >= start and gram in grams
      grams.setdefault(gram, t)
  return mask


@pytest.mark.parametrize("n", [1, 3, 8])
def test_the_mask_marks_continuation_tokens_that_complete_an_earlier_n_gram(n):
  rng = np.random.default_rng(n)
  tokens = rng.integers(0, 6, (5, 40))  # a small vocabulary: chance repeats of every length
  tokens[0, 20:30] = tokens[0, 2:12]  # a copy of the prefix
  tokens[1] = np.tile(np.arange(8), 5)  # a loop
  mask = np.asarray(unlikelihood.repeated_ngram_mask(jnp.asarray(tokens), 16, n))
  np.testing.assert_array_equal(mask, _numpy_mask(tokens, 16, n))
  assert mask[1, 16:].all()
  assert not mask[:, :16].any()


def test_the_loss_is_the_mean_over_continuation_tokens_of_minus_log_one_minus_p():
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, 7, (3, 30))
  logits = 2.0 * rng.standard_normal((3, 29, 7))
  mask = rng.random((3, 30)) < 0.3
  mask[:, :10] = False
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  p = np.take_along_axis(probs, tokens[:, 1:, None], axis=-1)[..., 0]
  expected = -np.log(1 - p)[mask[:, 1:]].sum() / (3 * 20)
  got = unlikelihood.unlikelihood_loss(jnp.asarray(logits), jnp.asarray(tokens), mask, 10)
  assert float(got) == pytest.approx(expected, rel=1e-5)


def test_a_gradient_step_lowers_the_marked_tokens_and_touches_nothing_else():
  rng = np.random.default_rng(2)
  tokens = jnp.asarray(rng.integers(0, 5, (2, 24)))
  mask = jnp.asarray(rng.random((2, 24)) < 0.4).at[:, :8].set(False)
  logits = jnp.asarray(rng.standard_normal((2, 23, 5)), jnp.float32)
  grad = jax.grad(lambda x: unlikelihood.unlikelihood_loss(x, tokens, mask, 8))(logits)
  rows_with_grad = np.abs(np.asarray(grad)).sum(-1) > 0  # [2, 23]
  np.testing.assert_array_equal(rows_with_grad, np.asarray(mask[:, 1:]))
  target = np.take_along_axis(np.asarray(grad), np.asarray(tokens)[:, 1:, None], -1)[..., 0]
  assert (target[np.asarray(mask[:, 1:])] > 0).all()  # descent lowers the repeated token


def test_rollouts_are_the_trainer_s_greedy_continuations():
  """The traced decoding loop must decode what the trainer's demos decode: the plain greedy
  loop, one forward per token, over the same prefixes."""
  config = trainer.smoke_model_config(64)
  model = GlmForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(3))
  prefixes = np.random.default_rng(4).integers(1, 64, (3, 7)).astype(np.int32)
  rollouts = jax.jit(lambda p: decoding.greedy_rollouts(model, p, 9, KernelChoices(moe="dense")))(
    jnp.asarray(prefixes)
  )
  expected = trainer.greedy_continuations(model, prefixes.tolist(), [None] * 3, 9)
  np.testing.assert_array_equal(np.asarray(rollouts)[:, :7], prefixes)
  np.testing.assert_array_equal(np.asarray(rollouts)[:, 7:], np.asarray(expected))


def test_a_train_step_decodes_from_stream_prefixes_and_reports_their_repeat_share():
  config = dataclasses.replace(
    cli.SMOKE,
    batch_size=4,
    unlikelihood_rows=3,
    unlikelihood_prefix_tokens=8,
    unlikelihood_new_tokens=24,
    unlikelihood_ngram=2,
  )
  model = trainer.Trainer(trainer.smoke_model_config(512), config)
  # A stream of few distinct tokens, so that the continuations hold repeats to count.
  stream = jnp.asarray(np.random.default_rng(6).integers(0, 8, 4000), jnp.int32)
  key = jax.random.key(0)
  # The rollouts the step must decode: the bf16 model's greedy continuations of the prefixes at
  # the step's start positions (computed before the step donates the parameters).
  starts = jax.random.randint(jax.random.fold_in(key, 2), (3,), 0, 4000 - 8 + 1)
  prefixes = np.asarray(stream)[np.asarray(starts)[:, None] + np.arange(8)]
  compute_model = nnx.merge(model.graphdef, trainer._compute_params(model.params))
  continuations = trainer.greedy_continuations(compute_model, prefixes.tolist(), [None] * 3, 24)
  tokens = np.concatenate([prefixes, np.asarray(continuations)], axis=1)
  expected_share = _numpy_mask(tokens, 8, 2)[:, 8:].mean()

  metrics = model.train_step(stream, key, 1e-3)
  assert float(metrics["rollout_penalised_share"]) == pytest.approx(expected_share)
  assert expected_share > 0
  assert float(metrics["unlikelihood_loss"]) > 0
  assert float(metrics["rollout_malformed_share"]) == 0.0  # no token is malformed by default


def test_malformed_tokens_are_the_ones_that_are_not_utf8_alone():
  pieces = [b"", b"def", b"\xc3", b"\xa9", b"\xc3\xa9", b" \xe2\x82", b"\n    "]
  np.testing.assert_array_equal(
    unlikelihood.malformed_tokens(pieces), [False, False, True, True, False, True, False]
  )


def test_malformed_continuation_tokens_are_penalised_and_the_prefix_is_not():
  tokens = jnp.asarray([[5, 1, 2, 5, 3, 4, 5, 6]])
  malformed = jnp.zeros(8, bool).at[5].set(True)
  mask = unlikelihood.penalised_mask(tokens, 2, 8, malformed)  # no 8-gram can repeat here
  np.testing.assert_array_equal(np.asarray(mask)[0], [0, 0, 0, 1, 0, 0, 1, 0])
  with_repeats = unlikelihood.penalised_mask(tokens, 2, 1, malformed)
  np.testing.assert_array_equal(np.asarray(with_repeats)[0], [0, 0, 0, 1, 0, 0, 1, 0])
  np.testing.assert_array_equal(
    np.asarray(unlikelihood.penalised_mask(jnp.asarray([[1, 2, 1, 2, 1]]), 2, 2, malformed))[0],
    [0, 0, 0, 1, 1],
  )


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(unlikelihood_rows=-1), "unlikelihood_rows must be at least 0"),
    (dict(unlikelihood_weight=float("nan")), "unlikelihood_weight must be at least 0"),
    (dict(unlikelihood_ngram=0), "unlikelihood_ngram must be positive"),
    (dict(unlikelihood_new_tokens=0), "unlikelihood_new_tokens must be positive"),
  ],
)
def test_bad_unlikelihood_settings_are_clear_errors(changes, message):
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(cli.SMOKE, **changes)
