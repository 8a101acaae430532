"""On a Hopper GPU the model's decode-type steps run the Pallas kernel; it must match XLA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.kernels.dispatch import is_hopper_gpu
from jaxspec.model.config import tiny
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.serving.engine import EngineConfig, Generator
from jaxspec.serving.kv_cache import BlockAllocator, PagedKVCache
from jaxspec.serving.sampling import GREEDY
from jaxspec.serving.spec_steps import verify_step

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
  graphdef, params = nnx.split(model)
  shape = engine.cache.layers[0][0].shape
  num_arrays = 2 * (model.config.num_hidden_layers + 1)  # target layers and the MTP layer

  def random_cache():
    """Fresh random pages each call (the step donates them), the same values every time."""
    arrays = [jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) for i in range(num_arrays)]
    return PagedKVCache(tuple(zip(arrays[::2], arrays[1::2], strict=True)))

  results = {}
  for impl in ("pallas", "xla"):
    _, _, hidden, _ = verify_step(
      graphdef,
      params,
      random_cache(),
      tokens,
      seq_lens,
      block_tables,
      None,
      jax.random.key(0),
      sampling=GREEDY,
      moe_impl="grouped",
      attention_impl=impl,
    )
    results[impl] = np.asarray(hidden.astype(jnp.float32))
  valid = np.asarray(seq_lens) > 0
  error = np.linalg.norm(results["pallas"][valid] - results["xla"][valid])
  assert error / np.linalg.norm(results["xla"][valid]) < 1e-2
