"""Deciding which draft tokens the target accepts, on device, for a whole batch at once.

Both functions take the target's `q_len = k + 1` verify rows (row j scores the token after draft
j; row 0 follows the last committed token) and return, per request, the number of accepted
drafts `a` and the tokens to emit: the `a` accepted drafts then one token from the target (the
"bonus" token), `-1` after that. Every request accepts its own number of tokens.
"""

import jax
import jax.numpy as jnp


def _emit(drafts, bonus, num_accepted, q_len):
  """[B, k] drafts, [B] bonus, [B] a -> int32 [B, q_len]: drafts[:a], bonus, then -1."""
  rows = jnp.arange(q_len, dtype=jnp.int32)[None]
  padded = jnp.pad(drafts, ((0, 0), (0, 1)))
  tokens = jnp.where(rows < num_accepted[:, None], padded, bonus[:, None])
  return jnp.where(rows <= num_accepted[:, None], tokens, -1).astype(jnp.int32)


def _leading_true(mask):
  """Length of the all-True prefix of each row of a [B, k] bool array."""
  return jnp.sum(jnp.cumprod(mask.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def greedy_accept(target_logits: jax.Array, drafts: jax.Array):
  """Longest prefix of drafts equal to the target's argmax, plus the target's next argmax.

  target_logits: [B, k + 1, V]; drafts: int32 [B, k] -> (num_accepted int32 [B],
  tokens int32 [B, k + 1]). Lossless: the emitted tokens are exactly greedy decoding's.
  """
  target_tokens = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, k + 1]
  num_accepted = _leading_true(target_tokens[:, :-1] == drafts)
  bonus = jnp.take_along_axis(target_tokens, num_accepted[:, None], axis=1)[:, 0]
  return num_accepted, _emit(drafts, bonus, num_accepted, target_tokens.shape[1])


def rejection_sample(
  target_probs: jax.Array, draft_probs: jax.Array, drafts: jax.Array, key: jax.Array
):
  """Speculative sampling (Leviathan et al., 2023, arXiv:2211.17192; Chen et al., 2023).

  Draft j, drawn from q_j, is accepted with probability min(1, p_j(d) / q_j(d)). At the first
  rejection the bonus token is drawn from the residual `max(p_j - q_j, 0)` (renormalised); when
  all k drafts pass it is drawn from p_k. The emitted tokens are then distributed exactly as
  sampling from the target alone.

  target_probs: float32 [B, k + 1, V]; draft_probs: float32 [B, k, V]; drafts: int32 [B, k].
  Both distributions must already carry the same temperature / top-k / top-p processing.
  Returns (num_accepted int32 [B], tokens int32 [B, k + 1]).
  """
  batch, num_draft = drafts.shape
  accept_key, bonus_key = jax.random.split(key)
  p_draft = jnp.take_along_axis(target_probs[:, :num_draft], drafts[..., None], axis=-1)[..., 0]
  q_draft = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
  uniform = jax.random.uniform(accept_key, (batch, num_draft), jnp.float32)
  # u < p / q without dividing: q(d) > 0 for any sampled draft.
  num_accepted = _leading_true(uniform * q_draft < p_draft)

  residual = jnp.maximum(target_probs[:, :num_draft] - draft_probs, 0.0)
  bonus_dists = jnp.concatenate([residual, target_probs[:, num_draft:]], axis=1)  # [B, k + 1, V]
  bonus_dist = jnp.take_along_axis(bonus_dists, num_accepted[:, None, None], axis=1)[:, 0]
  # A zero residual means p == q at that row, which never rejects; fall back to p for safety.
  target_row = jnp.take_along_axis(target_probs, num_accepted[:, None, None], axis=1)[:, 0]
  total = jnp.sum(bonus_dist, axis=-1, keepdims=True)
  bonus_dist = jnp.where(total > 0, bonus_dist, target_row)
  bonus = jax.random.categorical(bonus_key, jnp.log(bonus_dist), axis=-1).astype(jnp.int32)
  return num_accepted, _emit(drafts, bonus, num_accepted, num_draft + 1)
