"""GLM-5 indexer top-k: ties at the cut-off go to the lowest positions, in every mode."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.model.dsa_config import tiny_dsa
from jaxspec.model.metadata import KernelChoices, StepMetadata
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.serving.kv_cache import BlockAllocator
from jaxspec.serving.steps import decode_metadata, prefill_metadata

XLA = KernelChoices(attention="xla", index_conversion="xla")


def _all_tied_model():
  """A tiny GLM-5 model whose indexer scores every visible key exactly 0 (zero head weights)."""
  model = GlmForCausalLM(tiny_dsa(index_topk=4), rngs=nnx.Rngs(0))
  indexer = model.model.layers[0].self_attn.indexer
  indexer.weights_proj.kernel[...] = jnp.zeros_like(indexer.weights_proj.kernel[...])
  return model


def _attention(attention, x, pages, step):
  """``attention(x, pages, step, None)`` as one jitted program: eager, each of its ops compiles
  on its own, seconds on a CPU."""
  graphdef, state = nnx.split(attention)
  run = jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args, None))
  return run(state, x, pages, step)


def _lowest_positions(num_rows, topk):
  """Row t sees positions 0..t: the first `topk` of them, -1 where there are fewer."""
  return np.array([[p if p <= t else -1 for p in range(topk)] for t in range(num_rows)])


def test_planted_ties_select_the_lowest_positions_in_plain_and_decode_steps():
  model = _all_tied_model()
  layer = model.model.layers[0]
  num_tokens = 7
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (1, num_tokens)), jnp.int32)
  x = layer.input_layernorm(model.model.embed_tokens(ids))
  _, _, selection = _attention(layer.self_attn, x, None, StepMetadata.plain(ids, XLA))
  np.testing.assert_array_equal(np.asarray(selection.topk[0]), _lowest_positions(num_tokens, 4))

  # The same rule when the rows are decoded against the paged cache.
  page_size = 4
  allocator = BlockAllocator(4, page_size, shuffle_seed=1)
  block_tables = jnp.asarray([allocator.allocate(2)], jnp.int32)
  pages = layer.self_attn.init_pages(4, page_size, jnp.float32)
  prompt = 3
  prefill = prefill_metadata(jnp.asarray([prompt]), block_tables, prompt, page_size, XLA)
  _, pages, _ = _attention(layer.self_attn, x[:, :prompt], pages, prefill)
  q_len = num_tokens - prompt
  decode = decode_metadata(jnp.asarray([num_tokens]), block_tables, q_len, page_size, XLA)
  _, _, selection = _attention(layer.self_attn, x[:, prompt:], pages, decode)
  np.testing.assert_array_equal(
    np.asarray(selection.topk[0]), _lowest_positions(num_tokens, 4)[prompt:]
  )
