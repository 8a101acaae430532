"""Jitted steps of MTP speculative decoding: target verify, draft prefill, draft.

The model's cache holds the target's layers and the MTP layer's own pages (`ModelCache.draft`),
on the same block tables. The MTP cache is indexed by the position of the target hidden state a
row consumes (see `GlmForCausalLM.mtp_forward`), so its valid length always equals the target's
committed length, and a rejected draft is rolled back in both caches by length alone, with no
copies.

Row pruning (vLLM's GLM MTP draft step): the first draft step runs `q_len` rows per request
through the MTP layer's attention (every row writes its KV), but only the row of the last accepted
token produces the next draft. With `prune=True`, those rows (`last_token_indices`, one per slot
of the static batch, padding included) are gathered right after attention, so the post-attention
norm, the MoE, `shared_head.norm` and the lm head run on `B` rows instead of `B * q_len`. The
model decides the MoE implementation from the rows it starts with (before pruning), so the pruned
and unpruned steps make the same choice.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxspec.model.cache import ModelCache
from jaxspec.model.metadata import KernelChoices
from jaxspec.serving.acceptance import greedy_accept, rejection_sample
from jaxspec.serving.model_graph import ModelGraph
from jaxspec.serving.sampling import SamplingParams, sample, sampling_probs
from jaxspec.serving.steps import STATIC, decode_metadata, prefill_metadata, step_key

DRAFT_STATIC = STATIC + ("num_draft", "prune")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftInputs:
  """What a draft step takes from the verify step before it, as one pytree."""

  target_hidden: jax.Array  # [B, q_len, H], the target's hidden states of the verify rows
  emitted: jax.Array  # int32 [B, q_len]: accepted drafts, the bonus token, then -1
  num_accepted: jax.Array  # int32 [B]
  committed_lens: jax.Array  # int32 [B]: target length after this cycle; 0 = inactive slot
  block_tables: jax.Array  # int32 [B, max_pages]


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnames=("cache",))
def verify_step(
  graph: ModelGraph,
  params: list[jax.Array],  # graph.num_params arrays (split_model)
  cache: ModelCache,
  tokens: jax.Array,  # int32 [B, q_len]: last committed token, then the k drafts
  seq_lens: jax.Array,  # int32 [B]: committed length + q_len; 0 = inactive slot
  block_tables: jax.Array,  # int32 [B, max_pages]
  draft_probs: jax.Array | None,  # float32 [B, k, V]; None when greedy
  key: jax.Array,  # typed PRNG key, or its uint32 key data
  *,
  sampling: SamplingParams,
  kernels: KernelChoices,
):
  """Scores all q_len rows with the target and accepts a prefix of the drafts.

  Returns (num_accepted int32 [B], tokens int32 [B, q_len] (accepted drafts, bonus, then -1),
  target hidden [B, q_len, H] for the draft step, cache).
  """
  model, key = graph.merge(params), step_key(key)
  step = decode_metadata(seq_lens, block_tables, tokens.shape[1], cache.page_size, kernels)
  hidden, cache = model.forward(tokens, step, cache)
  logits = model.logits(hidden)  # [B, q_len, V]
  drafts = tokens[:, 1:]
  if sampling.greedy:
    num_accepted, emitted = greedy_accept(logits, drafts)
  else:
    num_accepted, emitted = rejection_sample(
      sampling_probs(logits, sampling), draft_probs, drafts, key
    )
  return num_accepted, emitted, hidden, cache


def _draft(
  model,
  cache: ModelCache,
  next_ids,  # int32 [B, T]
  target_hidden,  # [B, T, H]
  step,  # metadata of the T rows
  last_token_indices,  # int32 [B]: the row of each request that drafts
  committed_lens,  # int32 [B]; 0 = inactive
  block_tables,
  key,
  *,
  num_draft: int,
  sampling: SamplingParams,
  kernels: KernelChoices,
  prune: bool,
):
  """First draft step over all rows (pruned right after attention, or after the head), then
  k - 1 single-row MTP steps. Step i (1-based) consumes draft i at MTP index committed + i - 1.

  Returns (drafts int32 [B, k], draft_probs float32 [B, k, V] or None when greedy, cache).
  """
  hidden, cache = model.mtp_forward(
    next_ids, target_hidden, step, cache, last_token_indices=last_token_indices if prune else None
  )
  if not prune:
    hidden = jnp.take(hidden.reshape(-1, hidden.shape[-1]), last_token_indices, axis=0)
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
    single = decode_metadata(seq_lens, block_tables, 1, cache.page_size, kernels)
    out, cache = model.mtp_forward(drafts[-1][:, None], hidden[:, None], single, cache)
    hidden = out[:, 0]
  draft_probs = jnp.stack(probs, axis=1) if probs else None
  return jnp.stack(drafts, axis=1), draft_probs, cache


def draft_step_impl(
  graph: ModelGraph,
  params: list[jax.Array],  # graph.num_params arrays (split_model)
  cache: ModelCache,
  inputs: DraftInputs,
  key: jax.Array,  # typed PRNG key, or its uint32 key data
  *,
  num_draft: int,
  sampling: SamplingParams,
  kernels: KernelChoices,
  prune: bool,
):
  """Draft first step (q_len rows, pruned or not), then k - 1 single-row steps.

  Returns (drafts int32 [B, k], draft_probs float32 [B, k, V] or None when greedy, cache).
  `draft_step` is this function jitted; tests trace this one to inspect shapes and MoE choices.
  """
  model, key = graph.merge(params), step_key(key)
  batch_size, q_len = inputs.emitted.shape
  active = inputs.committed_lens > 0
  # Rows of this cycle start at MTP index committed - 1 - a (the verify's first position).
  seq_lens = jnp.where(active, inputs.committed_lens - 1 - inputs.num_accepted + q_len, 0)
  step = decode_metadata(seq_lens, inputs.block_tables, q_len, cache.page_size, kernels)
  # Rows after the bonus carry rejected tokens: any id will do.
  next_ids = jnp.maximum(inputs.emitted, 0)
  last_token_indices = jnp.arange(batch_size, dtype=jnp.int32) * q_len + inputs.num_accepted
  return _draft(
    model,
    cache,
    next_ids,
    inputs.target_hidden,
    step,
    last_token_indices,
    jnp.where(active, inputs.committed_lens, 0),
    inputs.block_tables,
    key,
    num_draft=num_draft,
    sampling=sampling,
    kernels=kernels,
    prune=prune,
  )


draft_step = jax.jit(draft_step_impl, static_argnames=DRAFT_STATIC, donate_argnames=("cache",))


@functools.partial(jax.jit, static_argnames=DRAFT_STATIC, donate_argnames=("cache",))
def draft_prefill_step(
  graph: ModelGraph,
  params: list[jax.Array],  # graph.num_params arrays (split_model)
  cache: ModelCache,
  target_hidden: jax.Array,  # [B, T, H] from the target prefill
  input_ids: jax.Array,  # int32 [B, T] prompts
  prompt_lens: jax.Array,  # int32 [B]; 0 = padding slot
  first_tokens: jax.Array,  # int32 [B]: the token the target sampled after each prompt
  block_tables: jax.Array,
  key: jax.Array,  # typed PRNG key, or its uint32 key data
  *,
  num_draft: int,
  sampling: SamplingParams,
  kernels: KernelChoices,
  prune: bool,
):
  """Fills the MTP cache for the prompts and drafts the first k tokens.

  MTP row t takes the target hidden of position t and the token of position t + 1 (the prompt
  shifted left, `first_tokens` at the last prompt row). Returns (drafts, draft_probs, cache).
  """
  model, key = graph.merge(params), step_key(key)
  batch_size, num_tokens = input_ids.shape
  rows = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32), input_ids.shape)
  last_row = jnp.maximum(prompt_lens - 1, 0)
  shifted = jnp.concatenate([input_ids[:, 1:], input_ids[:, :1]], axis=1)
  next_ids = jnp.where(rows == last_row[:, None], first_tokens[:, None], shifted)
  step = prefill_metadata(prompt_lens, block_tables, num_tokens, cache.page_size, kernels)
  last_token_indices = jnp.arange(batch_size, dtype=jnp.int32) * num_tokens + last_row
  return _draft(
    model,
    cache,
    next_ids,
    target_hidden,
    step,
    last_token_indices,
    prompt_lens,
    block_tables,
    key,
    num_draft=num_draft,
    sampling=sampling,
    kernels=kernels,
    prune=prune,
  )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CycleState:
  """What a speculative cycle hands to the next one, kept on the device."""

  last_tokens: jax.Array  # int32 [B]: each request's last committed token (not yet cached)
  drafts: jax.Array  # int32 [B, k]
  draft_probs: jax.Array | None  # float32 [B, k, V]; None when greedy
  seq_lens: jax.Array  # int32 [B]: committed length + k + 1 of the next verify; 0 = inactive


@jax.jit
def retire(state: CycleState, done: jax.Array) -> CycleState:
  """Marks the `done` (bool [B]) requests inactive: their next cycles neither read nor write."""
  return dataclasses.replace(state, seq_lens=jnp.where(done, 0, state.seq_lens))


@functools.partial(jax.jit, static_argnames=DRAFT_STATIC, donate_argnames=("cache",))
def cycle_step(
  graph: ModelGraph,
  params: list[jax.Array],
  cache: ModelCache,
  state: CycleState,
  block_tables: jax.Array,  # int32 [B, max_pages]
  key: jax.Array,  # typed PRNG key, or its uint32 key data
  *,
  num_draft: int,
  sampling: SamplingParams,
  kernels: KernelChoices,
  prune: bool,
):
  """One speculative cycle as one program: `verify_step` on the last token and the drafts, then
  `draft_step` from what it accepted, with the hand-over between them (`DraftInputs`) on the
  device.

  The next cycle's state, its `seq_lens` included, comes out on the device, so the engine can
  dispatch the next cycle before it reads this one's tokens: one dispatch and one copy back per
  cycle, and no wait between them. Returns (emitted int32 [B, k + 1] (accepted drafts, bonus,
  then -1), the next `CycleState`, cache).
  """
  verify_key, draft_key = jax.random.split(step_key(key))
  seq_lens = state.seq_lens
  tokens = jnp.concatenate([state.last_tokens[:, None], state.drafts], axis=1)  # [B, q_len]
  q_len = tokens.shape[1]
  statics = dict(sampling=sampling, kernels=kernels)
  num_accepted, emitted, hidden, cache = verify_step(
    graph, params, cache, tokens, seq_lens, block_tables, state.draft_probs, verify_key, **statics
  )
  # An active request had committed = seq_lens - q_len tokens; it now has 1 + num_accepted more.
  committed_lens = jnp.where(seq_lens > 0, seq_lens - q_len + 1 + num_accepted, 0)
  inputs = DraftInputs(hidden, emitted, num_accepted, committed_lens, block_tables)
  drafts, draft_probs, cache = draft_step(
    graph, params, cache, inputs, draft_key, num_draft=num_draft, prune=prune, **statics
  )
  next_state = CycleState(
    last_tokens=jnp.take_along_axis(emitted, num_accepted[:, None], axis=1)[:, 0],
    drafts=drafts,
    draft_probs=draft_probs,
    seq_lens=jnp.where(seq_lens > 0, committed_lens + q_len, 0),
  )
  return emitted, next_state, cache
