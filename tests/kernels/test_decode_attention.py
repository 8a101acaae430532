"""Paged multi-row decode attention: both paths against a float64 oracle, the host-side checks,
the device-value contract and the one rule every path follows outside it, fp8 pages.

Kernel cases run in GPU interpret mode with race detection on the CPU and natively on a GPU
(the same cases, marked ``gpu``); ``decode_attention_inputs`` draws the inputs (NaN-poisoned
unowned pages, shuffled page tables) and holds the oracle.
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_attention_inputs import (
  FP8,
  Inputs,
  KernelCase,
  case_params,
  check,
  make_inputs,
  oracle,
)
from jax.experimental import checkify
from jax.experimental.pallas import mosaic_gpu as plgpu
from races import races_found

from jaxspec.contracts import checked_jit
from jaxspec.kernels import paged_decode_attention
from jaxspec.kernels.decode_attention import api, mosaic_gpu
from jaxspec.kernels.decode_attention.mosaic_gpu import TuningConfig, default_config

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
ON_GPU_OR_INTERPRETED = [True, pytest.param(False, marks=pytest.mark.gpu)]


XLA_CASES = [
  KernelCase((1, 16, 17, 0), 1, 2, 1, 64, 16, F32),
  KernelCase((40, 3, 1, 0, 64), 4, 1, 8, 64, 16, F32),
  KernelCase((2, 33, 100), 8, 2, 3, 128, 32, BF16),
  KernelCase((5, 64, 129), 7, 1, 12, 64, 64, F16),
  KernelCase((30, 0, 77), 3, 2, 4, 64, 16, BF16, fp8=True),
  KernelCase((1, 50), 2, 1, 2, 64, 16, F32, fp8=True),
]


@pytest.mark.parametrize("case", **case_params(XLA_CASES))
def test_xla_matches_float64(case):
  inputs = case.inputs()
  out = jax.jit(functools.partial(paged_decode_attention, impl="xla"))(
    *inputs.arrays, **inputs.scales
  )
  check(out, inputs)


# Kernel cases (small: the interpreter is slow). Lengths hit 1, page and block boundaries,
# chunk boundaries, rows that see nothing (S < q_len) and padding slots (S = 0).
KERNEL_CASES = [
  KernelCase((70, 3, 0, 1), 3, 1, 2, 64, 16, BF16, TuningConfig(num_stages=2, num_chunks=2)),
  KernelCase((1, 64, 65, 130), 1, 2, 1, 128, 32, BF16, TuningConfig(num_stages=2, num_chunks=3)),
  KernelCase((200, 5), 8, 1, 8, 64, 64, F16, TuningConfig(num_stages=3, num_chunks=1)),
  KernelCase((129, 2, 7), 7, 1, 8, 128, 16, BF16, TuningConfig(num_stages=4, num_chunks=2)),
  KernelCase((100, 6), 6, 1, 12, 64, 32, BF16, TuningConfig(block_kv=128, num_stages=2)),
  KernelCase((64, 191), 2, 2, 4, 64, 16, F16),
]

# More than 64 packed rows (G * q_len > 64) as one 128-row tile of two warpgroups sharing each
# K/V block. Lengths cross chunk boundaries (200 over 2 chunks of 64-position blocks), need ring
# refills (num_stages below the blocks per chunk), and include rows that see nothing and padding.
TWO_WARPGROUP_CASES = [
  KernelCase(
    seq_lens, q_len, hkv, g, d, page, dtype, dataclasses.replace(cfg, two_warpgroup_tiles=True)
  )
  for seq_lens, q_len, hkv, g, d, page, dtype, cfg in [
    ((200, 4, 0, 65), 6, 1, 12, 64, 16, BF16, TuningConfig(num_stages=1, num_chunks=2)),
    ((129, 6, 1), 7, 1, 12, 128, 32, F16, TuningConfig(num_stages=2, num_chunks=1)),
    ((250, 3, 64), 5, 1, 16, 128, 16, BF16, TuningConfig(num_stages=1, num_chunks=3)),
    ((190, 7, 0), 8, 2, 16, 64, 64, BF16, TuningConfig(block_kv=128, num_stages=2)),
  ]
]

# The 128-row tile with a producer warpgroup issuing the ring's copies
# (TuningConfig.producer_warpgroup): one stage (every step after the first waits for both
# consumers to release the slot before its refill), 2 and 3 stages, chunks, a request with no
# blocks and rows that see nothing, 128-position blocks, page ids carried a step ahead, and the
# balanced plan's spare items (no steps: the producer issues nothing).
PRODUCER_CASES = [
  KernelCase(*shape, dataclasses.replace(cfg, two_warpgroup_tiles=True, producer_warpgroup=True))
  for *shape, cfg in [
    ((200, 4, 0, 65), 6, 1, 12, 64, 16, BF16, TuningConfig(num_stages=1, num_chunks=2)),
    ((129, 6, 1), 7, 1, 12, 128, 32, F16, TuningConfig(num_stages=2, num_chunks=1)),
    ((250, 3, 64), 5, 1, 16, 128, 16, BF16, TuningConfig(num_stages=3, num_chunks=3)),
    ((190, 7, 0), 8, 2, 16, 64, 64, BF16, TuningConfig(block_kv=128, num_stages=2)),
    ((330, 4, 0, 65), 6, 1, 12, 64, 16, BF16, TuningConfig(num_stages=1, page_ids_ahead=True)),
    (
      (260, 64, 2),
      6,
      1,
      12,
      64,
      16,
      BF16,
      TuningConfig(num_stages=2, num_chunks=3, balance_waves=1, num_sms=1),
    ),
  ]
]

# One chunk length for the whole batch (TuningConfig.balance_waves). The plan aims at
# `balance_waves x slots` items per (KV head, row tile); with 1 SM in place of 132 the tiny
# batches below already exceed that, so the common length decides: long requests get several
# chunks, short ones one, and the static grid's spare items (loading and storing nothing) must
# not leak NaN from their unwritten output tiles into the merge.
BALANCED_CASES = [
  KernelCase(
    (300, 5, 0, 70), 3, 1, 8, 64, 16, BF16, TuningConfig(num_stages=2, balance_waves=1, num_sms=1)
  ),
  KernelCase(
    (200, 1, 129), 7, 2, 4, 128, 32, F16, TuningConfig(num_stages=1, balance_waves=2, num_sms=1)
  ),
  KernelCase(
    (260, 64, 2),
    6,
    1,
    12,
    64,
    16,
    BF16,
    TuningConfig(num_stages=2, num_chunks=3, balance_waves=1, two_warpgroup_tiles=True, num_sms=1),
  ),
]

# fp8 pages: TMA reads the fp8 blocks, the kernel converts them into 16-bit staging blocks.
# Chunking, ring refills, two 64-row tiles (G 12, q_len 6), 128-position blocks, both q dtypes.
FP8_CASES = [
  KernelCase(
    (70, 3, 0, 1), 3, 1, 2, 64, 16, BF16, TuningConfig(num_stages=2, num_chunks=2), fp8=True
  ),
  KernelCase(
    (1, 64, 65, 130), 1, 2, 1, 128, 32, F16, TuningConfig(num_stages=2, num_chunks=3), fp8=True
  ),
  KernelCase((129, 2, 7), 7, 1, 8, 128, 16, BF16, fp8=True),
  KernelCase(
    (200, 5, 0, 70),
    6,
    1,
    12,
    64,
    16,
    BF16,
    TuningConfig(num_stages=1, balance_waves=1, num_sms=1),
    fp8=True,
  ),
  KernelCase((100, 6), 4, 1, 8, 64, 64, F16, TuningConfig(block_kv=128, num_stages=2), fp8=True),
  KernelCase(
    (130, 3, 64),
    5,
    1,
    4,
    128,
    32,
    BF16,
    TuningConfig(num_stages=2, num_chunks=2, fp8_8bit_layout=True),
    fp8=True,
  ),
  KernelCase(
    (70, 1), 2, 2, 8, 64, 16, F16, TuningConfig(num_stages=1, fp8_8bit_layout=True), fp8=True
  ),
]

# fp8 pages in the 128-row tile: the producer warpgroup converts each fp8 block into a float16
# ring that both consumers read, zeroing V rows past the length or on out-of-pool pages. One
# stage (the producer waits for both consumers before rewriting the slot; the race detector does
# not track wgmma's reads, so only the native runs would catch a missing wait), 2 and 3 stages,
# chunks, rows that see nothing and padding, 128-position blocks, the 8-bit register layout.
FP8_PRODUCER_CASES = [
  KernelCase(
    *shape, dataclasses.replace(cfg, two_warpgroup_tiles=True, producer_warpgroup=True), fp8=True
  )
  for *shape, cfg in [
    ((200, 4, 0, 65), 6, 1, 12, 64, 16, BF16, TuningConfig(num_stages=1, num_chunks=2)),
    ((129, 6, 1), 7, 1, 12, 128, 32, F16, TuningConfig(num_stages=2, fp8_8bit_layout=True)),
    ((250, 3, 64), 5, 1, 16, 128, 16, BF16, TuningConfig(num_stages=3, num_chunks=3)),
    ((190, 7, 0), 8, 2, 16, 64, 64, BF16, TuningConfig(block_kv=128, num_stages=2)),
  ]
]

# Separate K and V staging blocks converted while the wgmmas run (fp8_staging_overlap): chunks
# and refills, one stage (each refill is of the slot the next K waits on), two 64-row tiles,
# 128-position blocks, the transposed tile, masked tails and rows that see nothing.
FP8_OVERLAP_CASES = [
  KernelCase(
    seq_lens,
    q_len,
    hkv,
    g,
    d,
    page,
    dtype,
    dataclasses.replace(cfg, fp8_staging_overlap=True),
    True,
  )
  for seq_lens, q_len, hkv, g, d, page, dtype, cfg in [
    ((70, 3, 0, 1), 3, 1, 2, 64, 16, BF16, TuningConfig(num_stages=2, num_chunks=2)),
    ((129, 2, 7), 7, 1, 8, 128, 16, BF16, TuningConfig(num_stages=1)),
    ((200, 5, 0, 70), 6, 1, 12, 64, 16, F16, TuningConfig(num_stages=2, fp8_8bit_layout=True)),
    ((100, 6), 4, 1, 8, 64, 64, F16, TuningConfig(block_kv=128, num_stages=2)),
    ((130, 3, 64), 1, 2, 8, 128, 32, BF16, TuningConfig(num_stages=3, transposed_scores=True)),
  ]
]


# Row tiles with the softmax denominators summed once per work item (TuningConfig.deferred_sum):
# chunks and ring refills, rows that see nothing and padding slots, two warpgroups, fp8 pages
# through the staging block, 128-position blocks.
DEFERRED_ROW_SUM_CASES = [
  KernelCase(seq_lens, q_len, hkv, g, d, page, dtype, dataclasses.replace(cfg, deferred_sum=True))
  for seq_lens, q_len, hkv, g, d, page, dtype, cfg in [
    ((270, 3, 0, 1), 3, 1, 2, 64, 16, BF16, TuningConfig(num_stages=2, num_chunks=2)),
    ((200, 4, 0, 65), 6, 1, 12, 64, 16, BF16, TuningConfig(two_warpgroup_tiles=True)),
    ((300, 6), 4, 1, 8, 128, 64, F16, TuningConfig(block_kv=128, num_stages=2)),
  ]
] + [
  KernelCase(
    (129, 2, 7), 7, 1, 8, 128, 16, BF16, TuningConfig(num_stages=1, deferred_sum=True), fp8=True
  )
]


# Transposed scores (TuningConfig.transposed_scores): S^T = K Q^T and O^T = V^T P^T with the
# packed rows as the wgmma N dimension, rounded up to 8. One row (N 8), rows that are not a
# multiple of 8 (G 3, q_len 5: N 16), 84 rows in one tile (G 12, q_len 7: N 88), 128 rows (the
# most one tile takes), more than 128 (back to 64-row tiles), fp8 pages, 128-position blocks
# (pages of 64 and 128), chunking with the balanced plan, ring refills, rows that see nothing and
# padding slots; fp8 K and V converted in registers (TuningConfig.fp8_in_registers).
TRANSPOSED_CASES = [
  KernelCase(
    seq_lens, q_len, hkv, g, d, page, dtype, dataclasses.replace(cfg, transposed_scores=True), fp8
  )
  for seq_lens, q_len, hkv, g, d, page, dtype, cfg, fp8 in [
    ((70, 3, 0, 1), 1, 2, 1, 64, 16, BF16, TuningConfig(num_stages=2, num_chunks=2), False),
    ((129, 2, 7), 5, 1, 3, 128, 16, F16, TuningConfig(num_stages=1, num_chunks=1), False),
    ((200, 4, 0, 65), 7, 1, 12, 64, 32, BF16, TuningConfig(num_stages=2, num_chunks=2), False),
    ((190, 7), 8, 1, 16, 128, 64, BF16, TuningConfig(block_kv=128, num_stages=2), False),
    ((100, 6), 7, 1, 20, 64, 16, BF16, TuningConfig(num_stages=2), False),
    (
      (300, 5, 0, 70),
      3,
      1,
      8,
      64,
      16,
      BF16,
      TuningConfig(num_stages=2, balance_waves=1, num_sms=1),
      False,
    ),
    ((130, 3, 64), 7, 1, 12, 128, 32, BF16, TuningConfig(num_stages=2, num_chunks=2), True),
    ((70, 1), 1, 2, 8, 64, 16, F16, TuningConfig(num_stages=1, fp8_8bit_layout=True), True),
    ((300, 129, 0), 1, 1, 8, 128, 128, BF16, TuningConfig(block_kv=128, num_stages=2), False),
    # fp8 K and V converted in registers (natively; interpret mode stages them as before)
    ((70, 1), 1, 2, 8, 64, 16, F16, TuningConfig(num_stages=1, fp8_in_registers=True), True),
    (
      (200, 4, 0, 65),
      2,
      1,
      12,
      128,
      32,
      BF16,
      TuningConfig(num_stages=2, num_chunks=2, fp8_in_registers=True),
      True,
    ),
    # 24 rows (G 8, q_len 3), the most default_config converts in registers at D 128
    ((200, 4, 0, 65), 3, 1, 8, 128, 16, BF16, TuningConfig(fp8_in_registers=True), True),
    # Denominators summed once per work item (TuningConfig.deferred_sum): chunks, rows that
    # see nothing, N 16 with padded rows, fp8 pages in registers, 128-position blocks.
    ((70, 3, 0, 1), 1, 2, 1, 64, 16, BF16, TuningConfig(num_stages=2, deferred_sum=True), False),
    ((129, 2, 7), 5, 1, 3, 128, 16, F16, TuningConfig(num_chunks=2, deferred_sum=True), False),
    (
      (200, 4, 0, 65),
      1,
      1,
      8,
      128,
      32,
      BF16,
      TuningConfig(num_stages=2, fp8_in_registers=True, deferred_sum=True),
      True,
    ),
    (
      (300, 129, 0),
      1,
      1,
      8,
      64,
      64,
      BF16,
      TuningConfig(block_kv=128, num_stages=2, deferred_sum=True),
      False,
    ),
    # default_config's forms beyond 16 rows on an H100 (TRANSPOSED_MAX_ROWS_16BIT_BY_DEVICE):
    # 32 rows at D 128 with page ids ahead, 24 rows at D 64.
    (
      (200, 4, 0, 65),
      4,
      1,
      8,
      128,
      16,
      BF16,
      TuningConfig(num_stages=2, deferred_sum=True, page_ids_ahead=True),
      False,
    ),
    ((130, 3, 64), 3, 1, 8, 64, 16, BF16, TuningConfig(num_stages=2, deferred_sum=True), False),
  ]
]


# Page ids read one step before they are used (TuningConfig.page_ids_ahead). Chunks of 4 to 10
# blocks on rings of 1 and 2 stages, so that most steps refill a slot with ids read a step
# earlier (and the last steps read ids past the chunk's end); rows that see nothing and padding
# slots, two warpgroups, the transposed tile, fp8 pages staged and converted in registers,
# 128-position blocks.
PAGE_IDS_AHEAD_CASES = [
  KernelCase(*shape, dataclasses.replace(cfg, page_ids_ahead=True), fp8)
  for *shape, cfg, fp8 in [
    ((300, 3, 0, 1), 3, 1, 2, 64, 16, BF16, TuningConfig(num_stages=1, num_chunks=1), False),
    ((520, 2, 7), 7, 1, 8, 128, 16, BF16, TuningConfig(num_stages=2, num_chunks=2), False),
    (
      (330, 4, 0, 65),
      6,
      1,
      12,
      64,
      16,
      BF16,
      TuningConfig(num_stages=1, num_chunks=1, two_warpgroup_tiles=True),
      False,
    ),
    (
      (300, 5, 0, 70),
      1,
      2,
      8,
      64,
      32,
      F16,
      TuningConfig(num_stages=2, num_chunks=1, transposed_scores=True),
      False,
    ),
    ((600, 6), 4, 1, 8, 128, 64, F16, TuningConfig(block_kv=128, num_stages=1), False),
    ((330, 3, 64), 3, 1, 8, 128, 32, BF16, TuningConfig(num_stages=2, num_chunks=1), True),
    (
      (330, 4, 0, 65),
      1,
      1,
      8,
      128,
      32,
      BF16,
      TuningConfig(num_stages=1, num_chunks=1, transposed_scores=True, fp8_in_registers=True),
      True,
    ),
  ]
]


# The split-KV merge and row unpacking in one Mosaic GPU kernel (TuningConfig.merge_kernel):
# spare grid items with unwritten tiles, tokens whose rows straddle two tiles (G 12, q_len 6),
# fp8 pages.
MERGE_KERNEL_CASES = [
  KernelCase(
    (200, 5, 0, 70),
    6,
    1,
    12,
    64,
    16,
    BF16,
    TuningConfig(num_stages=2, balance_waves=1, num_sms=1, merge_kernel=True),
  ),
  KernelCase(
    (129, 2, 7), 3, 2, 3, 128, 16, F16, TuningConfig(num_chunks=3, merge_kernel=True), fp8=True
  ),
  # transposed scores tiles (12 rows, one tile of 16 merged as [D, 16]), one KV head: half the
  # programs; the merge test merges such a tile for two, (2, 6, 64, BF16, 3, 16)
  KernelCase(
    (300, 5, 0, 70),
    3,
    1,
    4,
    64,
    16,
    BF16,
    TuningConfig(num_stages=2, num_chunks=4, transposed_scores=True, merge_kernel=True),
  ),
]


# Cases that run natively only: interpreted, each would repeat another case's run, because the
# interpreter does not model what sets it apart (register layouts; fp8 K and V converted in
# registers, which it stages as the transposed fp8 cases do) or because the same shapes run
# interpreted with one more feature on (a producer warpgroup, the denominators' deferred sum,
# the fp8 staging overlap).
# Each interpreted case costs seconds of a CPU run, almost all tracing and compiling it.
NATIVE_ONLY_CASES = [
  TWO_WARPGROUP_CASES[1],  # PRODUCER_CASES[1]: the same shapes with the producer warpgroup
  TWO_WARPGROUP_CASES[2],  # PRODUCER_CASES[2]
  FP8_CASES[0],  # FP8_OVERLAP_CASES[0]: the same shapes with the row tiles' default overlap
  FP8_CASES[2],  # FP8_OVERLAP_CASES[1]
  FP8_CASES[4],  # FP8_OVERLAP_CASES[3]
  FP8_CASES[5],  # 8-bit layout; FP8_CASES[1] interprets one staging block with chunks
  FP8_CASES[6],  # 8-bit layout; FP8_CASES[3] interprets fp8 on one stage
  DEFERRED_ROW_SUM_CASES[2],  # 128-position blocks; DEFERRED_ROW_SUM_CASES[3] covers refills
  TRANSPOSED_CASES[0],  # TRANSPOSED_CASES[12]: the same shapes with the deferred sum
  TRANSPOSED_CASES[1],  # TRANSPOSED_CASES[13]
  TRANSPOSED_CASES[9],  # in registers; interpreted it is TRANSPOSED_CASES[7]
  TRANSPOSED_CASES[10],  # in registers; interpreted as TRANSPOSED_CASES[6] (fp8, N > 8, chunks)
  TRANSPOSED_CASES[11],  # in registers; interpreted as TRANSPOSED_CASES[6]
  PAGE_IDS_AHEAD_CASES[1],  # row tiles with ids ahead: PAGE_IDS_AHEAD_CASES[0, 4, 5]
  PAGE_IDS_AHEAD_CASES[2],  # PRODUCER_CASES[4]: the same shapes with the producer warpgroup
]


def interpreted_and_native(cases, native_only, case_id=lambda case: case.id, spread=False):
  """``(case, interpret)`` params (``(*case, interpret)`` with ``spread``): every case natively
  on the GPU, and interpreted on any host unless it is in ``native_only``."""
  params = []
  for case in cases:
    values = tuple(case) if spread else (case,)
    if case not in native_only:
      params.append(pytest.param(*values, True, id=f"{case_id(case)}-True"))
    params.append(pytest.param(*values, False, id=f"{case_id(case)}-False", marks=pytest.mark.gpu))
  return params


@pytest.mark.parametrize(
  "case, interpret",
  interpreted_and_native(
    KERNEL_CASES
    + TWO_WARPGROUP_CASES
    + PRODUCER_CASES
    + BALANCED_CASES
    + FP8_CASES
    + FP8_OVERLAP_CASES
    + FP8_PRODUCER_CASES
    + MERGE_KERNEL_CASES
    + DEFERRED_ROW_SUM_CASES
    + TRANSPOSED_CASES
    + PAGE_IDS_AHEAD_CASES,
    NATIVE_ONLY_CASES,
  ),
)
def test_kernel_matches_float64(case, interpret):
  inputs = case.inputs()
  out = paged_decode_attention(
    *inputs.arrays, impl="pallas", interpret=interpret, config=case.config, **inputs.scales
  )
  check(out, inputs)
  assert not (interpret and races_found())


# Row tiles of 64 merged natively only, like the interpreted tiles of (6, 12, 64, BF16, 3, 64)
# (two tiles, D 64) and (1, 1, 128, F16, 2, 64) (D 128).
MERGE_NATIVE_ONLY = [(5, 3, 128, BF16, 4, 64), (8, 16, 64, BF16, 2, 64)]


def _unpacked(merged, q_len, group):
  """[B, Hkv, R, D] packed rows r = j * G + g (R padded) -> [B, q_len, Hkv * G, D]."""
  batch, num_kv_heads, _, head_dim = merged.shape
  merged = merged[:, :, : q_len * group].reshape(batch, num_kv_heads, q_len, group, head_dim)
  return merged.transpose(0, 2, 1, 3, 4).reshape(batch, q_len, num_kv_heads * group, head_dim)


def _merge_kernel(tiles, lse, q_len, group, **kwargs):
  """The merge kernel on chunk partials [B, C, Hkv, R, D] and their lse [B, C, Hkv, R]."""
  batch, num_chunks, num_kv_heads, padded_rows, head_dim = tiles.shape
  return mosaic_gpu.merge_chunks_mosaic_gpu(
    tiles.reshape(batch * num_chunks, num_kv_heads, padded_rows, head_dim),
    lse.reshape(batch * num_chunks, num_kv_heads, padded_rows),
    num_chunks=num_chunks,
    q_len=q_len,
    group=group,
    **kwargs,
  )


@pytest.mark.parametrize(
  "q_len, group, head_dim, dtype, num_chunks, tile_rows, interpret",
  interpreted_and_native(
    [
      (6, 12, 64, BF16, 3, 64),
      (1, 1, 128, F16, 2, 64),
      *MERGE_NATIVE_ONLY,
      # more chunks than a warpgroup's ring has slots: slots refilled (4 slots of 64 rows at
      # D 128, 6 chunks for warpgroup 0 and 5 for the others)
      (1, 8, 128, BF16, 21, 64),
      # transposed scores tiles, merged as [64, N]: 10 chunks a warpgroup for 8 slots of 8 rows
      # (at D 64, half the programs: a slot holds 64 of D whatever D is; D 128 runs at 56 rows
      # and in the v_scale test's 8-row tile), 6 for 5 slots of 56 rows, and one chunk a
      # warpgroup
      (1, 8, 64, BF16, 40, 8),
      (7, 8, 128, F16, 24, 56),
      (6, 12, 64, BF16, 5, 72),  # beyond 64 rows: two warpgroups
      (2, 6, 64, BF16, 3, 16),
    ],
    MERGE_NATIVE_ONLY,
    case_id=lambda case: "-".join(
      str(jnp.dtype(x)) if i == 3 else str(x) for i, x in enumerate(case)
    ),
    spread=True,
  ),
)
def test_merge_kernel_matches_the_xla_merge(
  q_len, group, head_dim, dtype, num_chunks, tile_rows, interpret
):
  """Random chunk partials; some chunks saw nothing (lse -inf, NaN tiles), one row saw nothing
  in any chunk. The kernel's merged and unpacked rows equal XLA's merge and unpacking, for row
  tiles of 64 and for a transposed scores tile (``tile_rows`` a multiple of 8, not of 64)."""
  batch, num_kv_heads, num_rows = 2, 2, q_len * group
  padded_rows = -(-num_rows // tile_rows) * tile_rows
  rng = np.random.default_rng(num_rows + num_chunks)
  shape = (batch, num_chunks, num_kv_heads, padded_rows)
  lse = rng.uniform(-6.0, 6.0, shape).astype(np.float32)
  empty = rng.random(shape) < 0.3
  empty[1, :, 0, 5] = True  # request 1, KV head 0, row 5: no chunk saw anything
  lse[empty] = -np.inf
  tiles = rng.standard_normal((*shape, head_dim)).astype(np.float32)
  tiles[empty] = np.nan  # unwritten tiles of chunks that saw nothing
  tiles, lse = jnp.asarray(tiles, dtype), jnp.asarray(lse)
  expected = _unpacked(mosaic_gpu.merge_chunks(tiles, lse), q_len, group)
  out = _merge_kernel(tiles, lse, q_len, group, interpret=interpret)
  assert not (interpret and races_found())
  chex.assert_shape(out, expected.shape)
  chex.assert_type(out, dtype)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  tol = 2e-2 if dtype == BF16 else 4e-3
  chex.assert_trees_all_close(out.astype(F32), expected.astype(F32), atol=tol, rtol=tol)


@pytest.mark.parametrize(
  "q_len, group, num_chunks, tile_rows, interpret",
  interpreted_and_native(
    [(3, 8, 3, 64), (1, 8, 4, 8)], [], case_id=lambda case: "-".join(map(str, case)), spread=True
  ),
)
def test_merge_kernel_folds_in_the_v_scale(q_len, group, num_chunks, tile_rows, interpret):
  """fp8 pages: the merge kernel multiplies each KV head's merged rows by its ``v_scale`` and
  writes q's dtype, as XLA's merge followed by the float32 product and one rounding; row tiles
  and a transposed scores tile."""
  batch, num_kv_heads, head_dim, num_rows = 2, 2, 128, q_len * group
  padded_rows = -(-num_rows // tile_rows) * tile_rows
  rng = np.random.default_rng(num_rows * num_chunks)
  shape = (batch, num_chunks, num_kv_heads, padded_rows)
  lse = jnp.asarray(rng.uniform(-6.0, 6.0, shape), F32)
  tiles = jnp.asarray(rng.standard_normal((*shape, head_dim)) * 100, F16)
  v_scale = jnp.asarray([0.0037, 2.5], F32)  # [Hkv]
  merged = mosaic_gpu.merge_chunks(tiles, lse).astype(F32) * v_scale[None, :, None, None]
  expected = _unpacked(merged, q_len, group)
  out = _merge_kernel(
    tiles, lse, q_len, group, v_scale=v_scale, out_dtype=BF16, interpret=interpret
  )
  assert not (interpret and races_found())
  chex.assert_type(out, BF16)
  # One bf16 rounding of the float32 result; the reference went through float16 once more.
  chex.assert_trees_all_close(out.astype(F32), expected, rtol=2**-7, atol=1e-3)


def test_merge_ring_slots():
  """The ring sizes the refill cases above rely on: per warpgroup, one slot per chunk up to its
  share of the byte budget and of the 32 barriers the GPU lowers."""
  assert mosaic_gpu.merge_warpgroups(21, 64) == 4 and mosaic_gpu.merge_warpgroups(3, 16) == 3
  assert mosaic_gpu.merge_warpgroups(21, 96) == 2
  assert mosaic_gpu.merge_ring_slots(21, 64, 2) == 4
  assert mosaic_gpu.merge_ring_slots(40, 8, 2) == 8
  assert mosaic_gpu.merge_ring_slots(24, 56, 2) == 5
  assert mosaic_gpu.merge_ring_slots(3, 16, 2) == 1


@pytest.mark.parametrize("num_chunks", [2, 3, 16])
def test_xla_merge_matches_float64(num_chunks):
  """The one-reduction merge against a float64 oracle: chunks that saw nothing (lse -inf, NaN
  tiles) drop out, a row no chunk saw gives 0, NaN in a seen tile or in an lse reaches the
  row's output, and nothing else is NaN."""
  batch, num_kv_heads, rows, head_dim = 2, 2, 8, 64
  rng = np.random.default_rng(num_chunks)
  shape = (batch, num_chunks, num_kv_heads, rows)
  lse = rng.uniform(-30.0, 30.0, shape)
  empty = rng.random(shape) < 0.4
  empty[1, :, 0, 5] = True  # no chunk saw anything
  empty[0, :, 1, 2] = False  # every chunk saw something
  lse[empty] = -np.inf
  tiles = rng.standard_normal((*shape, head_dim))
  tiles[empty] = np.nan  # unwritten tiles of chunks that saw nothing
  seen_chunk = np.argmax(~empty[0, :, 0, 3])
  tiles[0, seen_chunk, 0, 3, 7] = np.nan  # NaN a row saw
  lse[1, 0, 1, 6] = np.nan  # a chunk's NaN sum

  lse_max = np.max(np.where(empty, -np.inf, lse), axis=1, keepdims=True)
  weights = np.where(empty, 0.0, np.exp2(lse - np.where(np.isfinite(lse_max), lse_max, 0.0)))
  total = weights.sum(axis=1)
  expected = np.einsum("bchr,bchrd->bhrd", weights, np.where(empty[..., None], 0.0, tiles))
  expected = expected / np.where(total > 0.0, total, 1.0)[..., None]
  expected[1, 1, 6] = np.nan

  got = np.asarray(
    mosaic_gpu.merge_chunks(jnp.asarray(tiles, F32), jnp.asarray(lse, F32)), np.float64
  )
  assert np.isnan(got[0, 0, 3, 7]) and np.all(np.isnan(got[1, 1, 6]))
  np.testing.assert_array_equal(got[1, 0, 5], 0.0)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_sm_scale_is_used():
  inputs = make_inputs(np.random.default_rng(0), [9, 20], 2, 1, 2, 64, 16, F32)
  halved = paged_decode_attention(*inputs.arrays, sm_scale=0.5 / 8.0, impl="xla")
  check(halved, inputs, sm_scale=0.5 / 8.0)
  default = paged_decode_attention(*inputs.arrays, impl="xla")
  assert not np.allclose(default, halved)


def test_chunk_merge_is_deterministic_and_split_invariant():
  inputs = make_inputs(np.random.default_rng(7), [190, 33], 2, 1, 8, 64, 16, BF16)
  run = functools.partial(paged_decode_attention, *inputs.arrays, impl="pallas", interpret=True)
  one = run(config=TuningConfig(num_chunks=1))  # the default would split these into 2
  three = run(config=TuningConfig(num_chunks=3))
  again = run(config=TuningConfig(num_chunks=3))
  np.testing.assert_array_equal(np.asarray(three), np.asarray(again))
  chex.assert_trees_all_close(one.astype(F32), three.astype(F32), atol=2e-2)


def test_pallas_rejects_what_it_cannot_serve_and_auto_falls_back():
  rng = np.random.default_rng(3)
  inputs = make_inputs(rng, [9, 20], 2, 1, 2, 64, 16, F32)
  with pytest.raises(ValueError, match="bf16 or fp16"):
    paged_decode_attention(*inputs.arrays, impl="pallas", interpret=True)
  check(paged_decode_attention(*inputs.arrays, impl="auto", interpret=True), inputs)
  inputs = make_inputs(rng, [9, 20], 2, 1, 2, 96, 16, BF16)
  with pytest.raises(ValueError, match="head dim"):
    paged_decode_attention(*inputs.arrays, impl="pallas", interpret=True)
  # fp8 pages with more than 64 rows: the two-warpgroup tile serves them only with a producer
  # warpgroup to convert them.
  inputs = make_inputs(rng, [9, 20], 6, 1, 12, 64, 16, BF16, fp8=True)
  config = TuningConfig(two_warpgroup_tiles=True)
  with pytest.raises(ValueError, match="fp8 pages only with producer_warpgroup"):
    paged_decode_attention(*inputs.arrays, impl="pallas", config=config, **inputs.scales)
  out = paged_decode_attention(
    *inputs.arrays, impl="auto", interpret=True, config=config, **inputs.scales
  )
  check(out, inputs)
  # ... and only with rings that fit the SM's shared memory (named before compiling).
  config = TuningConfig(two_warpgroup_tiles=True, producer_warpgroup=True, num_stages=4)
  inputs = make_inputs(rng, [9, 20], 6, 1, 12, 128, 16, BF16, fp8=True)
  with pytest.raises(ValueError, match="num_stages=4 needs 240 KiB of shared memory"):
    paged_decode_attention(*inputs.arrays, impl="pallas", config=config, **inputs.scales)
  # fp8 blocks in registers take 64-position blocks only: refused at 128, auto takes XLA.
  inputs = make_inputs(rng, [9, 20], 1, 1, 8, 64, 16, BF16, fp8=True)
  config = TuningConfig(block_kv=128, transposed_scores=True, fp8_in_registers=True)
  with pytest.raises(ValueError, match="fp8_in_registers needs block_kv 64"):
    paged_decode_attention(
      *inputs.arrays, impl="pallas", interpret=True, config=config, **inputs.scales
    )
  out = paged_decode_attention(
    *inputs.arrays, impl="auto", interpret=True, config=config, **inputs.scales
  )
  check(out, inputs)


@pytest.mark.parametrize(
  "field, value",
  [
    ("block_kv", 96),
    ("block_kv", 64.0),
    ("block_kv", "64"),
    ("num_stages", 0),
    ("num_stages", 2.5),
    ("num_stages", "x"),
    ("num_chunks", 0),
    ("num_chunks", 1.5),
    ("num_chunks", True),
    ("two_warpgroup_tiles", 1),
    ("operands_in_registers", "yes"),
    ("fp8_in_registers", 0),
    ("balance_waves", 0),
    ("balance_waves", True),
    ("num_sms", 0),
    ("merge_kernel", 1),
    ("transposed_scores", 1),
    ("fp8_8bit_layout", None),
    ("fp8_staging_overlap", "no"),
    ("deferred_sum", 0),
    ("page_ids_ahead", 1),
    ("producer_warpgroup", 1),
  ],
)
def test_tuning_config_is_validated(field, value):
  with pytest.raises(ValueError, match=field):
    TuningConfig(**{field: value})


@pytest.fixture
def no_device_rule(monkeypatch):
  """The api's default config as on a device without a rule of its own (the H200's policy), so
  that the policy tests below read the same on any machine."""
  monkeypatch.setattr(api, "gpu_device_kind", lambda: None)


@pytest.mark.parametrize(
  "batch, num_kv_heads, max_blocks, sms, chunks",
  [(1, 8, 128, 132, 16), (2, 8, 128, 132, 8), (1, 1, 1000, 132, 132), (1, 8, 10, 132, 5)]
  + [(1, 8, 1, 132, 1), (17, 8, 128, 132, 1), (16, 8, 128, 132, 1), (3, 1, 64, 4, 1)],
)
def test_default_split_streams_one_chunk_per_sm(batch, num_kv_heads, max_blocks, sms, chunks):
  """The measured policy (one request, H100): each SM streams one chunk of one (request, KV
  head) pair, chunks at least 2 blocks long, no split once the pairs fill the SMs; row tiles of
  a pair are not counted."""
  assert mosaic_gpu.default_num_chunks(batch, num_kv_heads, max_blocks, sms) == chunks


@pytest.mark.usefixtures("no_device_rule")
@pytest.mark.parametrize(
  "q_len, group, kv_dtype, transposed",
  [(1, 8, BF16, True), (1, 12, F16, True), (2, 8, BF16, True), (3, 8, BF16, False)]
  + [(7, 12, BF16, False), (1, 8, FP8, True), (1, 12, FP8, True), (4, 8, FP8, False)],
)
def test_default_config_transposes_scores_up_to_16_rows(q_len, group, kv_dtype, transposed):
  """The measured policy: transposed scores for up to 16 packed rows, 16-bit or fp8 pages (fp8
  pages in registers up to 24, see the next tests), and the api's default config follows it from
  the shapes of q and the pages."""
  rows = q_len * group
  assert default_config(128, 16, kv_dtype, rows).transposed_scores == transposed
  assert not default_config(128, 16, kv_dtype).transposed_scores  # rows unknown: row tiles
  q = jax.ShapeDtypeStruct((2, q_len, 2 * group, 128), BF16)
  pages = jax.ShapeDtypeStruct((2, 64, 16, 128), kv_dtype)
  assert api._default_config(q, pages).transposed_scores == transposed


@pytest.mark.usefixtures("no_device_rule")
@pytest.mark.parametrize(
  "q_len, group, kv_dtype, head_dim, two_warpgroups",
  [(5, 12, BF16, 128, False), (6, 12, BF16, 128, True), (7, 12, F16, 128, True)]
  + [(5, 16, BF16, 128, True), (8, 8, BF16, 128, False), (7, 12, BF16, 64, True)]
  + [(7, 12, FP8, 128, True), (7, 12, FP8, 64, True), (5, 12, FP8, 128, False)],
)
def test_default_config_takes_one_128_row_tile_beyond_64_rows(
  q_len, group, kv_dtype, head_dim, two_warpgroups
):
  """The measured policy: more than 64 packed rows run one 128-row tile of two warpgroups, fed
  by a producer warpgroup, which with fp8 pages converts them on a ring of its own depth."""
  config = default_config(head_dim, 16, kv_dtype, q_len * group)
  assert config.two_warpgroup_tiles == config.producer_warpgroup == two_warpgroups
  if two_warpgroups and kv_dtype == FP8:
    assert config.num_stages == mosaic_gpu.FP8_PRODUCER_STAGES
    assert not config.fp8_staging_overlap
  assert not default_config(head_dim, 16, kv_dtype).two_warpgroup_tiles  # rows unknown
  q = jax.ShapeDtypeStruct((32, q_len, 2 * group, head_dim), BF16)  # 64 (request, KV head) pairs
  pages = jax.ShapeDtypeStruct((2, 64, 16, head_dim), kv_dtype)
  assert api._default_config(q, pages).two_warpgroup_tiles == two_warpgroups


@pytest.mark.parametrize(
  "producer, consumer",
  [
    (mosaic_gpu.PRODUCER_REGISTERS, mosaic_gpu.CONSUMER_REGISTERS),
    (mosaic_gpu.CONVERTING_PRODUCER_REGISTERS, mosaic_gpu.CONVERTING_CONSUMER_REGISTERS),
  ],
)
def test_register_splits_fit_what_the_three_warpgroups_launch_with(producer, consumer):
  """setmaxnreg takes multiples of 8 in [24, 256]; a split that needs more than the 40 + 2 x 232
  registers the tile launches with makes a consumer's increase wait forever (the kernel hangs)."""
  for registers in (producer, consumer):
    assert registers % 8 == 0 and 24 <= registers <= 256
  assert producer + 2 * consumer == 40 + 2 * 232


@pytest.mark.usefixtures("no_device_rule")
@pytest.mark.parametrize("batch, registers", [(1, False), (31, False), (32, True), (64, True)])
def test_default_config_keeps_operands_in_shared_memory_for_few_pairs(batch, registers):
  """The measured policy: below 64 (request, KV head) pairs (one request: each work item gets a
  few blocks of the split KV) Q and P go through shared memory and more than 64 rows take
  64-row tiles; from 64 pairs on, registers and one 128-row tile."""
  q = jax.ShapeDtypeStruct((batch, 7, 24, 128), BF16)  # G 12, 84 packed rows
  pages = jax.ShapeDtypeStruct((2, 64, 16, 128), BF16)
  config = api._default_config(q, pages)
  assert config.operands_in_registers == registers
  assert config.two_warpgroup_tiles == registers
  assert default_config(128, 16, BF16, num_rows=84).operands_in_registers  # pairs unknown


@pytest.mark.usefixtures("no_device_rule")
@pytest.mark.parametrize(
  "batch, q_len, group, head_dim, page_size, kv_dtype, registers",
  [(256, 1, 8, 128, 16, FP8, True), (256, 2, 4, 128, 32, FP8, True), (1, 1, 8, 64, 64, FP8, True)]
  + [
    (32, 1, 12, 64, 16, FP8, True),
    (1, 1, 8, 128, 16, FP8, False),
    (255, 1, 8, 128, 16, FP8, False),
  ]
  + [(256, 1, 12, 128, 16, FP8, True), (256, 2, 8, 128, 16, FP8, True)]
  + [(256, 3, 8, 128, 16, FP8, True), (256, 2, 12, 128, 16, FP8, True)]
  + [(256, 4, 8, 128, 16, FP8, False), (32, 2, 8, 64, 16, FP8, False)]
  + [(256, 1, 8, 128, 128, FP8, False), (256, 1, 8, 128, 16, BF16, False)],
)
def test_default_config_converts_fp8_in_registers_for_few_rows(
  batch, q_len, group, head_dim, page_size, kv_dtype, registers
):
  """The measured policy: fp8 pages with up to 12 packed rows at D 64, 24 at D 128 (there from 512
  (request, KV head) pairs on) convert K and V in registers, in the transposed tile with
  ``block_kv`` 64 (128-position pages make 128-position blocks, which it does not serve); at
  D 128 their ring, with no staging block beside it, takes 4 stages, at D 64 the usual 6."""
  rows = q_len * group
  q = jax.ShapeDtypeStruct((batch, q_len, 2 * group, head_dim), BF16)  # Hkv 2
  pages = jax.ShapeDtypeStruct((2, 64, page_size, head_dim), kv_dtype)
  config = api._default_config(q, pages)
  assert config == default_config(head_dim, page_size, kv_dtype, rows, num_pairs=2 * batch)
  assert config.fp8_in_registers == registers
  if registers:
    assert config.transposed_scores
    assert config.num_stages == {128: 4, 64: 6}[head_dim]
  else:  # the staging block: transposed up to 16 rows, row tiles beyond
    assert config.transposed_scores == (rows <= mosaic_gpu.DEFAULT_TRANSPOSED_MAX_ROWS)
  assert not default_config(head_dim, page_size, kv_dtype).fp8_in_registers  # rows unknown


H100_SXM = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(
  "device_kind, head_dim, q_len, kv_dtype, transposed",
  [
    (None, 128, 2, BF16, True),  # 16 rows: everywhere
    (None, 128, 3, BF16, False),
    ("NVIDIA H200", 128, 3, BF16, False),
    (H100_SXM, 128, 3, BF16, True),  # 24 rows
    (H100_SXM, 128, 4, BF16, True),  # 32 rows
    (H100_SXM, 128, 5, BF16, False),
    (H100_SXM, 64, 3, F16, True),
    (H100_SXM, 64, 4, BF16, False),
    (H100_SXM, 128, 4, FP8, False),  # fp8 pages: registers up to 24 rows, row tiles beyond
  ],
)
def test_default_config_transposed_rows_follow_the_device(
  device_kind, head_dim, q_len, kv_dtype, transposed, monkeypatch
):
  """16-bit pages take transposed scores up to 16 packed rows, on an H100 SXM up to 32 at D 128
  and 24 at D 64 (measured there); the api hands ``default_config`` the GPU's device_kind. G 8,
  B64 (512 (request, KV head) pairs)."""
  monkeypatch.setattr(api, "gpu_device_kind", lambda: device_kind)
  q = jax.ShapeDtypeStruct((64, q_len, 64, head_dim), BF16)
  pages = jax.ShapeDtypeStruct((8, 64, 16, head_dim), kv_dtype)
  config = api._default_config(q, pages)
  assert config == default_config(head_dim, 16, kv_dtype, 8 * q_len, 512, device_kind)
  assert config.transposed_scores == transposed
  if transposed and kv_dtype != FP8:  # the 16-bit transposed tile's companions, as at 16 rows
    assert config.deferred_sum
    assert config.page_ids_ahead == (head_dim == 128)
    assert not config.two_warpgroup_tiles


@pytest.mark.parametrize(
  "device_kind, batch, q_len, group, kv_dtype, merge_kernel",
  [
    (H100_SXM, 1, 1, 8, BF16, True),  # 8 rows, 8 pairs
    (H100_SXM, 8, 1, 8, F16, True),  # 64 pairs
    (H100_SXM, 9, 1, 8, BF16, False),  # 72 pairs
    (H100_SXM, 1, 1, 12, BF16, False),  # 12 rows
    (H100_SXM, 1, 1, 8, FP8, True),  # fp8 pages since the merge kernel takes v_scale
    (H100_SXM, 1, 3, 8, FP8, False),  # 24 rows
    ("NVIDIA H200", 1, 1, 8, BF16, False),  # unmeasured there
    (None, 1, 1, 8, BF16, False),
  ],
)
def test_default_config_merge_kernel_follows_the_device(
  device_kind, batch, q_len, group, kv_dtype, merge_kernel, monkeypatch
):
  """The merge kernel is the default only where it was measured faster than XLA's merge: on an
  H100 SXM, 16-bit or fp8 pages, at most 8 packed rows and 64 (request, KV head) pairs."""
  monkeypatch.setattr(api, "gpu_device_kind", lambda: device_kind)
  q = jax.ShapeDtypeStruct((batch, q_len, 8 * group, 128), BF16)
  pages = jax.ShapeDtypeStruct((8, 64, 16, 128), kv_dtype)
  assert api._default_config(q, pages).merge_kernel == merge_kernel


def test_fp8_k_pairs_order_follows_the_wgmma_columns():
  """At D 128 each thread's 32-bit register of the 16-bit K view holds head dims 4s .. 4s + 3 of
  its 16-column block (s: lane % 4); its two float16 pairs land in the column tiles 2i and
  2i + 1 at columns 2s and 2s + 1, so Q's head dims must follow this order (the native kernel
  cases check the whole product)."""
  order = mosaic_gpu._k_pairs_order(128)
  np.testing.assert_array_equal(np.sort(order), np.arange(128))
  block = [0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15]
  np.testing.assert_array_equal(order, np.concatenate([np.add(block, 16 * i) for i in range(8)]))


@pytest.mark.parametrize("head_dim, stages", [(128, 2), (64, 6)])
def test_fp8_default_config_keeps_three_items_per_sm(head_dim, stages):
  """The fp8 ring is as deep as three items of one staging block allow; row tiles keep that ring
  and add the second staging block (two items per SM), transposed tiles keep one block."""
  # 64 pairs: too few for the register path at D 128 (at D 64, 16 rows are too many for it)
  transposed = default_config(head_dim, 16, FP8, num_rows=16, num_pairs=64)
  rows = default_config(head_dim, 16, FP8, num_rows=24, num_pairs=64)
  assert transposed.transposed_scores and not transposed.fp8_in_registers
  assert not transposed.fp8_staging_overlap and rows.fp8_staging_overlap
  for config in (transposed, rows):
    assert config.num_stages == stages and config.fp8_8bit_layout
  item = mosaic_gpu.smem_bytes(head_dim, transposed, kv_itemsize=1)
  assert 3 * item <= mosaic_gpu._SMEM_PER_SM < 4 * item
  overlapped_item = mosaic_gpu.smem_bytes(head_dim, rows, kv_itemsize=1)
  assert 2 * overlapped_item <= mosaic_gpu._SMEM_PER_SM < 3 * overlapped_item
  assert not default_config(head_dim, 16, BF16).fp8_8bit_layout


def test_default_config_gives_d64_transposed_tiles_two_stages():
  """The measured policy: transposed tiles on 16-bit pages at D 64 take a 2-stage ring (more
  items per SM); D 64 row tiles keep the 64 KiB ring, fp8 pages their own."""
  assert default_config(64, 16, BF16, num_rows=8).num_stages == 2
  assert default_config(64, 16, BF16, num_rows=24).num_stages == 4
  assert default_config(64, 16, FP8, num_rows=16).num_stages == 6


@pytest.mark.usefixtures("no_device_rule")
@pytest.mark.parametrize(
  "q_len, group, head_dim, kv_dtype, overlap, deferred",
  [(1, 8, 128, BF16, False, False), (1, 8, 64, BF16, False, True), (1, 12, 128, F16, False, True)]
  + [(3, 8, 128, BF16, False, False), (1, 8, 64, FP8, False, False)]
  + [(1, 12, 128, FP8, False, False), (3, 8, 128, FP8, True, False), (5, 12, 64, FP8, True, False)]
  + [(7, 12, 64, FP8, False, False)],  # the 128-row tile's producer converts instead
)
def test_default_config_overlaps_fp8_staging_and_defers_sums_where_measured(
  q_len, group, head_dim, kv_dtype, overlap, deferred
):
  """The measured policy: fp8 row tiles stage K and V in separate blocks; transposed tiles on
  16-bit pages sum the softmax denominators once per item at D 64 or beyond 8 rows."""
  q = jax.ShapeDtypeStruct((64, q_len, 2 * group, head_dim), BF16)  # 128 pairs
  pages = jax.ShapeDtypeStruct((2, 64, 16, head_dim), kv_dtype)
  config = api._default_config(q, pages)
  assert config.fp8_staging_overlap == overlap
  assert config.deferred_sum == deferred
  assert not default_config(head_dim, 16, kv_dtype).deferred_sum  # rows unknown: row tiles


@pytest.mark.usefixtures("no_device_rule")
@pytest.mark.parametrize(
  "batch, q_len, group, head_dim, kv_dtype, ahead",
  [
    (64, 7, 12, 128, BF16, True),  # 128-row tile
    (64, 6, 12, 128, F16, True),
    (8, 7, 12, 128, BF16, True),
    (64, 7, 12, 128, FP8, True),  # fp8 in the 128-row tile
    (64, 7, 12, 64, FP8, True),  # fp8 in the 128-row tile (D 64)
    (64, 5, 12, 64, FP8, False),  # fp8 row tiles (D 64)
    (64, 7, 8, 128, BF16, False),  # 64-row tile
    (64, 1, 8, 128, BF16, True),  # transposed, 512 pairs
    (64, 1, 12, 128, BF16, True),
    (128, 1, 8, 128, F16, True),
    (32, 1, 8, 128, BF16, False),  # transposed, 256 pairs
    (64, 1, 8, 64, BF16, False),  # transposed at D 64
    (64, 1, 8, 128, FP8, False),  # fp8 in registers
  ],
)
def test_default_config_reads_page_ids_ahead_where_measured_faster(
  batch, q_len, group, head_dim, kv_dtype, ahead
):
  """The measured policy: page ids read a step early on the 128-row tile of two warpgroups and
  on transposed tiles of 16-bit pages at D 128 from 512 (request, KV head) pairs."""
  q = jax.ShapeDtypeStruct((batch, q_len, 8 * group, head_dim), BF16)
  pages = jax.ShapeDtypeStruct((8, 64, 16, head_dim), kv_dtype)
  config = api._default_config(q, pages)
  assert config.page_ids_ahead == ahead
  if q_len > 1:
    assert config.page_ids_ahead == config.two_warpgroup_tiles
  else:
    assert config.transposed_scores


# ---------------------------------------------------------------------------------------------
# Host-side checks: every wrong type, shape, dtype or value is a TypeError / ValueError naming
# the argument, raised before any device work.


def _host_args():
  inputs = make_inputs(np.random.default_rng(1), [9, 20], 1, 2, 1, 64, 16, F32)
  return inputs._asdict() | {"k_scale": None, "v_scale": None}


def _pages(shape, dtype=F32):
  return {"k_pages": jnp.zeros(shape, dtype), "v_pages": jnp.zeros(shape, dtype)}


BAD_ARGUMENTS = [
  # id, changes to the valid arguments (a function of them), error type, message pattern
  ("q rank 3", lambda a: {"q": a["q"][0]}, ValueError, r"q must be \[B, q_len, Hq, D\]"),
  ("q list", lambda a: {"q": a["q"].tolist()}, TypeError, "q must be a jax.Array"),
  ("q_len 9", lambda a: {"q": jnp.zeros((2, 9, 2, 64))}, ValueError, "q_len .* 1..8, got 9"),
  ("q_len 0", lambda a: {"q": jnp.zeros((2, 0, 2, 64))}, ValueError, "q_len .* 1..8, got 0"),
  ("Hq 0", lambda a: {"q": jnp.zeros((2, 1, 0, 64))}, ValueError, "q must be .* Hq >= 1"),
  ("D 0", lambda a: {"q": jnp.zeros((2, 1, 2, 0))}, ValueError, "q must be .* D >= 1"),
  ("q int32", lambda a: {"q": a["q"].astype(jnp.int32)}, ValueError, "q must be bf16, fp16"),
  ("D mismatch", lambda a: {"k_pages": a["k_pages"][..., :32]}, ValueError, "k_pages .*D=64"),
  ("k_pages rank", lambda a: {"k_pages": a["k_pages"][0]}, ValueError, "k_pages must be"),
  ("Hkv 0", lambda a: _pages((0, 5, 16, 64)), ValueError, "k_pages .* Hkv >= 1"),
  ("no pages", lambda a: _pages((2, 0, 16, 64)), ValueError, "k_pages .* num_pages >= 1"),
  ("page_size 0", lambda a: _pages((2, 5, 0, 64)), ValueError, "k_pages .* page_size >= 1"),
  ("v_pages shape", lambda a: {"v_pages": a["v_pages"][:, :1]}, ValueError, "v_pages must have"),
  ("v_pages array", lambda a: {"v_pages": 1.0}, TypeError, "v_pages must be a jax.Array"),
  ("Hq % Hkv", lambda a: {"q": jnp.zeros((2, 1, 3, 64))}, ValueError, "multiple of Hkv=2"),
  ("k_pages bf16", lambda a: {"k_pages": a["k_pages"].astype(BF16)}, ValueError, "k_pages must"),
  ("v fp8, k f32", lambda a: {"v_pages": a["v_pages"].astype(FP8)}, ValueError, "v_pages must"),
  ("block_tables B", lambda a: {"block_tables": a["block_tables"][:1]}, ValueError, r"\[B=2"),
  (
    "empty block table",
    lambda a: {"block_tables": a["block_tables"][:, :0]},
    ValueError,
    "max_pages_per_req >= 1",
  ),
  (
    "block_tables int64",
    lambda a: {"block_tables": np.asarray(a["block_tables"], np.int64)},
    ValueError,
    "block_tables must be int32, got int64",
  ),
  ("seq_lens int16", lambda a: {"seq_lens": a["seq_lens"].astype(jnp.int16)}, ValueError, "int32"),
  (
    "seq_lens rank",
    lambda a: {"seq_lens": a["seq_lens"][:, None]},
    ValueError,
    r"seq_lens must be int32 \[B=2\]",
  ),
  ("seq_lens list", lambda a: {"seq_lens": [9, 20]}, TypeError, "seq_lens must be a jax.Array"),
  (
    "capacity past int32",  # numpy zeros are lazy: no memory is touched
    lambda a: {
      "k_pages": np.zeros((2, 1, 2**16, 64), np.float32),
      "v_pages": np.zeros((2, 1, 2**16, 64), np.float32),
      "block_tables": np.zeros((2, 2**15), np.int32),
    },
    ValueError,
    "capacity .* must be at most",
  ),
  ("sm_scale str", lambda a: {"sm_scale": "0.1"}, TypeError, "sm_scale must be a Python float"),
  ("sm_scale bool", lambda a: {"sm_scale": True}, TypeError, "sm_scale must be a Python float"),
  ("sm_scale array", lambda a: {"sm_scale": jnp.float32(0.1)}, TypeError, "sm_scale must be"),
  ("sm_scale nan", lambda a: {"sm_scale": float("nan")}, ValueError, "sm_scale must be finite"),
  ("sm_scale inf", lambda a: {"sm_scale": float("inf")}, ValueError, "sm_scale must be finite"),
  ("sm_scale 0", lambda a: {"sm_scale": 0.0}, ValueError, "sm_scale must be finite and positive"),
  ("sm_scale < 0", lambda a: {"sm_scale": -0.1}, ValueError, "sm_scale must be finite and pos"),
  ("impl bool", lambda a: {"impl": True}, TypeError, "impl must be a str"),
  ("impl name", lambda a: {"impl": "triton"}, ValueError, "impl must be one of"),
  ("interpret str", lambda a: {"interpret": "yes"}, TypeError, "interpret must be a bool"),
  ("config dict", lambda a: {"config": {"num_stages": 2}}, TypeError, "config must be"),
  ("k_scale bf16 pages", lambda a: {"k_scale": 0.5}, ValueError, "k_scale applies to float8"),
]


@pytest.fixture
def no_device_work(monkeypatch):
  """Fails the test if the call gets past the host-side checks (to the contract or a backend)."""

  def reached(*_, **__):
    raise AssertionError("the call got past the host-side checks")

  monkeypatch.setattr(api, "_require_device_contract", reached)
  monkeypatch.setattr(api, "OP", dataclasses.replace(api.OP, reference=reached, kernel=reached))


@pytest.mark.parametrize(
  "change, error, message",
  [pytest.param(*case[1:], id=case[0]) for case in BAD_ARGUMENTS],
)
def test_bad_host_arguments_raise_before_device_work(change, error, message, no_device_work):
  args = _host_args()
  args.update(change(args))
  with pytest.raises(error, match=message):
    paged_decode_attention(**args)


FP8_BAD_SCALES = [
  ("k_scale str", {"k_scale": "1"}, TypeError, "k_scale must be a Python float"),
  ("v_scale nan", {"v_scale": float("nan")}, ValueError, "v_scale must be finite and positive"),
  ("k_scale 0", {"k_scale": 0.0}, ValueError, "k_scale must be finite and positive"),
  ("k_scale [Hkv+1]", {"k_scale": jnp.ones((3,))}, ValueError, r"float32 \[Hkv=2\]"),
  ("v_scale bf16", {"v_scale": jnp.ones((2,), BF16)}, ValueError, r"float32 \[Hkv=2\]"),
  ("k_scale list", {"k_scale": [1.0, 1.0]}, TypeError, "k_scale must be a Python float"),
]


@pytest.mark.parametrize(
  "scales, error, message", [pytest.param(*case[1:], id=case[0]) for case in FP8_BAD_SCALES]
)
def test_bad_fp8_scales_raise_before_device_work(scales, error, message, no_device_work):
  args = _host_args()
  args["k_pages"], args["v_pages"] = args["k_pages"].astype(FP8), args["v_pages"].astype(FP8)
  with pytest.raises(error, match=message):
    paged_decode_attention(**(args | scales))


def test_fp8_scale_arrays_must_be_finite_and_positive():
  inputs = make_inputs(np.random.default_rng(2), [9, 20], 1, 2, 1, 64, 16, BF16, fp8=True)
  bad = inputs.k_scale.at[1].set(jnp.nan)
  with pytest.raises(ValueError, match="k_scale must be finite and positive for every KV head"):
    paged_decode_attention(*inputs.arrays, k_scale=bad, v_scale=inputs.v_scale, impl="xla")
  checked = checked_jit(functools.partial(paged_decode_attention, impl="xla"))
  with pytest.raises(checkify.JaxRuntimeError, match="v_scale must be finite and positive"):
    checked(*inputs.arrays, k_scale=inputs.k_scale, v_scale=-inputs.v_scale)


@pytest.mark.parametrize("impl, interpret", [("xla", False), ("pallas", True)])
def test_empty_batch_returns_an_empty_result(impl, interpret):
  inputs = make_inputs(np.random.default_rng(4), [], 3, 2, 4, 64, 16, BF16)
  call = functools.partial(paged_decode_attention, impl=impl, interpret=interpret)
  for out in (call(*inputs.arrays), jax.jit(call)(*inputs.arrays)):
    chex.assert_shape(out, (0, 3, 8, 64))
    chex.assert_type(out, BF16)


# ---------------------------------------------------------------------------------------------
# The device-value contract: 0 <= seq_lens[b] <= capacity; page ids inside the length in the
# pool. A concrete breach raises at once; under jit only checked mode checks; outside the
# contract every path follows the same rule (no page the table does not name is read).


def _contract_inputs(fp8=False, q_len=2, group=2) -> Inputs:
  """Two requests with 3 pages of 16 each (capacity 48) in a pool of 8 pages, 2 of them NaN."""
  inputs = make_inputs(np.random.default_rng(5), [40, 20], q_len, 1, group, 64, 16, BF16, fp8=fp8)
  k_pages = jnp.full((1, 8, 16, 64), jnp.nan, inputs.k_pages.dtype)
  v_pages = jnp.full((1, 8, 16, 64), jnp.nan, inputs.v_pages.dtype)
  rng = np.random.default_rng(6)
  owned = jnp.asarray(rng.standard_normal((2, 1, 6, 16, 64)) * (20 if fp8 else 1))
  k_pages = k_pages.at[:, :6].set(owned[0].astype(k_pages.dtype))
  v_pages = v_pages.at[:, :6].set(owned[1].astype(v_pages.dtype))
  tables = jnp.asarray([[4, 0, 2], [5, 1, 3]], jnp.int32)
  return inputs._replace(k_pages=k_pages, v_pages=v_pages, block_tables=tables)


def _with(inputs: Inputs, seq_lens=None, tables=None) -> Inputs:
  seq_lens = inputs.seq_lens if seq_lens is None else jnp.asarray(seq_lens, jnp.int32)
  tables = inputs.block_tables if tables is None else jnp.asarray(tables, jnp.int32)
  return inputs._replace(seq_lens=seq_lens, block_tables=tables)


CONTRACT_BREACHES = [
  (
    "length past capacity",
    {"seq_lens": [40, 60]},
    r"seq_lens\[1\] = 60 exceeds the block table's capacity 48 \(3 pages of 16\)",
  ),
  ("negative length", {"seq_lens": [-1, 20]}, r"seq_lens\[0\] = -1 is negative"),
  (
    "page id past the pool",
    {"tables": [[4, 0, 99], [5, 1, 3]]},
    r"block_tables\[0, 2\] = 99 is not a page id in \[0, 8\), but request 0 uses page 2",
  ),
  (
    "negative page id",
    {"tables": [[4, 0, 2], [-1, 1, 3]]},
    r"block_tables\[1, 0\] = -1 is not a page id in \[0, 8\)",
  ),
]


@pytest.mark.parametrize(
  "breach, message", [pytest.param(*case[1:], id=case[0]) for case in CONTRACT_BREACHES]
)
def test_contract_breach_raises_eagerly_and_in_checked_mode(breach, message):
  inputs = _with(_contract_inputs(), **breach)
  with pytest.raises(ValueError, match=message):
    paged_decode_attention(*inputs.arrays, impl="xla")
  # Under a plain jit nothing is checked (the rule below applies); checked mode raises.
  jax.jit(functools.partial(paged_decode_attention, impl="xla"))(*inputs.arrays)
  checked = checked_jit(functools.partial(paged_decode_attention, impl="xla"))
  with pytest.raises(checkify.JaxRuntimeError, match="seq_lens must be|block_tables: every"):
    checked(*inputs.arrays)


def test_entries_past_a_requests_pages_may_hold_anything():
  inputs = _contract_inputs()
  garbage = _with(inputs, tables=[[4, 0, 2], [5, 1, 99]])  # request 1 (20) uses 2 pages
  check(paged_decode_attention(*garbage.arrays, impl="xla"), garbage)
  checked = checked_jit(functools.partial(paged_decode_attention, impl="xla"))
  check(checked(*garbage.arrays), garbage)


@pytest.mark.parametrize("fp8", [False, True], ids=["16bit-kv", "fp8-kv"])
def test_nan_a_row_sees_reaches_its_output_on_every_path(fp8):
  """NaN inside a request's length is data, not padding: both paths return NaN for the rows
  that see it (the kernel must not take a NaN softmax sum for a row that saw nothing)."""
  inputs = _contract_inputs(fp8=fp8)
  k_pages = inputs.k_pages.at[0, 0, 5].set(jnp.nan)  # request 0's page 1, position 21
  inputs = inputs._replace(k_pages=k_pages)
  for impl in ("xla", "pallas"):
    out = paged_decode_attention(*inputs.arrays, impl=impl, interpret=True, **inputs.scales)
    out = np.asarray(out, np.float32)
    assert np.all(np.isnan(out[0])), impl  # request 0 (40 positions) sees position 21
    assert np.all(np.isfinite(out[1])), impl


# Requests of one batch, each breaching the contract its own way; one request stays inside.
OUT_OF_CONTRACT = {
  "inside the contract": (40, [4, 0, 2]),
  "length past the capacity (positions 48.. unseen)": (60, [5, 1, 3]),
  "length 2**31 - 1": (2**31 - 1, [1, 5, 3]),
  "negative length (sees nothing)": (-7, [2, 3, 4]),
  "page id past the pool (its positions unseen)": (40, [4, 99, 2]),
  "negative page ids (their positions unseen)": (45, [-1, 0, -3]),
  "no page in the pool (sees nothing)": (30, [-1, 8, 1000]),
}


@pytest.mark.parametrize(
  "fp8, q_len, group, config",
  [
    pytest.param(False, 2, 2, None, id="bf16-default-config"),
    pytest.param(True, 3, 2, TuningConfig(num_stages=2, num_chunks=2), id="fp8-two-chunks"),
    pytest.param(
      False, 6, 12, TuningConfig(num_stages=1, two_warpgroup_tiles=True), id="two-warpgroups"
    ),
  ],
)
def test_out_of_contract_inputs_give_the_same_result_on_every_path(fp8, q_len, group, config):
  base = _contract_inputs(fp8=fp8, q_len=q_len, group=group)
  rng = np.random.default_rng(8)
  names = list(OUT_OF_CONTRACT)
  order = rng.permutation(len(names))
  names = [names[i] for i in order]
  inputs = _with(
    make_inputs(rng, [1] * len(names), q_len, 1, group, 64, 16, BF16, fp8=fp8)._replace(
      k_pages=base.k_pages, v_pages=base.v_pages, k_scale=base.k_scale, v_scale=base.v_scale
    ),
    seq_lens=[OUT_OF_CONTRACT[name][0] for name in names],
    tables=[OUT_OF_CONTRACT[name][1] for name in names],
  )
  # Eager calls refuse the batch, naming its first bad entry (the permutation puts -7 first).
  with pytest.raises(ValueError, match=r"seq_lens\[0\] = -7 is negative"):
    paged_decode_attention(*inputs.arrays, impl="xla", **inputs.scales)
  outputs = {
    impl: jax.jit(
      functools.partial(
        paged_decode_attention, impl=impl, interpret=impl == "pallas", config=config
      )
    )(*inputs.arrays, **inputs.scales)
    for impl in ("xla", "pallas")
  }
  assert not races_found()
  expected = oracle(inputs, 1 / 8.0)
  for impl, out in outputs.items():
    actual = np.asarray(out.astype(F32), np.float64)
    for b, name in enumerate(names):
      np.testing.assert_allclose(
        actual[b], expected[b], rtol=2e-2, atol=2e-2, err_msg=f"{impl}, request {b}: {name}"
      )
  np.testing.assert_allclose(
    np.asarray(outputs["xla"], np.float32), np.asarray(outputs["pallas"], np.float32), atol=2e-2
  )


@pytest.mark.parametrize("interpret", ON_GPU_OR_INTERPRETED)
@pytest.mark.parametrize(
  "q_len, group, config",
  [
    (3, 2, TuningConfig(num_stages=1, num_chunks=1)),
    (1, 8, TuningConfig(num_stages=2, num_chunks=1, transposed_scores=True)),
    (6, 12, TuningConfig(num_stages=1, num_chunks=2, two_warpgroup_tiles=True)),
  ],
)
def test_page_ids_read_ahead_keep_out_of_pool_pages_unseen(q_len, group, config, interpret):
  """Page ids outside the pool in later blocks of long requests: the mask decision of each step
  takes ids read a step earlier (TuningConfig.page_ids_ahead), and still leaves exactly those
  pages' positions unseen."""
  inputs = make_inputs(np.random.default_rng(10), [330, 200], q_len, 1, group, 64, 16, BF16)
  tables = np.asarray(inputs.block_tables).copy()
  num_pages = inputs.k_pages.shape[1]
  tables[0, 9], tables[0, 14], tables[1, 6] = num_pages + 3, -5, 2**31 - 1  # blocks 2, 3; 1
  inputs = _with(inputs, tables=tables)
  call = functools.partial(
    paged_decode_attention,
    impl="pallas",
    interpret=interpret,
    config=dataclasses.replace(config, page_ids_ahead=True),
  )
  check(jax.jit(call)(*inputs.arrays, **inputs.scales), inputs)
  assert not (interpret and races_found())


# ---------------------------------------------------------------------------------------------
# fp8 pages.


def test_fp8_scale_float_equals_scale_array_and_arrays_are_traced():
  inputs = make_inputs(np.random.default_rng(9), [33, 7], 2, 2, 2, 64, 16, BF16, fp8=True)
  as_floats = {"k_scale": 0.03, "v_scale": 0.02}
  as_arrays = {name: jnp.full((2,), value, F32) for name, value in as_floats.items()}
  expected = oracle(inputs._replace(**as_arrays), 1 / 8.0)
  for impl in ("xla", "pallas"):
    call = functools.partial(paged_decode_attention, impl=impl, interpret=True)
    floats, arrays = call(*inputs.arrays, **as_floats), call(*inputs.arrays, **as_arrays)
    np.testing.assert_array_equal(np.asarray(floats, F32), np.asarray(arrays, F32))
    chex.assert_trees_all_close(np.asarray(floats, np.float64), expected, rtol=2e-2, atol=2e-2)
  traces = []

  @jax.jit
  def attend(k_scale, v_scale):
    traces.append(1)
    return paged_decode_attention(*inputs.arrays, impl="xla", k_scale=k_scale, v_scale=v_scale)

  check(attend(inputs.k_scale, inputs.v_scale), inputs)
  check(attend(2 * inputs.k_scale, inputs.v_scale), inputs._replace(k_scale=2 * inputs.k_scale))
  assert len(traces) == 1, "a new scale array must not retrace"


def test_fp8_queries_go_to_float16_exactly_per_tile():
  # Magnitudes from bf16's smallest normals to its largest finite values, one range per 64-row
  # tile; the last tile also holds NaN and inf, which must stay NaN and inf and leave the
  # tile's other values exact.
  rng = np.random.default_rng(4)
  exponents = np.array([-118, -60, -10, 0, 30, 127])
  q = rng.standard_normal((1, 2, 64 * len(exponents), 64)) * 0.5
  q = (q.reshape(1, 2, len(exponents), 64, 64) * 2.0 ** exponents[:, None, None]).reshape(q.shape)
  special = jnp.array([jnp.nan, jnp.inf], BF16)
  q = jnp.asarray(q, jnp.float32).astype(BF16).at[0, 1, -1, :2].set(special)
  q16, scale = mosaic_gpu._to_float16_tiles(q)
  assert q16.dtype == F16 and scale.shape == (1, 2, len(exponents))
  assert np.all(np.log2(np.asarray(scale)) % 1 == 0)  # powers of two
  back = np.asarray(q16, np.float64).reshape(1, 2, -1, 64, 64) * np.asarray(scale)[..., None, None]
  back = back.reshape(q.shape)
  want = np.asarray(q.astype(F32), np.float64)
  want[np.abs(want) < np.finfo(np.float32).tiny] = 0.0  # subnormals count as 0, as in XLA
  finite = np.isfinite(want)
  largest = np.abs(np.where(finite, want, 0)).reshape(1, 2, -1, 64 * 64).max(-1)
  error = np.abs(np.where(finite, back, 0.0) - np.where(finite, want, 0.0))
  tile_error = error.reshape(1, 2, -1, 64 * 64).max(-1)
  # Exact but for values under 2^-29 of their tile's largest (float16 subnormals).
  assert np.all(tile_error <= 2.0**-40 * largest)
  assert np.isnan(back[0, 1, -1, 0]) and np.isinf(back[0, 1, -1, 1])
  assert np.isfinite(back[finite]).all()


@pytest.mark.parametrize("interpret", ON_GPU_OR_INTERPRETED)
@pytest.mark.parametrize("exponent", [-40, 40])
def test_fp8_pages_serve_queries_of_any_bf16_magnitude(exponent, interpret):
  # q * 2^e with k_scale * 2^-e gives the same logits: float16 staging must neither overflow
  # (2^40 is past float16's 65504) nor lose the small queries' bits.
  inputs = make_inputs(np.random.default_rng(6), [70, 9], 3, 2, 4, 64, 16, BF16, fp8=True)
  scaled = inputs._replace(
    q=(inputs.q.astype(F32) * 2.0**exponent).astype(BF16), k_scale=inputs.k_scale * 2.0**-exponent
  )
  config = TuningConfig(num_stages=2, num_chunks=2)
  out = paged_decode_attention(
    *scaled.arrays, impl="pallas", interpret=interpret, config=config, **scaled.scales
  )
  check(out, scaled)


# ---------------------------------------------------------------------------------------------
# The real Mosaic GPU lowering, without a GPU: interpret mode is more permissive.


def _g8_d128(name, q_len, kv_dtype, config):
  """A lowering case at G 8, D 128: 4 requests of bf16 q over 2 KV heads of 16-position pages."""
  return (name, (4, q_len, 16, 128), (2, 64, 16, 128), 16, BF16, kv_dtype, config)


def _g12_q7_d128(name, kv_dtype, config):
  """A lowering case at G 12 q_len 7 (84 rows), D 128: 2 requests over 2 KV heads."""
  return (name, (2, 7, 24, 128), (2, 64, 16, 128), 16, BF16, kv_dtype, config)


LOWERING_CASES = [
  # id, (B, q_len, Hq, D), (Hkv, num_pages, page, D), max_pages, q dtype, pages' dtype, config
  _g8_d128("bf16 G8 q7", 7, BF16, None),
  ("f16 G12 q6 two tiles", (2, 6, 24, 64), (2, 32, 64, 64), 4, F16, F16, None),
  _g8_d128(
    "bf16 G8 q7 operands in shared memory",
    7,
    BF16,
    TuningConfig(operands_in_registers=False, num_stages=2),
  ),
  _g8_d128(
    "fp8 G8 q3 operands in shared memory",
    3,
    FP8,
    TuningConfig(operands_in_registers=False, num_stages=2),
  ),
  (
    "bf16 two warpgroups",
    (2, 7, 12, 128),
    (1, 64, 16, 128),
    16,
    BF16,
    BF16,
    TuningConfig(two_warpgroup_tiles=True, num_stages=2),
  ),
  _g12_q7_d128(
    "bf16 G12 q7 two warpgroups and a producer",
    BF16,
    TuningConfig(two_warpgroup_tiles=True, producer_warpgroup=True, page_ids_ahead=True),
  ),
  _g8_d128(
    "fp8 G8 q3 staging overlapped", 3, FP8, TuningConfig(fp8_staging_overlap=True, num_stages=2)
  ),
  _g12_q7_d128(
    "fp8 G12 q7 two warpgroups and a converting producer",
    FP8,
    TuningConfig(
      num_stages=3,
      two_warpgroup_tiles=True,
      producer_warpgroup=True,
      page_ids_ahead=True,
      fp8_8bit_layout=True,
    ),
  ),
  _g8_d128("bf16 G8 q7 row tile, deferred sums", 7, BF16, TuningConfig(deferred_sum=True)),
  _g12_q7_d128(
    "bf16 G12 q7 two warpgroups, deferred sums",
    BF16,
    TuningConfig(two_warpgroup_tiles=True, deferred_sum=True),
  ),
  _g8_d128(
    "bf16 G8 q1 transposed, deferred sums",
    1,
    BF16,
    TuningConfig(transposed_scores=True, deferred_sum=True, num_stages=2),
  ),
  _g8_d128("fp8 bf16 D128 G8 q3", 3, FP8, None),
  ("fp8 f16 D64 q1", (3, 1, 8, 64), (1, 64, 32, 64), 8, F16, FP8, TuningConfig(num_chunks=3)),
  _g8_d128("bf16 G8 q1 transposed", 1, BF16, TuningConfig(transposed_scores=True)),
  (
    "f16 G12 q7 transposed",
    (2, 7, 24, 64),
    (2, 32, 64, 64),
    4,
    F16,
    F16,
    TuningConfig(transposed_scores=True, block_kv=128),
  ),
  _g8_d128("fp8 bf16 G8 q3 transposed", 3, FP8, TuningConfig(transposed_scores=True, num_stages=2)),
  _g8_d128(
    "fp8 bf16 G8 q1 K and V in registers",
    1,
    FP8,
    TuningConfig(transposed_scores=True, fp8_in_registers=True, num_stages=2),
  ),
  _g8_d128(
    "fp8 bf16 G8 q3 K and V in registers",
    3,
    FP8,
    TuningConfig(transposed_scores=True, fp8_in_registers=True, num_stages=4),
  ),
  (
    "fp8 f16 G12 q1 D64 K and V in registers",
    (3, 1, 24, 64),
    (2, 64, 32, 64),
    8,
    F16,
    FP8,
    TuningConfig(transposed_scores=True, fp8_in_registers=True, num_stages=4),
  ),
  (
    "bf16 G12 q6 merge kernel",
    (2, 6, 24, 64),
    (2, 32, 16, 64),
    8,
    BF16,
    BF16,
    TuningConfig(num_chunks=3, merge_kernel=True),
  ),
  (
    "fp8 f16 D128 q3 merge kernel",
    (3, 3, 16, 128),
    (2, 64, 16, 128),
    16,
    F16,
    FP8,
    TuningConfig(num_chunks=2, merge_kernel=True),
  ),
  (
    "fp8 bf16 D128 8-bit layout",
    (2, 3, 16, 128),
    (2, 64, 16, 128),
    16,
    BF16,
    FP8,
    TuningConfig(num_stages=3, fp8_8bit_layout=True),
  ),
  (
    "fp8 f16 D64 8-bit layout",
    (2, 7, 16, 64),
    (2, 64, 32, 64),
    8,
    F16,
    FP8,
    TuningConfig(fp8_8bit_layout=True),
  ),
  (
    "fp8 bf16 G12 q7 block 128",
    (2, 7, 24, 64),
    (2, 64, 16, 64),
    16,
    BF16,
    FP8,
    TuningConfig(block_kv=128, num_stages=2),
  ),
]


@pytest.mark.parametrize(
  "q_shape, pages_shape, max_pages, dtype, kv_dtype, config",
  [pytest.param(*case[1:], id=case[0]) for case in LOWERING_CASES],
)
def test_kernel_lowers_for_cuda_on_any_host(
  q_shape, pages_shape, max_pages, dtype, kv_dtype, config
):
  batch, num_kv_heads = q_shape[0], pages_shape[0]
  fp8 = kv_dtype == FP8
  args = [
    jax.ShapeDtypeStruct(q_shape, dtype),
    jax.ShapeDtypeStruct(pages_shape, kv_dtype),
    jax.ShapeDtypeStruct(pages_shape, kv_dtype),
    jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
    jax.ShapeDtypeStruct((batch,), jnp.int32),
    jax.ShapeDtypeStruct((num_kv_heads,), F32) if fp8 else None,
    jax.ShapeDtypeStruct((num_kv_heads,), F32) if fp8 else None,
  ]
  config = config or default_config(q_shape[-1], pages_shape[2], kv_dtype)
  kernel = functools.partial(
    mosaic_gpu.paged_decode_attention_mosaic_gpu, sm_scale=0.1, config=config
  )
  lowered = jax.jit(kernel).trace(*args).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


# ---------------------------------------------------------------------------------------------
# Larger cases on the GPU only.


def _coverage_cases():
  """Every q_len 1..8, G in {1, 2, 4, 8, 12, 16}, D 64/128, page 16/32/64, bf16/fp16."""
  groups, head_dims, pages = (1, 2, 4, 8, 12, 16), (64, 128), (16, 32, 64)
  cases = []
  for i, q_len in enumerate(range(1, 9)):
    for g_index, group in enumerate(groups):
      dtype = (BF16, F16)[(i * 7 + g_index) % 2]
      cases.append((q_len, group, head_dims[(i + g_index) % 2], pages[(i + g_index) % 3], dtype))
  return cases


def _coverage_params():
  """The coverage cases with 16-bit pages, and with fp8 pages at G 1, 8 and 12."""
  params = []
  for q_len, group, head_dim, page_size, dtype in _coverage_cases():
    name = f"q{q_len}-G{group}-D{head_dim}-page{page_size}-{jnp.dtype(dtype).name}"
    params.append(pytest.param(q_len, group, head_dim, page_size, dtype, False, id=name))
    if group in (1, 8, 12):
      params.append(pytest.param(q_len, group, head_dim, page_size, dtype, True, id=name + "-fp8"))
  return params


def _convert_fp8_pairs_natively(pairs):
  """Runs the two fp8-pair conversions of the kernel on one 16-bit block [64, 64]: K as is, V
  from its transposed view; returns (K f16 [64, 128], V^T f16 [128, 64])."""
  transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

  def kernel(pairs_ref, k_ref, v_ref, pairs_smem, k_smem, v_smem, barrier):
    plgpu.copy_gmem_to_smem(pairs_ref, pairs_smem, barrier)
    plgpu.barrier_wait(barrier)
    k_smem[...] = mosaic_gpu._fp8_k_pairs_to_float16(
      plgpu.load(pairs_smem, layout=plgpu.Layout.WGMMA)
    )
    v_smem[...] = mosaic_gpu._fp8_v_pairs_to_float16(
      plgpu.load(pairs_smem.transpose((1, 0)), layout=plgpu.Layout.WGMMA)
    )
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, k_ref)
    plgpu.copy_smem_to_gmem(v_smem, v_ref)
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
    kernel,
    out_type=(jax.ShapeDtypeStruct((64, 128), F16), jax.ShapeDtypeStruct((128, 64), F16)),
    scratch_types=[
      plgpu.SMEM((64, 64), jnp.uint16, transforms=transforms),
      plgpu.SMEM((64, 128), F16, transforms=transforms),
      plgpu.SMEM((128, 64), F16, transforms=transforms),
      plgpu.Barrier(),
    ],
  )(pairs)


@pytest.mark.gpu
def test_fp8_pairs_convert_k_and_v_exactly():
  """The D 128 register path's conversions on their own, against NumPy: each e4m3 byte of a K
  block at its column of ``_k_pairs_order``, and of V^T with the even head dims first."""
  rng = np.random.default_rng(7)
  block = jnp.asarray(rng.standard_normal((64, 128)) * 30, F32).astype(FP8)  # [positions, D]
  pairs = jax.lax.bitcast_convert_type(block.reshape(64, 64, 2), jnp.uint16)
  k, v_t = jax.jit(_convert_fp8_pairs_natively)(pairs)
  values = np.asarray(block.astype(F32))
  np.testing.assert_array_equal(
    np.asarray(k, np.float32), values[:, mosaic_gpu._k_pairs_order(128)]
  )
  expected_v_t = np.concatenate([values.T[0::2], values.T[1::2]])
  np.testing.assert_array_equal(np.asarray(v_t, np.float32), expected_v_t)


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True], ids=["row-tiles", "transposed"])
@pytest.mark.parametrize("q_len, group, head_dim, page_size, dtype, fp8", _coverage_params())
def test_kernel_gpu_coverage(q_len, group, head_dim, page_size, dtype, fp8, transposed):
  """Both layouts on every case (transposed scores apply up to 128 packed rows)."""
  rng = np.random.default_rng(q_len * 1000 + group * 10 + head_dim + page_size)
  seq_lens = [0, 1, q_len, page_size + 1, int(rng.integers(200, 700))]
  inputs = make_inputs(rng, seq_lens, q_len, 2, group, head_dim, page_size, dtype, fp8=fp8)
  config = default_config(head_dim, page_size, FP8 if fp8 else dtype)
  config = dataclasses.replace(config, transposed_scores=transposed)
  out = paged_decode_attention(*inputs.arrays, impl="pallas", config=config, **inputs.scales)
  check(out, inputs)


@pytest.mark.gpu
@pytest.mark.parametrize(
  "kv, producer",
  [("16bit", False), ("16bit", True), ("fp8", True)],
  ids=["warpgroup-0-copies", "producer", "fp8-converting-producer"],
)
@pytest.mark.parametrize(
  "q_len, group, head_dim", [(6, 12, 128), (7, 12, 64), (8, 12, 128), (5, 16, 64), (8, 16, 128)]
)
def test_two_warpgroup_tile_gpu_random(q_len, group, head_dim, kv, producer):
  """Ragged random lengths (1 to ~3000, edge lengths included) with the heuristic defaults,
  with and without the producer warpgroup, and on fp8 pages (which need it)."""
  rng = np.random.default_rng(q_len * 100 + group + head_dim)
  seq_lens = [0, 1, q_len - 1, 16, 17, *rng.integers(200, 3000, size=3)]
  fp8 = kv == "fp8"
  inputs = make_inputs(rng, seq_lens, q_len, 2, group, head_dim, 16, BF16, fp8=fp8)
  config = dataclasses.replace(
    default_config(head_dim, 16, FP8 if fp8 else BF16),
    two_warpgroup_tiles=True,
    producer_warpgroup=producer,
  )
  out = paged_decode_attention(*inputs.arrays, impl="pallas", config=config, **inputs.scales)
  check(out, inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True], ids=["row-tiles", "transposed"])
@pytest.mark.parametrize("fp8", [False, True], ids=["16bit-kv", "fp8-kv"])
@pytest.mark.parametrize("batch, max_len", [(1, 9000), (6, 3000)])
@pytest.mark.parametrize("balance_waves", [None, 2])
def test_kernel_gpu_large_random(batch, max_len, balance_waves, fp8, transposed):
  rng = np.random.default_rng(batch)
  seq_lens = rng.integers(1, max_len, size=batch)
  inputs = make_inputs(rng, seq_lens, 7, 2, 8, 128, 16, BF16, fp8=fp8)
  config = dataclasses.replace(
    default_config(128, 16, FP8 if fp8 else BF16),
    balance_waves=balance_waves,
    transposed_scores=transposed,
  )
  out = paged_decode_attention(*inputs.arrays, impl="pallas", config=config, **inputs.scales)
  check(out, inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["16bit-kv", "fp8-kv"])
def test_balanced_chunks_gpu_ragged_batch(fp8):
  """64 requests of 1 to 5000 positions, padding slots among them, with the real SM count."""
  rng = np.random.default_rng(64)
  seq_lens = rng.integers(1, 5000, size=64)
  seq_lens[[3, 40]] = 0
  inputs = make_inputs(rng, seq_lens, 4, 4, 8, 128, 16, BF16, fp8=fp8)
  config = dataclasses.replace(default_config(128, 16, FP8 if fp8 else BF16), balance_waves=1)
  out = paged_decode_attention(*inputs.arrays, impl="pallas", config=config, **inputs.scales)
  check(out, inputs)


@pytest.mark.gpu
def test_out_of_contract_inputs_agree_on_the_gpu():
  """The out-of-contract rule natively: XLA and the kernel under jit, against the oracle."""
  for fp8 in (False, True):
    inputs = _contract_inputs(fp8=fp8, q_len=3)
    inputs = _with(inputs, seq_lens=[60, -3], tables=[[4, 99, 2], [5, -1, 3]])
    expected = oracle(inputs, 1 / 8.0)
    for impl in ("xla", "pallas"):
      out = jax.jit(functools.partial(paged_decode_attention, impl=impl))(
        *inputs.arrays, **inputs.scales
      )
      chex.assert_trees_all_close(np.asarray(out, np.float64), expected, rtol=2e-2, atol=2e-2)
