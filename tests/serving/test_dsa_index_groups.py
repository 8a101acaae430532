"""One top-k conversion per index group in decode steps, counted in the traced step.

Both backends of `convert_topk_to_physical` are `jax.jit` functions, so every conversion shows up
in a traced step as one `jit` equation named after its backend; the count does not depend on what
its body lowers to.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.jaxpr_utils import count_calls
from jaxspec.kernels.sparse_index import api as sparse_index_api
from jaxspec.model.dsa_config import glm53_small
from jaxspec.model.metadata import KernelChoices
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.serving.model_graph import split_model
from jaxspec.serving.sampling import GREEDY
from jaxspec.serving.spec_steps import DraftInputs, draft_step, verify_step
from jaxspec.serving.steps import decode_step

CONVERSION = sparse_index_api.OP.backend_names


def _int_arg(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.int32)


def _kernels(index_sharing):
  return KernelChoices(
    attention="xla", index_conversion="xla", index_sharing=index_sharing, moe="per_route"
  )


def _abstract(config, draft, num_pages, page_size):
  """(graph, abstract params, abstract cache): tracing needs no weights."""
  model = nnx.eval_shape(lambda: GlmForCausalLM(config, rngs=nnx.Rngs(0)))
  graph, params = split_model(model)
  cache = jax.eval_shape(lambda: graph.merge(params).init_cache(num_pages, page_size, draft=draft))
  return graph, params, cache


def _decode_step_jaxpr(config, index_sharing, batch_size=2, page_size=64, max_pages=2):
  graph, params, cache = _abstract(config, False, batch_size * max_pages, page_size)
  traced = decode_step.trace(
    graph,
    params,
    cache,
    _int_arg(batch_size),
    _int_arg(batch_size),
    _int_arg(batch_size, max_pages),
    jax.random.key(0),
    sampling=GREEDY,
    kernels=_kernels(index_sharing),
  )
  return traced.jaxpr


def test_glm53_decode_step_converts_once_per_group():
  config = glm53_small()  # 78 layers, index_topk_freq 4, index_skip_topk_offset 3
  assert len(config.index_groups) == 21
  assert count_calls(_decode_step_jaxpr(config, "per_group"), CONVERSION) == 21


def test_per_layer_conversion_converts_in_every_layer():
  config = glm53_small(
    num_hidden_layers=10, indexer_types=("full",) * 3 + ("shared",) * 3 + ("full",) * 4
  )
  assert len(config.index_groups) == 7
  assert count_calls(_decode_step_jaxpr(config, "per_group"), CONVERSION) == 7
  assert count_calls(_decode_step_jaxpr(config, "per_layer"), CONVERSION) == 10


def test_speculative_steps_convert_once_per_group():
  """Verify runs the 78-layer target on q_len rows: 21 conversions. The draft step runs the MTP
  layer (one full layer) once per draft: k conversions."""
  config = glm53_small()
  batch_size, q_len, num_draft, max_pages = 2, 4, 3, 2
  graph, params, cache = _abstract(config, True, batch_size * max_pages, 64)
  statics = dict(sampling=GREEDY, kernels=_kernels("per_group"))
  verify = verify_step.trace(
    graph,
    params,
    cache,
    _int_arg(batch_size, q_len),
    _int_arg(batch_size),
    _int_arg(batch_size, max_pages),
    None,
    jax.random.key(0),
    **statics,
  )
  assert count_calls(verify.jaxpr, CONVERSION) == 21
  inputs = DraftInputs(
    target_hidden=jax.ShapeDtypeStruct((batch_size, q_len, config.hidden_size), jnp.float32),
    emitted=_int_arg(batch_size, q_len),
    num_accepted=_int_arg(batch_size),
    committed_lens=_int_arg(batch_size),
    block_tables=_int_arg(batch_size, max_pages),
  )
  draft = draft_step.trace(
    graph,
    params,
    cache,
    inputs,
    jax.random.key(0),
    num_draft=num_draft,
    prune=True,
    **statics,
  )
  assert count_calls(draft.jaxpr, CONVERSION) == num_draft
