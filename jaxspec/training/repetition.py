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

# Spans repeated in a window, in tokens: from part of a line to a short function (~12 tokens a
# line). A window of W tokens caps its spans at W // 4, so at least two occurrences follow the
# longest prefix of natural text (W // 2).
SPAN_TOKENS = (4, 64)


def repeated_windows(stream: jax.Array, key: jax.Array, rows: int, window: int):
  """`rows` windows of `window` tokens: natural text, then the span that follows it repeated.

  stream: int32 [N] -> (windows int32 [rows, window], spans int32 [rows], prefixes int32 [rows]):
  row r is `stream[start_r - prefixes[r] + i]` for i < prefixes[r] (prefixes in [0, window // 2])
  and `stream[start_r + (i - prefixes[r]) mod spans[r]]` from there on.

  The prefix matters: trained only on windows that repeat from their first token, a model learns
  to break a loop that fills its whole context and still falls into one that follows real code
  (measured: a 535 s run's probability of a repeated span fell to 0.003 by the eighth occurrence
  from the start of the context, and rose to 0.77 after 256 tokens of held-out text).
  """
  low, high = SPAN_TOKENS[0], min(SPAN_TOKENS[1], window // 4)
  if high < low:
    raise ValueError(f"window must be at least {4 * low} tokens to repeat a span, got {window}")
  max_prefix = window // 2
  if stream.shape[0] < max_prefix + high:
    raise ValueError(f"stream of {stream.shape[0]} tokens is too short for {window}-token windows")
  span_key, prefix_key, start_key = jax.random.split(key, 3)
  spans = jax.random.randint(span_key, (rows, 1), low, high + 1)  # [rows, 1]
  prefixes = jax.random.randint(prefix_key, (rows, 1), 0, max_prefix + 1)  # [rows, 1]
  starts = jax.random.randint(start_key, (rows, 1), max_prefix, stream.shape[0] - high + 1)
  i = jnp.arange(window)[None, :]  # [1, window]
  offsets = jnp.where(i < prefixes, i - prefixes, (i - prefixes) % spans)  # [rows, window]
  return stream[starts + offsets], spans[:, 0], prefixes[:, 0]


def target_probabilities(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """logits [R, T, V], targets int [R, T] -> the probability of each target, float32 [R, T]."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.exp(jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0])


def self_reinforcement_loss(
  logits: jax.Array, windows: jax.Array, spans: jax.Array, prefixes: jax.Array, lam: float
):
  """DITTO's loss over the rows of repeated windows (`repeated_windows`).

  logits: float32 [R, T, V], row t predicting token t + 1 of `windows` int32 [R, >= T + 1];
  spans, prefixes: int32 [R]. Row t counts when its token is in the second occurrence of the span
  or later and the same token one occurrence earlier is itself predicted (row t - span >= 0); the
  mean is over those rows of all windows.
  """
  seq_len = logits.shape[1]
  p = target_probabilities(logits, windows[:, 1 : seq_len + 1])  # [R, T]
  positions = jnp.arange(seq_len)[None, :]  # [1, T]
  spans, prefixes = spans[:, None], prefixes[:, None]  # [R, 1]
  p_previous = jax.lax.stop_gradient(
    jnp.take_along_axis(p, jnp.maximum(positions - spans, 0), axis=1)
  )
  counted = (positions + 1 >= prefixes + spans) & (positions >= spans)  # [R, T]
  # The log's argument is 1 - |p - lam p'| in [0, 1]; clip it off 0 where p reaches 1, lam = 0.
  gap = jnp.clip(1.0 - jnp.abs(p - lam * p_previous), 1e-6, 1.0)
  return jnp.sum(jnp.where(counted, -jnp.log(gap), 0.0)) / jnp.maximum(jnp.sum(counted), 1)


# (span tokens, occurrences) the diagnostic reports: a line, and a short function (greedy
# decoding of a small model writes whole functions twice).
DIAGNOSTIC_SPANS = ((12, 10), (48, 4))
# Places in the held-out stream the diagnostic scores by default.
DIAGNOSTIC_ROWS = 64


def repetition_profiles(
  model, stream, kernels, *, rows: int = DIAGNOSTIC_ROWS
) -> dict[str, dict[str, list[float]]]:
  """`repetition_profile` at each of `DIAGNOSTIC_SPANS` over `rows` places, keyed
  "span_<tokens>"."""
  return {
    f"span_{span}": repetition_profile(model, stream, kernels, span=span, repeats=count, rows=rows)
    for span, count in DIAGNOSTIC_SPANS
  }


def repetition_profile(
  model,
  stream,
  kernels,
  *,
  span: int = 12,
  repeats: int = 10,
  prefix: int = 256,
  rows: int = DIAGNOSTIC_ROWS,
  seed: int = 0,
) -> dict[str, list[float]]:
  """How much a model reinforces a repetition in its context (DITTO's diagnostic).

  `rows` places in `stream` (int [N], held-out text) each give `prefix` tokens of text and the
  `span` tokens that follow them, repeated `repeats` times. Returns, for occurrences
  2..`repeats` of the span: "probability", the mean probability the model gives each of its
  tokens given everything before it, and "argmax", the share of its tokens that are the model's
  most likely next token (float32). A model whose probability rises with the occurrence count
  reinforces loops (DITTO's measure); greedy decoding repeats what is the argmax, and a model can
  lower the first while keeping the second. The prefix keeps both honest: a loop in generation
  follows real code, and a model can learn to break only the loops that start its context.
  """
  rng = np.random.default_rng(seed)
  stream = np.asarray(stream)
  starts = rng.integers(prefix, len(stream) - span + 1, rows)
  windows = np.stack(
    [
      np.concatenate([stream[s - prefix : s], np.tile(stream[s : s + span], repeats)])
      for s in starts
    ]
  )  # [rows, prefix + span * repeats]
  ids = jnp.asarray(windows[:, :-1], jnp.int32)

  @jax.jit
  def score(ids, targets):
    hidden, _ = model.forward(ids, StepMetadata.plain(ids, kernels))
    logits = model.logits(hidden)
    return target_probabilities(logits, targets), jnp.argmax(logits, axis=-1) == targets

  p, hit = map(np.asarray, score(ids, jnp.asarray(windows[:, 1:], jnp.int32)))  # [rows, T] each
  # Row t predicts token t + 1: occurrence k (1-based) holds tokens [prefix + (k - 1) span,
  # prefix + k span).
  first = [prefix + (k - 1) * span - 1 for k in range(2, repeats + 1)]
  return {
    "probability": [float(p[:, row : row + span].mean()) for row in first],
    "argmax": [float(hit[:, row : row + span].mean()) for row in first],
  }
