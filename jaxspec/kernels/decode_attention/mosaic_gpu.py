"""Packed-row paged decode attention in Pallas Mosaic GPU (Hopper).

Algorithm (FlashInfer's packed-row decode program, FlashAttention-2 online
softmax, flash-decoding split-KV merge):

* All ``G * q_len`` query rows of one (request, KV head) pair are packed into
  one ``wgmma`` M tile of 64 rows, row ``r = j * G + g`` (token ``j``, query
  head ``g`` of the group). Every KV page of the pair is therefore read from
  HBM once per tile, however many draft rows there are. Pairs with more than
  64 rows use further 64-row tiles (grid axis ``row_tile``), each reading the
  KV again; with ``TuningConfig.two_warpgroup_tiles`` they use one 128-row
  tile instead, served by two consumer warpgroups of 64 rows each that share
  one copy of every K/V block (see "Two warpgroups" below).
* A work item is (KV head, row tile, request, KV chunk). Its KV blocks of
  ``block_kv`` positions are fetched page by page with TMA into a ring of
  ``num_stages`` shared-memory slots; the page ids are read from the block
  table inside the kernel, so no gathered copy of the cache is ever made.
* ``Q K^T`` and ``P V`` run on the tensor cores (``wgmma``); the online
  softmax runs in float32 in base 2 with the scale folded into ``log2(e)``.
  The causal mask (row ``j`` sees positions ``< S - q_len + j + 1``) is only
  evaluated on the last blocks of a request, where it can bite.
* Length-aware split without host sync: each request's blocks are cut into
  at most ``num_chunks`` chunks computed on the device from ``seq_lens``, so a
  single long request spreads over all SMs while the grid shape stays static.
  By default a request's chunks are ``ceil(blocks / num_chunks)`` long; with
  ``TuningConfig.balance_waves`` the whole batch shares one chunk length,
  ``total blocks / (balance_waves x resident slots)`` (FlashInfer's planner
  picks one KV chunk size per batch the same way), so the long requests of a
  ragged batch are cut finer than the short ones and the waves finish
  together; unused items of the static grid return at once.
  Each chunk writes its normalised output and base-2 log-sum-exp; the chunks
  are merged afterwards in a fixed order (no atomics), so results do not
  depend on timing.

Two warpgroups (the idea of jax's FlashAttention-3 kernel ``attention_mgpu.py``; its producer
warpgroup is the option below): warpgroup 0 issues every TMA copy of the
ring, both warpgroups wait on the same full barriers and run their own
``wgmma`` on the shared slot. Before warpgroup 0 refills a slot it waits on
that slot's ``consumed`` barrier, which warpgroup 1 arrives at once its
``P V`` on the slot is complete (warpgroup 0's own ``wgmma`` is complete by
program order). The V tail of the last block is zeroed by warpgroup 0 alone,
which then arrives at a ``v_zeroed`` barrier that warpgroup 1 waits on before
its ``P V``. Both warpgroups take every branch together (the conditions depend
only on the request and the step), so every barrier phase is observed by every
waiter, as GPU interpret mode checks. Its race detector does not track the
shared-memory reads of ``wgmma`` yet, so a missing ``consumed`` wait would only
show on the GPU.

Producer warpgroup (``TuningConfig.producer_warpgroup``, jax's ``attention_mgpu.py`` has one):
a third warpgroup issues every TMA copy of the 128-row tile's ring, block ``i`` into slot
``i mod num_stages`` once both consumer warpgroups have arrived at that slot's ``consumed``
barrier after their ``P V`` of block ``i - num_stages``; the consumers only wait for their
blocks. Without it warpgroup 0 issues the copies at the end of its step, after waiting for
warpgroup 1's ``P V``, so the two consumers advance in step with each other. The producer
lowers its registers to ``PRODUCER_REGISTERS`` and the consumers raise theirs to
``CONSUMER_REGISTERS`` (``setmaxnreg``): the tile already holds one work item per SM at 255
registers, so the third warpgroup costs no occupancy. With fp8 pages the producer also converts
(and keeps ``CONVERTING_PRODUCER_REGISTERS``, the consumers ``CONVERTING_CONSUMER_REGISTERS``):
its copies land in an fp8 ring, and it turns each block into float16 in registers (K, then V
with the rows past the length or on out-of-pool pages zeroed where the step needs the mask),
stores it into a float16 ring of the same depth and arrives at that slot's ``k_ready`` /
``v_ready`` barrier, after a fence that makes its stores visible to the tensor cores; it
refills the fp8 slot at once. The consumers then run the 16-bit tile's step on the float16
ring, and one conversion of a block serves all 128 rows (64-row tiles convert it once per
tile).

Transposed scores (``TuningConfig.transposed_scores``, FlashAttention-3's
backward pass computes ``S^T = K Q^T`` the same way): with the packed rows as
the wgmma N dimension (a multiple of 8, up to 128) and the KV positions as M,
a pair's rows fit one tile without padding them to 64. ``S^T = K Q^T`` takes
K as the A operand and Q^T as a transposed B; the online softmax reduces over
axis 0 (the positions, spread over the warpgroup's four warps); P is stored
transposed, as ``P [N, block_kv]``, so that ``O^T = V^T P^T`` reads V^T as a
transposed A and P^T as a transposed B with the 128-byte swizzle of the other
tiles; the output tile is stored transposed into the Q tile. Per step a warp
then holds ``block_kv * N / 128`` scores instead of 32, which is what pays at
small N (plain decoding: one row per query head); from 24 rows on it measured
equal or slower than the 64-row tiles (``default_config``; the reductions
across warps are the suspect, not yet profiled).

Operands in registers (``TuningConfig.operands_in_registers``, row tiles, natively): Q is
loaded once per work item into the wgmma register layout and is the A operand of every
``Q K^T``; P, cast to the compute dtype, is the A operand of ``P V`` straight from the
softmax's registers, and ``P V`` accumulates onto the rescaled output (jax's
``attention_mgpu.py`` does both). Per step that spares the shared-memory reads of Q and the
store and reads of P: H200, B64 L32k, 1.03-1.05x at G 12 q_len 6/7, 1.05-1.08x at D 64,
1.08-1.09x with fp8 pages, 1.01x at G 8 (``benchmarks/NOTES_decode_attention.md``, version 9);
at one request (B1 L8k) it was slower, so ``default_config`` keeps shared memory there. GPU
interpret mode only models shared-memory operands and fresh accumulators, so there Q and P go
through shared memory as before; the native GPU tests cover the register form.

Pages a request may not attend (``reference.py`` states the rule): a page past
the request's length (or the table's capacity) or with an id outside
``[0, num_pages)`` is never copied; a plain barrier arrival stands in for its
TMA copy, its slot rows keep stale data, and the step masks them. Whether a
step needs a mask is decided per block (``lax.cond``): inside the contract
only the last blocks of a request do, as before, and the others run the
unmasked step.

fp8 pages (``float8_e4m3fn``): TMA copies the fp8 blocks (half the bytes of
bf16) into the ring. Each step converts its K block into a float16 staging
block (exact: every e4m3 value is a float16 value, and e4m3 -> f16 is one
``cvt`` per pair, where bf16 would go through float32), runs ``Q K^T`` on it,
then converts its V block into the same staging block for ``P V`` (reading the
``Q K^T`` accumulator has waited for that wgmma), and refills the slot: one
staging block keeps a work item small enough for three per SM. Transposed
tiles can instead keep both converted blocks in registers as the wgmmas' A
operands (``TuningConfig.fp8_in_registers``), with no staging block. Or
(``TuningConfig.fp8_staging_overlap``) a K and a V staging block take the
conversions off the tensor cores' path: V is converted while ``Q K^T`` runs, and
the next block's K while ``P V`` runs (each wgmma reads the other block, whose
previous reader has completed), so only the first K conversion of a work item
waits in front of a wgmma. The wgmmas
then run in float16, so q is given to the kernel in float16, scaled per row
tile by a power of two ``s`` that maps the tile's largest magnitude below
2^15: exact for every bf16 value within 2^29 of that maximum (smaller ones
lose bits only below 2^-40 of it), and no bf16 value overflows. P is float16
(in [0, 1], three more bits than bf16). The real value is ``stored * scale``
per KV head, so ``k_scale * s`` joins the score scale; the output tile is
``P V / l`` in float16 (a convex combination of e4m3 values, |.| <= 448) and
``v_scale`` multiplies it after the chunk merge, in float32 (per-head scalars
factor out of both matmuls and of the merge): in the merge kernel where it runs,
otherwise in the elementwise epilogue that XLA fuses into its merge.

Numerics: K positions a row must not see are masked with ``where`` to -inf,
and V rows past the request's length are zeroed in shared memory before
``P V`` (their probability is 0, but 0 * NaN = NaN on the tensor cores), so
garbage or NaN in unowned page slots cannot reach the output. Rows that see
nothing keep a running max of -inf; the exponent is then shifted by 0 instead
of -inf so no NaN is formed, and they finish with output 0 and lse -inf. NaN
in a position a row does see reaches its output, as on the XLA path.
"""

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.mosaic import gpu as mgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm

from jaxspec.kernels.dispatch import num_sms, validate_config_fields

ROWS_PER_TILE = 64  # wgmma M tile of one warpgroup
WARPS_PER_WARPGROUP = 4
# TuningConfig.producer_warpgroup: registers per thread after setmaxnreg, as jax's
# attention_mgpu.py sets them; 128 x (40 + 2 x 232) = 64512 of the SM's 65536.
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232
# The same with fp8 pages, where the producer converts every block and its share set the pace
# (H100, G 12 q_len 7, B64 L32k from L2, outputs bit for bit equal: 2886 -> 2763 us at D 128,
# 2284 -> 2161 us at D 64 against 40 / 232; 88 / 208: 2807 us). Every split must keep the sum
# of 40 + 2 x 232: the three warpgroups launch with 168 registers a thread, and a consumer's
# increase past what the producer gave back waits forever (64 / 224 hung the kernel).
CONVERTING_PRODUCER_REGISTERS = 120
CONVERTING_CONSUMER_REGISTERS = 192
# Transposed scores: the rows are the wgmma N dimension, a multiple of 8, here at most 128 (the
# accumulators of S^T [block_kv, N] and O^T [D, N] stay in one warpgroup's registers).
TRANSPOSED_ROW_ALIGN = 8
MAX_TRANSPOSED_ROWS = 128
# default_config's transposed tiles: up to this many packed rows, with 16-bit and fp8 pages
# (measured on the H200 in benchmarks/results/decode_attention_transposed.md and
# decode_attention_fp8_transposed.md; 24 rows and more ran slower).
DEFAULT_TRANSPOSED_MAX_ROWS = 16
# ... and with 16-bit pages on the devices named here (a piece of jax's device_kind), by head dim.
# H100 SXM (3.35 TB/s, where the row tile's extra work hides less under the reads than on the
# H200's 4.8), same process, three interleaved timings, against the 64-row tile: 24 rows (G 8
# q_len 3) 1.003-1.083x over B1-B64, L8k-L32k and a ragged batch (B1 L8k 22.8 against 24.7 us),
# also at G 12 q_len 2 and D 64; 32 rows (G 8 q_len 4) 1.004-1.025x; 40 rows 0.998-1.001x
# (benchmarks/results/decode_attention_transposed_rows_h100_2026-12-05.json).
TRANSPOSED_MAX_ROWS_16BIT_BY_DEVICE = (("H100 80GB HBM3", {128: 32, 64: 24}),)
# default_config's merge kernel (TuningConfig.merge_kernel): on the devices named here, up to
# this many packed rows and (request, KV head) pairs. H100 SXM, same process, three interleaved
# timings each, against XLA's merge: G 8 q_len 1 (8 rows) 1.017-1.096x at B1 L8k/L32k and B8 L8k
# (B1 L8k 19.1 against 20.3 us, 14.6 against 16.0 at D 64); 12 rows and more 0.96-0.99x, B64 L32k
# 0.996-0.998x (benchmarks/results/decode_attention_merge_ring_h100_2026-12-06.json); by CUPTI
# device time 1.006-1.040x at 8 rows, 0.96-0.98x from 12
# (decode_attention_kernel_time_merge_h100_2026-12-06.json). fp8 pages, once the merge kernel
# took v_scale (CUPTI, three interleaved timings): 8 rows 1.009-1.054x at B1 L8k/L32k and B8 L8k
# (B1 L8k 19.1 against 20.2 us), 24-84 rows 0.958-1.018x
# (decode_attention_merge_fp8_h100_2026-12-06.json). The H200 is not named: there the same
# shapes' ranges overlapped (decode_attention_merge_ring_h200_2026-12-06.json).
MERGE_KERNEL_BY_DEVICE = (("H100 80GB HBM3", (8, 64)),)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # q (and 16-bit pages)
FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_PAGE_SIZES = (16, 32, 64, 128)
_SMEM_PER_SM = 227 * 1024  # usable shared memory per SM on Hopper
_F32_PER_LINE = 32  # float32 values in a 128-byte shared-memory line
# merge_chunks_mosaic_gpu: tiles of 64 head dims (one 128-byte swizzle of 16-bit values), so a
# program per 64 of them; its warpgroups, each merging every W-th chunk; the shared memory it
# takes at most, most of it the warpgroups' rings of chunk tiles (a 64-row tile is 8 KiB); and
# at most this many slots in all (jax 0.11.2 lowers a Barrier group of at most 32 on the GPU;
# interpret mode runs more).
MERGE_COLS = 64
MERGE_WARPGROUPS = 4
MERGE_SMEM_BYTES = 200 * 1024
MERGE_RING_MAX_SLOTS = 32
_LOG2E = math.log2(math.e)
BALANCED_MAX_CHUNKS = 16  # chunks per request at most with balance_waves, unless num_chunks says
DEFAULT_BALANCE_WAVES = 4
# fp8 work items per SM that default_config sizes the ring for: each step's conversions sit on
# its single warpgroup's critical path, so more resident items hide more of them.
FP8_ITEMS_PER_SM = 3
# default_config's operands in registers (and 128-row tiles): from this many (request, KV head)
# pairs. H200: 64 pairs (B8, Hkv 8) and more ran faster with them, 8 pairs (B1) slower, where the
# split KV leaves each work item a few blocks (benchmarks/NOTES_decode_attention.md, version 9).
DEFAULT_REGISTER_OPERANDS_MIN_PAIRS = 64
# default_config's fp8_in_registers: fp8 pages with up to this many packed rows, by head dim.
# H200, B64 L32k, against the staging block: at D 128 8 rows 1.06-1.07x, 12 and 16 rows
# 0.97-1.02x with 8-bit loads; at D 64 8 rows 1.41x, 12 rows 1.14x. At D 128 only from
# DEFAULT_FP8_IN_REGISTERS_MIN_PAIRS_D128 (request, KV head) pairs on: B1 L8k ran 0.82x and B8
# L32k (64 pairs) 0.94-1.00x (benchmarks/results/decode_attention_fp8_in_registers.md and
# decode_attention_fp8_register_sweep/). With the 16-bit pair loads at D 128, H100, same
# process: 12 rows (G 12) B64 L32k 1.12-1.14x, B128 L16k 1.11x, 16 rows (G 8 q_len 2) B64 L32k
# 1.14x (benchmarks/results/decode_attention_fp8_pairs_ab_2026-12-05.json); H200, B64 L32k, against
# the module before the pair loads: 8 rows 1.15x, 12 rows 1.17x
# (benchmarks/results/decode_attention_fp8_pairs_ab_h200_2026-12-05.json). Beyond 16 rows, H200,
# B64 L32k, against the row tiles' staging blocks: 24 rows (G 8 q_len 3, G 12 q_len 2) 1.06x,
# 32 rows 0.92x, 40 rows 0.79x, 56 rows 0.57x (40 and 56 rows spill registers)
# (benchmarks/results/decode_attention_fp8_register_rows_h200_2026-12-05.json).
DEFAULT_FP8_IN_REGISTERS_MAX_ROWS = {64: 12, 128: 24}
# default_config's ring for fp8 pages in the 128-row tile (its producer converts them): H100 SXM,
# G 12 q_len 7, D 128, CUPTI, against two 64-row tiles: 2 stages 1.22x at B64 L32k and 1.18x at
# B8 L32k, 3 stages 1.18x and 1.15x; q_len 6 B64 L32k 1.21x, ragged B64 1.16x (2 stages)
# (benchmarks/results/decode_attention_fp8_producer_h100_2026-12-06.json).
FP8_PRODUCER_STAGES = 2
DEFAULT_FP8_IN_REGISTERS_MIN_PAIRS_D128 = 512
# Their ring at D 128, where no staging block sits beside it: B64 L32k, 8 rows, 2 stages 1316 us,
# 3 stages 1340, 4 stages 1241 and 1247, 6 stages 1567. At D 64 the staging-sized ring (6 stages)
# stays: 870 us against 1075 with 8.
FP8_IN_REGISTERS_STAGES_D128 = 4
# default_config's ring for transposed tiles on 16-bit pages at D 64, where a stage is 16 KiB:
# the smaller ring fits more work items per SM. H200, 8 rows, same process, against 4 stages:
# B64 L32k 959 against 1000 us (3 stages 978 against 982), B8 L32k 130 against 140 (3 stages 130
# against 131); 6 stages 0.89-0.91x, 8 stages 0.52-0.56x
# (benchmarks/results/decode_attention_d64_q1_stages/).
TRANSPOSED_STAGES_D64 = 2
# default_config's page_ids_ahead on transposed tiles (16-bit pages, D 128): from this many
# (request, KV head) pairs. H200, q_len 1, same process, three interleaved timings each: B64 L32k
# G 8 1.001-1.012x, G 12 1.010-1.016x, B64 L8k 1.003-1.020x, B64 ragged 0.999-1.015x, B128 L8k
# 1.001-1.009x; at 256 pairs (B32 L32k) 0.986-1.000x and at D 64 0.98-1.02x, B8 L32k 0.93-0.97x
# (benchmarks/results/decode_attention_page_ids_ahead/transposed_pairs.json).
DEFAULT_PAGE_IDS_AHEAD_TRANSPOSED_MIN_PAIRS = 512


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """Static tuning knobs of the kernel.

  Attributes:
    block_kv: KV positions per pipeline step (the wgmma N of ``Q K^T`` and K of
      ``P V``); a multiple of 64 and of the page size.
    num_stages: depth of the shared-memory ring of K/V blocks in flight.
    num_chunks: KV chunks per request (the split-KV factor); ``None`` picks it
      from the batch size so that every SM streams one chunk (see
      ``default_num_chunks``).
    two_warpgroup_tiles: when ``G * q_len > 64``, serve all rows of a pair
      with one 128-row tile of two warpgroups that share each K/V block,
      instead of 64-row tiles that each read the KV. fp8 pages only with
      ``producer_warpgroup``, which converts them; ``default_config`` turns it on
      where the rows call for it.
    operands_in_registers: row tiles give Q and P to wgmma from registers and accumulate
      ``P V`` onto the output (module docstring, "Operands in registers"); otherwise both go
      through shared memory. Native runs only: GPU interpret mode always takes shared memory.
    fp8_in_registers: fp8 pages with transposed scores and ``block_kv`` 64: each K block is
      converted to float16 in registers and is the A operand of ``S^T = K Q^T``, and each V
      block is loaded transposed, converted and is the A operand of ``O^T = V^T P^T``, instead
      of both going through the float16 staging block (two stores and two reads of 16 KiB
      fewer per step at D 128; no staging block). At D 128 both blocks are read as 16-bit
      pairs of head dims with ``ldmatrix`` (V transposed), four bytes a register, and
      converted with one byte permute (V only) and two ``cvt`` per register; K's head dims and
      V^T's rows come out permuted, which Q's column order and the output's reorder after the
      merge undo. Native runs only, as ``operands_in_registers``. ``default_config`` turns it
      on for up to ``DEFAULT_FP8_IN_REGISTERS_MAX_ROWS`` packed rows.
    fp8_staging_overlap: fp8 pages through staging: separate K and V staging blocks, V converted
      while ``Q K^T`` runs and the next K while ``P V`` runs (module docstring, "fp8 pages"),
      at 16 KiB more shared memory per item (D 128). ``default_config`` turns it on for fp8 row
      tiles.
    deferred_sum: the softmax denominators accumulate per score element (one more float32
      register per score element a thread holds: ``block_kv * N / 128`` on a transposed tile,
      ``64 * block_kv / 128`` on a row tile) and are summed across the KV positions once per
      work item instead of once per step: on a transposed tile a reduction across the
      warpgroup's warps (through shared memory), on a row tile across the four lanes that share
      a row (shuffles); as FlashAttention-2 keeps per-thread partial row sums.
      ``default_config`` turns it on for transposed tiles on 16-bit pages at D 64 or beyond 8
      rows.
    transposed_scores: when ``G * q_len <= 128``, compute ``S^T = K Q^T`` and
      ``O^T = V^T P^T`` with the packed rows as the wgmma N dimension, rounded
      up to 8 instead of 64 (module docstring, "Transposed scores"): one tile
      reads the KV once for up to 128 rows, and the softmax runs on the rows
      there are. Takes precedence over ``two_warpgroup_tiles`` where it applies.
    balance_waves: ``None`` cuts each request into ``num_chunks`` chunks of its
      own length. An integer ``w`` (batches of more than one request) plans
      one chunk length for the whole batch, ``ceil(total_blocks / (w * slots))``
      blocks with ``slots`` the resident work items per (KV head, row tile);
      each request is split evenly into that many chunks, at most
      ``num_chunks`` (which then defaults to room for a request twice the mean
      length, capped at ``BALANCED_MAX_CHUNKS``): ragged batches run in about
      ``w`` balanced waves.
    num_sms: SMs the grid is sized for; ``None`` asks the device (132 on an H100/H200).
    merge_kernel: when a call splits the KV into chunks, merge them and write the unpacked
      ``[B, q_len, Hq, D]`` rows in one small Mosaic GPU kernel (``merge_chunks_mosaic_gpu``)
      instead of XLA's merge fusions and row transpose. ``default_config`` turns it on for
      few rows over few pairs on the devices of ``MERGE_KERNEL_BY_DEVICE`` (on an H100 SXM
      it ran G 8 q_len 1 at B1 L8k in 19.1 against 20.3 us, with 16-bit and fp8 pages alike,
      but 12 rows and more and B64 0.96-0.998x); off on the H200, where host-timed B1 and B8
      calls at q_len 1 varied too much run to run to settle it (medians 1.01-1.10x, ranges
      overlapping), and elsewhere.
    fp8_8bit_layout: fp8 pages: load each fp8 block into registers in the 8-bit wgmma layout
      (4 consecutive bytes per thread and vector: half the shared-memory loads, and 8-byte
      stores of the converted values) instead of the 16-bit one (2 bytes). ``default_config``
      turns it on for fp8 pages (H200, B64 L32k q7: 2% and 4% faster in two runs).
    page_ids_ahead: each pipeline step reads the page ids of the next step's block and of the
      block the next step refills, and carries them, instead of reading its own where they are
      first used (the mask decision, the refill's copies): a warp issues in order and waits for
      a global load where its value is first used. ``default_config`` turns it on with
      ``two_warpgroup_tiles``, where it ran G 12 q_len 7 1.04-1.07x faster in four runs (H200,
      B64 and B8 L32k, same process), q_len 6 1.05-1.06x and q_len 7 at D 64 1.09-1.12x, and
      on transposed tiles of 16-bit pages at D 128 from
      ``DEFAULT_PAGE_IDS_AHEAD_TRANSPOSED_MIN_PAIRS`` pairs (1.00-1.02x at B64 and B128);
      elsewhere it was no faster: 16-bit row tiles 1.00x, transposed tiles at q_len 1
      0.93-0.97x at B8 L32k, fp8 pages in registers 0.85x (5 more registers per thread, 168 ->
      173, leave two items per SM where three fit;
      ``benchmarks/results/decode_attention_page_ids_ahead/``).
    producer_warpgroup: 128-row tiles (``two_warpgroup_tiles``) get a third warpgroup that
      issues every TMA copy of the ring, as jax's ``attention_mgpu.py`` has (module docstring,
      "Producer warpgroup"): the consumer warpgroups then only wait for their blocks and
      release each slot after their ``P V``, and neither waits on the other to refill. With
      fp8 pages it also converts each block into a float16 ring both consumers read (the
      128-row tile takes fp8 pages only this way). Registers are rebalanced with
      ``setmaxnreg``: ``PRODUCER_REGISTERS`` for the producer, ``CONSUMER_REGISTERS`` for the
      consumers. ``default_config`` turns it on with
      ``two_warpgroup_tiles``: H200, B64 L32k, same process, G 12 q_len 7 1.048x at D 128 and
      1.231x at D 64, q_len 6 1.047x, B8 L32k q_len 7 1.036x
      (``benchmarks/results/decode_attention_module_ab_2026-12-05.json``).
  """

  block_kv: int = 64
  num_stages: int = 4
  num_chunks: int | None = None
  two_warpgroup_tiles: bool = False
  balance_waves: int | None = None
  num_sms: int | None = None
  merge_kernel: bool = False
  fp8_8bit_layout: bool = False
  transposed_scores: bool = False
  operands_in_registers: bool = True
  fp8_in_registers: bool = False
  fp8_staging_overlap: bool = False
  deferred_sum: bool = False
  page_ids_ahead: bool = False
  producer_warpgroup: bool = False

  def __post_init__(self):
    # Positive ints (num_chunks and balance_waves may be None): bools and floats are refused.
    validate_config_fields(self, positive=("block_kv", "num_stages", "num_chunks", "balance_waves"))
    if self.block_kv % 64:
      raise ValueError(f"block_kv must be a positive multiple of 64, got {self.block_kv}")
    if not isinstance(self.two_warpgroup_tiles, bool):
      raise ValueError(f"two_warpgroup_tiles must be a bool, got {self.two_warpgroup_tiles!r}")
    for name in (
      "merge_kernel",
      "fp8_8bit_layout",
      "transposed_scores",
      "operands_in_registers",
      "fp8_in_registers",
      "fp8_staging_overlap",
      "deferred_sum",
      "page_ids_ahead",
      "producer_warpgroup",
    ):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


def default_config(
  head_dim: int,
  page_size: int,
  kv_dtype=jnp.bfloat16,
  num_rows: int | None = None,
  num_pairs: int | None = None,
  device_kind: str | None = None,
) -> TuningConfig:
  """Heuristic defaults: 64-position blocks, a ring of ~64 KiB of K/V, 4 balanced waves, and
  transposed scores for up to ``DEFAULT_TRANSPOSED_MAX_ROWS`` packed rows (``G * q_len``, when
  given; fp8 pages converted in registers take them up to ``DEFAULT_FP8_IN_REGISTERS_MAX_ROWS``,
  16-bit pages on a ``device_kind`` in ``TRANSPOSED_MAX_ROWS_16BIT_BY_DEVICE`` up to its figure).
  With ``num_pairs`` (``B * Hkv``) below ``DEFAULT_REGISTER_OPERANDS_MIN_PAIRS``, Q and P go
  through shared memory and more than 64 rows take 64-row tiles.

  On the H200 a small ring that lets two work items share an SM beat a deep
  ring with one (B64 L32k q7: 2 stages 4.0 TB/s, 4 stages 3.2 TB/s). One chunk
  length planned for four waves over the whole batch ran 64 ragged requests
  (1k..32k positions, q_len 7) in 1124 us against 1375 us with per-request
  chunks, and 64 requests of 32k in 1953 against 1930 us (tuning sweep in
  benchmarks/results/decode_attention.md). fp8 pages halve the ring's bytes per
  stage but add a float16 staging block; their ring gets as many stages (at
  most 8) as keep ``FP8_ITEMS_PER_SM`` work items on an SM (B64 L32k q7: 2 stages,
  three items, 2170 us; 3 stages, two items, 2296 us), and load in the 8-bit layout. fp8
  row tiles keep that ring and take a second staging block (``fp8_staging_overlap``), which
  leaves two items per SM but converts beside the wgmmas: H200, same process, 1.01-1.05x at B8
  and B64 L32k, q_len 3-7, G 8 and 12, D 128 and 64 (B64 L32k q_len 3 1838 against 1889 us;
  ``benchmarks/results/decode_attention_fp8_staging_overlap.md``).

  Transposed scores (H200, bf16, against 64-row tiles, same process): at 8 rows (G 8, q_len
  1) 1.03-1.26x at D 128 (B1 L8k 15.6 against 19.6 us, B64 L32k 1893 against 1952 us) and
  1.27-1.30x at D 64; at 16 rows (G 12, q_len 1) 0.99-1.02x; from 24 rows (G 8, q_len 3) on
  equal or slower, 0.67x at 56 rows. With fp8 pages (same ring, D 128): at 8 rows 1.47x at B64
  L32k (1403 against 2062 us) and 1.44x at B8 L32k, at 16 rows 1.13x at B64 L32k, at 24 rows
  0.87x, at 56 rows 0.59x. Few fp8 rows in many pairs also convert K and V in registers
  (``DEFAULT_FP8_IN_REGISTERS_MAX_ROWS``, measured beside it; at D 128 with
  ``FP8_IN_REGISTERS_STAGES_D128``).
  Transposed tiles on 16-bit pages sum the softmax denominators once per work item
  (``deferred_sum``) at D 64 and beyond 8 rows, where it ran 1.02-1.05x (D 64 B8 and B64 L32k,
  G 12 B8 L32k); at 8 rows and D 128 it ran 0.96-1.01x (B1, B8, B64 L32k) and with fp8 pages in
  registers 0.89x (``benchmarks/results/decode_attention_deferred_sum*.md``).

  More than 64 packed rows take the 128-row two-warpgroup tile; with fp8 pages its converting
  producer ran 1.22-1.27x faster than two 64-row tiles at D 128 and 1.17-1.22x at D 64 (H100,
  G 12 q_len 6 and 7, B8 and B64 L32k, a ring of ``FP8_PRODUCER_STAGES``, the producer with
  ``CONVERTING_PRODUCER_REGISTERS``;
  ``benchmarks/results/decode_attention_fp8_producer_check_registers_h100_2026-12-06.md``).
  With 16-bit pages, once Q and P reached wgmma from registers it ran G 12 q_len 6/7 at B64
  L32k in 3086 / 3129 us against 3643 / 3625 us with two 64-row tiles (1.16-1.18x) and q_len 7
  at B8 L32k in 410 against 459 us (H200, same process; ``benchmarks/NOTES_decode_attention.md``,
  version 9). At one request
  (B1 L8k, 8 pairs, each work item a few blocks) both were slower: G 8 q_len 7 17.7 against
  16.4 us with registers, G 12 q_len 6 20.6 us with registers and 24.2 us with the 128-row tile
  against 17.8 us, hence the threshold on the pairs.

  Page ids are read a step ahead (``page_ids_ahead``) on that tile and on transposed tiles of
  16-bit pages at D 128 from ``DEFAULT_PAGE_IDS_AHEAD_TRANSPOSED_MIN_PAIRS`` pairs, where it ran
  1.04-1.12x and 1.00-1.02x faster. The 128-row tile takes a producer warpgroup
  (``producer_warpgroup``): 1.04-1.05x at G 12 q_len 6 and 7 (B8, B64 L32k, D 128), 1.23x at D 64.
  On a device of ``MERGE_KERNEL_BY_DEVICE`` few rows over few pairs merge their chunks in one
  kernel (``merge_kernel``, ``takes_merge_kernel``).
  """
  block_kv = max(64, page_size)
  kv_itemsize = jnp.dtype(kv_dtype).itemsize
  many_pairs = num_pairs is None or num_pairs >= DEFAULT_REGISTER_OPERANDS_MIN_PAIRS
  block_bytes = 2 * block_kv * head_dim * kv_itemsize  # one stage: a K and a V block
  fp8_in_registers = (
    kv_itemsize == 1
    and block_kv == 64
    and num_rows is not None
    and num_rows <= DEFAULT_FP8_IN_REGISTERS_MAX_ROWS.get(head_dim, 0)
    and (
      head_dim == 64 or num_pairs is None or num_pairs >= DEFAULT_FP8_IN_REGISTERS_MIN_PAIRS_D128
    )
  )
  ring_budget = 64 * 1024
  if kv_itemsize == 1:
    rest = smem_bytes(head_dim, TuningConfig(block_kv=block_kv, num_stages=1), kv_itemsize=1)
    ring_budget = min(ring_budget, _SMEM_PER_SM // FP8_ITEMS_PER_SM - (rest - block_bytes))
  num_stages = max(2, min(8, ring_budget // block_bytes))
  if fp8_in_registers and head_dim == 128:
    num_stages = FP8_IN_REGISTERS_STAGES_D128
  # fp8 in registers runs in the transposed tile, also beyond DEFAULT_TRANSPOSED_MAX_ROWS.
  few_rows = num_rows is not None and num_rows <= transposed_max_rows(
    head_dim, kv_itemsize, device_kind
  )
  transposed = fp8_in_registers or few_rows
  if transposed and kv_itemsize == 2 and head_dim == 64:
    num_stages = TRANSPOSED_STAGES_D64
  # More than 64 rows (G 12 from q_len 6 on): one 128-row tile reads each K/V block once (fp8
  # pages converted by its producer, on a ring of FP8_PRODUCER_STAGES).
  two_warpgroup_tiles = many_pairs and num_rows is not None and num_rows > ROWS_PER_TILE
  if two_warpgroup_tiles and kv_itemsize == 1:
    num_stages = FP8_PRODUCER_STAGES
  # Transposed 16-bit tiles at D 128 over many pairs, where page ids read ahead paid.
  wide_transposed_16bit = (
    transposed
    and kv_itemsize == 2
    and head_dim == 128
    and (num_pairs is None or num_pairs >= DEFAULT_PAGE_IDS_AHEAD_TRANSPOSED_MIN_PAIRS)
  )
  return TuningConfig(
    block_kv=block_kv,
    num_stages=num_stages,
    balance_waves=DEFAULT_BALANCE_WAVES,
    merge_kernel=takes_merge_kernel(num_rows, num_pairs, device_kind),
    fp8_8bit_layout=kv_itemsize == 1,
    transposed_scores=transposed,
    two_warpgroup_tiles=two_warpgroup_tiles,
    operands_in_registers=many_pairs,
    fp8_in_registers=fp8_in_registers,
    fp8_staging_overlap=kv_itemsize == 1 and not transposed and not two_warpgroup_tiles,
    deferred_sum=transposed and kv_itemsize == 2 and (head_dim == 64 or num_rows > 8),
    page_ids_ahead=two_warpgroup_tiles or wide_transposed_16bit,
    producer_warpgroup=two_warpgroup_tiles,
  )


def transposed_max_rows(head_dim: int, kv_itemsize: int, device_kind: str | None) -> int:
  """The most packed rows ``default_config`` gives transposed scores to (without fp8 in
  registers): ``DEFAULT_TRANSPOSED_MAX_ROWS``, or for 16-bit pages on a device of
  ``TRANSPOSED_MAX_ROWS_16BIT_BY_DEVICE`` its figure at ``head_dim``."""
  by_head_dim = _for_device(TRANSPOSED_MAX_ROWS_16BIT_BY_DEVICE, device_kind)
  if kv_itemsize == 2 and by_head_dim is not None:
    return by_head_dim.get(head_dim, DEFAULT_TRANSPOSED_MAX_ROWS)
  return DEFAULT_TRANSPOSED_MAX_ROWS


def _for_device(table, device_kind: str | None):
  """The value of the ``(piece of a device_kind, value)`` pair of ``table`` that names
  ``device_kind``, or None."""
  if device_kind is not None:
    for name, value in table:
      if name in device_kind:
        return value
  return None


def takes_merge_kernel(
  num_rows: int | None, num_pairs: int | None, device_kind: str | None
) -> bool:
  """Whether ``default_config`` merges the KV chunks in ``merge_chunks_mosaic_gpu``: on a device
  of ``MERGE_KERNEL_BY_DEVICE``, within its rows and pairs (16-bit and fp8 pages alike)."""
  limits = _for_device(MERGE_KERNEL_BY_DEVICE, device_kind)
  if num_rows is None or num_pairs is None or limits is None:
    return False
  max_rows, max_pairs = limits
  return num_rows <= max_rows and num_pairs <= max_pairs


def smem_bytes(
  head_dim: int, config: TuningConfig, rows: int = ROWS_PER_TILE, kv_itemsize=2
) -> int:
  """Shared memory of one work item: the K/V ring (and, for fp8 pages, the float16 block K and
  then V is converted into, or one for each with ``fp8_staging_overlap``, or in a 128-row tile
  with a producer warpgroup a float16 ring as deep as the fp8 one), and the Q/output and P
  tiles of its ``rows`` (all warpgroups').

  Row tiles keep P in registers on the GPU (module docstring), so there the count is 8 KiB
  above what they allocate; the plans built on it (resident items per SM, the fp8 ring depth)
  were measured with it."""
  ring = 2 * config.num_stages * config.block_kv * head_dim * kv_itemsize
  if rows > ROWS_PER_TILE and config.producer_warpgroup:
    staging_blocks = 2 * config.num_stages
  else:
    staging_blocks = 2 if config.fp8_staging_overlap else 1
  staging = staging_blocks * config.block_kv * head_dim * 2 if kv_itemsize == 1 else 0
  return ring + staging + rows * (head_dim + config.block_kv) * 2 + rows * 4


def default_num_chunks(batch: int, num_kv_heads: int, max_blocks: int, sms: int) -> int:
  """Split factor so that every SM streams one chunk of one (request, KV head) pair's KV.

  A batch with a pair per SM already is not split (splitting only adds merge
  traffic); otherwise each request is cut so that ``pairs * chunks`` is at most
  the SM count, and chunks stay at least 2 blocks long. The row tiles of a pair
  (more than one where its packed rows exceed a tile) read the same chunk, the
  second from L2, so they are not counted.

  One long chunk per SM streams that SM's share of the KV through one ring, where
  several short resident items each pay their ring's fill and their own partial
  output. At one request (8 KV heads, so 16 chunks on 132 SMs, against the 49 of
  filling every resident slot) this ran, H100, device time of the kernels by CUPTI,
  bf16 D 128 L8k: G 8 q_len 1 17.8 against 19.0 us, q_len 3 21.1 against 25.4 us,
  q_len 7 22.0 against 25.6 us, G 12 q_len 1 20.2 against 22.2 us, D 64 12.3 against
  14.9 us; equal at L32k (51.5 against 51.7 us) and L2k. Counting the two row tiles of
  G 12 q_len 6 and 7 as well (8 chunks, an item per SM) ran 26.5 and 27.0 us against 25.1
  and 25.6 us with 16 (``benchmarks/results/decode_attention_b1_chunks_h100_2026-12-06.json``).
  """
  pairs = batch * num_kv_heads
  if pairs >= sms:
    return 1
  return max(1, min(sms // pairs, max_blocks // 2))


def packed_rows(q, k_pages) -> int:
  """Rows one (request, KV head) pair packs: ``G * q_len`` (q ``[B, q_len, Hq, D]``)."""
  return q.shape[1] * (q.shape[2] // k_pages.shape[0])


def _transposed_rows(q, k_pages, config: TuningConfig) -> int | None:
  """The N rows of the one transposed tile (the packed rows rounded up to 8), or None where the
  call runs row tiles of 64 (``transposed_scores`` off, or more than 128 packed rows)."""
  num_rows = packed_rows(q, k_pages)
  if config.transposed_scores and num_rows <= MAX_TRANSPOSED_ROWS:
    return pl.cdiv(num_rows, TRANSPOSED_ROW_ALIGN) * TRANSPOSED_ROW_ALIGN
  return None


def _uses_two_warpgroups(q, k_pages, config: TuningConfig) -> bool:
  return (
    config.two_warpgroup_tiles
    and packed_rows(q, k_pages) > ROWS_PER_TILE
    and _transposed_rows(q, k_pages, config) is None
  )


def unsupported_reason(
  q,
  k_pages,
  v_pages,
  block_tables,
  seq_lens,
  k_scale,
  v_scale,
  *,
  config: TuningConfig,
  sm_scale: float,
) -> str | None:
  """Why the kernel cannot serve these inputs, or ``None`` when it can."""
  del v_pages, seq_lens, k_scale, v_scale, sm_scale  # any values the api accepts are served
  head_dim = q.shape[-1]
  page_size = k_pages.shape[2]
  if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
    return f"the Mosaic GPU kernel needs bf16 or fp16 queries, got {q.dtype}"
  if jnp.dtype(k_pages.dtype) not in (jnp.dtype(q.dtype), FP8_DTYPE):
    return f"the Mosaic GPU kernel needs pages in q's dtype or float8_e4m3fn, got {k_pages.dtype}"
  if head_dim not in SUPPORTED_HEAD_DIMS:
    return f"the Mosaic GPU kernel needs head dim in {SUPPORTED_HEAD_DIMS}, got {head_dim}"
  if page_size not in SUPPORTED_PAGE_SIZES:
    return f"the Mosaic GPU kernel needs page size in {SUPPORTED_PAGE_SIZES}, got {page_size}"
  if config.block_kv % page_size:
    return f"block_kv={config.block_kv} must be a multiple of the page size {page_size}"
  if k_pages.dtype == FP8_DTYPE and _uses_two_warpgroups(q, k_pages, config):
    if not config.producer_warpgroup:
      return (
        "two_warpgroup_tiles serves fp8 pages only with producer_warpgroup, which converts them"
      )
    # Its fp8 and float16 rings (counted with a P tile, which the GPU form keeps in registers).
    needed = smem_bytes(head_dim, config, 2 * ROWS_PER_TILE, kv_itemsize=1)
    if needed > _SMEM_PER_SM:
      return (
        f"num_stages={config.num_stages} needs {needed // 1024} KiB of shared memory for fp8 "
        f"pages in the 128-row tile (fp8 and float16 rings), more than the SM's "
        f"{_SMEM_PER_SM // 1024} KiB"
      )
  if (
    config.fp8_in_registers
    and k_pages.dtype == FP8_DTYPE
    and _transposed_rows(q, k_pages, config) is not None
    and config.block_kv != 64
  ):
    return f"fp8_in_registers needs block_kv 64, got {config.block_kv}"
  group = q.shape[2] // k_pages.shape[0]
  capacity = block_tables.shape[1] * page_size
  if (capacity + config.block_kv + 2 * q.shape[1]) * group >= 2**31:
    return f"the causal mask's int32 arithmetic overflows at capacity {capacity} and G {group}"
  return None


@functools.partial(jax.jit, static_argnames=("sm_scale", "config", "interpret"))
def paged_decode_attention_mosaic_gpu(
  q: jax.Array,  # [B, q_len, Hq, D]
  k_pages: jax.Array,  # [Hkv, num_pages, page_size, D], q.dtype or float8_e4m3fn
  v_pages: jax.Array,  # [Hkv, num_pages, page_size, D], like k_pages
  block_tables: jax.Array,  # int32 [B, max_pages_per_req]
  seq_lens: jax.Array,  # int32 [B]
  k_scale: jax.Array | None,  # f32 [Hkv] with fp8 pages, else None
  v_scale: jax.Array | None,  # f32 [Hkv] with fp8 pages, else None
  *,
  sm_scale: float,
  config: TuningConfig,
  interpret: bool = False,
) -> jax.Array:  # [B, q_len, Hq, D], q.dtype
  """Runs the packed-row kernel and merges its KV chunks (inputs checked by the api)."""
  batch, q_len, num_q_heads, head_dim = q.shape
  num_kv_heads, num_pages, page_size, _ = k_pages.shape
  if batch == 0:
    return jnp.zeros(q.shape, q.dtype)
  max_pages = block_tables.shape[1]
  capacity = max_pages * page_size
  group = num_q_heads // num_kv_heads
  dtype = q.dtype
  fp8 = k_pages.dtype == FP8_DTYPE
  compute_dtype = jnp.dtype(jnp.float16) if fp8 else dtype  # Q, P, staging and output tiles
  block_kv, num_stages = config.block_kv, config.num_stages
  pages_per_block = block_kv // page_size
  num_rows = q_len * group
  transposed_rows = _transposed_rows(q, k_pages, config)
  transposed = transposed_rows is not None
  # Consumer warpgroups per tile, each owning 64 of its rows (transposed: one, owning all N).
  warpgroups = 2 if _uses_two_warpgroups(q, k_pages, config) else 1
  tile_rows = transposed_rows if transposed else ROWS_PER_TILE  # rows of one warpgroup
  rows_per_tile = warpgroups * tile_rows
  row_tiles = pl.cdiv(num_rows, rows_per_tile)
  padded_rows = row_tiles * rows_per_tile
  max_blocks = pl.cdiv(capacity, block_kv)
  item_smem = smem_bytes(head_dim, config, rows_per_tile, jnp.dtype(k_pages.dtype).itemsize)
  items_per_sm = max(1, min(4, _SMEM_PER_SM // item_smem))
  sms = num_sms(config.num_sms)
  slots = sms * items_per_sm  # work items resident at once
  num_chunks = config.num_chunks or default_num_chunks(batch, num_kv_heads, max_blocks, sms)
  # One chunk length for the whole batch (in blocks, [B]), planned on the device.
  balanced = config.balance_waves is not None and batch > 1
  if balanced:
    # Items per (KV head, row tile) the plan aims at: balance_waves waves of resident items.
    target = max(1, config.balance_waves * slots // (num_kv_heads * row_tiles))
    if config.num_chunks is None:
      # Room for a request twice the mean length; spare items of the static grid cost a launch.
      num_chunks = min(BALANCED_MAX_CHUNKS, max_blocks, pl.cdiv(2 * target, batch))
    kv_lens = jnp.clip(seq_lens, 0, capacity)  # what the kernel attends (see its kv_len)
    blocks = lax.div(kv_lens + (block_kv - 1), block_kv)  # [B]
    common = lax.div(jnp.sum(blocks) + (target - 1), target)
    # Chunks of about the common length, at most num_chunks, split evenly within a request.
    chunks = jnp.clip(lax.div(blocks + (common - 1), jnp.maximum(common, 1)), 1, num_chunks)
    chunk_lengths = lax.div(blocks + (chunks - 1), chunks)
  else:
    chunk_lengths = jnp.zeros((1,), jnp.int32)  # unused: the kernel plans per request
  base_qk_scale = sm_scale * _LOG2E  # softmax in base 2: exp(s) = exp2(s * log2(e))
  # Transposed scores put the rows on axis 1 (wgmma N) and the KV positions on axis 0.
  pos_axis, row_axis = (0, 1) if transposed else (1, 0)
  scores_shape = (block_kv, tile_rows) if transposed else (tile_rows, block_kv)
  acc_shape = (head_dim, tile_rows) if transposed else (tile_rows, head_dim)
  # Register layout of the fp8 blocks on their way to the staging blocks.
  fp8_layout = plgpu.Layout.WGMMA_8BIT if config.fp8_8bit_layout else plgpu.Layout.WGMMA
  # Row tiles give Q and P to wgmma from registers (A operands), which halves the shared-memory
  # reads of Q K^T's operands and spares P's store; the GPU interpreter only models
  # shared-memory operands.
  operands_in_registers = config.operands_in_registers and not transposed and not interpret
  # fp8 K and V blocks converted in registers, the A operands of S^T = K Q^T and O^T = V^T P^T
  # (TuningConfig.fp8_in_registers). K loads in the 16-bit wgmma layout (an 8-bit load cast to it
  # does not lower, jax 0.11.2); V^T loads from the transposed view in the transposed wgmma
  # layout, which a register shuffle per pair turns into the wgmma layout after the conversion.
  fp8_in_registers = fp8 and transposed and config.fp8_in_registers and not interpret
  # At D 128 the pages reach the kernel as uint16 pairs of adjacent head dims instead, which
  # ldmatrix loads four bytes a register (K as is, V transposed) and a byte permute and two cvts
  # convert: K's head dims come out permuted within each 16 (Q takes the same order,
  # _k_pairs_order) and V^T's rows even head dims first (the output's order, put back after the
  # merge). See _fp8_k_pairs_to_float16 and _fp8_v_pairs_to_float16.
  fp8_pairs = fp8_in_registers and head_dim == 128
  # A third warpgroup issues the ring's copies for the two consumer warpgroups.
  producer = config.producer_warpgroup and warpgroups > 1
  # With fp8 pages it also converts each block into a float16 ring that both consumers read
  # (the conversion of a block serves all 128 rows; the consumers run the 16-bit tile's step).
  converting_producer = fp8 and producer
  staged = fp8 and not fp8_in_registers and not producer  # the float16 staging block
  # Separate K and V staging blocks, each converted while a wgmma reads the other.
  overlapped = staged and config.fp8_staging_overlap
  # Softmax denominators per score element, summed over the positions after the last step.
  deferred_sum = config.deferred_sum
  # Each step carries the page ids of the next step's block and refill, read a step early.
  page_ids_ahead = config.page_ids_ahead

  # Pack rows token-major, r = j * G + g, and pad them to whole tiles with zeros.
  q_packed = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
  q_packed = q_packed.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, num_rows, head_dim)
  q_packed = jnp.pad(q_packed, ((0, 0), (0, 0), (0, padded_rows - num_rows), (0, 0)))
  if fp8:
    q_packed, q_scale = _to_float16_tiles(q_packed, rows_per_tile)  # f32 [B, Hkv, row_tiles]
  if fp8_pairs:
    q_packed = q_packed[..., _k_pairs_order(head_dim)]  # the converted K's column order
    # [Hkv, num_pages, page_size, D / 2] uint16: the same bytes, in slots of the same swizzle
    k_pages, v_pages = (
      lax.bitcast_convert_type(pages.reshape(*pages.shape[:-1], head_dim // 2, 2), jnp.uint16)
      for pages in (k_pages, v_pages)
    )

  def paged_attention_kernel(
    block_tables_ref,  # GMEM int32 [B, max_pages]
    seq_lens_ref,  # GMEM int32 [B]
    chunk_lengths_ref,  # GMEM int32 [B] blocks per chunk when balanced, else [1] unused
    *refs,
  ):
    if fp8:
      k_scale_ref, q_scale_ref, *refs = refs  # GMEM f32 [Hkv], f32 [B, Hkv, row_tiles]
    (
      q_ref,  # GMEM [B, Hkv, padded_rows, D], compute_dtype
      k_ref,  # GMEM [Hkv, num_pages, page_size, D]
      v_ref,  # GMEM [Hkv, num_pages, page_size, D]
      out_ref,  # GMEM [B * num_chunks, Hkv, padded_rows, D], compute_dtype
      lse_ref,  # GMEM f32 [B * num_chunks, Hkv, padded_rows]
      qo_smem,  # [(warpgroups,) 64, D], Q tile, then the output tile
      k_smem,  # [num_stages, block_kv, D], pages' dtype
      v_smem,  # [num_stages, block_kv, D], pages' dtype
      lse_smem,  # f32 [(warpgroups,) 64]
      q_barrier,  # [(warpgroups,)]
      k_barriers,  # [num_stages], one arrival per page copy
      v_barriers,
      *extra_scratch,  # P tile (p_smem, where P goes through shared memory); fp8: the staging
      # block(s), or with a producer the float16 ring and its barriers; two warpgroups:
      # consumed, v_zeroed (16-bit pages)
    ) = refs
    extra_scratch = iter(extra_scratch)
    # [(warpgroups,) rows, block_kv], the probabilities of the current block
    p_smem = None if operands_in_registers else next(extra_scratch)
    kv_head = lax.axis_index("kv_head")
    row_tile = lax.axis_index("row_tile")
    item = lax.axis_index("item")
    request = lax.div(item, num_chunks)
    chunk = lax.rem(item, num_chunks)
    row_base = row_tile * rows_per_tile
    if overlapped:
      staging_k, staging_v = next(extra_scratch), next(extra_scratch)  # f16 [block_kv, D] each
    elif staged:  # f16 [block_kv, D]: the step's K block, then its V block
      staging_k = staging_v = next(extra_scratch)
    # The ring the consumers read, and the barriers that say a slot holds its block: the
    # copies' own, or with a converting producer its float16 ring [num_stages, block_kv, D]
    # and one arrival (the producer's) per converted block.
    if converting_producer:
      k_ring, v_ring, k_ready, v_ready = (next(extra_scratch) for _ in range(4))
    else:
      k_ring, v_ring, k_ready, v_ready = k_smem, v_smem, k_barriers, v_barriers
    if fp8:
      # Real K = stored K * k_scale and real q = kernel q * q_scale: both join the score scale.
      q_scale = q_scale_ref[request, kv_head, row_tile]
      qk_scale = k_scale_ref[kv_head] * q_scale * base_qk_scale
    else:
      qk_scale = base_qk_scale
    if warpgroups > 1:
      consumed_barriers = next(extra_scratch)
      v_zeroed_barrier = None if fp8 else next(extra_scratch)
      wg = lax.axis_index("wg")
      row_base = row_base + wg * tile_rows
      qo_smem, lse_smem = qo_smem.at[wg], lse_smem.at[wg]
      p_smem = None if p_smem is None else p_smem.at[wg]
      q_barrier = q_barrier.at[wg]

    def when_issuer(condition):
      """``pl.when`` for the ring's TMA copies, which warpgroup 0 alone issues."""
      return pl.when(condition & (wg == 0)) if warpgroups > 1 else pl.when(condition)

    # The chunk plan, from the request's length on the device. Lengths past the table's
    # capacity attend the capacity only (clipped, the causal limits are unchanged and the
    # int32 arithmetic cannot overflow); negative lengths see nothing.
    seq_len = jnp.clip(seq_lens_ref[request], 0, capacity + q_len)
    kv_len = jnp.minimum(seq_len, capacity)  # positions this request may attend
    num_blocks = lax.div(kv_len + (block_kv - 1), block_kv)
    if balanced:
      chunk_blocks = chunk_lengths_ref[request]
    else:
      chunk_blocks = lax.div(num_blocks + (num_chunks - 1), num_chunks)
    start = jnp.minimum(chunk * chunk_blocks, num_blocks)
    end = jnp.minimum(start + chunk_blocks, num_blocks)
    num_steps = end - start
    # Blocks entirely below the first row's limit S - q_len + 1 (and the capacity) need no
    # causal or length mask.
    first_limit = jnp.minimum(seq_len - (q_len - 1), kv_len)
    unmasked_end = jnp.clip(lax.div(jnp.maximum(first_limit, 0), block_kv), start, end)

    # Items past a request's last chunk (the grid is static) load and store no tile:
    # they only report lse = -inf, which gives their partial weight 0 in the merge.
    # Chunk 0 always stores its tile (zeros when it saw nothing): unsplit calls skip the merge.
    has_work = num_steps > 0
    stores_tile = has_work | (chunk == 0)

    def page_ids(block):
      """The block's page ids from the table (entries past the table: its last entry)."""
      return [
        block_tables_ref[request, jnp.minimum(block * pages_per_block + p, max_pages - 1)]
        for p in range(pages_per_block)
      ]

    def in_pool(page):
      return (page >= 0) & (page < num_pages)

    def out_of_pool(page):  # not in_pool(page), for warp regions, which have no `not`
      return (page < 0) | (page >= num_pages)

    def copy_page(page, slot, rows):
      plgpu.copy_gmem_to_smem(k_ref.at[kv_head, page], k_smem.at[slot, rows], k_barriers.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[kv_head, page], v_smem.at[slot, rows], v_barriers.at[slot])

    def skip_page(slot):
      plgpu.barrier_arrive(k_barriers.at[slot])
      plgpu.barrier_arrive(v_barriers.at[slot])

    def fetch(block, slot, pages=None):
      """Block ``block``'s pages into ``slot`` (``pages``: their ids, read earlier).

      Page ``p`` is issued by warp ``p % 4`` of the warpgroup, from one lane. Issued by the
      whole warpgroup instead, each copy would be preceded by a warpgroup barrier (Pallas
      inserts one before every copy so that no thread still reads the destination); in a warp
      region the barriers are one on entry and one on exit, whatever the number of pages.
      """
      pages = page_ids(block) if pages is None else pages

      @pl.kernel(mesh=plgpu.WarpMesh(axis_name="warp"))
      def issue_by_warps():
        warp = lax.axis_index("warp")
        for p, page in enumerate(pages):
          # Only pages inside the length with an id in the pool are read. The slot rows of
          # the others keep stale data: the mask and the V zeroing below discard them, and a
          # plain barrier arrival stands in for the copy's. The flags are computed here, not
          # passed in (values live across the region cost registers: 89 instead of 79 at
          # D 64, 6 work items per SM down to 5), and the three cases are disjoint
          # comparisons: a warp region has no `not`.
          mine = warp == p % WARPS_PER_WARPGROUP
          first_row = (block * pages_per_block + p) * page_size
          inside, outside = first_row < kv_len, first_row >= kv_len
          pooled, unpooled = in_pool(page), out_of_pool(page)
          rows = pl.ds(p * page_size, page_size)
          pl.when(mine & inside & pooled)(functools.partial(copy_page, page, slot, rows))
          pl.when(mine & outside)(functools.partial(skip_page, slot))
          pl.when(mine & inside & unpooled)(functools.partial(skip_page, slot))

      issue_by_warps()

    def attendable(positions, block, pages_in_pool):
      """Positions (within the block) inside the length, on pages whose id is in the pool."""
      ok = positions + block * block_kv < kv_len
      page_of_position = lax.div(positions, page_size)
      for p, page_ok in enumerate(pages_in_pool):
        ok = ok & ((page_of_position != p) | page_ok)
      return ok

    def v_keep(masked, block, pages_in_pool):
      """Where a masked step keeps V (rows the mask removed may hold stale or NaN data, and
      0 * NaN = NaN in P V), else None."""
      if not masked:
        return None
      positions = plgpu.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0, layout=fp8_layout)
      return attendable(positions, block, pages_in_pool)

    def to_staging(src, dst, keep=None):
      """fp8 block -> registers -> float16 (exact, one cvt per pair) -> a 16-bit block."""
      values = plgpu.load(src, layout=fp8_layout).astype(jnp.float16)
      if keep is not None:
        values = jnp.where(keep, values, 0)
      dst[...] = values

    def produce():
      """The producer warpgroup: every block of the item into the ring, each slot refilled once
      both consumers have released it (they arrive at its ``consumed`` barrier after ``P V``)."""
      plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

      def refill(i, carry):
        slot = lax.rem(i, num_stages)
        pl.when(i >= num_stages)(lambda: plgpu.barrier_wait(consumed_barriers.at[slot]))
        fetch(start + i, slot)
        return carry

      lax.fori_loop(0, num_steps, refill, None)

    def produce_converted():
      """The producer warpgroup with fp8 pages: every block of the item through the fp8 ring
      (its copies) into the float16 ring, K then V, each slot of the float16 ring rewritten once
      both consumers have released it. A block that needs the mask gets its V rows past the
      length or on out-of-pool pages zeroed on the way (the consumers' mask covers K). Each
      fp8 slot is refilled as soon as its block is converted."""
      plgpu.set_max_registers(CONVERTING_PRODUCER_REGISTERS, action="decrease")
      for s in range(num_stages):
        pl.when(s < num_steps)(functools.partial(fetch, start + s, s))

      def convert(i, carry):
        slot = lax.rem(i, num_stages)
        block = start + i
        pl.when(i >= num_stages)(lambda: plgpu.barrier_wait(consumed_barriers.at[slot]))
        plgpu.barrier_wait(k_barriers.at[slot])
        to_staging(k_smem.at[slot], k_ring.at[slot])
        plgpu.commit_smem()  # the stores, visible to the tensor cores before the arrival
        plgpu.barrier_arrive(k_ready.at[slot])
        pages_in_pool = [in_pool(page) for page in page_ids(block)]
        needs_mask = (block >= unmasked_end) | jnp.logical_not(_all(pages_in_pool))
        plgpu.barrier_wait(v_barriers.at[slot])
        for masked in (True, False):
          keep = v_keep(masked, block, pages_in_pool)
          when = needs_mask if masked else jnp.logical_not(needs_mask)
          pl.when(when)(functools.partial(to_staging, v_smem.at[slot], v_ring.at[slot], keep))
        plgpu.commit_smem()  # also orders this warpgroup's reads of the fp8 slot before its refill
        plgpu.barrier_arrive(v_ready.at[slot])
        refill = i + num_stages
        pl.when(refill < num_steps)(functools.partial(fetch, start + refill, slot))
        return carry

      lax.fori_loop(0, num_steps, convert, None)

    if not producer:  # the ring's first blocks (the producer issues them as its first steps)
      for s in range(num_stages):
        when_issuer(s < num_steps)(functools.partial(fetch, start + s, s))

    def consume():
      """A consumer warpgroup (the only one without a producer): its rows of the tile."""
      if producer:
        registers = CONVERTING_CONSUMER_REGISTERS if converting_producer else CONSUMER_REGISTERS
        plgpu.set_max_registers(registers, action="increase")

      @pl.when(has_work)
      def _load_q():
        plgpu.copy_gmem_to_smem(
          q_ref.at[request, kv_head, pl.ds(row_base, tile_rows)], qo_smem, q_barrier
        )

      def zero_v_rows(slot, block, pages_in_pool):
        v_block = v_smem.at[slot]
        positions = plgpu.broadcasted_iota(
          jnp.int32, (block_kv, head_dim), 0, layout=plgpu.Layout.WGMMA
        )
        values = plgpu.load(v_block, layout=plgpu.Layout.WGMMA)
        v_block[...] = jnp.where(attendable(positions, block, pages_in_pool), values, 0)
        plgpu.commit_smem()  # make the stores visible to the tensor cores

      def stage_k(i):
        """Overlapped staging: block ``start + i``'s K into ``staging_k`` (its copy waited)."""
        slot = lax.rem(i, num_stages)
        plgpu.barrier_wait(k_barriers.at[slot])
        to_staging(k_smem.at[slot], staging_k)
        plgpu.commit_smem()

      def block_step(i, carry, *, masked, pages_in_pool, refill_pages):
        acc, m_i, l_i = carry
        block = start + i
        slot = lax.rem(i, num_stages)
        refill = i + num_stages
        if not overlapped:  # (overlapped: the step before, or the prologue, waited and staged K)
          plgpu.barrier_wait(k_ready.at[slot])
        if fp8_in_registers:  # K [block_kv, D], the A operand of S^T = K Q^T
          k_block = plgpu.load(k_smem.at[slot], layout=plgpu.Layout.WGMMA)
          # (pairs: head dims in _k_pairs_order)
          k_block = _fp8_k_pairs_to_float16(k_block) if fp8_pairs else k_block.astype(jnp.float16)
          v_block = None  # converted once Q K^T is complete, below
        elif staged:  # one block unless overlapped: V is converted once Q K^T is complete
          if not overlapped:
            to_staging(k_smem.at[slot], staging_k)
            plgpu.commit_smem()
          k_block, v_block = staging_k, staging_v
        else:
          k_block, v_block = k_ring.at[slot], v_ring.at[slot]

        def compute_qk(acc_ref):
          if transposed:  # S^T = K Q^T
            plgpu.wgmma(acc_ref, k_block, qo_smem.transpose((1, 0)))
          else:  # S = Q K^T
            plgpu.wgmma(acc_ref, q_tile, k_block.transpose((1, 0)))
          if overlapped:  # V while Q K^T runs (the previous P V, its reader, is complete)
            plgpu.barrier_wait(v_barriers.at[slot])
            to_staging(v_smem.at[slot], staging_v, v_keep(masked, block, pages_in_pool))
          return acc_ref[...]

        # Scores, rows along row_axis; the base-2 logits are qk * qk_scale. With 16-bit pages
        # qk_scale is sm_scale * log2(e), static and positive, so a row's largest score is its
        # largest logit and the scale goes inside the exponent's fused multiply-add,
        # qk * qk_scale - m, instead of a multiply of every score first. With fp8 pages it holds
        # k_scale, a device value whose sign the contract checks only outside jit: scaled first.
        qk = pl.run_scoped(compute_qk, plgpu.ACC(scores_shape, jnp.float32))
        if fp8:
          qk = qk * qk_scale

        def logits(scores):
          return scores if fp8 else scores * qk_scale

        if masked:
          # packed row r = j * G + g
          rows = plgpu.broadcasted_iota(jnp.int32, qk.shape, row_axis, layout=plgpu.Layout.WGMMA)
          cols = plgpu.broadcasted_iota(jnp.int32, qk.shape, pos_axis, layout=plgpu.Layout.WGMMA)
          # pos < S - q_len + 1 + j  <=>  (pos - S + q_len) * G <= r  (no division).
          visible = (cols + (block * block_kv - seq_len + q_len)) * group <= rows + row_base
          visible = visible & attendable(cols, block, pages_in_pool)
          qk = jnp.where(visible, qk, -jnp.inf)
        m_new = jnp.maximum(m_i, logits(qk.max(axis=pos_axis)))
        # A row that has seen nothing yet has max -inf: shift by 0 to avoid inf - inf.
        m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_i - m_shift)
        p = jnp.exp2(logits(qk) - lax.broadcast_in_dim(m_shift, qk.shape, [row_axis]))
        if deferred_sum:  # no reduction across warps (transposed) or lanes (row tiles) in the step
          l_i = l_i * lax.broadcast_in_dim(alpha, qk.shape, [row_axis]) + p
        else:
          l_i = l_i * alpha + p.sum(axis=pos_axis)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [row_axis])
        if not overlapped:  # (overlapped: V was waited for and staged during Q K^T)
          plgpu.barrier_wait(v_ready.at[slot])
        if fp8_in_registers:  # V^T [D, block_kv] in registers, the A operand of O^T = V^T P^T
          if fp8_pairs:  # head dims even then odd
            pairs_t = plgpu.load(v_smem.at[slot].transpose((1, 0)), layout=plgpu.Layout.WGMMA)
            v_t = _fp8_v_pairs_to_float16(pairs_t)
          else:
            v_t = plgpu.load(
              v_smem.at[slot].transpose((1, 0)), layout=plgpu.Layout.WGMMA_TRANSPOSED
            )
            v_t = plgpu.layout_cast(v_t.astype(jnp.float16), plgpu.Layout.WGMMA)
          if masked:  # V rows the mask removed may hold stale or NaN data: 0 * NaN = NaN
            positions = plgpu.broadcasted_iota(
              jnp.int32, (head_dim, block_kv), 1, layout=plgpu.Layout.WGMMA
            )
            v_t = jnp.where(attendable(positions, block, pages_in_pool), v_t, 0)
        elif staged and not overlapped:  # reading qk waited for Q K^T, the staging block's reader
          to_staging(v_smem.at[slot], staging_v, v_keep(masked, block, pages_in_pool))
        elif masked and not fp8:
          needs_zeroing = ((block + 1) * block_kv > kv_len) | jnp.logical_not(_all(pages_in_pool))

          @pl.when(needs_zeroing)
          def _zero_rows():
            if warpgroups == 1:
              zero_v_rows(slot, block, pages_in_pool)
              return

            @pl.when(wg == 0)
            def _zero_and_signal():
              zero_v_rows(slot, block, pages_in_pool)
              plgpu.barrier_arrive(v_zeroed_barrier)

            @pl.when(wg != 0)
            def _await_zeroed():
              plgpu.barrier_wait(v_zeroed_barrier)

        # P is the A operand of O = P V, from registers; transposed, P^T is the B operand, stored
        # as P [N, block_kv] (K-major, the 128-byte swizzle of the A operand V^T). The GPU
        # interpreter only models shared-memory operands, so there P goes through p_smem too.
        if transposed:
          p_smem.transpose((1, 0))[...] = p.astype(compute_dtype)
          p_operand = p_smem.transpose((1, 0))
        elif operands_in_registers:
          p_operand = p.astype(compute_dtype)
        else:
          p_smem[...] = p.astype(compute_dtype)
          p_operand = p_smem
        reads_fp8_slot = fp8 and not producer
        if reads_fp8_slot or p_smem is not None:
          # Makes P and the staged V visible to the tensor cores, and orders this step's reads of
          # the slot before its refill.
          plgpu.commit_smem()
        if reads_fp8_slot:  # both fp8 blocks of the slot are converted: refill it while P V runs
          pl.when(refill < num_steps)(functools.partial(fetch, start + refill, slot, refill_pages))

        def compute_pv(pv_ref):
          if transposed:  # O^T = V^T P^T
            v_operand = v_t if fp8_in_registers else v_block.transpose((1, 0))
            plgpu.wgmma(pv_ref, v_operand, p_operand)
          else:  # O = P V
            plgpu.wgmma(pv_ref, p_operand, v_block)
          if overlapped:  # the next K while P V runs (this step's Q K^T, its reader, is complete)
            pl.when(i + 1 < num_steps)(functools.partial(stage_k, i + 1))

        if not operands_in_registers:  # into a fresh accumulator (the only form interpret runs)

          def fresh_pv(pv_ref):
            compute_pv(pv_ref)
            return pv_ref[...]

          acc = acc + pl.run_scoped(fresh_pv, plgpu.ACC(acc_shape, jnp.float32))
        else:  # onto the rescaled output, as jax's attention_mgpu.py does: no second accumulator
          acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
        if producer:  # both consumers release the slot; the producer refills (or converts) it
          pl.when(refill < num_steps)(lambda: plgpu.barrier_arrive(consumed_barriers.at[slot]))
        elif fp8:
          pass  # refilled above
        elif warpgroups == 1:
          # Both wgmmas on this slot are complete: refill it.
          pl.when(refill < num_steps)(functools.partial(fetch, start + refill, slot, refill_pages))
        else:

          @pl.when((refill < num_steps) & (wg != 0))
          def _release_slot():
            plgpu.barrier_arrive(consumed_barriers.at[slot])

          @when_issuer(refill < num_steps)
          def _refill_slot():
            plgpu.barrier_wait(consumed_barriers.at[slot])  # warpgroup 1 is done with it too
            fetch(start + refill, slot, refill_pages)

        return acc, m_new, l_i

      def ids_ahead(block):
        """The page ids a step carries: its block's and (without a producer) its refill's."""
        return page_ids(block), [] if producer else page_ids(block + num_stages)

      def step(i, carry):
        # With page_ids_ahead the page ids of this block and of the block this step refills were
        # read one step earlier and arrive in the carry (TuningConfig.page_ids_ahead).
        carry, ahead = carry
        block = start + i
        if page_ids_ahead:
          pages, refill_pages = ahead
          ahead = ids_ahead(block + 1)
        else:
          pages, refill_pages = page_ids(block), None
        # Blocks below the first row's limit whose pages all lie in the pool (always, inside
        # the contract) skip the mask; the rest (the last blocks, out-of-pool pages) apply it.
        pages_in_pool = [in_pool(page) for page in pages]
        needs_mask = (block >= unmasked_end) | jnp.logical_not(_all(pages_in_pool))
        step_of = functools.partial(
          block_step, pages_in_pool=pages_in_pool, refill_pages=refill_pages
        )
        carry = lax.cond(
          needs_mask,
          functools.partial(step_of, masked=True),
          functools.partial(step_of, masked=False),
          i,
          carry,
        )
        return carry, ahead

      row_layout = plgpu.Layout.WGMMA.reduce(pos_axis)
      m_i = plgpu.layout_cast(jnp.full((tile_rows,), -jnp.inf, jnp.float32), row_layout)
      if deferred_sum:
        l_i = plgpu.layout_cast(jnp.full(scores_shape, 0.0, jnp.float32), plgpu.Layout.WGMMA)
      else:
        l_i = plgpu.layout_cast(jnp.full((tile_rows,), 0.0, jnp.float32), row_layout)
      acc = plgpu.layout_cast(jnp.full(acc_shape, 0.0, jnp.float32), plgpu.Layout.WGMMA)
      pl.when(has_work)(lambda: plgpu.barrier_wait(q_barrier))
      # Row tiles take Q as the A operand of S = Q K^T from registers, loaded once per work item
      # (an item without work loads stale values it never uses).
      q_tile = plgpu.load(qo_smem, layout=plgpu.Layout.WGMMA) if operands_in_registers else qo_smem
      if overlapped:  # the first K; every later one is staged during the step before
        pl.when(num_steps > 0)(functools.partial(stage_k, 0))
      ahead = ids_ahead(start) if page_ids_ahead else ()
      (acc, m_i, l_i), _ = lax.fori_loop(0, num_steps, step, ((acc, m_i, l_i), ahead))
      if deferred_sum:
        l_i = l_i.sum(axis=pos_axis)

      # Rows that saw nothing have l = 0 and acc = 0. NaN in a row's visible K/V makes l NaN:
      # it must reach the output as on the XLA path, not pass for "saw nothing".
      seen = l_i != 0.0
      inv_l = 1.0 / jnp.where(seen, l_i, 1.0)
      acc = acc * lax.broadcast_in_dim(inv_l, acc.shape, [row_axis])
      if transposed:
        qo_smem.transpose((1, 0))[...] = acc.astype(compute_dtype)
      else:
        qo_smem[...] = acc.astype(compute_dtype)
      lse_smem[...] = jnp.where(seen, m_i + jnp.log2(jnp.where(seen, l_i, 1.0)), -jnp.inf)
      plgpu.commit_smem()
      tile = pl.ds(row_base, tile_rows)
      pl.when(stores_tile)(
        lambda: plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[item, kv_head, tile])
      )
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[item, kv_head, tile])
      plgpu.wait_smem_to_gmem(0)

    if producer:
      pl.when(wg == warpgroups)(produce_converted if fp8 else produce)
      pl.when(wg < warpgroups)(consume)
    else:
      consume()

  transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  if fp8 and not fp8_pairs:  # rows of D bytes: 128-byte swizzle at D 128, 64-byte at D 64
    swizzle = min(128, head_dim)
    kv_transforms = (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))
  else:  # 16-bit rows (fp8 pairs: D / 2 uint16, the same 128 bytes)
    kv_transforms = transforms
  per_warpgroup = (warpgroups,) if warpgroups > 1 else ()
  # The K and V rings, in the dtype and row length of the pages as given to the kernel.
  kv_ring = functools.partial(
    plgpu.SMEM, (num_stages, block_kv, k_pages.shape[-1]), k_pages.dtype, transforms=kv_transforms
  )
  scratch = [
    plgpu.SMEM((*per_warpgroup, tile_rows, head_dim), compute_dtype, transforms=transforms),
    kv_ring(),
    kv_ring(),
    plgpu.SMEM((*per_warpgroup, tile_rows), jnp.float32),
    plgpu.Barrier(num_barriers=warpgroups) if warpgroups > 1 else plgpu.Barrier(),
    plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=num_stages),
    plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=num_stages),
  ]
  if not operands_in_registers:  # the P tile
    scratch.append(
      plgpu.SMEM((*per_warpgroup, tile_rows, block_kv), compute_dtype, transforms=transforms)
    )
  for _ in range(2 if overlapped else int(staged)):  # the float16 staging block(s)
    scratch.append(plgpu.SMEM((block_kv, head_dim), compute_dtype, transforms=transforms))
  if converting_producer:  # the float16 K and V rings, and their ready barriers
    scratch += [
      plgpu.SMEM((num_stages, block_kv, head_dim), compute_dtype, transforms=transforms),
      plgpu.SMEM((num_stages, block_kv, head_dim), compute_dtype, transforms=transforms),
      plgpu.Barrier(num_barriers=num_stages),
      plgpu.Barrier(num_barriers=num_stages),
    ]
  if warpgroups > 1:  # consumed, and with 16-bit pages v_zeroed
    consumed_arrivals = warpgroups if producer else 1  # every consumer, or warpgroup 1
    scratch.append(plgpu.Barrier(num_arrivals=consumed_arrivals, num_barriers=num_stages))
    if not fp8:
      scratch.append(plgpu.Barrier())
  num_items = batch * num_chunks
  out_type = (
    jax.ShapeDtypeStruct((num_items, num_kv_heads, padded_rows, head_dim), compute_dtype),
    jax.ShapeDtypeStruct((num_items, num_kv_heads, padded_rows), jnp.float32),
  )
  scales = (k_scale, q_scale) if fp8 else ()
  partial_out, partial_lse = plgpu.kernel(
    paged_attention_kernel,
    out_type=out_type,
    scratch_types=scratch,
    grid=(num_kv_heads, row_tiles, num_items),
    grid_names=("kv_head", "row_tile", "item"),
    num_threads=warpgroups + producer if warpgroups > 1 else None,
    thread_name="wg" if warpgroups > 1 else None,
    compiler_params=plgpu.CompilerParams(approx_math=True),
    interpret=plgpu.InterpretGPUParams(detect_races=True) if interpret else False,
  )(block_tables, seq_lens, chunk_lengths, *scales, q_packed, k_pages, v_pages)

  # The merge kernel takes v_scale in and writes q's dtype; XLA's merge fuses the product below.
  merge_in_kernel = num_chunks > 1 and config.merge_kernel
  if merge_in_kernel:
    out = merge_chunks_mosaic_gpu(
      partial_out,
      partial_lse,
      num_chunks=num_chunks,
      q_len=q_len,
      group=group,
      v_scale=v_scale if fp8 else None,
      out_dtype=dtype,
      interpret=interpret,
    )  # [B, q_len, Hq, D]
  else:
    out = merge_chunks(
      partial_out.reshape(batch, num_chunks, num_kv_heads, padded_rows, head_dim),
      partial_lse.reshape(batch, num_chunks, num_kv_heads, padded_rows),
    )  # [B, Hkv, padded_rows, D]
    out = out[:, :, :num_rows].reshape(batch, num_kv_heads, q_len, group, head_dim)
    out = out.transpose(0, 2, 1, 3, 4).reshape(batch, q_len, num_q_heads, head_dim)
  if fp8_pairs:  # head dims even then odd -> in order
    out = out.reshape(*out.shape[:-1], 2, head_dim // 2).swapaxes(-1, -2).reshape(out.shape)
  if fp8 and not merge_in_kernel:  # real V = stored V * v_scale, per KV head
    out = out.astype(jnp.float32) * jnp.repeat(v_scale, group)[:, None]
  return out.astype(dtype)


def _to_float16_tiles(
  q_packed: jax.Array,  # [B, Hkv, R, D], bf16 or f16, R a multiple of tile_rows
  tile_rows: int = ROWS_PER_TILE,
) -> tuple[jax.Array, jax.Array]:  # f16 [B, Hkv, R, D], f32 [B, Hkv, R / tile_rows]
  """``q / s`` in float16 with ``s`` a power of two per tile of ``tile_rows`` rows, and ``s``.

  ``s = 2^(e - 15)`` where the tile's largest finite magnitude is below ``2^e``, so every
  finite value of ``q / s`` is below 2^15 (float16 reaches 65504) and, within 2^29 of the
  maximum, above float16's smallest normal 2^-14: those are converted exactly; smaller ones
  round at 2^-24, an error below 2^-40 of the maximum. NaN and inf stay NaN and inf without
  changing the tile's scale (the other rows of the tile are unaffected). bf16 subnormals
  count as 0, as in XLA's float32 arithmetic.
  """
  batch, num_kv_heads, rows, head_dim = q_packed.shape
  tiles = q_packed.astype(jnp.float32).reshape(batch, num_kv_heads, -1, tile_rows, head_dim)
  magnitude = jnp.where(jnp.isfinite(tiles), jnp.abs(tiles), 0.0)
  largest = jnp.max(magnitude, axis=(3, 4))  # [B, Hkv, row_tiles]
  _, exponent = jnp.frexp(largest)  # largest = m * 2^exponent, 0.5 <= m < 1
  # Tiles of subnormal values keep a normal float32 scale (their q / s is then tiny, not inf).
  scale = jnp.ldexp(jnp.float32(1.0), jnp.maximum(exponent, -100) - 15)
  scaled = tiles / scale[..., None, None]
  return scaled.astype(jnp.float16).reshape(q_packed.shape), scale


def _fp8_words_to_float16(fragments, selector: int | None = None):
  """Each 32-bit register of ``fragments`` (four e4m3 bytes) as two float16 pairs.

  With a ``selector`` a byte permute (PTX ``prmt``) first orders the bytes; then one
  ``cvt.rn.f16x2.e4m3x2`` (exact: every e4m3 value is a float16 value) converts each 16-bit
  half: returns the register arrays of the low halves and of the high halves.
  """
  i32 = ir.IntegerType.get_signless(32)
  f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
  permute, source = "", "$2"
  if selector is not None:
    permute, source = f"prmt.b32 ordered, $2, $2, {selector:#06x};", "ordered"
  low, high = np.empty_like(fragments.registers), np.empty_like(fragments.registers)
  for index, register in np.ndenumerate(fragments.registers):
    halves = llvm.inline_asm(
      llvm.StructType.get_literal([i32, i32]),
      [mgpu.utils.bitcast(register, i32)],
      f"""{{
      .reg .b32 ordered;
      .reg .b16 low_pair, high_pair;
      {permute}
      mov.b32 {{low_pair, high_pair}}, {source};
      cvt.rn.f16x2.e4m3x2 $0, low_pair;
      cvt.rn.f16x2.e4m3x2 $1, high_pair;
      }}""",
      "=r,=r,r",
    )
    low[index] = mgpu.utils.bitcast(llvm.extractvalue(i32, halves, [0]), f16x2)
    high[index] = mgpu.utils.bitcast(llvm.extractvalue(i32, halves, [1]), f16x2)
  return low, high


def _fp8_k_pairs_to_float16(pairs):
  """K in float16 from the 16-bit view of an fp8 K block, head dims in ``_k_pairs_order``.

  ``pairs`` [block_kv, D / 2] uint16 in the wgmma layout (an ``ldmatrix`` of the 16-bit view):
  element ``(p, j)`` holds the e4m3 bytes of ``K[p, 2j]`` and ``K[p, 2j + 1]``, and each
  register the pair ``j, j + 1``, so four consecutive head dims. Each register becomes two
  float16 registers, one per column tile of 8 (the layout's second register axis): returns
  f16 [block_kv, D] whose column ``c`` is head dim ``_k_pairs_order(D)[c]``. Q gets the same
  column order, so ``S^T = K Q^T`` is unchanged. The 8-bit load it replaces read two bytes per
  load.
  """
  block_kv, half = pairs.shape

  @plgpu.inline_mgpu(
    arg_types=(plgpu.Layout.WGMMA,),
    return_type=plgpu.ShapeDtypeStruct(
      (block_kv, 2 * half), jnp.float16, layout=plgpu.Layout.WGMMA
    ),
  )
  def convert(_, fragments):
    low, high = _fp8_words_to_float16(fragments)
    shape = list(low.shape)
    shape[1] *= 2
    registers = np.empty(shape, dtype=object)
    registers[:, 0::2], registers[:, 1::2] = low, high
    return mgpu.FragmentedArray(_registers=registers, _layout=fragments.layout, _is_signed=None)

  return convert(pairs)


def _k_pairs_order(head_dim: int) -> np.ndarray:
  """Head dim of each float16 column of ``_fp8_k_pairs_to_float16``'s K: within each 16 columns,
  column ``2s + e`` holds head dim ``4s + e`` and column ``8 + 2s + e`` head dim ``4s + 2 + e``
  (``s`` < 4, ``e`` < 2; a thread's four bytes of one register split over two column tiles)."""
  column = np.arange(head_dim)
  base, within = 16 * (column // 16), column % 16
  second = within >= 8
  pair, element = (within % 8) // 2, within % 2
  return base + 4 * pair + 2 * second + element


def _fp8_v_pairs_to_float16(pairs_t):
  """V^T in float16 from the transposed 16-bit view of an fp8 V block.

  ``pairs_t`` [D / 2, block_kv] uint16 in the wgmma layout (an ``ldmatrix.trans`` of the 16-bit
  view): element ``(j, k)`` holds the e4m3 bytes of ``V[k, 2j]`` (low) and ``V[k, 2j + 1]``
  (high), and each register the positions ``k, k + 1``. One byte permute per register groups
  its bytes by head dim: returns f16 [D, block_kv] with rows ``0, 2, ..., D - 2`` then ``1, 3,
  ..., D - 1`` (the layout tiles rows by 64 along its first register axis), so ``O^T = V^T
  P^T`` comes out with its head dims in that order. The 8-bit transposed load it replaces took
  a 2-byte load, a permute and a shuffle per pair (``ldmatrix`` has no 8-bit transpose before
  SM100).
  """
  half, block_kv = pairs_t.shape

  @plgpu.inline_mgpu(
    arg_types=(plgpu.Layout.WGMMA,),
    return_type=plgpu.ShapeDtypeStruct(
      (2 * half, block_kv), jnp.float16, layout=plgpu.Layout.WGMMA
    ),
  )
  def convert(_, fragments):
    # bytes [V[k, 2j], V[k, 2j+1], V[k+1, 2j], V[k+1, 2j+1]] -> even dim (k, k+1), odd dim
    even, odd = _fp8_words_to_float16(fragments, 0x3120)
    registers = np.concatenate([even, odd], axis=0)
    return mgpu.FragmentedArray(_registers=registers, _layout=fragments.layout, _is_signed=None)

  return convert(pairs_t)


def _all(flags):
  """Logical and of a list of traced bools."""
  return functools.reduce(jnp.logical_and, flags)


def merge_chunks(
  partial_out: jax.Array,  # [B, C, Hkv, R, D], each chunk normalised on its own
  partial_lse: jax.Array,  # f32 [B, C, Hkv, R], base-2 log-sum-exp, -inf = saw nothing
) -> jax.Array:  # [B, Hkv, R, D], partial_out.dtype
  """Log-sum-exp merge of KV chunks over axis 1, in a fixed order.

  ``o = sum_c 2^(lse_c - M) o_c / sum_c 2^(lse_c - M)`` with ``M = max_c lse_c``;
  rows no chunk saw (all -inf) get weight 0 everywhere and output 0. Chunks of
  weight 0 are selected away, not multiplied by 0: empty chunks leave their
  output tile unwritten, and 0 * NaN would be NaN.
  """
  if partial_out.shape[1] == 1:
    return partial_out[:, 0]
  lse_max = jnp.max(partial_lse, axis=1, keepdims=True)
  lse_max = jnp.where(lse_max == -jnp.inf, 0.0, lse_max)
  weights = jnp.exp2(partial_lse - lse_max)  # [B, C, Hkv, R], 0 for empty chunks
  total = jnp.sum(weights, axis=1)
  seen = (weights > 0.0)[..., None]
  merged = jnp.einsum(
    "bchr,bchrd->bhrd", weights, jnp.where(seen, partial_out.astype(jnp.float32), 0.0)
  )
  merged = merged / jnp.where(total > 0.0, total, 1.0)[..., None]
  return merged.astype(partial_out.dtype)


def merge_chunks_mosaic_gpu(
  partial_out: jax.Array,  # [B * C, Hkv, R, D], each chunk normalised on its own
  partial_lse: jax.Array,  # f32 [B * C, Hkv, R], base-2 log-sum-exp, -inf = saw nothing
  *,
  num_chunks: int,
  q_len: int,
  group: int,
  v_scale: jax.Array | None = None,  # f32 [Hkv]
  out_dtype=None,
  interpret: bool = False,
) -> jax.Array:  # [B, q_len, Hkv * G, D], out_dtype (default partial_out.dtype)
  """``merge_chunks`` and the row unpacking in one Mosaic GPU kernel.

  With ``v_scale`` (fp8 pages: the real V is the stored V times the KV head's scale, which
  factors out of ``P V`` and of the merge) each merged row is multiplied by its KV head's scale
  in float32 before the one rounding to ``out_dtype``, so no elementwise kernel follows.

  One program per (KV head, row tile, 64 head dims, request) merges the request's ``C`` chunk
  tiles online: with ``M`` the running max of the chunks' lse,
  ``acc = acc * 2^(M_old - M) + 2^(lse_c - M) o_c`` and ``l`` likewise. Its ``W`` warpgroups
  (``merge_warpgroups``) each merge every ``W``-th chunk, so that the chain of dependent steps
  is ``C / W`` long, and warpgroup 0 then combines their ``(acc, M, l)`` the same way, in a
  fixed order: the result is ``merge_chunks``' up to float32 rounding, and deterministic.
  Chunks that saw nothing (lse -inf) have weight 0 and are selected away (their tiles are
  unwritten); NaN in an lse reaches the output as in ``merge_chunks``. The merged tile goes
  straight to the output: packed row ``r = j * G + g`` is row ``(j, h * G + g)`` of its
  request, so the tile's rows of token ``j`` are one TMA copy of at most ``G`` contiguous rows.

  Each warpgroup streams its chunks through its own ring of shared-memory slots, all filled at
  the start (slot ``s`` issued by warp ``s % 4``, see the attention kernel's ``fetch``) and
  each refilled with the chunk a ring ahead as soon as it is read. Row tiles are 64 rows, merged
  as ``[64, 64]``; a transposed scores tile of ``N`` rows (``N`` a multiple of 8, not of 64) is
  merged whole as ``[64, N]``, the orientation it was computed in (rows on the wgmma N axis), so
  that a slot holds just its ``N`` rows.
  """
  num_items, num_kv_heads, padded_rows, head_dim = partial_out.shape
  batch = num_items // num_chunks
  num_rows = q_len * group
  dtype = partial_out.dtype
  out_dtype = jnp.dtype(out_dtype or dtype)
  # Rows of one merged tile, and the axis of the rows in its register array.
  transposed = padded_rows % ROWS_PER_TILE != 0
  tile_rows = padded_rows if transposed else ROWS_PER_TILE
  row_tiles = padded_rows // tile_rows
  col_blocks = head_dim // MERGE_COLS
  row_axis, col_axis = (1, 0) if transposed else (0, 1)
  warpgroups = merge_warpgroups(num_chunks, tile_rows)
  slots = merge_ring_slots(num_chunks, tile_rows, jnp.dtype(dtype).itemsize)  # per warpgroup
  # A TMA copy's shared-memory destination starts on a 128-byte line: each slot's lse is padded
  # to whole lines (interpret mode does not model that alignment; the GPU faults without it).
  lse_stride = pl.cdiv(tile_rows, _F32_PER_LINE) * _F32_PER_LINE
  tile_shape = (MERGE_COLS, tile_rows) if transposed else (tile_rows, MERGE_COLS)
  row_layout = plgpu.Layout.WGMMA.reduce(col_axis)

  def merge_chunks_kernel(
    tiles_ref,  # GMEM [B * C, Hkv, R, D]
    lse_ref,  # GMEM f32 [B * C, Hkv, R]
    *refs,  # v_scale: GMEM f32 [Hkv]; out: GMEM [B, q_len, Hq, D], out_dtype; scratch
  ):
    if v_scale is not None:
      v_scale_ref, *refs = refs
    (
      out_ref,
      tile_smem,  # [W, slots, tile_rows, 64]
      lse_smem,  # f32 [W, slots, lse_stride], the first tile_rows of each used
      merged_smem,  # [tile_rows, 64], out_dtype, unswizzled: any run of rows can be copied out
      barriers,  # [W * slots], two arrivals: the tile and its lse
      *combine_refs,  # W > 1: f32 [W - 1, *tile_shape], [W - 1, 2, tile_rows], barrier
    ) = refs
    kv_head = lax.axis_index("kv_head")
    row_tile = lax.div(lax.axis_index("tile"), col_blocks)
    cols = pl.ds(lax.rem(lax.axis_index("tile"), col_blocks) * MERGE_COLS, MERGE_COLS)
    request = lax.axis_index("request")
    rows = pl.ds(row_tile * tile_rows, tile_rows)
    wg = lax.axis_index("wg") if warpgroups > 1 else 0
    tile_ring, lse_ring = tile_smem.at[wg], lse_smem.at[wg]

    def ring_barrier(slot):  # a group of one barrier is not indexed
      return barriers.at[wg * slots + slot] if warpgroups * slots > 1 else barriers

    # This warpgroup's chunks: wg, wg + W, ...
    my_chunks = lax.div(num_chunks - wg + (warpgroups - 1), warpgroups)

    def fetch(k, slot):  # this warpgroup's k-th chunk into its slot `slot`
      item = request * num_chunks + wg + k * warpgroups
      plgpu.copy_gmem_to_smem(
        tiles_ref.at[item, kv_head, rows, cols], tile_ring.at[slot], ring_barrier(slot)
      )
      plgpu.copy_gmem_to_smem(
        lse_ref.at[item, kv_head, rows],
        lse_ring.at[slot, pl.ds(0, tile_rows)],
        ring_barrier(slot),
      )

    @pl.kernel(mesh=plgpu.WarpMesh(axis_name="warp"))
    def fill_ring():
      warp = lax.axis_index("warp")
      for slot in range(slots):
        mine = (warp == slot % WARPS_PER_WARPGROUP) & (slot < my_chunks)
        pl.when(mine)(functools.partial(fetch, slot, slot))

    fill_ring()

    def rows_of(vector):
      return lax.broadcast_in_dim(vector, tile_shape, [row_axis])

    def merge_in(acc, m_i, l_i, lse, tile):
      """Adds a tile of weight 2^lse (per row) to the running (acc, M, l)."""
      m_new = jnp.maximum(m_i, lse)
      m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: no inf - inf
      alpha = jnp.exp2(m_i - m_shift)
      weight = jnp.exp2(lse - m_shift)  # 0 for a chunk that saw nothing
      tile = jnp.where(rows_of(weight > 0.0), tile, 0.0)  # unwritten tiles: 0 * NaN = NaN
      return acc * rows_of(alpha) + rows_of(weight) * tile, m_new, l_i * alpha + weight

    def step(k, carry):
      acc, m_i, l_i = carry
      slot = lax.rem(k, slots)
      plgpu.barrier_wait(ring_barrier(slot))
      lse = plgpu.load(lse_ring.at[slot, pl.ds(0, tile_rows)], layout=row_layout)
      tile_ref = tile_ring.at[slot]
      tile_ref = tile_ref.transpose((1, 0)) if transposed else tile_ref
      tile = plgpu.load(tile_ref, layout=plgpu.Layout.WGMMA).astype(jnp.float32)

      @pl.when(k + slots < my_chunks)
      def _refill():
        plgpu.commit_smem()  # orders this step's reads of the slot before its refill
        fetch(k + slots, slot)

      return merge_in(acc, m_i, l_i, lse, tile)

    m_i = plgpu.layout_cast(jnp.full((tile_rows,), -jnp.inf, jnp.float32), row_layout)
    l_i = plgpu.layout_cast(jnp.full((tile_rows,), 0.0, jnp.float32), row_layout)
    acc = plgpu.layout_cast(jnp.full(tile_shape, 0.0, jnp.float32), plgpu.Layout.WGMMA)
    acc, m_i, l_i = lax.fori_loop(0, my_chunks, step, (acc, m_i, l_i))

    def store(acc, l_i):
      inv_l = 1.0 / jnp.where(l_i > 0.0, l_i, 1.0)  # rows no chunk saw: acc = 0
      if v_scale is not None:
        inv_l = inv_l * v_scale_ref[kv_head]
      merged = (acc * rows_of(inv_l)).astype(out_dtype)
      if transposed:
        merged_smem.transpose((1, 0))[...] = merged
      else:
        merged_smem[...] = merged
      plgpu.commit_smem()
      for tile_index in range(row_tiles):  # the rows' tokens are static per tile
        pl.when(row_tile == tile_index)(functools.partial(store_rows, tile_index * tile_rows))
      plgpu.wait_smem_to_gmem(0)

    def store_rows(tile_start):
      for j in range(q_len):  # token j: packed rows [j * G, (j + 1) * G) of this tile
        first = max(j * group, tile_start)
        last = min((j + 1) * group, tile_start + tile_rows, num_rows)
        if first < last:
          plgpu.copy_smem_to_gmem(
            merged_smem.at[pl.ds(first - tile_start, last - first)],
            out_ref.at[request, j, pl.ds(kv_head * group + first - j * group, last - first), cols],
          )

    if warpgroups == 1:
      store(acc, l_i)
      return

    # Warpgroups 1.. hand their unnormalised (acc, M, l) to warpgroup 0 through shared memory.
    acc_smem, ml_smem, handed_over = combine_refs

    @pl.when(wg != 0)
    def _hand_over():
      acc_smem.at[wg - 1][...] = acc
      ml_smem.at[wg - 1, 0][...] = m_i
      ml_smem.at[wg - 1, 1][...] = l_i
      plgpu.barrier_arrive(handed_over)

    @pl.when(wg == 0)
    def _combine():
      plgpu.barrier_wait(handed_over)
      acc_w, m_w, l_w = acc, m_i, l_i
      for other in range(warpgroups - 1):  # in a fixed order
        m_o = plgpu.load(ml_smem.at[other, 0], layout=row_layout)
        l_o = plgpu.load(ml_smem.at[other, 1], layout=row_layout)
        acc_o = plgpu.load(acc_smem.at[other], layout=plgpu.Layout.WGMMA)
        m_new = jnp.maximum(m_w, m_o)
        m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha, beta = jnp.exp2(m_w - m_shift), jnp.exp2(m_o - m_shift)
        acc_w = acc_w * rows_of(alpha) + acc_o * rows_of(beta)
        m_w, l_w = m_new, l_w * alpha + l_o * beta
      store(acc_w, l_w)

  transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  scratch = [
    plgpu.SMEM((warpgroups, slots, tile_rows, MERGE_COLS), dtype, transforms=transforms),
    plgpu.SMEM((warpgroups, slots, lse_stride), jnp.float32),
    plgpu.SMEM((tile_rows, MERGE_COLS), out_dtype),
    plgpu.Barrier(num_arrivals=2, num_barriers=warpgroups * slots),
  ]
  if warpgroups > 1:
    scratch += [
      plgpu.SMEM((warpgroups - 1, *tile_shape), jnp.float32),
      plgpu.SMEM((warpgroups - 1, 2, tile_rows), jnp.float32),
      plgpu.Barrier(num_arrivals=warpgroups - 1),
    ]
  return plgpu.kernel(
    merge_chunks_kernel,
    out_type=jax.ShapeDtypeStruct((batch, q_len, num_kv_heads * group, head_dim), out_dtype),
    scratch_types=scratch,
    grid=(num_kv_heads, row_tiles * col_blocks, batch),
    grid_names=("kv_head", "tile", "request"),
    num_threads=warpgroups if warpgroups > 1 else None,
    thread_name="wg" if warpgroups > 1 else None,
    interpret=plgpu.InterpretGPUParams(detect_races=True) if interpret else False,
  )(partial_out, partial_lse, *(() if v_scale is None else (v_scale,)))


def merge_warpgroups(num_chunks: int, tile_rows: int) -> int:
  """Warpgroups of ``merge_chunks_mosaic_gpu``: one per chunk, at most ``MERGE_WARPGROUPS``,
  and at most 2 beyond 64 rows (at 4 the 128 registers a thread then has spill: 538 B a
  thread at 96 rows, compiled for the H200)."""
  return min(num_chunks, MERGE_WARPGROUPS if tile_rows <= ROWS_PER_TILE else 2)


def merge_ring_slots(num_chunks: int, tile_rows: int, itemsize: int) -> int:
  """Slots of each warpgroup's ring in ``merge_chunks_mosaic_gpu``: one per chunk of the
  warpgroup, as many as its share of ``MERGE_SMEM_BYTES`` holds once the merged tile and the
  warpgroups' hand-over buffers are counted (a slot is a ``[tile_rows, 64]`` tile and its lse
  line(s)), and at most its share of ``MERGE_RING_MAX_SLOTS``."""
  warpgroups = merge_warpgroups(num_chunks, tile_rows)
  handed_over = (warpgroups - 1) * (tile_rows * MERGE_COLS + 2 * tile_rows) * 4  # f32
  ring_bytes = MERGE_SMEM_BYTES - handed_over - tile_rows * MERGE_COLS * itemsize
  slot_bytes = tile_rows * MERGE_COLS * itemsize + pl.cdiv(tile_rows, _F32_PER_LINE) * 128
  most = min(MERGE_RING_MAX_SLOTS, ring_bytes // slot_bytes) // warpgroups
  return max(1, min(pl.cdiv(num_chunks, warpgroups), most))
