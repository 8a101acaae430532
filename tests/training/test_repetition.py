"""DITTO's pseudo-repetitive windows and loss (`jaxspec.training.repetition`)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.training import cli, repetition, trainer


def test_repeated_windows_follow_natural_text_with_one_span_of_it_repeated():
  stream = jnp.arange(1000, dtype=jnp.int32) * 7  # distinct tokens: a row's content locates it
  window = 200
  windows, spans, prefixes = repetition.repeated_windows(stream, jax.random.key(0), 32, window)
  windows, spans, prefixes = map(np.asarray, (windows, spans, prefixes))
  assert windows.shape == (32, window) and spans.shape == prefixes.shape == (32,)
  low, high = repetition.SPAN_TOKENS[0], window // 4
  assert ((spans >= low) & (spans <= high)).all() and len(set(spans.tolist())) > 1
  assert ((prefixes >= 0) & (prefixes <= window // 2)).all() and len(set(prefixes.tolist())) > 1
  for row, span, prefix in zip(windows, spans, prefixes, strict=True):
    start = row[prefix] // 7  # the span's first token
    # The prefix is the text just before the span, and the span repeats with period `span`.
    np.testing.assert_array_equal(
      row[: prefix + span], np.asarray(stream[start - prefix : start + span])
    )
    np.testing.assert_array_equal(row[prefix + span :], row[prefix:-span])


@pytest.mark.parametrize("window, message", [(15, "window must be at least 16"), (64, "too short")])
def test_repeated_windows_refuse_what_cannot_hold_two_occurrences(window, message):
  with pytest.raises(ValueError, match=message):
    repetition.repeated_windows(jnp.arange(40, dtype=jnp.int32), jax.random.key(0), 2, window)


def _numpy_loss(logits, windows, spans, prefixes, lam):
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  total, count = 0.0, 0
  for r, (span, prefix) in enumerate(zip(spans, prefixes, strict=True)):
    # Token j = t + 1 in the second occurrence or later, its previous occurrence predicted too.
    for t in range(max(prefix + span - 1, span), logits.shape[1]):
      p = probs[r, t, windows[r, t + 1]]
      p_previous = probs[r, t - span, windows[r, t + 1 - span]]
      total += -np.log(1.0 - abs(p - lam * p_previous))
      count += 1
  return total / count


def test_the_loss_is_ditto_s_formula_over_the_positions_with_a_previous_occurrence():
  rows, seq_len, vocab = 6, 160, 11
  stream = jnp.asarray(np.random.default_rng(0).integers(0, vocab, 500), jnp.int32)
  windows, spans, prefixes = repetition.repeated_windows(
    stream, jax.random.key(1), rows, seq_len + 1
  )
  # A row without a prefix too: there the first token of the second occurrence has no predicted
  # previous occurrence (the formula holds for any spans and prefixes, consistent or not).
  prefixes = prefixes.at[0].set(0)
  # Sharp logits so that the probabilities span (0, 1), not just values near 1 / vocab.
  logits = 4.0 * jax.random.normal(jax.random.key(2), (rows, seq_len, vocab))
  got = repetition.self_reinforcement_loss(logits, windows, spans, prefixes, 0.5)
  want = _numpy_loss(
    np.asarray(logits, np.float64), *map(np.asarray, (windows, spans, prefixes)), 0.5
  )
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_a_gradient_step_lowers_the_loss_and_leaves_the_prefix_and_first_occurrence_alone():
  """The previous repetition's probability is a stop-gradient target: only the positions that
  are counted (the second occurrence on) get a gradient, and a small step against it lowers
  the loss."""
  stream = jnp.asarray(np.random.default_rng(3).integers(0, 9, 300), jnp.int32)
  windows, spans, prefixes = repetition.repeated_windows(stream, jax.random.key(4), 4, 97)
  logits = 3.0 * jax.random.normal(jax.random.key(5), (4, 96, 9))

  def loss(logits):
    return repetition.self_reinforcement_loss(logits, windows, spans, prefixes, 0.5)

  grad = jax.grad(loss)(logits)
  assert float(loss(logits - 0.5 * grad)) < float(loss(logits))
  positions = np.arange(96)[None, :]
  spans, prefixes = np.asarray(spans)[:, None], np.asarray(prefixes)[:, None]
  uncounted = (positions + 1 < prefixes + spans) | (positions < spans)  # [4, 96]
  assert np.abs(np.asarray(grad))[uncounted].max() == 0.0
  assert np.abs(np.asarray(grad))[~uncounted].max() > 0.0


def test_a_train_step_with_repeated_rows_reports_the_repetition_loss():
  config = dataclasses.replace(cli.SMOKE, batch_size=4, repetition_rows=2)
  model = trainer.Trainer(trainer.smoke_model_config(512), config)
  stream = jnp.asarray(np.random.default_rng(6).integers(0, 512, 4000), jnp.int32)
  metrics = model.train_step(stream, jax.random.key(0), 1e-3)
  assert np.isfinite(float(metrics["repetition_loss"])) and float(metrics["repetition_loss"]) > 0
  # Without repeated rows there is no such metric: test_training's smoke run checks its log.


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(repetition_rows=4), r"repetition_rows must be in \[0, batch_size\)"),
    (dict(repetition_rows=-1), "repetition_rows"),
    (dict(repetition_lambda=1.5), "repetition_lambda must be in"),
  ],
)
def test_bad_repetition_settings_are_clear_errors(changes, message):
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(cli.SMOKE, **changes)


class _FakeModel:
  """Logits from the ids alone: `copy_back` > 0 puts all mass on the token `copy_back - 1`
  positions back (a perfect copier of a span of that length); 0 gives uniform logits. With
  `shortcut`, rows whose context repeats from its first token get uniform logits: the model
  that DITTO's windows taught when they had no prefix of natural text."""

  def __init__(self, vocab: int, copy_back: int, shortcut: bool = False):
    self.vocab, self.copy_back, self.shortcut = vocab, copy_back, shortcut

  def forward(self, ids, step):
    del step
    if not self.copy_back:
      return jnp.zeros(ids.shape + (self.vocab,)), None
    source = jnp.roll(ids, self.copy_back - 1, axis=1)  # source[t] = ids[t - copy_back + 1]
    logits = 50.0 * jax.nn.one_hot(source, self.vocab)
    if self.shortcut:
      period = self.copy_back
      loops_from_start = jnp.all(ids[:, :period] == ids[:, period : 2 * period], axis=1)
      logits = jnp.where(loops_from_start[:, None, None], 0.0, logits)
    return logits, None

  def logits(self, hidden):
    return hidden


def test_repetition_profile_reads_occurrences_two_to_the_last():
  stream = np.random.default_rng(7).integers(0, 20, 400)
  kernels = trainer.training_kernels("cpu")
  uniform = repetition.repetition_profile(_FakeModel(20, 0), stream, kernels, repeats=5)
  np.testing.assert_allclose(uniform["probability"], [1 / 20] * 4, rtol=1e-5)
  # A copier of 12-token spans predicts every token from the second occurrence on, and none of
  # the first: a slice reaching back into the first occurrence would pull the first value below 1.
  copier = repetition.repetition_profile(_FakeModel(20, 12), stream, kernels, span=12)
  assert len(copier["probability"]) == len(copier["argmax"]) == 9
  assert min(copier["probability"]) > 0.999 and min(copier["argmax"]) == 1.0


def test_the_argmax_share_counts_the_tokens_greedy_decoding_would_repeat():
  """Uniform logits put the argmax on token 0: the share is the span tokens equal to 0."""
  stream = np.random.default_rng(9).integers(0, 4, 400)
  kernels = trainer.training_kernels("cpu")
  profile = repetition.repetition_profile(_FakeModel(4, 0), stream, kernels, span=12, rows=256)
  np.testing.assert_allclose(profile["probability"], [1 / 4] * 9, rtol=1e-5)
  # Every occurrence of a span holds the same tokens, so the share is one value, near 1/4.
  assert len(set(profile["argmax"])) == 1 and 0.2 < profile["argmax"][0] < 0.3


def test_repetition_profile_sees_through_a_model_that_breaks_only_loops_from_the_start():
  stream = np.random.default_rng(8).integers(0, 20, 400)
  kernels = trainer.training_kernels("cpu")
  model = _FakeModel(20, 12, shortcut=True)
  after_text = repetition.repetition_profile(model, stream, kernels, span=12)
  from_start = repetition.repetition_profile(model, stream, kernels, span=12, prefix=0)
  assert min(after_text["probability"]) > 0.999 and min(after_text["argmax"]) == 1.0
  np.testing.assert_allclose(from_start["probability"], [1 / 20] * 9, rtol=1e-5)
