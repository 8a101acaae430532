"""One top-k conversion per index group in decode steps, counted in the traced step.

`convert_topk_to_physical` is a `jax.jit` function, so every call shows up in a traced step as one
`jit` equation named after it; the count does not depend on what its body lowers to.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.jaxpr_utils import count_calls
from jaxspec.kernels.sparse_index import api as sparse_index_api
from jaxspec.model.dsa_config import glm53_small
from jaxspec.model.dsa_transformer import GlmDsaForCausalLM
from jaxspec.serving.latent_cache import create_latent_cache
from jaxspec.serving.sampling import GREEDY
from jaxspec.serving.spec_steps import draft_step, verify_step
from jaxspec.serving.steps import decode_step

CONVERSION = sparse_index_api.OP.backend_names


def _int_arg(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.int32)


def _abstract(config, index_conversion, num_cache_layers, num_pages, page_size):
  """(graphdef, abstract params, abstract cache): tracing needs no weights."""
  model = nnx.eval_shape(
    lambda: GlmDsaForCausalLM(config, rngs=nnx.Rngs(0), index_conversion=index_conversion)
  )
  graphdef, params = nnx.split(model)
  cache = jax.eval_shape(
    lambda: create_latent_cache(config, num_cache_layers, num_pages, page_size, jnp.float32)
  )
  return graphdef, params, cache


def _decode_step_jaxpr(config, index_conversion, batch_size=2, page_size=64, max_pages=2):
  graphdef, params, cache = _abstract(
    config, index_conversion, config.num_hidden_layers, batch_size * max_pages, page_size
  )
  traced = decode_step.trace(
    graphdef,
    params,
    cache,
    _int_arg(batch_size, 1),
    _int_arg(batch_size),
    _int_arg(batch_size, max_pages),
    jax.random.key(0),
    sampling=GREEDY,
    moe_impl="per_route",
    attention_impl="xla",
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
  graphdef, params, cache = _abstract(
    config, "per_group", config.num_hidden_layers + 1, batch_size * max_pages, 64
  )
  statics = dict(sampling=GREEDY, attention_impl="xla")
  verify = verify_step.trace(
    graphdef,
    params,
    cache,
    _int_arg(batch_size, q_len),
    _int_arg(batch_size),
    _int_arg(batch_size, max_pages),
    None,
    jax.random.key(0),
    moe_impl="per_route",
    **statics,
  )
  assert count_calls(verify.jaxpr, CONVERSION) == 21
  draft = draft_step.trace(
    graphdef,
    params,
    cache,
    jax.ShapeDtypeStruct((batch_size, q_len, config.hidden_size), jnp.float32),
    _int_arg(batch_size, q_len),
    _int_arg(batch_size),
    _int_arg(batch_size),
    _int_arg(batch_size, max_pages),
    jax.random.key(0),
    num_draft=num_draft,
    prune=True,
    **statics,
  )
  assert count_calls(draft.jaxpr, CONVERSION) == num_draft
