"""Triton kernels that bound the top-k index conversion from below; benchmark contenders only.

``bench_sparse_index.py`` times them beside the Mosaic GPU kernel, on the same inputs, to answer
one question: how fast can *any* kernel move the conversion's bytes on this GPU?

* ``copy_kernel``: each program reads ``BLOCK`` int32 of the top-k with plain vector loads and
  writes them (xor 1, so the copy cannot be elided) to a fresh array: the conversion's traffic
  with no lookup. A sweep of block sizes, warps and cache hints (``evict_first`` loads,
  streaming ``.cs`` stores) gives the fastest such copy.
* ``convert_kernel``: the whole conversion (``jaxspec.kernels.sparse_index.reference``'s
  semantics, valid counts included) as plain vector loads and stores, one program per token, the
  table entries read through L1 by address: the form the notes left untested beside the Mosaic
  GPU kernel's bulk (TMA) copies of whole rows.

Importing this module needs Triton and a CUDA GPU; the benchmark imports it only where both are
present.
"""

import triton
import triton.language as tl

# (block, warps, hints) and (sub_block, warps, hints) swept by the benchmark.
COPY_CONFIGS = tuple(
  (block, warps, hints) for block in (2048, 4096, 8192) for warps in (4, 8, 16) for hints in (0, 1)
)
CONVERT_CONFIGS = tuple(
  (sub, warps, hints) for sub in (512, 1024, 2048) for warps in (4, 8) for hints in (0, 1)
)


@triton.jit
def copy_kernel(src, dst, BLOCK: tl.constexpr, HINTS: tl.constexpr):
  offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
  if HINTS:
    values = tl.load(src + offsets, eviction_policy="evict_first")
    tl.store(dst + offsets, values ^ 1, cache_modifier=".cs")
  else:
    values = tl.load(src + offsets)
    tl.store(dst + offsets, values ^ 1)


@triton.jit
def convert_kernel(
  req_ids,  # int32 [T]
  table,  # int32 [R, max_blocks]
  topk,  # int32 [T, K]
  physical,  # int32 [T, K], out
  counts,  # int32 [T], out
  num_requests,
  max_blocks,
  max_entry,  # the largest entry whose block's slots all fit in int32
  K: tl.constexpr,
  SUB: tl.constexpr,  # entries per inner step; divides K
  BLOCK_SIZE: tl.constexpr,  # block and block stride
  HINTS: tl.constexpr,
):
  token = tl.program_id(0)
  request = tl.load(req_ids + token)
  request_ok = (request >= 0) & (request < num_requests)
  row = tl.minimum(tl.maximum(request, 0), num_requests - 1).to(tl.int64) * max_blocks
  total = 0
  for step in tl.static_range(K // SUB):
    offsets = token.to(tl.int64) * K + step * SUB + tl.arange(0, SUB)
    if HINTS:
      index = tl.load(topk + offsets, eviction_policy="evict_first")
    else:
      index = tl.load(topk + offsets)
    block = index // BLOCK_SIZE  # truncates for negative indices, which `selects` drops first
    selects = (index >= 0) & (block < max_blocks) & request_ok
    entry = tl.load(table + row + tl.where(selects, block, 0))
    valid = selects & (entry >= 0) & (entry <= max_entry)
    slot = tl.where(valid, entry * BLOCK_SIZE + index % BLOCK_SIZE, -1)
    if HINTS:
      tl.store(physical + offsets, slot, cache_modifier=".cs")
    else:
      tl.store(physical + offsets, slot)
    total += tl.sum(valid.to(tl.int32))
  tl.store(counts + token, total)


def copy(src, dst, config) -> None:
  """``dst = src ^ 1`` for int32 tensors whose size is a multiple of the config's block."""
  block, warps, hints = config
  copy_kernel[(src.numel() // block,)](src, dst, BLOCK=block, HINTS=hints, num_warps=warps)


def convert(req_ids, table, topk, physical, counts, *, block_size, max_entry, config) -> None:
  """The conversion into ``physical [T, K]`` and ``counts [T]`` (``block_stride == block_size``)."""
  sub, warps, hints = config
  num_tokens, topk_size = topk.shape
  convert_kernel[(num_tokens,)](
    req_ids,
    table,
    topk,
    physical,
    counts,
    table.shape[0],
    table.shape[1],
    max_entry,
    K=topk_size,
    SUB=min(sub, topk_size),
    BLOCK_SIZE=block_size,
    HINTS=hints,
    num_warps=warps,
  )
