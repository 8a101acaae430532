"""Static-shape step functions, each one `jit` boundary with the model's cache donated.

Every step takes the model as `(graph, params)` from `split_model` (a static `ModelGraph`, a flat
list of arrays: cheap for `jit` to hash and flatten on every call), so the compiled program
depends only on the shape bucket and the static options (sampling, `KernelChoices`), never on
lengths or positions, which stay device arrays.
"""

import functools

import jax
import jax.numpy as jnp

from jaxspec.model.cache import ModelCache
from jaxspec.model.metadata import KernelChoices, StepMetadata
from jaxspec.serving.kv_cache import slot_mapping
from jaxspec.serving.model_graph import ModelGraph
from jaxspec.serving.sampling import SamplingParams, sample

STATIC = ("graph", "sampling", "kernels")


def step_key(key: jax.Array) -> jax.Array:
  """A typed PRNG key from a step's `key` argument: a typed key, or its raw `uint32` key data.

  The engine passes key data from a host array it split once per wave: a host array is only
  copied in with the step's other inputs, where splitting a device key before every step costs
  three eager device operations (0.66 ms of a 2.3 ms decode step of the default model on an
  H200 host).
  """
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key
  return jax.random.wrap_key_data(key)


def prefill_metadata(
  prompt_lens: jax.Array,  # int32 [B], 0 = padding request
  block_tables: jax.Array,  # int32 [B, max_pages]
  num_tokens: int,
  page_size: int,
  kernels: KernelChoices,
) -> StepMetadata:
  """Metadata of a prefill over positions 0..num_tokens-1; rows past a prompt are not written."""
  batch = prompt_lens.shape[0]
  positions = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32), (batch, num_tokens))
  valid = positions < prompt_lens[:, None]
  return StepMetadata(
    positions=positions,
    slot_mapping=slot_mapping(block_tables, positions, valid, page_size),
    block_tables=block_tables,
    seq_lens=prompt_lens,
    mode="prefill",
    kernels=kernels,
  )


def decode_metadata(
  seq_lens: jax.Array,  # int32 [B], KV length after this step's rows; 0 = padding
  block_tables: jax.Array,  # int32 [B, max_pages]
  q_len: int,
  page_size: int,
  kernels: KernelChoices,
) -> StepMetadata:
  """Metadata of `q_len` new rows per request ending at `seq_lens`."""
  positions = seq_lens[:, None] - q_len + jnp.arange(q_len, dtype=jnp.int32)[None]  # [B, q_len]
  valid = (seq_lens[:, None] > 0) & (positions >= 0)
  return StepMetadata(
    positions=jnp.maximum(positions, 0),
    slot_mapping=slot_mapping(block_tables, positions, valid, page_size),
    block_tables=block_tables,
    seq_lens=seq_lens,
    mode="decode",
    kernels=kernels,
  )


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnames=("cache",))
def prefill_step(
  graph: ModelGraph,
  params: list[jax.Array],  # graph.num_params arrays (split_model)
  cache: ModelCache,
  input_ids: jax.Array,  # int32 [B, T], request b's prompt in [:prompt_lens[b]]
  prompt_lens: jax.Array,  # int32 [B], 0 = padding request
  block_tables: jax.Array,  # int32 [B, max_pages]
  key: jax.Array,  # typed PRNG key, or its uint32 key data
  first_token_mask: jax.Array | None = None,  # bool [B, V]; None: every token allowed
  *,
  sampling: SamplingParams,
  kernels: KernelChoices,
):
  """Runs the prompts, fills the target's cache, samples each request's first new token.

  `first_token_mask` restricts the first token to the allowed ids (token healing): the others'
  logits become -inf before sampling, so greedy takes the argmax over the allowed ids and sampling
  renormalises over them. None (a pytree without leaves) traces the unmasked program.

  Returns (next_tokens int32 [B], hidden [B, T, H] after the final norm, cache).
  """
  model, key = graph.merge(params), step_key(key)
  step = prefill_metadata(prompt_lens, block_tables, input_ids.shape[1], cache.page_size, kernels)
  hidden, cache = model.forward(input_ids, step, cache)
  last = jnp.clip(prompt_lens - 1, 0, input_ids.shape[1] - 1)
  last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [B, H]
  logits = model.logits(last_hidden)  # [B, V]
  if first_token_mask is not None:
    logits = jnp.where(first_token_mask, logits, -jnp.inf)
  next_tokens = sample(logits, key, sampling)
  return next_tokens, hidden, cache


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnames=("cache",))
def decode_step(
  graph: ModelGraph,
  params: list[jax.Array],  # graph.num_params arrays (split_model)
  cache: ModelCache,
  tokens: jax.Array,  # int32 [B], each request's newest token (not yet in the cache)
  seq_lens: jax.Array,  # int32 [B], KV length including this token; 0 = padding
  block_tables: jax.Array,  # int32 [B, max_pages]
  key: jax.Array,  # typed PRNG key, or its uint32 key data
  *,
  sampling: SamplingParams,
  kernels: KernelChoices,
):
  """One plain decode step: writes each request's newest token, samples the next.

  Takes and returns tokens as `[B]`, so a step's output feeds the next step as it is (the
  engine dispatches the next step before it reads this one's tokens).
  Returns (next_tokens int32 [B], cache).
  """
  model, key = graph.merge(params), step_key(key)
  step = decode_metadata(seq_lens, block_tables, 1, cache.page_size, kernels)
  hidden, cache = model.forward(tokens[:, None], step, cache)
  next_tokens = sample(model.logits(hidden[:, -1]), key, sampling)
  return next_tokens, cache
