"""Jitted steps of MTP speculative decoding: target verify, draft prefill, draft.

The KV cache holds `num_hidden_layers + 1` layers: the target's, then the MTP layer's own. Both
use the same block tables. The MTP cache is indexed by the position of the target hidden state a
row consumes: row t (hidden of position t, token of position t + 1, RoPE position t + 1) lives at
index t. So the MTP cache's valid length always equals the target's committed length, and a
rejected draft is rolled back in both caches by length alone, with no copies.

Row pruning (vLLM's GLM MTP draft step): the first draft step runs `q_len` rows per request
through the MTP layer's attention (every row writes its KV), but only the row of the last accepted
token produces the next draft. With `prune=True`, those rows (`last_token_indices`, one per slot
of the static batch, padding included) are gathered right after attention, so the post-attention
norm, the MoE, `shared_head.norm` and the lm head run on `B` rows instead of `B * q_len`. The MoE
implementation is decided once from the token count before pruning (`moe_policy_tokens`) and
passed down, so the pruned and unpruned steps make the same choice.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.model.attention import AttentionBatch
from jaxspec.model.moe import choose_moe_impl
from jaxspec.serving.acceptance import greedy_accept, rejection_sample
from jaxspec.serving.kv_cache import PagedKVCache, slot_mapping
from jaxspec.serving.sampling import SamplingParams, sample, sampling_probs
from jaxspec.serving.steps import decode_batch

_STATIC = ("graphdef", "sampling", "attention_impl")


def _split_cache(model, cache: PagedKVCache):
  """(target layers, the MTP layer's pages) of a speculative cache."""
  num_layers = model.config.num_hidden_layers
  if len(cache.layers) != num_layers + 1:
    raise ValueError(f"a speculative cache holds {num_layers + 1} layers, got {len(cache.layers)}")
  return cache.layers[:num_layers], cache.layers[num_layers]


@functools.partial(jax.jit, static_argnames=_STATIC + ("moe_impl",), donate_argnames=("cache",))
def verify_step(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  cache: PagedKVCache,
  tokens: jax.Array,  # int32 [B, q_len]: last committed token, then the k drafts
  seq_lens: jax.Array,  # int32 [B]: committed length + q_len; 0 = inactive slot
  block_tables: jax.Array,  # int32 [B, max_pages]
  draft_probs: jax.Array | None,  # float32 [B, k, V]; None when greedy
  key: jax.Array,
  *,
  sampling: SamplingParams,
  moe_impl: str,
  attention_impl: str,
):
  """Scores all q_len rows with the target and accepts a prefix of the drafts.

  Returns (num_accepted int32 [B], tokens int32 [B, q_len] (accepted drafts, bonus, then -1),
  target hidden [B, q_len, H] for the draft step, cache).
  """
  model = nnx.merge(graphdef, params)
  target_pages, mtp_pages = _split_cache(model, cache)
  batch = decode_batch(cache, seq_lens, block_tables, tokens.shape[1], attention_impl)
  hidden, target_pages = model.forward(
    tokens, batch.positions, target_pages, batch, moe_impl=moe_impl
  )
  logits = model.logits(hidden)  # [B, q_len, V]
  drafts = tokens[:, 1:]
  if sampling.greedy:
    num_accepted, emitted = greedy_accept(logits, drafts)
  else:
    num_accepted, emitted = rejection_sample(
      sampling_probs(logits, sampling), draft_probs, drafts, key
    )
  return num_accepted, emitted, hidden, PagedKVCache(target_pages + (mtp_pages,))


def draft_moe_impls(config, batch_size: int, q_len: int) -> tuple[str, str]:
  """MoE choices of a draft step: (first step, from the unpruned count `batch * q_len`; the
  single-row steps after it, from `batch`)."""
  moe_policy_tokens = batch_size * q_len
  return choose_moe_impl(moe_policy_tokens, config), choose_moe_impl(batch_size, config)


def _draft_chain(
  model,
  mtp_pages,
  first_hidden,
  committed_lens,
  block_tables,
  key,
  cache,
  num_draft,
  sampling,
  moe_impl,
  attention_impl,
):
  """Turns the first draft step's kept rows into k drafts with k - 1 single-row MTP steps.

  first_hidden: [B, H] MTP output of the last accepted row; committed_lens: int32 [B] (0 =
  inactive). Step i (1-based) consumes draft i at MTP index committed + i - 1.
  """
  hidden = first_hidden
  drafts, probs = [], []
  for i in range(num_draft):
    logits = model.mtp_logits(hidden)  # [B, V]
    key, draw_key = jax.random.split(key)
    drafts.append(sample(logits, draw_key, sampling))
    if not sampling.greedy:
      probs.append(sampling_probs(logits, sampling))
    if i == num_draft - 1:
      break
    seq_lens = jnp.where(committed_lens > 0, committed_lens + i + 1, 0)
    batch = decode_batch(cache, seq_lens, block_tables, 1, attention_impl)
    out, mtp_pages = model.mtp_forward(
      drafts[-1][:, None], hidden[:, None], batch.positions + 1, mtp_pages, batch, moe_impl=moe_impl
    )
    hidden = out[:, 0]
  draft_probs = jnp.stack(probs, axis=1) if probs else None
  return jnp.stack(drafts, axis=1), draft_probs, mtp_pages


def _draft(
  model,
  mtp_pages,
  next_ids,
  target_hidden,
  batch: AttentionBatch,
  last_token_indices,
  committed_lens,
  block_tables,
  key,
  cache,
  *,
  num_draft,
  sampling,
  moe_impls,
  prune,
):
  """First draft step over all rows (pruned right after attention, or after the head), then
  the chain of single-row steps. Returns (drafts, draft_probs, mtp_pages)."""
  first_moe, rest_moe = moe_impls
  hidden, mtp_pages = model.mtp_forward(
    next_ids,
    target_hidden,
    batch.positions + 1,
    mtp_pages,
    batch,
    moe_impl=first_moe,
    last_token_indices=last_token_indices if prune else None,
  )
  if not prune:
    hidden = jnp.take(hidden.reshape(-1, hidden.shape[-1]), last_token_indices, axis=0)
  return _draft_chain(
    model,
    mtp_pages,
    hidden,
    committed_lens,
    block_tables,
    key,
    cache,
    num_draft,
    sampling,
    rest_moe,
    batch.attention_impl,
  )


def draft_step_impl(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  cache: PagedKVCache,
  target_hidden: jax.Array,  # [B, q_len, H] from verify_step
  emitted: jax.Array,  # int32 [B, q_len] from verify_step
  num_accepted: jax.Array,  # int32 [B]
  committed_lens: jax.Array,  # int32 [B]: target length after this cycle; 0 = inactive
  block_tables: jax.Array,  # int32 [B, max_pages]
  key: jax.Array,
  *,
  num_draft: int,
  sampling: SamplingParams,
  attention_impl: str,
  prune: bool,
):
  """Draft first step (q_len rows, pruned or not), then k - 1 single-row steps.

  Returns (drafts int32 [B, k], draft_probs float32 [B, k, V] or None when greedy, cache).
  `draft_step` is this function jitted; tests trace this one to inspect shapes and MoE choices.
  """
  model = nnx.merge(graphdef, params)
  target_pages, mtp_pages = _split_cache(model, cache)
  batch_size, q_len = emitted.shape
  first_moe, rest_moe = draft_moe_impls(model.config, batch_size, q_len)
  active = committed_lens > 0
  # Rows of this cycle start at MTP index committed - 1 - a (the verify's first position).
  seq_lens = jnp.where(active, committed_lens - 1 - num_accepted + q_len, 0)
  batch = decode_batch(cache, seq_lens, block_tables, q_len, attention_impl)
  next_ids = jnp.maximum(emitted, 0)  # rows after the bonus carry rejected tokens: any id will do
  last_token_indices = jnp.arange(batch_size, dtype=jnp.int32) * q_len + num_accepted  # [B]
  drafts, draft_probs, mtp_pages = _draft(
    model,
    mtp_pages,
    next_ids,
    target_hidden,
    batch,
    last_token_indices,
    jnp.where(active, committed_lens, 0),
    block_tables,
    key,
    cache,
    num_draft=num_draft,
    sampling=sampling,
    moe_impls=(first_moe, rest_moe),
    prune=prune,
  )
  return drafts, draft_probs, PagedKVCache(target_pages + (mtp_pages,))


draft_step = jax.jit(
  draft_step_impl, static_argnames=_STATIC + ("num_draft", "prune"), donate_argnames=("cache",)
)


@functools.partial(
  jax.jit, static_argnames=_STATIC + ("num_draft", "prune"), donate_argnames=("cache",)
)
def draft_prefill_step(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  cache: PagedKVCache,
  target_hidden: jax.Array,  # [B, T, H] from the target prefill
  input_ids: jax.Array,  # int32 [B, T] prompts
  prompt_lens: jax.Array,  # int32 [B]; 0 = padding slot
  first_tokens: jax.Array,  # int32 [B]: the token the target sampled after each prompt
  block_tables: jax.Array,
  key: jax.Array,
  *,
  num_draft: int,
  sampling: SamplingParams,
  attention_impl: str,
  prune: bool,
):
  """Fills the MTP cache for the prompts and drafts the first k tokens.

  MTP row t takes the target hidden of position t and the token of position t + 1 (the prompt
  shifted left, `first_tokens` at the last prompt row). Returns (drafts, draft_probs, cache).
  """
  model = nnx.merge(graphdef, params)
  target_pages, mtp_pages = _split_cache(model, cache)
  batch_size, num_tokens = input_ids.shape
  first_moe, rest_moe = draft_moe_impls(model.config, batch_size, num_tokens)
  rows = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32), input_ids.shape)
  last_row = jnp.maximum(prompt_lens - 1, 0)
  shifted = jnp.concatenate([input_ids[:, 1:], input_ids[:, :1]], axis=1)
  next_ids = jnp.where(rows == last_row[:, None], first_tokens[:, None], shifted)
  batch = AttentionBatch(
    positions=rows,
    slot_mapping=slot_mapping(block_tables, rows, rows < prompt_lens[:, None], cache.page_size),
    block_tables=block_tables,
    seq_lens=prompt_lens,
    mode="prefill",
    attention_impl=attention_impl,
  )
  last_token_indices = jnp.arange(batch_size, dtype=jnp.int32) * num_tokens + last_row
  drafts, draft_probs, mtp_pages = _draft(
    model,
    mtp_pages,
    next_ids,
    target_hidden,
    batch,
    last_token_indices,
    prompt_lens,
    block_tables,
    key,
    cache,
    num_draft=num_draft,
    sampling=sampling,
    moe_impls=(first_moe, rest_moe),
    prune=prune,
  )
  return drafts, draft_probs, PagedKVCache(target_pages + (mtp_pages,))
