"""Paged prefill then decode reproduce the plain causal forward, for both model families.

Runs on the transformers fixtures (tests/fixtures), whose router and GLM-5 indexer top-k have no
near-ties on their `input_ids`, so a float32 rounding difference between the plain forward and the
paged path (for GLM-5: the expanded and the absorbed attention form) cannot flip a selection.
`glm_moe_dsa_a` prunes (top-k 4 of up to 11 keys, index groups (full, shared), (full));
`glm_moe_dsa_b` has one group of three layers. Caches are poisoned with NaN and page tables
shuffled, so a read of a slot that was never written shows.
"""

from pathlib import Path
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec.model.attention import GqaPages
from jaxspec.model.config import tiny
from jaxspec.model.dsa_config import tiny_dsa
from jaxspec.model.metadata import KernelChoices
from jaxspec.model.mla import MlaPages
from jaxspec.serving.engine import EngineConfig
from jaxspec.serving.kv_cache import BlockAllocator
from jaxspec.serving.speculative import SpeculativeConfig, SpeculativeGenerator
from jaxspec.serving.steps import decode_metadata, prefill_metadata

FIXTURES = Path(__file__).parents[1] / "fixtures"
XLA = KernelChoices(attention="xla", index_conversion="xla")


class PagedCase(NamedTuple):
  fixture: str
  page_size: int

  def __str__(self):
    return f"{self.fixture}-page{self.page_size}"


PREFILL_DECODE_CASES = [
  PagedCase("glm4_moe_a", 1),
  PagedCase("glm4_moe_b", 4),
  PagedCase("glm4_moe_c", 16),
  PagedCase("glm_moe_dsa_a", 2),
  PagedCase("glm_moe_dsa_a", 4),
  PagedCase("glm_moe_dsa_b", 64),
]


def _forward_logits(graphdef, params, cache, tokens, step):
  model = nnx.merge(graphdef, params)
  hidden, cache = model.forward(tokens, step, cache)
  return model.logits(hidden), cache


_forward = jax.jit(_forward_logits, static_argnums=0)


def _plain_logits(graphdef, params, tokens):
  return nnx.merge(graphdef, params)(tokens)


# The plain forward as one program: eager, each of the model's ops compiles on its own (seconds
# for each fixture on a CPU).
_plain_forward = jax.jit(_plain_logits, static_argnums=0)


def _setup(fixture, page_size, num_tokens, seed):
  """The fixture's model, its input ids and plain-forward logits, shuffled block tables and a
  NaN-poisoned cache."""
  model = jaxspec.load_pretrained(FIXTURES / fixture, dtype=jnp.float32)
  tokens = np.load(FIXTURES / fixture / "reference.npz")["input_ids"][:, :num_tokens]
  tokens = tokens.astype(np.int32)
  expected = np.asarray(_plain_forward(*nnx.split(model), jnp.asarray(tokens)))  # [B, T, V]
  batch_size = tokens.shape[0]
  max_pages = -(-num_tokens // page_size)
  allocator = BlockAllocator(batch_size * max_pages + 3, page_size, shuffle_seed=seed)
  block_tables = np.array([allocator.allocate(max_pages) for _ in range(batch_size)], np.int32)
  cache = model.init_cache(allocator.num_pages, page_size, dtype=jnp.float32)
  cache = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), cache)
  return model, tokens, expected, jnp.asarray(block_tables), cache


def _prefill(graphdef, params, cache, tokens, prompt_lens, block_tables, kernels=XLA):
  step = prefill_metadata(
    jnp.asarray(prompt_lens), block_tables, tokens.shape[1], cache.page_size, kernels
  )
  return _forward(graphdef, params, cache, jnp.asarray(tokens), step)


@pytest.mark.parametrize("case", PREFILL_DECODE_CASES, ids=str)
def test_prefill_then_decode_matches_plain_forward(case):
  total = 11
  model, tokens, expected, block_tables, cache = _setup(
    case.fixture, case.page_size, total, case.page_size
  )
  graphdef, params = nnx.split(model)
  prompt_lens = np.array([6, 2], np.int32)
  logits, cache = _prefill(graphdef, params, cache, tokens[:, :6], prompt_lens, block_tables)
  for b in range(2):
    np.testing.assert_allclose(
      np.asarray(logits)[b, : prompt_lens[b]], expected[b, : prompt_lens[b]], rtol=1e-5, atol=1e-5
    )
  lengths = prompt_lens.copy()
  while (lengths < total).any():
    step_tokens = tokens[np.arange(2), np.minimum(lengths, total - 1)][:, None]
    seq_lens = np.where(lengths < total, lengths + 1, 0).astype(np.int32)
    step = decode_metadata(jnp.asarray(seq_lens), block_tables, 1, case.page_size, XLA)
    logits, cache = _forward(graphdef, params, cache, jnp.asarray(step_tokens), step)
    logits = np.asarray(logits)
    assert np.isfinite(logits).all()  # padding rows included
    for b in np.flatnonzero(lengths < total):
      np.testing.assert_allclose(logits[b, 0], expected[b, lengths[b]], rtol=1e-5, atol=1e-5)
    lengths = np.where(lengths < total, lengths + 1, lengths)


@pytest.mark.parametrize(
  "fixture, q_len",
  [("glm4_moe_a", 2), ("glm4_moe_c", 4), ("glm_moe_dsa_a", 3), ("glm_moe_dsa_a", 5)],
)
def test_multi_row_decode_matches_plain_forward(fixture, q_len):
  """A verify-style step with q_len rows per request: each row attends over its causal prefix
  (GLM-5: each row selects its own keys)."""
  page_size, total = 4, 11
  model, tokens, expected, block_tables, cache = _setup(fixture, page_size, total, q_len)
  graphdef, params = nnx.split(model)
  prompt = total - q_len
  prompt_lens = np.full((2,), prompt, np.int32)
  _, cache = _prefill(graphdef, params, cache, tokens[:, :prompt], prompt_lens, block_tables)
  step = decode_metadata(jnp.full((2,), total, jnp.int32), block_tables, q_len, page_size, XLA)
  logits, _ = _forward(graphdef, params, cache, jnp.asarray(tokens[:, prompt:]), step)
  np.testing.assert_allclose(np.asarray(logits), expected[:, prompt:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fixture", ["glm_moe_dsa_a", "glm_moe_dsa_b"])
def test_shared_group_conversion_equals_per_layer_conversion(fixture):
  """Shared layers reusing their full layer's physical slots give the logits of converting in
  every layer (and both match the plain forward)."""
  page_size, total, q_len = 4, 11, 4
  model, tokens, expected, block_tables, cache = _setup(fixture, page_size, total, 3)
  graphdef, params = nnx.split(model)
  prompt = total - q_len
  prompt_lens = np.full((2,), prompt, np.int32)
  _, filled = _prefill(graphdef, params, cache, tokens[:, :prompt], prompt_lens, block_tables)
  results = []
  for sharing in ("per_group", "per_layer"):
    kernels = XLA.replace(index_sharing=sharing)
    step = decode_metadata(
      jnp.full((2,), total, jnp.int32), block_tables, q_len, page_size, kernels
    )
    logits, _ = _forward(graphdef, params, filled, jnp.asarray(tokens[:, prompt:]), step)
    results.append(np.asarray(logits))
  np.testing.assert_array_equal(results[0], results[1])
  np.testing.assert_allclose(results[0], expected[:, prompt:], rtol=1e-5, atol=1e-5)


def test_gqa_cache_layout():
  config = tiny()
  model = jaxspec.GlmForCausalLM(config, rngs=nnx.Rngs(0))
  cache = model.init_cache(5, 16, draft=True)
  shape = (config.num_key_value_heads, 5, 16, config.head_dim)
  for pages in [*cache.layers, cache.draft]:
    assert isinstance(pages, GqaPages)
    chex.assert_shape([pages.k, pages.v], shape)
    chex.assert_type([pages.k, pages.v], jnp.float32)
  assert len(cache.layers) == config.num_hidden_layers
  assert cache.page_size == 16 and cache.num_pages == 5
  assert model.init_cache(5, 16).draft is None


def test_mla_cache_layout():
  config = tiny_dsa()
  model = jaxspec.GlmForCausalLM(config, rngs=nnx.Rngs(0))
  cache = model.init_cache(5, 64, dtype=jnp.bfloat16, draft=True)
  latent, keys = (1, 5, 64, config.latent_dim), (1, 5, 64, config.index_head_dim)
  # full, shared, full, then the MTP layer (a full layer of its own).
  for pages, full in zip([*cache.layers, cache.draft], [True, False, True, True], strict=True):
    assert isinstance(pages, MlaPages)
    chex.assert_shape(pages.latent, latent)
    chex.assert_type(pages.latent, jnp.bfloat16)
    assert (pages.index_keys is not None) == full
    if full:
      chex.assert_shape(pages.index_keys, keys)
  assert cache.page_size == 64 and cache.num_pages == 5


def test_init_cache_rejects_bad_sizes_and_a_missing_draft_layer():
  model = jaxspec.GlmForCausalLM(tiny(num_nextn_predict_layers=0), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_pages"):
    model.init_cache(0, 16)
  with pytest.raises(ValueError, match="page_size"):
    model.init_cache(4, 2.5)
  with pytest.raises(ValueError, match="MTP layer"):
    model.init_cache(4, 16, draft=True)


def _fp8_prefill(kv_scale: float):
  """The glm4_moe_a fixture's prompts prefilled into a float32 cache and a float8_e4m3fn one
  (`kv_scale`): (the fp8 run's pieces, then for every written key and value vector: its fp8
  entries as float32 [N, Hkv, D], its per-head scales [N, Hkv, 1], the float32 cache's entries
  [N, Hkv, D])."""
  page_size, total = 4, 11
  model, tokens, _, block_tables, cache32 = _setup("glm4_moe_a", page_size, total, 5)
  graphdef, params = nnx.split(model)
  cache8 = model.init_cache(
    cache32.num_pages, page_size, dtype=jnp.float8_e4m3fn, kv_scale=kv_scale
  )
  prompt_lens = np.array([6, 2], np.int32)
  _, cache32 = _prefill(graphdef, params, cache32, tokens[:, :6], prompt_lens, block_tables)
  _, cache8 = _prefill(graphdef, params, cache8, tokens[:, :6], prompt_lens, block_tables)
  stored, scales, exact = [], [], []
  for pages8, pages32 in zip(cache8.layers, cache32.layers, strict=True):
    chex.assert_type([pages8.k, pages8.v], jnp.float8_e4m3fn)
    pairs = ((pages8.k, pages8.k_scale, pages32.k), (pages8.v, pages8.v_scale, pages32.v))
    for entries, scale, entries32 in pairs:
      for b, n in enumerate(prompt_lens):
        pages = np.asarray(block_tables[b])
        for t in range(n):
          page, offset = pages[t // page_size], t % page_size
          stored.append(np.asarray(entries[:, page, offset].astype(jnp.float32)))
          scales.append(np.asarray(scale)[:, None])
          exact.append(np.asarray(entries32[:, page, offset]))
  run = (graphdef, params, cache8, tokens, block_tables, prompt_lens, page_size)
  return run, np.stack(stored), np.stack(scales), np.stack(exact)


@pytest.mark.parametrize("kv_scale", [1.0, 0.01])
def test_fp8_cache_stores_each_key_and_value_to_e4m3_precision(kv_scale):
  """KV pages in float8_e4m3fn: the cache writer quantises value / kv_scale; read back times the
  scale, every entry is within e4m3's rounding (3 mantissa bits: relative 2^-4, and the subnormal
  step 2^-9 near zero) of the float32 cache's entry."""
  _, stored, scales, exact = _fp8_prefill(kv_scale)
  bound = 2.0**-4 * np.abs(exact) + 2.0**-9 * kv_scale
  assert (np.abs(stored * scales - exact) <= bound).all()


def test_fp8_cache_saturates_values_beyond_its_range():
  """A key or value beyond +-448 * kv_scale is stored as +-448 with its sign (saturating, as vLLM
  and FlashInfer write fp8 caches), never NaN: float8_e4m3fn has no infinities, so a plain cast
  stores NaN, and every later attention output of that request would be NaN."""
  kv_scale = 2.0**-12  # most keys and values overflow at this scale
  run, stored, _, exact = _fp8_prefill(kv_scale)
  want = exact / kv_scale
  over = np.abs(want) > 448
  assert over.any()
  np.testing.assert_array_equal(stored[over], np.sign(want[over]) * 448)
  bound = 2.0**-4 * np.abs(want[~over]) + 2.0**-9
  assert (np.abs(stored[~over] - want[~over]) <= bound).all()
  # A decode step reads the saturated pages: its logits stay finite.
  graphdef, params, cache8, tokens, block_tables, prompt_lens, page_size = run
  seq_lens = jnp.asarray(prompt_lens + 1)
  step = decode_metadata(seq_lens, block_tables, 1, page_size, XLA)
  step_tokens = jnp.asarray(tokens[np.arange(2), prompt_lens][:, None])
  logits, _ = _forward(graphdef, params, cache8, step_tokens, step)
  assert np.isfinite(np.asarray(logits)).all()


def test_fp8_cache_serves_generation():
  """An engine with fp8 KV pages decodes the same prompt end to end; its first greedy token
  agrees with the 16-bit cache's (later ones may drift with e4m3 rounding)."""
  model = jaxspec.load_pretrained(FIXTURES / "glm4_moe_a", dtype=jnp.float32)
  prompt = np.load(FIXTURES / "glm4_moe_a" / "reference.npz")["prompt_ids"][0].tolist()
  outputs = {}
  for dtype in ("auto", "float8_e4m3fn"):
    engine = EngineConfig(max_batch_size=1, max_seq_len=32, page_size=4, kv_cache_dtype=dtype)
    outputs[dtype] = SpeculativeGenerator(model, engine, SpeculativeConfig(3)).generate(
      [prompt], max_new_tokens=12, stop_token_ids=()
    )
  assert outputs["float8_e4m3fn"].tokens[0][0] == outputs["auto"].tokens[0][0]
  assert len(outputs["float8_e4m3fn"].tokens[0]) == 12
