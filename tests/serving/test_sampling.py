"""Sampling filters: temperature, top-k and top-p keep exactly the tokens they should."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.serving.sampling import SamplingParams, sample, sampling_probs

LOGITS = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]], jnp.float32))


def test_greedy_is_argmax():
  assert int(sample(LOGITS, jax.random.key(0), SamplingParams())[0]) == 0
  np.testing.assert_array_equal(sampling_probs(LOGITS, SamplingParams()), [[1, 0, 0, 0, 0]])


def test_top_k_keeps_k_most_likely():
  probs = np.asarray(sampling_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2)))
  np.testing.assert_allclose(probs, [[0.5 / 0.7, 0.2 / 0.7, 0, 0, 0]], rtol=1e-6)


def test_top_p_keeps_the_token_that_crosses_the_threshold():
  # 0.5 + 0.2 = 0.7 < 0.75, so 0.15 is needed to reach 0.75: three tokens stay.
  probs = np.asarray(sampling_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.75)))
  np.testing.assert_allclose(probs, [[0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0]], rtol=1e-6)


def test_temperature_sharpens():
  probs = np.asarray(sampling_probs(LOGITS, SamplingParams(temperature=0.5)))
  expected = np.array([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
  np.testing.assert_allclose(probs[0], expected / expected.sum(), rtol=1e-5)


def test_samples_follow_the_filtered_distribution():
  params = SamplingParams(temperature=1.0, top_k=3)
  keys = jax.random.split(jax.random.key(0), 20000)
  draws = np.asarray(jax.vmap(lambda k: sample(LOGITS[0], k, params))(keys))
  assert set(np.unique(draws)) <= {0, 1, 2}
  freq = np.bincount(draws, minlength=5)[:3] / draws.size
  # Binomial standard error at n = 20000 is below 0.0036; 5 sigma bounds false failures < 1e-6.
  np.testing.assert_allclose(freq, np.array([0.5, 0.2, 0.15]) / 0.85, atol=0.018)


@pytest.mark.parametrize(
  ("bad", "message"),
  [
    (dict(temperature=-1.0), "temperature must be"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(top_p=0.0), "top_p must be in"),
  ],
)
def test_bad_params_are_rejected(bad, message):
  with pytest.raises(ValueError, match=message):
    SamplingParams(**bad)


@pytest.mark.parametrize(
  "field, value",
  [
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", -0.1),
    ("temperature", "0.7"),
    ("top_k", 2.5),
    ("top_k", True),
    ("top_k", -1),
    ("top_p", float("nan")),
    ("top_p", 0.0),
    ("top_p", 1.5),
  ],
)
def test_bad_sampling_params_are_named(field, value):
  with pytest.raises(ValueError, match=field):
    SamplingParams(**{field: value})
