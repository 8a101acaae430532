"""On a Hopper GPU the model's decode-type steps run the Pallas kernel; it must match XLA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.kernels.dispatch import is_hopper_gpu
from jaxspec.model.config import tiny
from jaxspec.model.dsa_config import tiny_dsa
from jaxspec.model.metadata import KernelChoices
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.serving.engine import EngineConfig, Generator
from jaxspec.serving.kv_cache import BlockAllocator
from jaxspec.serving.model_graph import split_model
from jaxspec.serving.sampling import GREEDY
from jaxspec.serving.spec_steps import verify_step
from jaxspec.serving.steps import decode_metadata

pytestmark = pytest.mark.gpu


def _model():
  # Kernel-friendly head shape (D 128, G 8) in a small model.
  config = tiny(
    hidden_size=256, num_attention_heads=16, num_key_value_heads=2, head_dim=128, vocab_size=512
  )
  return GlmForCausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))


def test_verify_step_logits_with_the_kernel_match_xla():
  assert is_hopper_gpu()
  model = _model()
  k, batch, context, page = 5, 4, 300, 16
  engine = Generator(model, EngineConfig(max_batch_size=batch, max_seq_len=512, page_size=page))
  allocator = BlockAllocator(engine.config.total_pages, page)
  pages = -(-(context + k + 1) // page)
  block_tables = jnp.asarray([allocator.allocate(pages) for _ in range(batch)], jnp.int32)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 512, (batch, k + 1)), jnp.int32)
  seq_lens = jnp.asarray([context + k + 1, 17, k + 1, 0], jnp.int32)  # ragged, one padding slot
  graph, params = split_model(model)
  template = model.init_cache(engine.config.total_pages, page, draft=True)

  def random_cache():
    """Fresh random pages each call (the step donates them), the same values every time."""
    leaves, treedef = jax.tree.flatten(template)
    arrays = [
      jax.random.normal(jax.random.key(i), leaf.shape, jnp.bfloat16)
      for i, leaf in enumerate(leaves)
    ]
    return jax.tree.unflatten(treedef, arrays)

  results = {}
  for impl in ("pallas", "xla"):
    _, _, hidden, _ = verify_step(
      graph,
      params,
      random_cache(),
      tokens,
      seq_lens,
      block_tables,
      None,
      jax.random.key(0),
      sampling=GREEDY,
      kernels=KernelChoices(attention=impl, moe="grouped"),
    )
    results[impl] = np.asarray(hidden.astype(jnp.float32))
  valid = np.asarray(seq_lens) > 0
  error = np.linalg.norm(results["pallas"][valid] - results["xla"][valid])
  assert error / np.linalg.norm(results["xla"][valid]) < 1e-2


def test_dsa_verify_logits_with_the_conversion_kernel_match_xla():
  """GLM-5 family: a verify-style step (q_len 4) whose top-k conversion runs the Mosaic GPU kernel
  gives the logits of the XLA conversion, with conversions shared per group or done per layer."""
  assert is_hopper_gpu()
  config = tiny_dsa(index_topk=500)  # any top-k: the kernel masks the tail of its 512 tile
  model = GlmForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
  page, q_len, batch_size = 64, 4, 3
  seq_lens = jnp.asarray([700, 300, 0], jnp.int32)  # top-k prunes, top-k > length, padding
  allocator = BlockAllocator(batch_size * 12, page, shuffle_seed=3)
  block_tables = jnp.asarray([allocator.allocate(12) for _ in range(batch_size)], jnp.int32)
  cache = model.init_cache(allocator.num_pages, page, dtype=jnp.float32)
  keys = iter(jax.random.split(jax.random.key(2), len(jax.tree.leaves(cache))))
  cache = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype), cache)
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 64, (batch_size, q_len)), jnp.int32)

  @functools.partial(jax.jit, static_argnums=(0, 3))
  def logits(graphdef, params, cache, kernels):
    model = nnx.merge(graphdef, params)
    step = decode_metadata(seq_lens, block_tables, q_len, page, kernels)
    hidden, _ = model.forward(tokens, step, cache)
    return model.logits(hidden)

  graphdef, params = nnx.split(model)
  results = {}
  for sharing in ("per_group", "per_layer"):
    for impl in ("auto", "xla"):
      # Attention stays on XLA: this test is about the conversion kernel.
      kernels = KernelChoices(
        attention="xla", index_conversion=impl, index_sharing=sharing, moe="grouped"
      )
      lowered = logits.lower(graphdef, params, cache, kernels).as_text()
      assert ("mosaic_gpu" in lowered) == (impl == "auto")  # the kernel runs only on "auto"
      results[sharing, impl] = np.asarray(logits(graphdef, params, cache, kernels))
  valid = np.asarray(seq_lens) > 0
  reference = results["per_layer", "xla"][valid]
  assert np.isfinite(reference).all()
  for key, result in results.items():
    np.testing.assert_allclose(result[valid], reference, rtol=1e-5, atol=1e-5, err_msg=str(key))


def test_model_moe_with_the_routed_expert_kernels_matches_xla():
  """The decode step's MoE layers on the Mosaic GPU routed-expert kernels ("pallas") against
  the XLA grouped path, same weights and inputs (bf16: compared by relative error)."""
  assert is_hopper_gpu()
  config = tiny(
    hidden_size=256, moe_intermediate_size=128, n_routed_experts=16, n_group=1, vocab_size=512
  )
  model = GlmForCausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, 512, (4, 9)), jnp.int32)
  results = {
    impl: np.asarray(model(tokens, kernels=KernelChoices(moe=impl)), np.float32)
    for impl in ("pallas", "grouped")
  }
  error = np.linalg.norm(results["pallas"] - results["grouped"])
  assert error / np.linalg.norm(results["grouped"]) < 1e-2
