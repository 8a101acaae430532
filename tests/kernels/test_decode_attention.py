"""Tests of paged multi-row decode attention against a float64 NumPy reference."""

import dataclasses
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

from jaxspec.kernels.decode_attention.api import paged_decode_attention
from jaxspec.kernels.decode_attention.mosaic_gpu import TuningConfig, default_config

# Output tolerances per input dtype: the inputs are exact in that dtype (the
# float64 reference reads the same rounded values), so the error comes from
# rounding the probabilities / output to it (bf16: 8 mantissa bits).
TOLERANCES = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


def make_case(rng, seq_lens, q_len, num_kv_heads, group, head_dim, page_size, dtype, spare_pages=3):
  """Random inputs with a shuffled page pool; every page no request owns is NaN.

  Block-table entries past a request's pages hold garbage ids (out of range or
  pointing at NaN pages) so that a read beyond the length would show.
  """
  seq_lens = np.asarray(seq_lens, np.int32)
  batch = len(seq_lens)
  pages_needed = [math.ceil(s / page_size) for s in seq_lens]
  max_pages = max(max(pages_needed), 1) + 1
  num_pages = sum(pages_needed) + spare_pages
  order = rng.permutation(num_pages)
  block_tables = rng.integers(-5, num_pages + 5, size=(batch, max_pages)).astype(np.int32)
  next_page = 0
  for b, needed in enumerate(pages_needed):
    block_tables[b, :needed] = order[next_page : next_page + needed]
    next_page += needed
  shape = (num_kv_heads, num_pages, page_size, head_dim)
  k_pages = rng.standard_normal(shape).astype(np.float32)
  v_pages = rng.standard_normal(shape).astype(np.float32)
  unused = order[next_page:]
  k_pages[:, unused] = np.nan
  v_pages[:, unused] = np.nan
  # Positions past each request's length inside its last page are NaN too.
  for b, s in enumerate(seq_lens):
    if s % page_size:
      last = block_tables[b, pages_needed[b] - 1]
      k_pages[:, last, s % page_size :] = np.nan
      v_pages[:, last, s % page_size :] = np.nan
  q = rng.standard_normal((batch, q_len, num_kv_heads * group, head_dim)).astype(np.float32)
  return (
    jnp.asarray(q, dtype),
    jnp.asarray(k_pages, dtype),
    jnp.asarray(v_pages, dtype),
    jnp.asarray(block_tables),
    jnp.asarray(seq_lens),
  )


def reference_float64(q, k_pages, v_pages, block_tables, seq_lens, sm_scale):
  """Row-by-row float64 attention, written independently of the jnp reference."""
  q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
  block_tables, seq_lens = np.asarray(block_tables), np.asarray(seq_lens)
  batch, q_len, num_q_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  out = np.zeros(q.shape, np.float64)
  for b in range(batch):
    for j in range(q_len):
      visible = seq_lens[b] - q_len + j + 1
      if visible <= 0:
        continue
      pos = np.arange(visible)
      pages = block_tables[b, pos // page_size]
      for h in range(num_q_heads):
        keys = k_pages[h // group, pages, pos % page_size]  # [visible, D]
        values = v_pages[h // group, pages, pos % page_size]
        scores = keys @ q[b, j, h] * sm_scale
        probs = np.exp(scores - scores.max())
        out[b, j, h] = probs @ values / probs.sum()
  return out


def check(out, q, k_pages, v_pages, block_tables, seq_lens, dtype):
  assert out.shape == q.shape and out.dtype == q.dtype
  expected = reference_float64(
    q, k_pages, v_pages, block_tables, seq_lens, 1.0 / math.sqrt(q.shape[-1])
  )
  actual = np.asarray(out, np.float64)
  assert np.all(np.isfinite(actual))
  tol = TOLERANCES[dtype]
  np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol)


XLA_CASES = [
  # seq_lens, q_len, Hkv, G, D, page, dtype
  ([1, 16, 17, 0], 1, 2, 1, 64, 16, jnp.float32),
  ([40, 3, 1, 0, 64], 4, 1, 8, 64, 16, jnp.float32),
  ([2, 33, 100], 8, 2, 3, 128, 32, jnp.bfloat16),
  ([5, 64, 129], 7, 1, 12, 64, 64, jnp.float16),
]


@pytest.mark.parametrize("case", XLA_CASES)
def test_xla_matches_float64(case):
  seq_lens, q_len, num_kv_heads, group, head_dim, page_size, dtype = case
  rng = np.random.default_rng(zlib.crc32(str(case).encode()))
  args = make_case(rng, seq_lens, q_len, num_kv_heads, group, head_dim, page_size, dtype)
  out = jax.jit(paged_decode_attention, static_argnames=("impl",))(*args, impl="xla")
  check(out, *args, dtype)


def test_sm_scale_is_used():
  rng = np.random.default_rng(0)
  args = make_case(rng, [9, 20], 2, 1, 2, 64, 16, jnp.float32)
  default = paged_decode_attention(*args, impl="xla")
  halved = paged_decode_attention(*args, sm_scale=0.5 / 8.0, impl="xla")
  assert not np.allclose(default, halved)


@pytest.mark.parametrize(
  "mutate, message",
  [
    (lambda a: {**a, "q": a["q"][0]}, "q must be"),
    (lambda a: {**a, "q": jnp.zeros((2, 9, 2, 64), jnp.float32)}, "q_len"),
    (lambda a: {**a, "k_pages": a["k_pages"][..., :32]}, "k_pages"),
    (lambda a: {**a, "v_pages": a["v_pages"][:, :1]}, "v_pages"),
    (lambda a: {**a, "q": jnp.zeros((2, 1, 3, 64), jnp.float32)}, "multiple of Hkv"),
    (lambda a: {**a, "block_tables": a["block_tables"][:1]}, "block_tables"),
    (lambda a: {**a, "seq_lens": a["seq_lens"].astype(jnp.int16)}, "seq_lens"),
    (lambda a: {**a, "k_pages": a["k_pages"].astype(jnp.bfloat16)}, "k_pages"),
  ],
)
def test_bad_inputs_raise(mutate, message):
  rng = np.random.default_rng(1)
  names = ("q", "k_pages", "v_pages", "block_tables", "seq_lens")
  args = dict(zip(names, make_case(rng, [9, 20], 1, 2, 1, 64, 16, jnp.float32), strict=True))
  with pytest.raises(ValueError, match=message):
    paged_decode_attention(**mutate(args), impl="xla")
  with pytest.raises(ValueError, match="impl"):
    paged_decode_attention(*make_case(rng, [3], 1, 1, 1, 64, 16, jnp.float32), impl="triton")


# Interpret-mode cases of the Mosaic GPU kernel (small: the interpreter is slow).
# Lengths hit 1, page and block boundaries, chunk boundaries, rows that see
# nothing (S < q_len) and padding slots (S = 0).
KERNEL_CASES = [
  # seq_lens, q_len, Hkv, G, D, page, dtype, config
  ([70, 3, 0, 1], 3, 1, 2, 64, 16, jnp.bfloat16, TuningConfig(num_stages=2, num_chunks=2)),
  ([1, 64, 65, 130], 1, 2, 1, 128, 32, jnp.bfloat16, TuningConfig(num_stages=2, num_chunks=3)),
  ([200, 5], 8, 1, 8, 64, 64, jnp.float16, TuningConfig(num_stages=3, num_chunks=1)),
  ([129, 2, 7], 7, 1, 8, 128, 16, jnp.bfloat16, TuningConfig(num_stages=4, num_chunks=2)),
  ([100, 6], 6, 1, 12, 64, 32, jnp.bfloat16, TuningConfig(block_kv=128, num_stages=2)),
  ([64, 191], 2, 2, 4, 64, 16, jnp.float16, None),
]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_interpret_matches_float64(case):
  seq_lens, q_len, num_kv_heads, group, head_dim, page_size, dtype, config = case
  rng = np.random.default_rng(zlib.crc32(str(case).encode()))
  args = make_case(rng, seq_lens, q_len, num_kv_heads, group, head_dim, page_size, dtype)
  out = paged_decode_attention(*args, impl="pallas", interpret=True, config=config)
  check(out, *args, dtype)
  assert not get_races().races_found


# More than 64 packed rows (G * q_len > 64) as one 128-row tile of two
# warpgroups sharing each K/V block. Lengths cross chunk boundaries (200 over
# 2 chunks of 64-position blocks), need ring refills (num_stages below the
# blocks per chunk), and include rows that see nothing and padding slots.
TWO_WARPGROUP_CASES = [
  # seq_lens, q_len, Hkv, G, D, page, dtype, config
  ([200, 4, 0, 65], 6, 1, 12, 64, 16, jnp.bfloat16, TuningConfig(num_stages=1, num_chunks=2)),
  ([129, 6, 1], 7, 1, 12, 128, 32, jnp.float16, TuningConfig(num_stages=2, num_chunks=1)),
  ([250, 3, 64], 5, 1, 16, 128, 16, jnp.bfloat16, TuningConfig(num_stages=1, num_chunks=3)),
  ([190, 7, 0], 8, 2, 16, 64, 64, jnp.bfloat16, TuningConfig(block_kv=128, num_stages=2)),
]


def _two_warpgroups(config):
  return dataclasses.replace(config, two_warpgroup_tiles=True)


@pytest.mark.parametrize("case", TWO_WARPGROUP_CASES)
def test_two_warpgroup_tile_interpret_matches_float64(case):
  seq_lens, q_len, num_kv_heads, group, head_dim, page_size, dtype, config = case
  rng = np.random.default_rng(zlib.crc32(str(case).encode()))
  args = make_case(rng, seq_lens, q_len, num_kv_heads, group, head_dim, page_size, dtype)
  out = paged_decode_attention(*args, impl="pallas", interpret=True, config=_two_warpgroups(config))
  check(out, *args, dtype)
  assert not get_races().races_found


# One chunk length for the whole batch (TuningConfig.balance_waves). The plan
# aims at `balance_waves x slots` items per (KV head, row tile); with 1 SM in
# place of 132 the tiny batches below already exceed that, so the common
# length decides: long requests get several chunks, short ones one, and the
# static grid's spare items (loading and storing nothing) must not leak NaN
# from their unwritten output tiles into the merge.
BALANCED_CASES = [
  # seq_lens, q_len, Hkv, G, D, page, dtype, config
  ([300, 5, 0, 70], 3, 1, 8, 64, 16, jnp.bfloat16, TuningConfig(num_stages=2, balance_waves=1)),
  ([200, 1, 129], 7, 2, 4, 128, 32, jnp.float16, TuningConfig(num_stages=1, balance_waves=2)),
  (
    [260, 64, 2],
    6,
    1,
    12,
    64,
    16,
    jnp.bfloat16,
    TuningConfig(num_stages=2, num_chunks=3, balance_waves=1, two_warpgroup_tiles=True),
  ),
]


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", BALANCED_CASES)
def test_balanced_chunks_match_float64(case, interpret):
  seq_lens, q_len, num_kv_heads, group, head_dim, page_size, dtype, config = case
  config = dataclasses.replace(config, num_sms=1)
  rng = np.random.default_rng(zlib.crc32(str(case).encode()))
  args = make_case(rng, seq_lens, q_len, num_kv_heads, group, head_dim, page_size, dtype)
  out = paged_decode_attention(*args, impl="pallas", interpret=interpret, config=config)
  check(out, *args, dtype)
  assert not (interpret and get_races().races_found)


def test_chunk_merge_is_deterministic_and_split_invariant():
  rng = np.random.default_rng(7)
  args = make_case(rng, [190, 33], 2, 1, 8, 64, 16, jnp.bfloat16)
  one = paged_decode_attention(*args, impl="pallas", interpret=True, config=TuningConfig())
  three = paged_decode_attention(
    *args, impl="pallas", interpret=True, config=TuningConfig(num_chunks=3)
  )
  again = paged_decode_attention(
    *args, impl="pallas", interpret=True, config=TuningConfig(num_chunks=3)
  )
  np.testing.assert_array_equal(np.asarray(three), np.asarray(again))
  np.testing.assert_allclose(np.asarray(one, np.float32), np.asarray(three, np.float32), atol=2e-2)


def test_pallas_rejects_what_it_cannot_serve_and_auto_falls_back():
  rng = np.random.default_rng(3)
  args = make_case(rng, [9, 20], 2, 1, 2, 64, 16, jnp.float32)
  with pytest.raises(ValueError, match="bf16 or fp16"):
    paged_decode_attention(*args, impl="pallas", interpret=True)
  check(paged_decode_attention(*args, impl="auto", interpret=True), *args, jnp.float32)
  args = make_case(rng, [9, 20], 2, 1, 2, 96, 16, jnp.bfloat16)
  with pytest.raises(ValueError, match="head dim"):
    paged_decode_attention(*args, impl="pallas", interpret=True)
  with pytest.raises(ValueError, match="block_kv"):
    TuningConfig(block_kv=96)
  with pytest.raises(ValueError, match="two_warpgroup_tiles"):
    TuningConfig(two_warpgroup_tiles=1)
  with pytest.raises(ValueError, match="balance_waves"):
    TuningConfig(balance_waves=0)


def _coverage_cases():
  """Every q_len 1..8, G in {1, 2, 4, 8, 12, 16}, D 64/128, page 16/32/64, bf16/fp16."""
  groups, head_dims, pages, dtypes = (1, 2, 4, 8, 12, 16), (64, 128), (16, 32, 64), (0, 1)
  cases = []
  for i, q_len in enumerate(range(1, 9)):
    for g_index, group in enumerate(groups):
      cases.append(
        (
          q_len,
          group,
          head_dims[(i + g_index) % 2],
          pages[(i + g_index) % 3],
          (jnp.bfloat16, jnp.float16)[dtypes[(i * 7 + g_index) % 2]],
        )
      )
  return cases


@pytest.mark.gpu
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_gpu_small_cases(case):
  seq_lens, q_len, num_kv_heads, group, head_dim, page_size, dtype, config = case
  rng = np.random.default_rng(zlib.crc32(str(case).encode()))
  args = make_case(rng, seq_lens, q_len, num_kv_heads, group, head_dim, page_size, dtype)
  check(paged_decode_attention(*args, impl="pallas", config=config), *args, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("case", _coverage_cases())
def test_kernel_gpu_coverage(case):
  q_len, group, head_dim, page_size, dtype = case
  rng = np.random.default_rng(zlib.crc32(str(case).encode()))
  seq_lens = [0, 1, q_len, page_size + 1, int(rng.integers(200, 700))]
  args = make_case(rng, seq_lens, q_len, 2, group, head_dim, page_size, dtype)
  check(paged_decode_attention(*args, impl="pallas"), *args, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("case", TWO_WARPGROUP_CASES)
def test_two_warpgroup_tile_gpu_small_cases(case):
  seq_lens, q_len, num_kv_heads, group, head_dim, page_size, dtype, config = case
  rng = np.random.default_rng(zlib.crc32(str(case).encode()))
  args = make_case(rng, seq_lens, q_len, num_kv_heads, group, head_dim, page_size, dtype)
  out = paged_decode_attention(*args, impl="pallas", config=_two_warpgroups(config))
  check(out, *args, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize(
  "q_len, group, head_dim", [(6, 12, 128), (7, 12, 64), (8, 12, 128), (5, 16, 64), (8, 16, 128)]
)
def test_two_warpgroup_tile_gpu_random(q_len, group, head_dim):
  """Ragged random lengths (1 to ~3000, edge lengths included) with the heuristic defaults."""
  rng = np.random.default_rng(q_len * 100 + group + head_dim)
  seq_lens = [0, 1, q_len - 1, 16, 17, *rng.integers(200, 3000, size=3)]
  args = make_case(rng, seq_lens, q_len, 2, group, head_dim, 16, jnp.bfloat16)
  config = _two_warpgroups(default_config(head_dim, 16))
  check(paged_decode_attention(*args, impl="pallas", config=config), *args, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, max_len", [(1, 9000), (6, 3000)])
@pytest.mark.parametrize("balance_waves", [None, 2])
def test_kernel_gpu_large_random(batch, max_len, balance_waves):
  rng = np.random.default_rng(batch)
  seq_lens = rng.integers(1, max_len, size=batch)
  args = make_case(rng, seq_lens, 7, 2, 8, 128, 16, jnp.bfloat16)
  config = dataclasses.replace(default_config(128, 16), balance_waves=balance_waves)
  check(paged_decode_attention(*args, impl="pallas", config=config), *args, jnp.bfloat16)


@pytest.mark.gpu
def test_balanced_chunks_gpu_ragged_batch():
  """64 requests of 1 to 5000 positions, padding slots among them, with the real SM count."""
  rng = np.random.default_rng(64)
  seq_lens = rng.integers(1, 5000, size=64)
  seq_lens[[3, 40]] = 0
  args = make_case(rng, seq_lens, 4, 4, 8, 128, 16, jnp.bfloat16)
  config = dataclasses.replace(default_config(128, 16), balance_waves=1)
  check(paged_decode_attention(*args, impl="pallas", config=config), *args, jnp.bfloat16)
