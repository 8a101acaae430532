"""Greedy acceptance and speculative (rejection) sampling, on synthetic distributions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.serving.acceptance import greedy_accept, rejection_sample


def _one_hot_logits(tokens, vocab=8):
  return jax.nn.one_hot(jnp.asarray(tokens), vocab) * 10.0


def test_greedy_accepts_the_matching_prefix_and_adds_the_bonus():
  target = _one_hot_logits([[3, 5, 1, 6], [2, 2, 2, 2], [4, 0, 7, 7]])  # argmax per row
  drafts = jnp.array([[3, 5, 0], [2, 2, 2], [1, 0, 7]], jnp.int32)
  num_accepted, tokens = greedy_accept(target, drafts)
  np.testing.assert_array_equal(num_accepted, [2, 3, 0])
  np.testing.assert_array_equal(tokens, [[3, 5, 1, -1], [2, 2, 2, 2], [4, -1, -1, -1]])


def _random_dist(rng, shape):
  logits = rng.normal(size=shape) * 1.5
  probs = np.exp(logits)
  return probs / probs.sum(-1, keepdims=True)


@pytest.mark.parametrize("num_draft", [1, 3])
def test_rejection_sampling_reproduces_the_target_distribution(num_draft):
  """Speculative sampling must emit tokens distributed exactly as the target's.

  Target rows p_j are fixed; the draft proposes from a different q_j. Over N = 200000 trials the
  first emitted token must follow p_0, and the second (when the first draft was accepted, so it
  is drawn at row 1) p_1. A chi-square test at a 1e-6 false-failure rate per check, with a fixed
  seed, so the test is deterministic.
  """
  vocab, trials = 5, 200_000
  rng = np.random.default_rng(num_draft)
  target = _random_dist(rng, (num_draft + 1, vocab)).astype(np.float32)
  draft = _random_dist(rng, (num_draft, vocab)).astype(np.float32)

  def trial(key):
    draft_key, accept_key = jax.random.split(key)
    drafts = jax.random.categorical(draft_key, jnp.log(draft), axis=-1).astype(jnp.int32)
    return rejection_sample(target[None], draft[None], drafts[None], accept_key)

  num_accepted, tokens = jax.vmap(trial)(jax.random.split(jax.random.key(0), trials))
  num_accepted, tokens = np.asarray(num_accepted)[:, 0], np.asarray(tokens)[:, 0]
  # chi-square critical value for 4 degrees of freedom at p = 1e-6.
  critical = 33.4

  def chi_square(samples, expected):
    observed = np.bincount(samples, minlength=vocab)
    expected = expected * samples.size
    return float(np.sum((observed - expected) ** 2 / expected))

  assert chi_square(tokens[:, 0], target[0]) < critical
  if num_draft > 1:
    second = tokens[num_accepted >= 1, 1]
    assert chi_square(second, target[1]) < critical
  # The acceptance rate of draft 0 is sum_x min(p, q): the overlap of the two distributions.
  overlap = np.minimum(target[0], draft[0]).sum()
  assert abs(np.mean(num_accepted >= 1) - overlap) < 5 * np.sqrt(overlap * (1 - overlap) / trials)


def test_identical_distributions_accept_everything():
  dist = np.full((1, 3, 4), 0.25, np.float32)
  drafts = jnp.array([[1, 2]], jnp.int32)
  num_accepted, tokens = rejection_sample(dist, dist[:, :2], drafts, jax.random.key(1))
  assert int(num_accepted[0]) == 2 and tokens[0, :2].tolist() == [1, 2] and tokens[0, 2] >= 0
