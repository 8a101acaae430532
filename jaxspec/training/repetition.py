"""Pseudo-repetitive training windows and DITTO's loss against self-reinforcing repetition.

Xu et al., "Learning to Break the Loop: Analyzing and Mitigating Repetitions for Neural Text
Generation" (NeurIPS 2022, arXiv:2206.02369): language models raise the probability of repeating
a sentence with every repetition already in the context, which is how greedy decoding falls into
loops. DITTO trains on windows made of one sentence repeated, and at the n-th repetition asks the
probability of each token to be `lam` times its probability at repetition n - 1 (a stop-gradient
target): `loss = -log(1 - |p_n - lam * p_{n-1}|)`. For code a span of tokens plays the sentence.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.model.metadata import StepMetadata

# Spans repeated in a window, in tokens: about one to three lines of Python at ~12 tokens a line.
SPAN_TOKENS = (4, 32)


def repeated_windows(stream: jax.Array, key: jax.Array, rows: int, window: int):
  """`rows` windows of `window` tokens, each one random span of `stream` repeated to fill it.

  stream: int32 [N] -> (windows int32 [rows, window], spans int32 [rows]): row r is
  `stream[start_r + (i mod spans[r])]` for i in [0, window).
  """
  span_key, start_key = jax.random.split(key)
  low, high = SPAN_TOKENS
  spans = jax.random.randint(span_key, (rows,), low, high + 1)  # [rows]
  starts = jax.random.randint(start_key, (rows,), 0, stream.shape[0] - high + 1)  # [rows]
  offsets = jnp.arange(window)[None, :] % spans[:, None]  # [rows, window]
  return stream[starts[:, None] + offsets], spans


def _target_probabilities(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """logits [R, T, V], targets int [R, T] -> the probability of each target, float32 [R, T]."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.exp(jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0])


def self_reinforcement_loss(logits: jax.Array, windows: jax.Array, spans: jax.Array, lam: float):
  """DITTO's loss over the rows of repeated windows.

  logits: float32 [R, T, V], row t predicting token t + 1 of `windows` int32 [R, >= T + 1];
  spans: int32 [R]. Position t counts when its token's previous occurrence (one span earlier) is
  itself predicted, i.e. t >= span; the mean is over those positions of all rows.
  """
  seq_len = logits.shape[1]
  p = _target_probabilities(logits, windows[:, 1 : seq_len + 1])  # [R, T]
  positions = jnp.arange(seq_len)[None, :]  # [1, T]
  previous_index = jnp.maximum(positions - spans[:, None], 0)  # [R, T]
  p_previous = jax.lax.stop_gradient(jnp.take_along_axis(p, previous_index, axis=1))
  counted = positions >= spans[:, None]  # [R, T]
  # The log's argument is 1 - |p - lam p'| in [0, 1]; clip it off 0 where p reaches 1, lam = 0.
  gap = jnp.clip(1.0 - jnp.abs(p - lam * p_previous), 1e-6, 1.0)
  return jnp.sum(jnp.where(counted, -jnp.log(gap), 0.0)) / jnp.maximum(jnp.sum(counted), 1)


def repetition_probabilities(
  model, stream, kernels, *, span: int = 12, repeats: int = 10, rows: int = 64, seed: int = 0
) -> list[float]:
  """How much a model reinforces a repetition in its context (DITTO's diagnostic).

  `rows` spans of `span` tokens drawn from `stream` (int [N], held-out text) are each repeated
  `repeats` times; returns, for occurrences 2..`repeats`, the mean probability the model gives
  each token of the span given everything before it (float32). A model that rises towards 1
  with the occurrence count is one that greedy decoding traps in loops.
  """
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, len(stream) - span + 1, rows)
  windows = np.stack([np.tile(np.asarray(stream[s : s + span]), repeats) for s in starts])
  ids = jnp.asarray(windows[:, :-1], jnp.int32)  # [rows, span * repeats - 1]

  @jax.jit
  def probabilities(ids, targets):
    hidden, _ = model.forward(ids, StepMetadata.plain(ids, kernels))
    return _target_probabilities(model.logits(hidden), targets)

  p = np.asarray(probabilities(ids, jnp.asarray(windows[:, 1:], jnp.int32)))
  # Row t predicts token t + 1: occurrence k (1-based) holds tokens [(k - 1) span, k span).
  return [float(p[:, (k - 1) * span - 1 : k * span - 1].mean()) for k in range(2, repeats + 1)]
