"""Sequence-level unlikelihood training on the model's own greedy continuations.

Welleck et al., "Neural Text Generation with Unlikelihood Training" (ICLR 2020,
arXiv:1908.04319), section 5.2: decode a continuation of a real prefix greedily with the current
model, mark every continuation token that completes an n-gram already present earlier in the
sequence, and lower those tokens' probabilities with `-log(1 - p)`. Unlike DITTO's synthetic
repeated windows (`repetition`), the loss sees exactly the loops greedy decoding falls into, after
real code: in the default model, DITTO alone lowered the probability of copying a 48-token span
but the greedy demos still copied whole functions, breaking the copy with an odd byte token and
resuming it.

The paper's candidate set is the repeated tokens; this one adds the tokens that are not valid
UTF-8 on their own (bytes 0x80-0xFF and merges of them: 130 of the default model's 2048). Trained
against repeats alone, the default model escaped its loops through exactly those: the greedy demos
stopped repeating and turned to strings of stray bytes (`\ufffdfer\ufffds(`), which real
Python almost never holds outside a multi-byte character; the maximum-likelihood term keeps
them where they do.

For code the n-gram is longer than the paper's 4 tokens: at ~2.9 bytes per token an 8-token
n-gram is about half a line, so the indentation and idioms that real code repeats
(`self.`, `    return `) are not penalised while copied lines are.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.training import repetition


def repeated_ngram_mask(tokens: jax.Array, start: int, n: int) -> jax.Array:
  """tokens: int [U, L] -> bool [U, L]: position t >= `start` is marked when the n-gram ending at
  t, `tokens[t - n + 1 : t + 1]`, also ends at some earlier position s (n - 1 <= s < t), in the
  prefix or the continuation. Exact comparison ([U, L, L] per offset), no hashing."""
  length = tokens.shape[1]
  t = jnp.arange(length)
  same = jnp.ones((tokens.shape[0], length, length), bool)  # [U, t, s]
  for offset in range(n):
    shifted = jnp.roll(tokens, offset, axis=1)  # shifted[:, t] = tokens[:, t - offset]
    same &= shifted[:, :, None] == shifted[:, None, :]
  earlier = (t[None, :] < t[:, None]) & (t[None, :] >= n - 1)  # [t, s]
  return jnp.any(same & earlier[None], axis=-1) & (t >= max(start, n - 1))[None, :]


def malformed_tokens(token_bytes) -> np.ndarray:
  """bool [V]: the tokens whose bytes (`token_bytes`, a list of bytes per id) do not decode as
  UTF-8 on their own."""

  def malformed(data: bytes) -> bool:
    try:
      data.decode("utf-8")
    except UnicodeDecodeError:
      return True
    return False

  return np.asarray([malformed(data) for data in token_bytes], bool)


def penalised_mask(tokens: jax.Array, start: int, n: int, malformed: jax.Array) -> jax.Array:
  """tokens: int [U, L]; malformed: bool [V] -> bool [U, L], the candidates of the loss:
  continuation tokens (t >= `start`) that repeat an n-gram (`repeated_ngram_mask`) or are
  malformed."""
  in_continuation = (jnp.arange(tokens.shape[1]) >= start)[None, :]
  return repeated_ngram_mask(tokens, start, n) | (malformed[tokens] & in_continuation)


def unlikelihood_loss(
  logits: jax.Array, tokens: jax.Array, mask: jax.Array, start: int
) -> jax.Array:
  """`sum over marked t of -log(1 - p(tokens[t]))`, divided by the continuation's token count.

  logits: [U, L - 1, V], row t predicting `tokens[:, t + 1]`; tokens int [U, L]; mask bool [U, L]
  (`penalised_mask` from `start`, the prefix length). Dividing by every continuation token,
  marked or not, makes the loss shrink with the share of repeated tokens.
  """
  p = repetition.target_probabilities(logits, tokens[:, 1:])  # [U, L - 1]
  # 1 - p underflows to 0 where the model is certain of the repeat; clip it off 0.
  penalty = -jnp.log(jnp.clip(1.0 - p, 1e-6, 1.0))
  continuation_tokens = tokens.shape[0] * (tokens.shape[1] - start)
  return jnp.sum(jnp.where(mask[:, 1:], penalty, 0.0)) / continuation_tokens
