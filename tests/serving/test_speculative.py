"""MTP speculative decoding: lossless under greedy, row pruning, static shapes, acceptance.

The lossless test runs on both model families: GLM-4.5 (GQA) and GLM-5 (MLA + DSA, whose top-k 4
is smaller than the sequences, so the indexer prunes in the target's verify rows and in the MTP
layer's draft rows, both reading the paged latent cache).
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.model import moe as moe_module
from jaxspec.model.config import tiny
from jaxspec.model.dsa_config import tiny_dsa
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.serving import spec_steps, speculative
from jaxspec.serving.engine import EngineConfig, Generator
from jaxspec.serving.sampling import GREEDY, SamplingParams
from jaxspec.serving.speculative import SpeculativeConfig, SpeculativeGenerator
from jaxspec.testing import count_compiles

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 3, 11, 12, 13, 14, 15, 1, 2, 3, 4, 6]]
ENGINE = EngineConfig(
  max_batch_size=4, max_seq_len=96, page_size=4, shuffle_pages_seed=5, attention_impl="xla"
)
# (config, attention/MLP scale): the small contributions keep the caches (and GLM-5's indexers)
# in play, so a cache bug changes tokens.
BIGRAM_FAMILIES = {
  "glm4_moe": (tiny(vocab_size=32, first_k_dense_replace=1), 0.05),
  "glm_moe_dsa": (tiny_dsa(vocab_size=32), 0.2),
}


@pytest.fixture(scope="module")
def random_model():
  return GlmForCausalLM(tiny(vocab_size=16), rngs=nnx.Rngs(1))


@pytest.fixture(scope="module", params=sorted(BIGRAM_FAMILIES))
def family_bigram_model(request, mostly_bigram):
  config, scale = BIGRAM_FAMILIES[request.param]
  return mostly_bigram(GlmForCausalLM(config, rngs=nnx.Rngs(0)), scale=scale)


@pytest.fixture(scope="module")
def bigram_model(mostly_bigram):
  config, scale = BIGRAM_FAMILIES["glm4_moe"]
  return mostly_bigram(GlmForCausalLM(config, rngs=nnx.Rngs(0)), scale=scale)


def _plain(model, prompts, max_new_tokens, stop=()):
  return Generator(model, ENGINE).generate(
    prompts, max_new_tokens=max_new_tokens, stop_token_ids=stop
  )


# k = 3 (the default) runs in most other tests of speculative decoding; 1 and 5 are the edges.
@pytest.mark.parametrize("k", [1, 5])
def test_greedy_speculative_equals_plain_greedy(family_bigram_model, k):
  model = family_bigram_model
  plain = _plain(model, PROMPTS, 24)
  # Request 1 finishes early at a stop token of its own plain output.
  stop = (plain.tokens[1][6],)
  plain = _plain(model, PROMPTS, 24, stop)
  spec = SpeculativeGenerator(model, ENGINE, SpeculativeConfig(k)).generate(
    PROMPTS, max_new_tokens=24, stop_token_ids=stop
  )
  assert spec.tokens == plain.tokens
  assert len(spec.tokens[1]) < 24
  metrics = spec.metrics
  # Drafts are accepted often but not always: both paths of the rollback are exercised.
  assert 0.3 < metrics["acceptance_rate"] < 1.0
  assert len(metrics["per_position_acceptance"]) == k
  assert metrics["mean_accepted_length"] == pytest.approx(
    1 + sum(metrics["per_position_acceptance"])
  )


def test_lossless_with_a_random_draft_head(random_model):
  """Nearly every draft of a random MTP head is rejected: the all-reject path stays lossless."""
  plain = _plain(random_model, PROMPTS, 16)
  spec = SpeculativeGenerator(random_model, ENGINE, SpeculativeConfig(3)).generate(
    PROMPTS, max_new_tokens=16, stop_token_ids=()
  )
  assert spec.tokens == plain.tokens


def test_oracle_drafts_with_planted_errors_are_accepted_up_to_the_error(random_model, monkeypatch):
  """Drafts from the true greedy continuation, corrupted at a random position per cycle: the
  target must accept exactly the correct prefix, and the output stay exactly greedy."""
  k, max_new = 4, 20
  plain = _plain(random_model, PROMPTS, max_new + 2 * k + 2)
  full = [p + t for p, t in zip(PROMPTS, plain.tokens, strict=True)]
  rng = np.random.default_rng(0)
  planted = []

  def oracle_cycle_step(graph, params, cache, state, tables, key, **kw):
    emitted, next_state, cache = spec_steps.cycle_step(
      graph, params, cache, state, tables, key, **kw
    )
    # The cycle's committed lengths: seq_lens - (k + 1) + the tokens it emitted.
    seq_lens, emitted_now = np.asarray(state.seq_lens), np.asarray(emitted)
    committed = np.where(seq_lens > 0, seq_lens - (k + 1) + (emitted_now >= 0).sum(axis=1), 0)
    drafts = np.zeros((len(committed), k), np.int32)
    errors = rng.integers(0, k + 1, len(committed))
    for b, n in enumerate(committed):
      # A cycle the engine dispatched after the request's last one (its rows are dropped) starts
      # with max_new tokens generated: nothing of it is counted.
      generated_before = seq_lens[b] - (k + 1) - len(PROMPTS[b]) + 1 if b < len(full) else 0
      if n > 0 and b < len(full) and generated_before < max_new:
        # The bonus token sits at position `committed`; draft i belongs at committed + i.
        drafts[b] = full[b][n + 1 : n + 1 + k]
        if errors[b] < k:
          drafts[b, errors[b]] = (drafts[b, errors[b]] + 1) % 16
          planted.append(errors[b])
        else:
          planted.append(k)
    return emitted, dataclasses.replace(next_state, drafts=jnp.asarray(drafts)), cache

  monkeypatch.setattr(speculative, "cycle_step", oracle_cycle_step)
  spec = SpeculativeGenerator(random_model, ENGINE, SpeculativeConfig(k)).generate(
    PROMPTS, max_new_tokens=max_new, stop_token_ids=()
  )
  assert spec.tokens == [t[:max_new] for t in plain.tokens]
  # Each cycle accepts exactly the drafts before the planted error. Two kinds of cycles escape
  # the count, at most one of each per request: the first verify checks the random head's drafts,
  # and the drafts made in a request's last cycle are never verified.
  metrics = spec.metrics
  assert metrics["acceptance_rate"] > 0.3
  accepted_rows = np.round(np.array(metrics["per_position_acceptance"]) * metrics["verify_steps"])
  planted_counts = np.array([sum(e > j for e in planted) for j in range(k)])
  assert np.all(np.abs(accepted_rows - planted_counts) <= len(PROMPTS)), (
    accepted_rows,
    planted_counts,
  )


def _moe_calls(monkeypatch, prune, model, batch, q_len):
  calls = []
  original = moe_module.MoE.__call__

  def recording(self, x, *, moe_impl, interpret=False):
    calls.append((x.shape, moe_impl))
    return original(self, x, moe_impl=moe_impl, interpret=interpret)

  monkeypatch.setattr(moe_module.MoE, "__call__", recording)
  generator = SpeculativeGenerator(model, ENGINE, SpeculativeConfig(q_len - 1))
  inputs = spec_steps.DraftInputs(
    target_hidden=jnp.zeros((batch, q_len, model.config.hidden_size)),
    emitted=jnp.zeros((batch, q_len), jnp.int32),
    num_accepted=jnp.zeros(batch, jnp.int32),
    committed_lens=jnp.full(batch, 8, jnp.int32),
    block_tables=jnp.zeros((batch, 4), jnp.int32),
  )
  jax.make_jaxpr(
    lambda cache: spec_steps.draft_step_impl(
      generator.graph,
      generator.params,
      cache,
      inputs,
      jax.random.key(0),
      num_draft=q_len - 1,
      sampling=GREEDY,
      kernels=ENGINE.kernels,
      prune=prune,
    )
  )(generator.cache)
  monkeypatch.setattr(moe_module.MoE, "__call__", original)
  return calls


def test_pruned_draft_step_runs_moe_on_max_num_reqs_rows(bigram_model, monkeypatch):
  batch, q_len = 4, 4
  pruned = _moe_calls(monkeypatch, True, bigram_model, batch, q_len)
  unpruned = _moe_calls(monkeypatch, False, bigram_model, batch, q_len)
  hidden = bigram_model.config.hidden_size
  # First draft step: the MoE input has max_num_reqs rows when pruned, all rows otherwise.
  chex.assert_shape(jnp.zeros(pruned[0][0]), (batch, hidden))
  chex.assert_shape(jnp.zeros(unpruned[0][0]), (batch, q_len, hidden))
  # The implementation is chosen from the unpruned count and is the same on both paths.
  assert [impl for _, impl in pruned] == [impl for _, impl in unpruned]
  assert pruned[0][1] == moe_module.choose_moe_impl(batch * q_len, bigram_model.config)


def test_pruned_and_unpruned_give_identical_drafts_and_acceptance(bigram_model):
  outputs = [
    SpeculativeGenerator(bigram_model, ENGINE, SpeculativeConfig(3, prune_draft_rows=p)).generate(
      PROMPTS, max_new_tokens=16, stop_token_ids=()
    )
    for p in (True, False)
  ]
  assert outputs[0].tokens == outputs[1].tokens
  for field in ("acceptance_rate", "per_position_acceptance", "verify_steps"):
    assert outputs[0].metrics[field] == outputs[1].metrics[field]


def test_no_recompilation_after_warm_up(bigram_model):
  generator = SpeculativeGenerator(
    bigram_model,
    EngineConfig(max_batch_size=4, max_seq_len=640, page_size=8, attention_impl="xla"),
    SpeculativeConfig(2),
  )
  generator.generate(PROMPTS, max_new_tokens=8, stop_token_ids=())  # warm-up
  with count_compiles() as count:
    out = generator.generate(PROMPTS, max_new_tokens=600, stop_token_ids=())
  assert out.metrics.decode_steps >= 200  # verify + draft cycles, acceptance varying
  assert 0.3 < out.metrics.acceptance_rate < 1.0
  assert count.compiles == 0


def test_sampled_speculative_decoding_is_reproducible(bigram_model):
  sampling = SamplingParams(temperature=0.7, top_k=8, top_p=0.9)
  runs = [
    SpeculativeGenerator(bigram_model, ENGINE, SpeculativeConfig(3)).generate(
      PROMPTS, max_new_tokens=12, sampling=sampling, seed=4, stop_token_ids=()
    )
    for _ in range(2)
  ]
  assert runs[0].tokens == runs[1].tokens
  assert all(len(t) == 12 for t in runs[0].tokens)
  assert runs[0].metrics["acceptance_rate"] > 0.2


@pytest.mark.parametrize("k", [5, 7])
def test_rows_past_a_requests_pages_land_in_the_spill_page(bigram_model, monkeypatch, k):
  """The drafts of a request's last cycle reach up to 2k - 2 positions past its last token, its
  pages only k + 1: the rows past its pages must land in the spill page, and every page the
  wave never owned keep its zeros, in every layer's cache and the MTP layer's. Page 0 is among
  those: block tables padded with 0 would send the rows there, into another request's page when
  that request owns it (its drafts change, which losslessness alone does not show)."""
  engine = SpeculativeGenerator(bigram_model, ENGINE, SpeculativeConfig(k))
  owned, allocate = set(), engine.allocator.allocate

  def recording(num_pages):
    pages = allocate(num_pages)
    owned.update(pages)
    return pages

  monkeypatch.setattr(engine.allocator, "allocate", recording)
  # 20 tokens: a last cycle that accepts enough drafts to write past its request's pages.
  out = engine.generate(PROMPTS, max_new_tokens=20, stop_token_ids=())
  assert all(len(tokens) == 20 for tokens in out.tokens)
  never_owned = sorted(set(range(ENGINE.total_pages)) - owned)
  assert 0 in never_owned and ENGINE.spill_page not in owned
  spill_written = False
  for pages in jax.tree.leaves(engine.cache):  # [Hkv, num_pages + 1, page_size, D]
    pages = np.asarray(pages)
    assert not pages[:, never_owned].any()
    spill_written |= bool(pages[:, ENGINE.spill_page].any())
  assert spill_written, "no row went past its request's pages: the test no longer tests them"
