"""MTP speculative decoding on the GLM-5 family (MLA + DSA, latent cache) is lossless.

The model's top-k (4) is smaller than the sequences (up to 36 tokens), so the indexer prunes in
the target's verify rows and in the MTP layer's draft rows, both reading the paged latent cache.
"""

import pytest
from flax import nnx

from jaxspec.model.dsa_config import tiny_dsa
from jaxspec.model.dsa_transformer import GlmDsaForCausalLM
from jaxspec.serving.engine import EngineConfig, Generator
from jaxspec.serving.speculative import SpeculativeConfig, SpeculativeGenerator

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 3, 11, 12, 13, 14, 15, 1, 2, 3, 4, 6]]
ENGINE = EngineConfig(
  max_batch_size=4, max_seq_len=64, page_size=4, shuffle_pages_seed=5, attention_impl="xla"
)


@pytest.fixture(scope="module")
def bigram_model(mostly_bigram):
  # The small attention and MLP contributions keep both latent caches and the indexers in play.
  model = GlmDsaForCausalLM(tiny_dsa(vocab_size=32), rngs=nnx.Rngs(1))
  return mostly_bigram(model, scale=0.2)


@pytest.fixture(scope="module")
def plain_tokens(bigram_model):
  return (
    Generator(bigram_model, ENGINE).generate(PROMPTS, max_new_tokens=24, stop_token_ids=()).tokens
  )


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculative_equals_plain_greedy(bigram_model, plain_tokens, k):
  spec = SpeculativeGenerator(bigram_model, ENGINE, SpeculativeConfig(k)).generate(
    PROMPTS, max_new_tokens=24, stop_token_ids=()
  )
  assert spec.tokens == plain_tokens
  # Drafts are accepted often but not always: both paths of the rollback are exercised.
  assert 0.3 < spec.metrics["acceptance_rate"] < 1.0
