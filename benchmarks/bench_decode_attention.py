"""Paged multi-row decode attention on one GPU: our kernel against its contenders.

Runs side by side in one process, on identical inputs (bf16, Hkv 8, page 16, shuffled page
tables, fresh random data):

* ``ours``: ``paged_decode_attention(impl="pallas")``, the packed-row Mosaic GPU kernel;
* ``flashinfer``: FlashInfer's fastest Hopper paths on the same paged data (our HND pages
  transposed once, outside the timing, into its HND ``[num_pages, Hkv, page, D]`` layout):
  ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)`` for q_len 1 and
  ``BatchPrefillWithPagedKVCacheWrapper(causal=True, backend="fa2")`` for q_len > 1; timed
  as a CUDA graph of back-to-back calls on distinct queries (CUDA events around its replay),
  its output checked against ours. Optional: without an importable ``flashinfer`` (0.7.2 was
  measured; it compiles its kernels on first use, about a minute) the run goes on without it
  and says so;
* ``triton_per_row``: jax's Pallas Triton ``paged_attention`` with one work item
  per draft row (every row a separate sequence of its own causal length), the
  way a JAX user runs MTP today;
* ``xla``: our XLA reference (gather + einsum), where it fits in memory;
* ``torch_sdpa``: torch ``scaled_dot_product_attention`` on contiguous KV with a
  lower-right causal mask (the same values, gathered once outside the timing).

Sections (rows of ``results/decode_attention.{json,md}``):

* ``G8 D128`` (all contenders): B in {1, 8, 64} x L in {8k, 32k} x q_len in {1, 3, 7}, plus
  a ragged batch of 64 requests with lengths drawn from 1k..32k;
* ``GLM-4.5 G12`` (ours, FlashInfer): 96 query / 8 KV heads, where q_len 6 and 7 pack 72 and
  84 rows (more than one 64-row tile): B1 L8k, B8 L32k, B64 L32k, ragged B64, q_len 1/6/7;
* ``fp8 KV`` (ours): B64 L32k, q_len 1/3/7, the same values in bf16 and in fp8 (e4m3, one
  scale per KV head) pages; the bf16 / fp8 time ratio (target: at least 1.8);
* ``D64`` (ours, FlashInfer): G8, D 64 at B8 and B64 L32k, q_len 1/3/7.

Sections run in this order; after ``--time-budget`` seconds (default 420) no new shape is
started and the ones left are listed as skipped.

Every row also reports the largest difference between our output and the XLA reference's
on the first input, over the first requests of the batch (up to 8, so that it fits).
Effective bandwidth is unique KV bytes (K and V of every request's ``S`` positions, in the
pages' dtype) / time. Where a batch's KV is smaller than ``COLD_READ_BYTES`` (4x the L2), the
calls of a timed program rotate over copies of its pages, for every contender, so that no row
is timed with its KV warm in L2 (a served model's step reads every layer's KV, never L2-warm).

``--quick`` runs only B1 and B64 at L 8k and the ragged batch of the first section; ``--only``
runs the shapes it names, in its order. ``--kernel-time`` adds, for ours and FlashInfer, the
CUPTI device time of one call (the sum of its kernels, ``_timing.kernel_seconds``) and a table
of it. At small shapes that is the fair comparison: our steady-state timing of a program of
back-to-back calls is not one call's device time there (on an H100 at B1 L8k it varied from run
to run and came out below the sum of a call's kernels, 17.8 against 25.3 us at G 12 q_len 7:
the program's calls overlap, or the method misreads at that size), while FlashInfer's graph runs
its calls one after another.
``--tune`` instead runs only a sweep of tuning configs (on three shapes; the fp8 ring depth and
register layout; ``TuningConfig.merge_kernel`` against the XLA merge where the KV is split; the
128-row two-warpgroup tile at G 12, L 32k) and writes ``results/decode_attention_tuning.{json,md}``;
with ``--only``, the sweeps it names.

``--two-warpgroup-check`` instead times only our kernel at G 12 (GLM-4.5), where
``G * q_len > 64``: the default 64-row tiles (each reads the KV) against one
128-row tile of two warpgroups (``TuningConfig.two_warpgroup_tiles``), at B8 and
B64, L 8k and 32k, q_len 6 and 7, and writes ``results/two_warpgroup_tiles.{json,md}``.

``--transposed-check`` instead times our kernel with 64-row tiles against transposed scores
(``TuningConfig.transposed_scores``) on the shapes where we trail FlashInfer or read the KV
twice (``results/decode_attention_transposed.{json,md}``); ``--fp8-transposed-check`` the same on
fp8 pages at B8 and B64 L32k (``results/decode_attention_fp8_transposed.{json,md}``).

``--transposed-rows-check`` instead times, on 16-bit pages at 24, 32 and 40 packed rows (B1 to
B64, D 128 and 64), the 64-row tile against the transposed tile, each as ``default_config``
builds it, three interleaved timings each: where the device's transposed-row limit should lie
(``results/decode_attention_transposed_rows.{json,md}``).

``--register-check`` instead times our row tiles with Q and P in registers against shared
memory (``TuningConfig.operands_in_registers``) at B1, B2, B4 and B8, L 8k and 32k, G 8 q_len 3/7
and G 12 q_len 6: where the default's threshold on the (request, KV head) pairs should lie
(``results/decode_attention_register_operands.{json,md}``).

``--fp8-registers-check`` instead times fp8 pages with transposed scores (q_len 1, 3, 7, G 8 and
12, D 128 and 64) with K and V through the float16 staging block against both converted in
registers (``TuningConfig.fp8_in_registers``; ``results/decode_attention_fp8_in_registers.*``).

``--fp8-overlap-check`` instead times fp8 pages on row tiles (q_len 3, 6 and 7) with one staging
block against K and V staged while the wgmmas run (``TuningConfig.fp8_staging_overlap``;
``results/decode_attention_fp8_staging_overlap.{json,md}``).

``--deferred-sum-check`` instead times the softmax denominators summed every step against once
per work item (``TuningConfig.deferred_sum``): q_len 1 on transposed tiles (G 8 and 12, D 128
and 64, B1 to B64, bf16 and fp8 pages), then q_len 3-7 on row tiles and on the 128-row tile
(``results/decode_attention_deferred_sum{,_fp8,_rows,_two_warpgroups}.{json,md}``).

``--fp8-register-sweep`` instead times the parts of that choice ``default_config`` rests on:
ring depths with registers at D 128 and 64, registers against staging at 12 and 16 rows, at one
request and at B8 (``results/decode_attention_fp8_register_sweep/``).

``--d64-stage-sweep`` instead times the ring depth of transposed tiles at D 64, q_len 1 (2, 3, 6
and 8 stages against 4; ``results/decode_attention_d64_q1_stages/``).

``--page-ids-ahead-check`` instead times page ids read where they are used against a step
earlier (``TuningConfig.page_ids_ahead``) on each tile kind as ``default_config`` runs it
(``results/decode_attention_page_ids_ahead/``).

``--breakdown`` instead lists, for a few shapes, every GPU kernel one call of ours
launches (Q packing, the attention kernel, the chunk merge, the row unpacking) with
its CUPTI time, next to the steady-state time per call: where the time of small shapes goes.

``--smoke`` (main run, ``--tune`` and the checks) runs the same steps on tiny
shapes in GPU interpret mode with ours and XLA only: a CPU check of the script, not a
measurement.

Usage: ``python benchmarks/bench_decode_attention.py [--quick] [--no-flashinfer]``,
``python benchmarks/bench_decode_attention.py --tune``,
``python benchmarks/bench_decode_attention.py --two-warpgroup-check`` or
``python benchmarks/bench_decode_attention.py --breakdown``.
"""

import argparse
import dataclasses
import datetime
import itertools
import json
import pathlib
import statistics
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks._timing import kernel_seconds, time_jax, time_torch  # noqa: E402
from jaxspec.kernels.decode_attention.api import paged_decode_attention  # noqa: E402
from jaxspec.kernels.decode_attention.mosaic_gpu import (  # noqa: E402
  DEFAULT_BALANCE_WAVES,
  DEFAULT_FP8_IN_REGISTERS_MAX_ROWS,
  DEFAULT_FP8_IN_REGISTERS_MIN_PAIRS_D128,
  DEFAULT_PAGE_IDS_AHEAD_TRANSPOSED_MIN_PAIRS,
  DEFAULT_REGISTER_OPERANDS_MIN_PAIRS,
  DEFAULT_TRANSPOSED_MAX_ROWS,
  FP8_IN_REGISTERS_STAGES_D128,
  FP8_PRODUCER_STAGES,
  TuningConfig,
  default_config,
  transposed_max_rows,
)
from jaxspec.kernels.dispatch import gpu_device_kind  # noqa: E402

NUM_KV_HEADS, GROUP, HEAD_DIM, PAGE_SIZE = 8, 8, 128, 16
GLM_GROUP = 12  # GLM-4.5: 96 query heads over 8 KV heads
DTYPE = jnp.bfloat16
FP8 = jnp.float8_e4m3fn
# HBM bandwidth on the datasheet, by a piece of jax's device_kind: H200 (HBM3e), H100 SXM
# (HBM3, device_kind "NVIDIA H100 80GB HBM3"), H100 NVL, H100 PCIe. First match wins.
DATASHEET_TBPS = (("H200", 4.8), ("H100 80GB HBM3", 3.35), ("H100 NVL", 3.9), ("H100 PCIe", 2.0))
RESULTS = pathlib.Path(__file__).resolve().parent / "results"
XLA_CHECK_REQUESTS = 8  # ours is compared with the XLA reference on this many requests
FP8_TARGET_RATIO = 1.8
L2_BYTES = 50 * 2**20  # H100 / H200
# Calls of a timed program rotate over copies of the pages so that at least this many bytes
# are read between two reads of one copy: the KV of a served model's step (every layer's) is
# never in L2, and a batch whose KV is smaller than the L2 would otherwise be timed warm.
COLD_READ_BYTES = 4 * L2_BYTES
MAX_CALLS_PER_PROGRAM = 16


@dataclasses.dataclass
class Batch:
  seq_lens: np.ndarray  # [B]
  k_pages: jax.Array  # [Hkv, num_pages, page, D], bf16 or fp8
  v_pages: jax.Array
  block_tables: jax.Array  # int32 [B, max_pages]
  kv_bytes: int  # unique K and V bytes the step must read
  k_scale: jax.Array | None = None  # f32 [Hkv] with fp8 pages
  v_scale: jax.Array | None = None
  page_copies: tuple = ()  # further (K, V) copies of the same values, see cold_copies

  @property
  def head_dim(self) -> int:
    return self.k_pages.shape[-1]

  @property
  def shared_args(self) -> tuple:
    """What one call of ours reads besides q: pages (the first copy), table, lengths, scales."""
    return (self.k_pages, self.v_pages, *self.rest_args)

  @property
  def rest_args(self) -> tuple:
    """What every call of ours reads besides q and the pages: table, lengths, scales."""
    return (self.block_tables, jnp.asarray(self.seq_lens), self.k_scale, self.v_scale)

  def pages(self, call: int) -> tuple[jax.Array, jax.Array]:
    """The (K, V) pages that call ``call`` of a timed program reads: the copies in turn."""
    copies = ((self.k_pages, self.v_pages), *self.page_copies)
    return copies[call % len(copies)]

  def variants(self, queries) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
    """(q, K pages, V pages) of each call of a timed program."""
    return [(q, *self.pages(i)) for i, q in enumerate(queries)]


def cold_copies(k_pages, v_pages, kv_bytes: int) -> tuple:
  """Further (K, V) copies of the pages, so that consecutive calls read ``COLD_READ_BYTES``
  before one copy comes round again (none where the KV alone is that large)."""
  count = int(min(MAX_CALLS_PER_PROGRAM, -(-COLD_READ_BYTES // max(kv_bytes, 1))))
  return tuple((jnp.copy(k_pages), jnp.copy(v_pages)) for _ in range(count - 1))


def make_batch(rng, seq_lens, head_dim=HEAD_DIM, pad_to=128) -> Batch:
  seq_lens = np.asarray(seq_lens, np.int32)
  pages_needed = -(-seq_lens // PAGE_SIZE)
  # Triton's paged_attention needs k_splits (16) * pages_per_compute_block (8) | max_pages.
  max_pages = int(-(-pages_needed.max() // pad_to) * pad_to)
  num_pages = int(pages_needed.sum())
  order = rng.permutation(num_pages).astype(np.int32)
  block_tables = np.zeros((len(seq_lens), max_pages), np.int32)
  offsets = np.concatenate([[0], np.cumsum(pages_needed)])
  for b, needed in enumerate(pages_needed):
    block_tables[b, :needed] = order[offsets[b] : offsets[b + 1]]
  key_k, key_v = jax.random.split(jax.random.key(int(rng.integers(1 << 31))))
  shape = (NUM_KV_HEADS, num_pages, PAGE_SIZE, head_dim)
  kv_bytes = int(seq_lens.sum()) * NUM_KV_HEADS * head_dim * 2 * jnp.dtype(DTYPE).itemsize
  k_pages, v_pages = jax.random.normal(key_k, shape, DTYPE), jax.random.normal(key_v, shape, DTYPE)
  copies = cold_copies(k_pages, v_pages, kv_bytes)
  return Batch(seq_lens, k_pages, v_pages, jnp.asarray(block_tables), kv_bytes, page_copies=copies)


def to_fp8(batch: Batch) -> Batch:
  """The same values in e4m3 pages with one scale per KV head (amax / 448, as calibrated)."""

  def quantise(pages):
    scale = jnp.max(jnp.abs(pages.astype(jnp.float32)), axis=(1, 2, 3)) / 448.0  # [Hkv]
    stored = (pages / scale[:, None, None, None].astype(pages.dtype)).astype(FP8)
    return stored, scale

  (k_pages, k_scale), (v_pages, v_scale) = quantise(batch.k_pages), quantise(batch.v_pages)
  # The copies hold the same values, hence the same scales; half the bytes, so twice as many.
  copies = cold_copies(k_pages, v_pages, batch.kv_bytes // 2)
  return dataclasses.replace(
    batch,
    k_pages=k_pages,
    v_pages=v_pages,
    k_scale=k_scale,
    v_scale=v_scale,
    kv_bytes=batch.kv_bytes // 2,
    page_copies=copies,
  )


def fresh_queries(rng, batch, q_len, count, group=GROUP, head_dim=HEAD_DIM):
  keys = jax.random.split(jax.random.key(int(rng.integers(1 << 31))), count)
  shape = (batch, q_len, NUM_KV_HEADS * group, head_dim)
  return [jax.random.normal(k, shape, DTYPE) for k in keys]


def inner_count(kv_bytes):
  """Calls per timed program: enough that a program outlasts its own host dispatch (the
  steady-state timing then measures the device), few enough to keep compile time short."""
  return int(np.clip(2e10 / max(kv_bytes, 1), 4, MAX_CALLS_PER_PROGRAM))


def _ours(impl, config=None, interpret=False):
  def call(variant, tables, lens, k_scale, v_scale):
    q, k, v = variant
    return paged_decode_attention(
      q,
      k,
      v,
      tables,
      lens,
      impl=impl,
      config=config,
      interpret=interpret,
      k_scale=k_scale,
      v_scale=v_scale,
    )

  return call


def time_ours(batch, queries, config=None, interpret=False, notes=None, **timing):
  del notes
  fn = _ours("pallas", config, interpret)
  return time_jax(fn, batch.variants(queries), *batch.rest_args, **timing)


def kernel_time_ours(batch, queries, config=None) -> dict:
  """CUPTI device time of one call of ours (``kernel_seconds``), the calls taking the timed
  program's inputs in turn (its page copies: KV not warm in L2)."""
  call = jax.jit(_ours("pallas", config))
  variants = itertools.cycle(batch.variants(queries))
  seconds, kernels = kernel_seconds(
    lambda: call(next(variants), *batch.rest_args), jax.block_until_ready
  )
  return _kernel_entry(seconds, kernels)


def _listed(kernels) -> str:
  """A ``_kernel_entry``'s kernels for a table cell: short names and us."""
  return "; ".join(f"{name[:40]} {us:.1f}" for name, us in kernels)


def _kernel_time(measure, *args) -> dict:
  """``measure(*args)``'s ``_kernel_entry``, or the error that stopped it: a contender whose
  device time cannot be taken keeps its timing."""
  try:
    return measure(*args)
  except Exception as error:  # reported in the row, not fatal
    return {"kernel_error": f"{type(error).__name__}: {str(error)[:300]}"}


def _kernel_entry(seconds, kernels) -> dict:
  """A contender's ``kernel_seconds`` in its row: the sum, and each kernel (name, us)."""
  return {
    "kernel_us": seconds * 1e6,
    "kernel_count": len(kernels),
    "kernels": [[name, kernel_s * 1e6] for name, kernel_s in kernels],
  }


def time_xla(batch, queries, notes=None, **timing):
  del notes
  return time_jax(_ours("xla"), batch.variants(queries), *batch.rest_args, **timing)


def time_triton_per_row(batch, queries, notes=None):
  del notes
  from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

  b, q_len, num_heads, head_dim = queries[0].shape
  rows = np.arange(q_len)
  row_lens = np.maximum(batch.seq_lens[:, None] - q_len + 1 + rows[None, :], 0).reshape(-1)
  row_tables = jnp.repeat(batch.block_tables, q_len, axis=0)  # [B * q_len, max_pages]

  def fn(variant, tables, lens):
    q, k, v = variant
    return paged_attention(q.reshape(b * q_len, num_heads, head_dim), k, v, tables, lens)

  return time_jax(fn, batch.variants(queries), row_tables, jnp.asarray(row_lens, jnp.int32))


def time_torch_sdpa(batch, queries, notes=None):
  """Contiguous KV [B, Hkv, L, D] (uniform lengths only), GQA, lower-right causal mask."""
  del notes
  import torch
  import torch.nn.functional as F
  from torch.nn.attention.bias import causal_lower_right

  length = int(batch.seq_lens[0])
  if np.any(batch.seq_lens != length):
    raise ValueError("torch SDPA runs on uniform lengths only (contiguous KV)")
  b, q_len = queries[0].shape[:2]
  head_dim = batch.head_dim

  def contiguous(pages):
    gathered = pages[:, batch.block_tables].reshape(NUM_KV_HEADS, b, -1, head_dim)
    return torch.from_dlpack(jnp.swapaxes(gathered[:, :, :length], 0, 1))

  copies = [tuple(map(contiguous, batch.pages(i))) for i in range(1 + len(batch.page_copies))]
  qs = [torch.from_dlpack(q).permute(0, 2, 1, 3).contiguous() for q in queries]
  mask = None if q_len == 1 else causal_lower_right(q_len, length)
  state = {"i": 0}

  def call():
    state["i"] = (state["i"] + 1) % len(qs)
    keys, values = copies[state["i"] % len(copies)]
    return F.scaled_dot_product_attention(
      qs[state["i"]], keys, values, attn_mask=mask, enable_gqa=True
    )

  return time_torch(call, inner=len(qs))


def flashinfer_version() -> str | None:
  """FlashInfer's version when it can be imported with torch on a GPU, else ``None``."""
  try:
    import flashinfer
    import torch
  except ImportError:
    return None
  if not torch.cuda.is_available():
    return None
  return getattr(flashinfer, "__version__", "unknown version")


def time_torch_graph(calls, reps: int = 15, warmup: int = 2) -> float:
  """Median seconds per call of ``calls`` (a list of closures) captured back to back in one
  CUDA graph, timed by CUDA events around each replay: no host launch cost per call."""
  import torch

  for call in calls:  # first use outside the capture: builds, allocations
    call()
  torch.cuda.synchronize()
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    for call in calls:
      call()
  for _ in range(warmup):
    graph.replay()
  torch.cuda.synchronize()
  samples = []
  for _ in range(reps):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    stop.record()
    torch.cuda.synchronize()
    samples.append(start.elapsed_time(stop) / 1e3 / len(calls))
  return statistics.median(samples)


def time_flashinfer(batch, queries, notes, kernel_time=False):
  """FlashInfer's best Hopper path for this q_len on the same pages; checked against ours.
  ``kernel_time``: also its CUPTI device time per call (``notes["kernel_us"]``)."""
  import flashinfer
  import torch

  if batch.k_scale is not None:
    raise ValueError("fp8 pages are timed for ours only")
  b, q_len, num_q_heads, head_dim = queries[0].shape
  page_size = batch.k_pages.shape[2]
  needed = -(-batch.seq_lens // page_size)
  tables = np.asarray(batch.block_tables)
  indices = np.concatenate([tables[i, :n] for i, n in enumerate(needed)]).astype(np.int32)
  indptr = np.concatenate([[0], np.cumsum(needed)]).astype(np.int32)
  last_page_len = ((batch.seq_lens - 1) % page_size + 1).astype(np.int32)
  device = torch.device("cuda")

  def tensor(array):
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)

  # Our [Hkv, N, page, D] pages as FlashInfer's HND [N, Hkv, page, D] (one transpose of each
  # copy, untimed).
  kv_caches = [
    tuple(
      torch.from_dlpack(jax.block_until_ready(jnp.swapaxes(pages, 0, 1)))
      for pages in batch.pages(i)
    )
    for i in range(1 + len(batch.page_copies))
  ]
  workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)
  dtypes = {"q_data_type": torch.bfloat16, "kv_data_type": torch.bfloat16}
  plan_args = (tensor(indptr), tensor(indices), tensor(last_page_len))
  if q_len == 1:
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
      workspace, kv_layout="HND", use_tensor_cores=True
    )
    wrapper.plan(*plan_args, num_q_heads, NUM_KV_HEADS, head_dim, page_size, **dtypes)
    notes["path"] = "BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)"
  else:
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
      workspace, kv_layout="HND", backend="fa2"
    )
    qo_indptr = tensor(np.arange(b + 1, dtype=np.int32) * q_len)
    wrapper.plan(
      qo_indptr, *plan_args, num_q_heads, NUM_KV_HEADS, head_dim, page_size, causal=True, **dtypes
    )
    notes["path"] = 'BatchPrefillWithPagedKVCacheWrapper(causal=True, backend="fa2")'
  jax.block_until_ready(queries)  # torch reads them on its own stream
  torch_queries = [torch.from_dlpack(q).reshape(b * q_len, num_q_heads, head_dim) for q in queries]
  outputs = []

  def make_call(q, kv_cache):
    return lambda: outputs.append(wrapper.run(q, kv_cache))

  calls = [make_call(q, kv_caches[i % len(kv_caches)]) for i, q in enumerate(torch_queries)]
  calls[0]()
  torch.cuda.synchronize()
  first = jnp.asarray(np.asarray(outputs[0].float().cpu())).reshape(queries[0].shape)
  ours = paged_decode_attention(queries[0], *batch.shared_args[:4], impl="pallas")
  notes["max_abs_diff_vs_ours"] = float(jnp.max(jnp.abs(first - ours.astype(jnp.float32))))
  if kernel_time:

    def device_time():
      in_turn = itertools.cycle(calls)  # as ours: the page copies in turn
      return _kernel_entry(
        *kernel_seconds(lambda: next(in_turn)(), lambda _: torch.cuda.synchronize())
      )

    notes.update(_kernel_time(device_time))
    outputs.clear()
  try:
    notes["timing"] = "CUDA graph"
    return time_torch_graph(calls)
  except Exception as error:  # fall back, and say so in the row
    notes["timing"] = f"CUDA events, no graph ({type(error).__name__})"
    state = {"i": 0}

    def call():
      state["i"] = (state["i"] + 1) % len(calls)
      calls[state["i"]]()
      outputs.clear()

    return time_torch(call, inner=len(calls))


def measure_read_bandwidth():
  """TB/s of float32 sums over four distinct 1 GiB bf16 arrays: a practical read ceiling.

  Distinct arrays, not one array with a distinct scale per call: XLA rewrites
  ``sum(x * v)`` into ``v * sum(x)`` and then computes the sum only once.
  """
  keys = jax.random.split(jax.random.key(0), 4)
  arrays = [jax.random.normal(k, (1 << 29,), jnp.bfloat16) for k in keys]
  seconds = time_jax(lambda x: jnp.sum(x.astype(jnp.float32)), arrays)
  return arrays[0].nbytes / seconds / 1e12


def difference_vs_xla(batch: Batch, q, interpret=False) -> float:
  """Largest |ours - XLA| on the first requests of the batch (the XLA gather must fit)."""
  n = min(len(batch.seq_lens), XLA_CHECK_REQUESTS)
  k_pages, v_pages, tables, lens, k_scale, v_scale = batch.shared_args
  args = (q[:n], k_pages, v_pages, tables[:n], lens[:n])
  scales = {"k_scale": k_scale, "v_scale": v_scale}
  outs = [
    paged_decode_attention(*args, impl=impl, interpret=interpret, **scales).astype(jnp.float32)
    for impl in ("pallas", "xla")
  ]
  return float(jnp.max(jnp.abs(outs[0] - outs[1])))


class Shape(NamedTuple):
  section: str
  name: str
  seq_lens: np.ndarray
  q_lens: tuple[int, ...]
  contenders: tuple[str, ...]
  group: int = GROUP
  head_dim: int = HEAD_DIM
  fp8: bool = False  # time ours on bf16 and on fp8 pages of the same values


# The contenders run_shape times with no options of their own (ours, XLA and FlashInfer take
# the run's timing, interpret or kernel-time options there).
TIMERS = {
  "triton_per_row": time_triton_per_row,
  "torch_sdpa": time_torch_sdpa,
}


def run_shape(rng, shape: Shape, smoke=False, kernel_time=False):
  """Times the shape's contenders at each of its q_lens; ``kernel_time``: ours and FlashInfer
  also by CUPTI device time (``kernel_seconds``)."""
  batch = make_batch(rng, shape.seq_lens, shape.head_dim, pad_to=8 if smoke else 128)
  variants = [("bf16", batch)] + ([("fp8", to_fp8(batch))] if shape.fp8 else [])
  timing = {"reps": 1, "warmup": 0} if smoke else {}
  rows = []
  for q_len in shape.q_lens:
    count = 1 if smoke else inner_count(batch.kv_bytes)
    queries = fresh_queries(rng, len(shape.seq_lens), q_len, count, shape.group, shape.head_dim)
    row = {
      "section": shape.section,
      "shape": shape.name,
      "B": len(shape.seq_lens),
      "G": shape.group,
      "D": shape.head_dim,
      "q_len": q_len,
      "kv_bytes": batch.kv_bytes,
    }
    for label, pages in variants:
      suffix = "" if label == "bf16" else "_fp8"
      try:  # reported with the timings, not fatal
        row["max_abs_diff_vs_xla" + suffix] = difference_vs_xla(pages, queries[0], smoke)
      except Exception as error:  # reported, not fatal
        row["check_error" + suffix] = f"{type(error).__name__}: {str(error)[:300]}"
      for contender in shape.contenders if label == "bf16" else ("ours",):
        entry = {}
        try:
          if contender == "ours":
            seconds = time_ours(pages, queries, interpret=smoke, **timing)
            if kernel_time and label == "bf16":
              entry.update(_kernel_time(kernel_time_ours, pages, queries))
          elif contender == "xla":
            seconds = time_xla(pages, queries, **timing)
          elif contender == "flashinfer":
            seconds = time_flashinfer(pages, queries, notes=entry, kernel_time=kernel_time)
          else:
            seconds = TIMERS[contender](pages, queries, notes=entry)
          entry.update(us=seconds * 1e6, tbps=pages.kv_bytes / seconds / 1e12)
        except Exception as error:  # a contender that cannot run is reported, not fatal
          entry["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        row[contender + suffix] = entry
        print(
          shape.name,
          f"G{shape.group} D{shape.head_dim}",
          q_len,
          contender + suffix,
          entry,
          flush=True,
        )
    rows.append(row)
  return rows


def benchmark_shapes(rng, quick: bool, flashinfer: bool, smoke: bool) -> list[Shape]:
  """The grid (module docstring); ``smoke``: tiny stand-ins for every section."""
  fi = ("flashinfer",) if flashinfer else ()
  if smoke:
    ours = ("ours", "xla")
    return [
      Shape("G8 D128", "B2 L200", np.array([200, 77]), (1, 3), ours),
      Shape("GLM-4.5 G12", "B2 L150", np.array([150, 64]), (6,), ours, group=GLM_GROUP),
      Shape("D64", "B2 L130", np.array([130, 1]), (3,), ours, head_dim=64),
      Shape("fp8 KV", "B2 L140", np.array([140, 20]), (1, 3), ("ours",), fp8=True),
    ]
  everyone = ("ours", *fi, "triton_per_row", "xla", "torch_sdpa")
  shapes = []
  for b in (1, 64) if quick else (1, 8, 64):
    for length in (8192,) if quick else (8192, 32768):
      # The XLA gather of f32 K/V would not fit next to the rest at larger sizes.
      contenders = tuple(c for c in everyone if c != "xla" or b * length <= 8 * 32768)
      shapes.append(
        Shape("G8 D128", f"B{b} L{length // 1024}k", np.full(b, length), (1, 3, 7), contenders)
      )
  ragged = rng.integers(1024, 32768 + 1, size=64)
  shapes.append(
    Shape("G8 D128", "B64 ragged 1k..32k", ragged, (1, 3, 7), ("ours", *fi, "triton_per_row"))
  )
  if quick:
    return shapes
  ours_and_fi = ("ours", *fi)
  for name, lens in [
    ("B1 L8k", np.full(1, 8192)),
    ("B8 L32k", np.full(8, 32768)),
    ("B64 L32k", np.full(64, 32768)),
    ("B64 ragged 1k..32k", ragged),
  ]:
    shapes.append(Shape("GLM-4.5 G12", name, lens, (1, 6, 7), ours_and_fi, group=GLM_GROUP))
  shapes.append(Shape("fp8 KV", "B64 L32k", np.full(64, 32768), (1, 3, 7), ("ours",), fp8=True))
  for name, lens in [("B8 L32k", np.full(8, 32768)), ("B64 L32k", np.full(64, 32768))]:
    shapes.append(Shape("D64", name, lens, (1, 3, 7), ours_and_fi, head_dim=64))
  return shapes


def _check_meta(setup: str, smoke: bool, **extra) -> dict:
  """The header of a config check's results: device, versions, date, ``setup``, datasheet."""
  kind = jax.devices()[0].device_kind
  return {
    "gpu": kind,
    "jax": jax.__version__,
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    "setup": setup + (", interpret-mode smoke run (not a measurement)" if smoke else ""),
    "datasheet_tbps": datasheet_tbps(kind),
    **extra,
  }


def _save_check(out_dir, stem, title, meta, rows) -> None:
  """Writes a config check's ``results/{stem}.{json,md}`` (after every shape: a run cut short
  keeps the shapes it finished)."""
  (out_dir / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
  (out_dir / f"{stem}.md").write_text(render_config_check(title, meta, rows))


def config_check(rng, out_dir, stem, title, variant, shapes, smoke=False, base=None):
  """Our kernel under its default config (with the fields of the dict ``base`` replaced, when
  given) against ``variant`` of that, on the same inputs.

  ``shapes``: ``(name, seq_lens, q_lens, G, D, fp8)``. Also reports the largest difference
  between the two outputs on one input (bf16 rounding of differently split chunks, ~1e-2; a
  broken tile shows as NaN or ~1). Writes ``results/{stem}.{json,md}`` after every shape, so
  a run cut short keeps the shapes it finished.
  """
  timing = {"reps": 1, "warmup": 0} if smoke else {}
  meta = _check_meta(
    f"bf16 queries, Hkv {NUM_KV_HEADS}, page {PAGE_SIZE}", smoke, configs={}, base=base
  )
  rows = []
  for name, seq_lens, q_lens, group, head_dim, fp8 in shapes:
    old_config = default_config(head_dim, PAGE_SIZE, FP8 if fp8 else DTYPE)
    if base:
      old_config = dataclasses.replace(old_config, **base)
    if smoke:  # interpret mode: tiny and unsplit
      old_config = dataclasses.replace(old_config, num_chunks=1)
    new_config = variant(old_config)
    meta["configs"][f"{name} G{group} D{head_dim}" + (" fp8" if fp8 else "")] = {
      "default": dataclasses.asdict(old_config),
      "variant": dataclasses.asdict(new_config),
    }
    batch = make_batch(rng, seq_lens, head_dim, pad_to=8 if smoke else 128)
    if fp8:
      batch = to_fp8(batch)
    lens = jnp.asarray(batch.seq_lens)
    for q_len in q_lens:
      count = 1 if smoke else min(16, inner_count(batch.kv_bytes))  # bounds compile time
      queries = fresh_queries(rng, len(seq_lens), q_len, count, group=group, head_dim=head_dim)
      row = {
        "shape": name + (" fp8" if fp8 else ""),
        "q_len": q_len,
        "G": group,
        "D": head_dim,
        "kv_bytes": batch.kv_bytes,
      }
      outputs = {}
      for label, config in (("default", old_config), ("variant", new_config)):
        try:
          outputs[label] = paged_decode_attention(
            queries[0],
            batch.k_pages,
            batch.v_pages,
            batch.block_tables,
            lens,
            k_scale=batch.k_scale,
            v_scale=batch.v_scale,
            impl="pallas",
            config=config,
            interpret=smoke,
          )
          seconds = time_ours(batch, queries, config, interpret=smoke, **timing)
          row[label] = {"us": seconds * 1e6, "tbps": batch.kv_bytes / seconds / 1e12}
        except Exception as error:  # reported in the table, not fatal
          row[label] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        print(name, f"q{q_len} G{group} D{head_dim}", label, row[label], flush=True)
      if len(outputs) == 2:
        difference = jnp.abs(
          outputs["variant"].astype(jnp.float32) - outputs["default"].astype(jnp.float32)
        )
        row["max_abs_difference"] = float(jnp.max(difference))
      rows.append(row)
    del batch
    _save_check(out_dir, stem, title, meta, rows)
  print(render_config_check(title, meta, rows))


def datasheet_tbps(device_kind: str) -> float | None:
  """The datasheet's HBM bandwidth (TB/s) of a jax ``device_kind``; None where unknown (CPU)."""
  return next((tbps for name, tbps in DATASHEET_TBPS if name in device_kind), None)


def _share(tbps: float, datasheet: float | None) -> str:
  """Effective bandwidth as a share of the datasheet's, or "n/a" on an unknown device."""
  return f"{100 * tbps / datasheet:.0f}%" if datasheet else "n/a"


def render_config_check(title, meta, rows) -> str:
  """The markdown table of a ``config_check`` run (or one with the same rows whose ``meta``
  carries its own ``legend`` of the two columns)."""
  datasheet = meta.get("datasheet_tbps")
  legend = meta.get("legend") or (
    "'default' is `default_config(D, page, pages' dtype)` without the packed-row count (so 64-row "
    "tiles)"
    + ("".join(f", then {k}={v}" for k, v in (meta.get("base") or {}).items()))
    + ", 'variant' the config under test; both per shape in the JSON file."
  )

  def cell(entry):
    if "us" not in entry:
      return "fails"
    return f"{entry['us']:.1f} us / {entry['tbps']:.2f} ({_share(entry['tbps'], datasheet)})"

  lines = [
    f"# {title}",
    "",
    f"{meta['gpu']}, jax {meta['jax']}, {meta['date']}; {meta['setup']}. "
    "Time per call / effective KV TB/s (unique KV bytes, in the pages' dtype, / time); "
    f"share of the datasheet's {datasheet or 'n/a'} TB/s in brackets. " + legend,
    "",
    "| shape | q_len | G | D | default | variant | speedup | max abs difference |",
    "| --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for row in rows:
    old, new = row["default"], row["variant"]
    speedup = f"{old['us'] / new['us']:.2f}x" if "us" in old and "us" in new else "n/a"
    difference = f"{row['max_abs_difference']:.3g}" if "max_abs_difference" in row else "n/a"
    lines.append(
      f"| {row['shape']} | {row['q_len']} | {row['G']} | {row['D']} | {cell(old)} | {cell(new)} "
      f"| {speedup} | {difference} |"
    )
  return "\n".join(lines) + "\n"


def _glm_many_row_shapes(smoke):
  """G 12 with q_len 6 and 7 (72 and 84 packed rows) at B8 and B64, L 8k and 32k."""
  if smoke:
    return [("B2 L200", [200, 77], (6,), GLM_GROUP, HEAD_DIM, False)]
  return [
    (f"B{b} L{length // 1024}k", [length] * b, (6, 7), GLM_GROUP, HEAD_DIM, False)
    for length in (8192, 32768)
    for b in (8, 64)
  ]


def two_warpgroup_check(rng, out_dir, smoke=False):
  """G 12: default 64-row tiles against one 128-row tile of two warpgroups."""
  config_check(
    rng,
    out_dir,
    "two_warpgroup_tiles",
    "128-row tile of two warpgroups (variant) against 64-row tiles (G * q_len > 64)",
    lambda config: dataclasses.replace(config, two_warpgroup_tiles=True),
    _glm_many_row_shapes(smoke),
    smoke,
  )


def register_check(rng, out_dir, smoke=False):
  """Row tiles with Q and P in registers (default, without the pair count) against shared
  memory, at the small batches where ``DEFAULT_REGISTER_OPERANDS_MIN_PAIRS`` draws its line."""
  shapes = [
    (f"B{b} L{length // 1024}k", [length] * b, q_lens, group, HEAD_DIM, False)
    for length in (8192, 32768)
    for b in (1, 2, 4, 8)
    for group, q_lens in ((GROUP, (3, 7)), (GLM_GROUP, (6,)))
  ]
  if smoke:
    shapes = [("B2 L200", [200, 77], (3,), GROUP, HEAD_DIM, False)]
  config_check(
    rng,
    out_dir,
    "decode_attention_register_operands",
    "Q and P through shared memory (variant) against registers (default), 64-row tiles",
    lambda config: dataclasses.replace(config, operands_in_registers=False),
    shapes,
    smoke,
  )


def transposed_check(rng, out_dir, smoke=False, fp8=False):
  """Transposed scores (rows as the wgmma N dimension) against row tiles of 64, over the shapes
  of the main run where we trail FlashInfer or read the KV more than once; with ``fp8``, on fp8
  pages instead (``decode_attention_fp8_transposed.*``)."""
  if fp8:
    stem, title = "decode_attention_fp8_transposed", "fp8 pages: transposed scores"
    shapes = [  # (name, seq_lens, q_lens, G, D, fp8)
      ("B64 L32k", [32768] * 64, (1, 3, 7), GROUP, HEAD_DIM, True),
      ("B8 L32k", [32768] * 8, (1, 3), GROUP, HEAD_DIM, True),
      ("B64 L32k", [32768] * 64, (1,), GLM_GROUP, HEAD_DIM, True),
    ]
    smoke_shapes = [("B2 L200", [200, 77], (1, 3), GROUP, HEAD_DIM, True)]
  else:
    stem = "decode_attention_transposed"
    title = "Transposed scores (variant: S^T = K Q^T, O^T = V^T P^T, rows as wgmma N)"
    ragged = rng.integers(1024, 32768 + 1, size=64)
    shapes = [
      ("B1 L8k", [8192], (1, 7), GROUP, HEAD_DIM, False),
      ("B1 L32k", [32768], (1, 3), GROUP, HEAD_DIM, False),
      ("B8 L8k", [8192] * 8, (1,), GROUP, HEAD_DIM, False),
      ("B8 L32k", [32768] * 8, (1, 7), GROUP, HEAD_DIM, False),
      ("B64 L32k", [32768] * 64, (1, 3, 7), GROUP, HEAD_DIM, False),
      ("B64 ragged 1k..32k", ragged, (1, 7), GROUP, HEAD_DIM, False),
      ("B8 L32k", [32768] * 8, (1, 7), GLM_GROUP, HEAD_DIM, False),
      ("B64 L32k", [32768] * 64, (1, 6, 7), GLM_GROUP, HEAD_DIM, False),
      ("B8 L32k", [32768] * 8, (1,), GROUP, 64, False),
      ("B64 L32k", [32768] * 64, (1, 7), GROUP, 64, False),
    ]
    smoke_shapes = [("B2 L200", [200, 77], (1, 7), GLM_GROUP, 64, False)]
  config_check(
    rng,
    out_dir,
    stem,
    title + " against 64-row tiles",
    lambda config: dataclasses.replace(config, transposed_scores=True),
    smoke_shapes if smoke else shapes,
    smoke,
  )


def fp8_registers_check(rng, out_dir, smoke=False):
  """fp8 pages with transposed scores: K and V blocks through the float16 staging block against
  both converted in registers (``TuningConfig.fp8_in_registers``)."""
  shapes = [  # (name, seq_lens, q_lens, G, D, fp8)
    ("B64 L32k", [32768] * 64, (1, 3, 7), GROUP, HEAD_DIM, True),
    ("B8 L32k", [32768] * 8, (1,), GROUP, HEAD_DIM, True),
    ("B64 L32k", [32768] * 64, (1,), GLM_GROUP, HEAD_DIM, True),
    ("B64 L32k", [32768] * 64, (1,), GROUP, 64, True),
  ]
  smoke_shapes = [("B2 L200", [200, 77], (1, 2), GROUP, HEAD_DIM, True)]
  config_check(
    rng,
    out_dir,
    "decode_attention_fp8_in_registers",
    "fp8 pages, transposed scores: K and V converted in registers (variant) against the staging "
    "block",
    lambda config: dataclasses.replace(config, fp8_in_registers=True),
    smoke_shapes if smoke else shapes,
    smoke,
    base={"transposed_scores": True},
  )


def fp8_overlap_check(rng, out_dir, smoke=False):
  """fp8 pages on row tiles (q_len 3 and 7): one staging block against separate K and V staging
  blocks converted while the wgmmas run (``TuningConfig.fp8_staging_overlap``)."""
  shapes = [  # (name, seq_lens, q_lens, G, D, fp8)
    ("B64 L32k", [32768] * 64, (3, 7), GROUP, HEAD_DIM, True),
    ("B8 L32k", [32768] * 8, (3, 7), GROUP, HEAD_DIM, True),
    ("B64 L32k", [32768] * 64, (6,), GLM_GROUP, HEAD_DIM, True),
    ("B64 L32k", [32768] * 64, (7,), GROUP, 64, True),
  ]
  smoke_shapes = [("B2 L200", [200, 77], (3,), GROUP, HEAD_DIM, True)]
  config_check(
    rng,
    out_dir,
    "decode_attention_fp8_staging_overlap",
    "fp8 pages, row tiles: K and V staged while the wgmmas run (variant) against one staging block",
    lambda config: dataclasses.replace(config, fp8_staging_overlap=True),
    smoke_shapes if smoke else shapes,
    smoke,
  )


def deferred_sum_check(rng, out_dir, smoke=False):
  """The softmax denominators summed every step against once per work item
  (``TuningConfig.deferred_sum``): q_len 1 on transposed tiles (the default up to 16 rows) on
  16-bit pages, then on fp8 pages in registers as ``default_config`` runs them at B64; then
  q_len 3-7 on row tiles (16-bit and fp8 pages) and on the 128-row tile of two warpgroups."""
  b64, b8 = [32768] * 64, [32768] * 8
  parts = [  # (stem, shapes (name, seq_lens, q_lens, G, D, fp8), base)
    (
      "decode_attention_deferred_sum",
      [
        ("B64 L32k", b64, (1,), GROUP, HEAD_DIM, False),
        ("B8 L32k", b8, (1,), GROUP, HEAD_DIM, False),
        ("B1 L32k", [32768], (1,), GROUP, HEAD_DIM, False),
        ("B8 L32k", b8, (1,), GLM_GROUP, HEAD_DIM, False),
        ("B64 L32k", b64, (1,), GROUP, 64, False),
        ("B8 L32k", b8, (1,), GROUP, 64, False),
      ],
      {"transposed_scores": True},
    ),
    (
      "decode_attention_deferred_sum_fp8",
      [("B64 L32k", b64, (1,), GROUP, HEAD_DIM, True)],
      {"transposed_scores": True, "fp8_in_registers": True, "num_stages": 4},
    ),
    (
      "decode_attention_deferred_sum_rows",
      [
        ("B64 L32k", b64, (3, 7), GROUP, HEAD_DIM, False),
        ("B8 L32k", b8, (7,), GROUP, HEAD_DIM, False),
        ("B64 L32k", b64, (7,), GROUP, HEAD_DIM, True),
      ],
      None,
    ),
    (
      "decode_attention_deferred_sum_two_warpgroups",
      [("B64 L32k", b64, (6,), GLM_GROUP, HEAD_DIM, False)],
      {"two_warpgroup_tiles": True},
    ),
  ]
  for stem, shapes, base in parts:
    if smoke:
      shapes = [("B2 L200", [200, 77], (1,), GROUP, HEAD_DIM, shapes[0][5])]
    title = "Softmax denominators summed once per work item (variant) against every step"
    config_check(
      rng,
      out_dir,
      stem,
      title,
      lambda config: dataclasses.replace(config, deferred_sum=True),
      shapes,
      smoke,
      base=base,
    )


def page_ids_ahead_check(rng, out_dir, smoke=False):
  """Page ids read where they are used against one step earlier (``TuningConfig.page_ids_ahead``),
  each tile kind as ``default_config`` runs it: the 128-row tile at G 12 q_len 7, fp8 pages
  converted in registers (8 rows) and on row tiles, 16-bit row tiles, transposed tiles at q_len
  1. Writes ``{part}.{json,md}`` under ``decode_attention_page_ids_ahead/``."""
  out_dir = out_dir / "decode_attention_page_ids_ahead"
  out_dir.mkdir(parents=True, exist_ok=True)
  b64, b8 = [32768] * 64, [32768] * 8
  off = {"page_ids_ahead": False}
  parts = [  # (stem, shapes (name, seq_lens, q_lens, G, D, fp8), base)
    (
      "two_warpgroups",
      [
        ("B64 L32k", b64, (7,), GLM_GROUP, HEAD_DIM, False),
        ("B8 L32k", b8, (7,), GLM_GROUP, HEAD_DIM, False),
      ],
      {**off, "two_warpgroup_tiles": True},
    ),
    (
      "fp8_in_registers",
      [("B64 L32k", b64, (1,), GROUP, HEAD_DIM, True)],
      {**off, "transposed_scores": True, "fp8_in_registers": True, "num_stages": 4},
    ),
    ("rows", [("B64 L32k", b64, (3, 7), GROUP, HEAD_DIM, fp8) for fp8 in (False, True)], off),
    (
      "transposed",
      [
        ("B64 L32k", b64, (1,), GROUP, HEAD_DIM, False),
        ("B8 L32k", b8, (1,), GROUP, HEAD_DIM, False),
        ("B1 L8k", [8192], (1,), GROUP, HEAD_DIM, False),
      ],
      {**off, "transposed_scores": True},
    ),
  ]
  for stem, shapes, base in parts:
    if smoke:
      shapes = [("B2 L200", [200, 77], shapes[0][2], shapes[0][3], HEAD_DIM, shapes[0][5])]
    config_check(
      rng,
      out_dir,
      stem,
      "Page ids read one step ahead (variant) against where they are used",
      lambda config: dataclasses.replace(config, page_ids_ahead=True),
      shapes,
      smoke,
      base=base,
    )


def producer_check(rng, out_dir, smoke=False):
  """The 128-row tile with a producer warpgroup issuing the ring's copies
  (``TuningConfig.producer_warpgroup``, variant, ``default_config``'s choice since 2026-12-05)
  against the tile without it (warpgroup 0 issues them), at G 12 q_len 6 and 7, where more than
  64 rows take that tile."""
  b64, b8 = [32768] * 64, [32768] * 8
  shapes = [  # (name, seq_lens, q_lens, G, D, fp8)
    ("B64 L32k", b64, (6, 7), GLM_GROUP, HEAD_DIM, False),
    ("B8 L32k", b8, (6, 7), GLM_GROUP, HEAD_DIM, False),
    (
      "B64 ragged 1k..32k",
      rng.integers(1024, 32768 + 1, size=64),
      (7,),
      GLM_GROUP,
      HEAD_DIM,
      False,
    ),
    ("B64 L32k", b64, (7,), GLM_GROUP, 64, False),
  ]
  if smoke:
    shapes = _glm_many_row_shapes(smoke)
  config_check(
    rng,
    out_dir,
    "decode_attention_producer_warpgroup",
    "128-row tile: a producer warpgroup issues the copies (variant) against warpgroup 0",
    lambda config: dataclasses.replace(config, producer_warpgroup=True),
    shapes,
    smoke,
    base={"two_warpgroup_tiles": True, "page_ids_ahead": True, "producer_warpgroup": False},
  )


def fp8_producer_check(rng, out_dir, smoke=False):
  """fp8 pages beyond 64 rows: the 128-row tile whose producer warpgroup converts each block
  (default, ``default_config``'s choice since 2026-12-06, at D 64 from this check's first GPU
  run) against two 64-row tiles that each convert it (variant, the default before), at G 12
  q_len 6 and 7, D 128 and 64."""
  b64 = [32768] * 64
  ragged = rng.integers(1024, 32768 + 1, size=64)
  shapes = [  # (name, seq_lens, q_lens, G, D, fp8)
    ("B64 L32k", b64, (6, 7), GLM_GROUP, HEAD_DIM, True),
    ("B8 L32k", [32768] * 8, (7,), GLM_GROUP, HEAD_DIM, True),
    ("B64 ragged 1k..32k", ragged, (7,), GLM_GROUP, HEAD_DIM, True),
    ("B64 L32k", b64, (7,), GLM_GROUP, 64, True),
    ("B8 L32k", [32768] * 8, (7,), GLM_GROUP, 64, True),
  ]
  if smoke:
    shapes = [("B2 L200", [200, 77], (6,), GLM_GROUP, HEAD_DIM, True)]
  config_check(
    rng,
    out_dir,
    "decode_attention_fp8_producer",
    "fp8 pages beyond 64 rows: 128-row tile, converting producer / two 64-row tiles (variant)",
    lambda config: dataclasses.replace(
      config,
      two_warpgroup_tiles=False,
      producer_warpgroup=False,
      page_ids_ahead=False,
      fp8_staging_overlap=True,
    ),
    shapes,
    smoke,
    base={
      "two_warpgroup_tiles": True,
      "producer_warpgroup": True,
      "page_ids_ahead": True,
      "fp8_staging_overlap": False,
      "num_stages": FP8_PRODUCER_STAGES,
    },
  )


def transposed_rows_check(rng, out_dir, smoke=False):
  """Where transposed scores stop paying on 16-bit pages: 24, 32 and 40 packed rows (G 8 q_len
  3-5, G 12 q_len 2, D 128 and 64), the 64-row tile (default) against the transposed tile
  (variant), each as ``default_config`` builds it for the shape's rows and (request, KV head)
  pairs on a device without a rule of its own, the transposed one as for 16 rows. Three
  interleaved timings of each (the median in the table). ``TRANSPOSED_MAX_ROWS_16BIT_BY_DEVICE``
  rests on this check (``results/decode_attention_transposed_rows.{json,md}``)."""
  b64_32k, b64_8k = [32768] * 64, [8192] * 64
  shapes = [  # (name, seq_lens, q_lens, G, D)
    ("B1 L8k", [8192], (3, 4), GROUP, HEAD_DIM),
    ("B1 L32k", [32768], (3,), GROUP, HEAD_DIM),
    ("B8 L8k", [8192] * 8, (3, 4, 5), GROUP, HEAD_DIM),
    ("B8 L32k", [32768] * 8, (3, 4), GROUP, HEAD_DIM),
    ("B64 L8k", b64_8k, (3, 4), GROUP, HEAD_DIM),
    ("B64 L32k", b64_32k, (3, 4, 5), GROUP, HEAD_DIM),
    ("B64 ragged 1k..32k", rng.integers(1024, 32768 + 1, size=64), (3,), GROUP, HEAD_DIM),
    ("B64 L32k", b64_32k, (2,), GLM_GROUP, HEAD_DIM),
    ("B64 L32k", b64_32k, (3, 4), GROUP, 64),
  ]
  if smoke:
    shapes = [("B2 L200", [200, 77], (3,), GROUP, 64)]
  meta = _check_meta(
    f"bf16, Hkv {NUM_KV_HEADS}, page {PAGE_SIZE}",
    smoke,
    legend="'default' is `default_config(D, page, bf16, G * q_len, B * Hkv)` (the 64-row "
    "tile), 'variant' the same as for 16 rows (the transposed tile); each the median of three "
    "interleaved timings, all three in the JSON file.",
    configs={},
  )
  title = "16-bit pages beyond 16 rows: 64-row / transposed tile"
  timing = {"reps": 1, "warmup": 0} if smoke else {}
  rows = []
  for name, seq_lens, q_lens, group, head_dim in shapes:
    batch = make_batch(rng, seq_lens, head_dim, pad_to=8 if smoke else 128)
    pairs = len(seq_lens) * NUM_KV_HEADS
    for q_len in q_lens:
      configs = {
        label: default_config(head_dim, PAGE_SIZE, DTYPE, rows, pairs)
        for label, rows in (("default", group * q_len), ("variant", DEFAULT_TRANSPOSED_MAX_ROWS))
      }
      if smoke:  # interpret mode: tiny and unsplit
        configs = {k: dataclasses.replace(c, num_chunks=1) for k, c in configs.items()}
      key = f"{name} q{q_len} G{group} D{head_dim}"
      meta["configs"][key] = {k: dataclasses.asdict(c) for k, c in configs.items()}
      count = 1 if smoke else min(16, inner_count(batch.kv_bytes))  # bounds compile time
      queries = fresh_queries(rng, len(seq_lens), q_len, count, group=group, head_dim=head_dim)
      first = batch.variants(queries)[0]
      outputs = {
        label: _ours("pallas", config, smoke)(first, *batch.rest_args)
        for label, config in configs.items()
      }
      timings = {label: [] for label in configs}
      for _ in range(1 if smoke else 3):
        for label, config in configs.items():
          timings[label].append(time_ours(batch, queries, config, interpret=smoke, **timing))
      row = {"shape": name, "q_len": q_len, "G": group, "D": head_dim, "kv_bytes": batch.kv_bytes}
      for label, seconds in timings.items():
        median = float(np.median(seconds))
        row[label] = {
          "us": median * 1e6,
          "tbps": batch.kv_bytes / median / 1e12,
          "timings_us": [t * 1e6 for t in seconds],
        }
      difference = outputs["variant"].astype(jnp.float32) - outputs["default"].astype(jnp.float32)
      row["max_abs_difference"] = float(jnp.max(jnp.abs(difference)))
      print(key, {k: row[k]["timings_us"] for k in configs}, flush=True)
      rows.append(row)
    del batch
    _save_check(out_dir, "decode_attention_transposed_rows", title, meta, rows)
  print(render_config_check(title, meta, rows))


def d64_stage_sweep(rng, out_dir, smoke=False):
  """The ring depth of transposed tiles at D 64 on 16-bit pages (q_len 1, with the denominators
  summed once, as ``default_config`` runs them): 2, 3, 6 and 8 stages against 4. Writes
  ``d64_q1_stages{n}.{json,md}`` under ``decode_attention_d64_q1_stages/``."""
  out_dir = out_dir / "decode_attention_d64_q1_stages"
  out_dir.mkdir(parents=True, exist_ok=True)
  shapes = [  # (name, seq_lens, q_lens, G, D, fp8)
    ("B64 L32k", [32768] * 64, (1,), GROUP, 64, False),
    ("B8 L32k", [32768] * 8, (1,), GROUP, 64, False),
  ]
  if smoke:
    shapes = [("B2 L200", [200, 77], (1,), GROUP, 64, False)]
  for count in (2, 3, 6, 8):
    config_check(
      rng,
      out_dir,
      f"d64_q1_stages{count}",
      f"D 64 q_len 1, transposed tiles, denominators summed once: {count} stages (variant)",
      lambda config, count=count: dataclasses.replace(config, num_stages=count),
      shapes,
      smoke,
      base={"transposed_scores": True, "deferred_sum": True},
    )


def fp8_register_sweep(rng, out_dir, smoke=False):
  """Where ``default_config`` turns ``fp8_in_registers`` on, and its ring depth: stages at D 128
  and D 64, then rows (12, 16) and pairs (B1, B8), each part against its own base config.
  Writes one ``{part}.{json,md}`` per part under ``decode_attention_fp8_register_sweep/``."""
  out_dir = out_dir / "decode_attention_fp8_register_sweep"
  out_dir.mkdir(parents=True, exist_ok=True)
  b64 = [32768] * 64
  transposed = {"transposed_scores": True}
  registers = {**transposed, "fp8_in_registers": True}

  def stages(count):
    return lambda config: dataclasses.replace(config, num_stages=count)

  d128 = [("B64 L32k", b64, (1,), GROUP, HEAD_DIM, True)]
  parts = [  # (part, title, variant, shapes (name, seq_lens, q_lens, G, D, fp8), base)
    *[
      (f"d128_stages{n}", f"D 128 in registers: 2 (base) / {n} stages", stages(n), d128, registers)
      for n in (3, 4)
    ],
    (
      "d128_stages6",
      "D 128 in registers: 4 (base) / 6 stages",
      stages(6),
      d128,
      {**registers, "num_stages": 4},
    ),
    (
      "d64_stages3",
      "D 64 in registers: 6 (base) / 3 stages",
      stages(3),
      [("B64 L32k", b64, (1,), GROUP, 64, True)],
      registers,
    ),
    (
      "d64_stages6",
      "D 64 in registers: 8 (base) / 6 stages",
      stages(6),
      [("B64 L32k", b64, (1,), group, 64, True) for group in (GROUP, GLM_GROUP)],
      {**registers, "num_stages": 8},
    ),
    (
      "rows",
      "Staging block (base) / registers at 12 and 16 rows and one request",
      lambda config: dataclasses.replace(config, fp8_in_registers=True),
      [
        ("B64 L32k", b64, (1,), GLM_GROUP, 64, True),
        ("B64 L32k", b64, (2,), GROUP, HEAD_DIM, True),
        ("B1 L8k", [8192], (1,), GROUP, HEAD_DIM, True),
        ("B1 L8k", [8192], (1,), GROUP, 64, True),
      ],
      transposed,
    ),
    (
      "regs4",
      "Staging block (base, 2 stages) / registers with 4 stages",
      lambda config: dataclasses.replace(config, fp8_in_registers=True, num_stages=4),
      [
        ("B8 L32k", [32768] * 8, (1,), GROUP, HEAD_DIM, True),
        ("B64 L32k", b64, (1,), GLM_GROUP, HEAD_DIM, True),
        ("B64 L32k", b64, (2,), GROUP, HEAD_DIM, True),
      ],
      transposed,
    ),
  ]
  for part, title, variant, shapes, base in parts:
    if smoke:
      shapes = [("B2 L200", [200, 77], (1,), GROUP, shapes[0][4], True)]
    config_check(rng, out_dir, part, "fp8 pages: " + title, variant, shapes, smoke, base=base)


def breakdown(rng, out_dir):
  """CUPTI time of every kernel of one call of ours (``kernel_time_ours``), and the
  steady-state time per call."""
  merge = dataclasses.replace(default_config(HEAD_DIM, PAGE_SIZE), merge_kernel=True)
  rows = []
  for name, seq_lens, q_len, fp8, config in [
    ("B1 L8k", [8192], 1, False, None),
    ("B1 L8k", [8192], 7, False, None),
    ("B1 L8k", [8192], 7, False, merge),
    ("B8 L32k", [32768] * 8, 1, False, None),
    ("B64 L32k", [32768] * 64, 1, False, None),
    ("B64 L32k", [32768] * 64, 7, False, None),
    ("B64 L32k", [32768] * 64, 7, True, None),
  ]:
    batch = make_batch(rng, seq_lens)
    if fp8:
      batch = to_fp8(batch)
    queries = fresh_queries(rng, len(seq_lens), q_len, inner_count(batch.kv_bytes))
    kernels = kernel_time_ours(batch, queries, config)["kernels"]
    wall_us = time_ours(batch, queries, config) * 1e6
    label = name + (" fp8" if fp8 else "") + (" merge kernel" if config is merge else "")
    row = {"shape": label, "q_len": q_len, "wall_us": wall_us, "kernels": kernels}
    print(json.dumps(row), flush=True)
    rows.append(row)
    del batch
  (out_dir / "decode_attention_breakdown.json").write_text(json.dumps(rows, indent=1))
  lines = [
    "# Where one call of ours spends its time",
    "",
    f"{jax.devices()[0].device_kind}, jax {jax.__version__}; CUPTI time of each kernel (fastest "
    "of ten calls one after another, taking the page copies in turn) and the steady-state time "
    "per call in a jitted batch of calls.",
    "",
    "| shape | q_len | per call us | sum of kernels us | kernels (us) |",
    "| --- | --- | --- | --- | --- |",
  ]
  for row in rows:
    total = sum(us for _, us in row["kernels"])
    lines.append(
      f"| {row['shape']} | {row['q_len']} | {row['wall_us']:.1f} | {total:.1f} "
      f"| {_listed(row['kernels'])} |"
    )
  markdown = "\n".join(lines) + "\n"
  (out_dir / "decode_attention_breakdown.md").write_text(markdown)
  print(markdown)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument(
    "--tune", action="store_true", help="only the tuning sweep (decode_attention_tuning.*)"
  )
  parser.add_argument("--quick", action="store_true", help="first section, B1 and B64 at 8k")
  parser.add_argument("--no-flashinfer", action="store_true", help="leave FlashInfer out")
  parser.add_argument(
    "--two-warpgroup-check", action="store_true", help="only G 12: 64-row tiles vs two warpgroups"
  )
  parser.add_argument(
    "--transposed-check",
    action="store_true",
    help="only: 64-row tiles against transposed scores (decode_attention_transposed.*)",
  )
  parser.add_argument(
    "--fp8-transposed-check",
    action="store_true",
    help="only: the same on fp8 pages (decode_attention_fp8_transposed.*)",
  )
  parser.add_argument(
    "--transposed-rows-check",
    action="store_true",
    help="only: 64-row against transposed tiles at 24-40 rows on 16-bit pages "
    "(decode_attention_transposed_rows.*)",
  )
  parser.add_argument(
    "--register-check",
    action="store_true",
    help="only: Q and P in registers against shared memory at B1-B8 "
    "(decode_attention_register_operands.*)",
  )
  parser.add_argument(
    "--fp8-registers-check",
    action="store_true",
    help="only: fp8 K and V through the staging block against registers "
    "(decode_attention_fp8_in_registers.*)",
  )
  parser.add_argument(
    "--fp8-overlap-check",
    action="store_true",
    help="only fp8 row tiles: one staging block against conversions overlapping the wgmmas "
    "(decode_attention_fp8_staging_overlap.*)",
  )
  parser.add_argument(
    "--deferred-sum-check",
    action="store_true",
    help="only: denominators summed every step or once, transposed tiles at q_len 1, then row "
    "and 128-row tiles (decode_attention_deferred_sum*.*)",
  )
  parser.add_argument(
    "--fp8-register-sweep",
    action="store_true",
    help="only: where fp8_in_registers pays, and its ring depth "
    "(decode_attention_fp8_register_sweep/)",
  )
  parser.add_argument(
    "--d64-stage-sweep",
    action="store_true",
    help="only: the ring depth of D 64 transposed tiles (decode_attention_d64_q1_stages/)",
  )
  parser.add_argument(
    "--page-ids-ahead-check",
    action="store_true",
    help="only: page ids read where used or a step ahead (decode_attention_page_ids_ahead/)",
  )
  parser.add_argument(
    "--producer-check",
    action="store_true",
    help="only: the 128-row tile with a producer warpgroup (decode_attention_producer_warpgroup.*)",
  )
  parser.add_argument(
    "--fp8-producer-check",
    action="store_true",
    help="only: fp8 pages beyond 64 rows, converting producer vs 64-row tiles "
    "(decode_attention_fp8_producer.*)",
  )
  parser.add_argument("--breakdown", action="store_true", help="only: time each kernel of a call")
  parser.add_argument(
    "--kernel-time",
    action="store_true",
    help="main grid: ours and FlashInfer also by CUPTI device time (kernel sums)",
  )
  parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
  parser.add_argument(
    "--time-budget",
    type=float,
    default=420.0,
    help="seconds after which no new shape is started (the rest is listed as skipped)",
  )
  parser.add_argument(
    "--only",
    nargs="+",
    default=None,
    help='run only the shapes named "SECTION NAME", in the order given, e.g. "fp8 KV B64 L32k" '
    '"G8 D128 B64 L32k"; with --tune, the sweeps labelled "SHAPE qQ_LEN GG[ DD][ fp8]", e.g. '
    '"B64 L32k q7 G8 fp8"',
  )
  parser.add_argument("--out", default=str(RESULTS))
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  checks = {  # flag: the config check it runs instead of the main grid
    "two_warpgroup_check": two_warpgroup_check,
    "fp8_registers_check": fp8_registers_check,
    "register_check": register_check,
    "fp8_register_sweep": fp8_register_sweep,
    "d64_stage_sweep": d64_stage_sweep,
    "fp8_overlap_check": fp8_overlap_check,
    "deferred_sum_check": deferred_sum_check,
    "page_ids_ahead_check": page_ids_ahead_check,
    "producer_check": producer_check,
    "fp8_producer_check": fp8_producer_check,
    "transposed_rows_check": transposed_rows_check,
  }
  for flag, check in checks.items():
    if getattr(args, flag):
      check(rng, out_dir, smoke=args.smoke)
      return
  if args.transposed_check or args.fp8_transposed_check:
    transposed_check(rng, out_dir, smoke=args.smoke, fp8=args.fp8_transposed_check)
    return
  if args.breakdown:
    breakdown(rng, out_dir)
    return

  started = time.perf_counter()
  version = None if args.no_flashinfer or args.smoke else flashinfer_version()
  if args.no_flashinfer:
    flashinfer_note = "left out (--no-flashinfer)"
  elif version is None:
    flashinfer_note = "not available (no flashinfer/torch with a GPU): the run goes on without it"
  else:
    flashinfer_note = f"flashinfer {version}"
  print("FlashInfer:", flashinfer_note, flush=True)
  read_tbps = None if args.smoke else measure_read_bandwidth()
  if read_tbps:
    print(f"read ceiling {read_tbps:.2f} TB/s", flush=True)
  meta = {
    "gpu": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    "setup": f"bf16, Hkv {NUM_KV_HEADS}, page {PAGE_SIZE}; G and D per section"
    + (", interpret-mode smoke run (not a measurement)" if args.smoke else ""),
    "flashinfer": flashinfer_note,
    "read_ceiling_tbps": read_tbps,  # shares below are of the datasheet figure
    "datasheet_tbps": datasheet_tbps(jax.devices()[0].device_kind),
    "timing": "jax: median steady-state time per call of a jitted batch of calls on distinct "
    "inputs (wall time of two back-to-back launches minus one); FlashInfer: CUDA events around "
    "the replay of a CUDA graph of back-to-back calls on distinct inputs; torch: CUDA events "
    "around back-to-back calls; warm-up excluded",
    "default_config": dataclasses.asdict(default_config(HEAD_DIM, PAGE_SIZE)),
    "default_config_fp8": dataclasses.asdict(default_config(HEAD_DIM, PAGE_SIZE, FP8)),
    "default_transposed_max_rows": DEFAULT_TRANSPOSED_MAX_ROWS,
    "transposed_max_rows_16bit_here": {  # by head dim, on this device
      str(d): transposed_max_rows(d, 2, gpu_device_kind()) for d in (64, 128)
    },
    "default_register_operands_min_pairs": DEFAULT_REGISTER_OPERANDS_MIN_PAIRS,
    "default_page_ids_ahead_transposed_min_pairs": DEFAULT_PAGE_IDS_AHEAD_TRANSPOSED_MIN_PAIRS,
    "default_fp8_in_registers": {
      "max_rows_by_head_dim": {str(d): n for d, n in DEFAULT_FP8_IN_REGISTERS_MAX_ROWS.items()},
      "min_pairs_d128": DEFAULT_FP8_IN_REGISTERS_MIN_PAIRS_D128,
      "stages_d128": FP8_IN_REGISTERS_STAGES_D128,
    },
  }
  rows, tuning = [], []
  name = "decode_attention_tuning" if args.tune else "decode_attention"

  def save():
    """Writes what has been measured so far (a run cut short keeps its finished shapes)."""
    meta["elapsed_s"] = round(time.perf_counter() - started, 1)
    (out_dir / f"{name}.json").write_text(
      json.dumps({"meta": meta, "rows": rows, "tuning": tuning}, indent=1)
    )
    (out_dir / f"{name}.md").write_text(render_markdown(meta, rows, tuning))

  meta["skipped"] = []
  if args.tune:
    tune(rng, tuning, save, smoke=args.smoke, only=args.only)
  else:
    shapes = benchmark_shapes(rng, args.quick, version is not None, args.smoke)
    if args.only is not None:
      by_name = {f"{shape.section} {shape.name}": shape for shape in shapes}
      unknown = [name for name in args.only if name not in by_name]
      if unknown:
        parser.error(f"--only: no shape named {unknown}; the shapes are {list(by_name)}")
      shapes = [by_name[name] for name in args.only]
    for shape in shapes:
      if time.perf_counter() - started > args.time_budget:
        meta["skipped"].append(f"{shape.section} {shape.name}")
        continue
      rows += run_shape(rng, shape, smoke=args.smoke, kernel_time=args.kernel_time)
      save()
      print(f"[{time.perf_counter() - started:.0f} s]", flush=True)
  save()
  print(render_markdown(meta, rows, tuning))


def tune(rng, tuning, save, smoke=False, only=None):
  """Our kernel under several tuning configs: the merge kernel where the KV is split, the
  chunking and ring on three shapes, the fp8 ring depth, and the 128-row two-warpgroup tile at
  G 12 where the KV does not fit in L2. ``only``: the sweeps to run, by label (in that order)."""
  configs = [
    TuningConfig(num_stages=s, block_kv=bk, num_chunks=c, balance_waves=w)
    for s, bk, c, w in [
      (2, 64, None, None),  # per-request chunks (the default before balance_waves)
      (2, 64, 16, None),
      (2, 64, None, 2),
      (2, 64, None, 4),  # the default
      (3, 64, None, 4),
      (1, 128, None, 4),
    ]
  ]
  fp8_configs = [  # ring depth (2, three items per SM, is the default at D 128), register layout
    *(TuningConfig(num_stages=s, balance_waves=4) for s in (2, 3, 4)),
    TuningConfig(num_stages=2, balance_waves=4, fp8_8bit_layout=True),
  ]
  # The merge and row unpacking in one kernel (off in the device-less default) on shapes that
  # split the KV.
  default = default_config(HEAD_DIM, PAGE_SIZE)
  merge = [default, dataclasses.replace(default, merge_kernel=True)]
  two_warpgroups = [default, dataclasses.replace(default, two_warpgroup_tiles=True)]
  # D 64: a K/V block of 64 positions is 8 KiB, so each pipeline step moves half the bytes of
  # D 128 for the same fixed costs; longer blocks, and shallower rings that fit more work items
  # on an SM (the default ring at D 64 is 4 stages).
  d64 = [default_config(64, PAGE_SIZE)] + [
    TuningConfig(num_stages=s, block_kv=bk, balance_waves=DEFAULT_BALANCE_WAVES)
    for s, bk in [(2, 64), (2, 128), (3, 128), (4, 128)]
  ]
  ragged = rng.integers(1024, 32768 + 1, size=64)
  sweeps = [  # (shape, lengths, q_len, fp8, G, D, configs)
    ("B1 L8k", [8192], 1, False, GROUP, HEAD_DIM, merge),
    ("B1 L8k", [8192], 7, False, GROUP, HEAD_DIM, merge),
    ("B8 L32k", [32768] * 8, 1, False, GROUP, HEAD_DIM, merge),
    ("B64 ragged 1k..32k", ragged, 7, False, GROUP, HEAD_DIM, merge),
    ("B64 L32k", [32768] * 64, 7, False, GROUP, HEAD_DIM, configs),
    ("B8 L32k", [32768] * 8, 1, False, GROUP, HEAD_DIM, configs),
    ("B64 ragged 1k..32k", ragged, 7, False, GROUP, HEAD_DIM, configs),
    ("B64 L32k", [32768] * 64, 7, True, GROUP, HEAD_DIM, fp8_configs),
    ("B8 L32k", [32768] * 8, 7, False, GLM_GROUP, HEAD_DIM, two_warpgroups),
    ("B64 L32k", [32768] * 64, 7, False, GLM_GROUP, HEAD_DIM, two_warpgroups),
    ("B64 L32k", [32768] * 64, 1, False, GROUP, 64, d64),
    ("B8 L32k", [32768] * 8, 1, False, GROUP, 64, d64),
    ("B64 L32k", [32768] * 64, 7, False, GROUP, 64, d64),
  ]
  if smoke:
    sweeps = [
      ("B2 L200", [200, 77], 3, False, GROUP, HEAD_DIM, merge),
      ("B2 L200", [200, 77], 3, True, GROUP, HEAD_DIM, configs[:1]),
      ("B2 L200", [200, 77], 1, False, GROUP, 64, d64[2:3]),
    ]

  def label(name, q_len, fp8, group, head_dim):
    return (
      f"{name} q{q_len} G{group}"
      + (f" D{head_dim}" if head_dim != HEAD_DIM else "")
      + (" fp8" if fp8 else "")
    )

  if only is not None:  # every sweep of each label (a shape can have several), in that order
    labels = [label(name, q, fp8, g, d) for name, _, q, fp8, g, d, _ in sweeps]
    unknown = [name for name in only if name not in labels]
    if unknown:
      raise ValueError(f"--only: no sweep labelled {unknown}; the sweeps are {labels}")
    sweeps = [
      sweep for name in only for sweep, at in zip(sweeps, labels, strict=True) if at == name
    ]
  timing = {"reps": 1, "warmup": 0} if smoke else {}
  for name, seq_lens, q_len, fp8, group, head_dim, sweep in sweeps:
    batch = make_batch(rng, seq_lens, head_dim, pad_to=8 if smoke else 128)
    if fp8:
      batch = to_fp8(batch)
    count = 1 if smoke else inner_count(batch.kv_bytes)
    queries = fresh_queries(rng, len(seq_lens), q_len, count, group=group, head_dim=head_dim)
    for config in sweep:
      entry = {
        "shape": name + (" fp8" if fp8 else ""),
        "q_len": q_len,
        "G": group,
        "D": head_dim,
        "config": dataclasses.asdict(config),
      }
      try:
        seconds = time_ours(batch, queries, config, interpret=smoke, **timing)
        entry.update(us=seconds * 1e6, tbps=batch.kv_bytes / seconds / 1e12)
      except Exception as error:  # reported, not fatal
        entry["error"] = f"{type(error).__name__}: {str(error)[:300]}"
      print("tune", entry, flush=True)
      tuning.append(entry)
    del batch
    save()


def _cell(entry):
  if entry is None:
    return "n/a"
  return f"{entry['us']:.1f} us / {entry['tbps']:.2f}" if "us" in entry else "fails"


def _ratio(row, slower, faster):
  """How many times ``faster``'s time fits in ``slower``'s (> 1: ``faster`` is faster)."""
  a, b = row.get(slower, {}), row.get(faster, {})
  return f"{a['us'] / b['us']:.2f}x" if "us" in a and "us" in b else "n/a"


def _number(value):
  return "n/a" if value is None else f"{value:.3g}"


def render_markdown(meta, rows, tuning):
  lines = [
    "# Paged decode attention (packed-row MTP) on one GPU",
    "",
    f"{meta['gpu']}, jax {meta['jax']}, {meta['date']}; {meta['setup']}; "
    f"FlashInfer: {meta['flashinfer']}.",
    f"Timing: {meta['timing']}. Effective bandwidth = unique KV bytes / time (TB/s); "
    f"share of the datasheet's {meta['datasheet_tbps'] or 'n/a'} TB/s; read ceiling measured in "
    "the same process: "
    + (
      f"{ceiling:.2f} TB/s." if (ceiling := meta["read_ceiling_tbps"]) else "not valid in this run."
    ),
    "Ours runs its default tuning: "
    + ", ".join(f"{k}={v}" for k, v in meta.get("default_config", {}).items())
    + " (fp8 pages: "
    + (
      ", ".join(
        f"{k}={v}"
        for k, v in meta.get("default_config_fp8", {}).items()
        if meta["default_config"].get(k) != v
      )
      or "the same"
    )
    + f"); transposed scores (transposed_scores=True) for up to "
    f"{meta.get('default_transposed_max_rows', 'n/a')} packed rows (G x q_len), 16-bit or "
    "fp8 pages"
    + (
      f" (16-bit pages on this device: up to {here['128']} rows at D 128, {here['64']} at D 64)"
      if (here := meta.get("transposed_max_rows_16bit_here"))
      and {here["128"], here["64"]} != {meta["default_transposed_max_rows"]}
      else ""
    )
    + (
      f"; from {pairs} (request, KV head) pairs Q and P reach wgmma from registers "
      "(operands_in_registers=True) and more than 64 rows on 16-bit pages take one 128-row tile "
      "(two_warpgroup_tiles=True), below that operands_in_registers=False"
      if (pairs := meta.get("default_register_operands_min_pairs"))
      else ""
    )
    + (
      f"; fp8 pages with up to {fp8['max_rows_by_head_dim']['128']} rows at D 128 (from "
      f"{fp8['min_pairs_d128']} pairs, {fp8['stages_d128']} stages) and "
      f"{fp8['max_rows_by_head_dim']['64']} at D 64 convert K and V in registers "
      "(fp8_in_registers=True), in the transposed tile"
      if (fp8 := meta.get("default_fp8_in_registers"))
      else ""
    )
    + ". Cells: time per call / effective TB/s. 'vs X' is X's time / ours (> 1: ours is "
    "faster). 'diff vs XLA' is the largest |ours - XLA reference| on the first input over the "
    f"first {XLA_CHECK_REQUESTS} requests; 'diff vs FlashInfer' over the whole first input.",
    f"Whole run: {meta.get('elapsed_s', 0):.0f} s."
    + (
      f" Not run (time budget spent): {', '.join(skipped)}."
      if (skipped := meta.get("skipped"))
      else ""
    ),
  ]
  base = [row for row in rows if row["section"] == "G8 D128"]
  if base:
    lines += [
      "",
      "## G 8, D 128: all contenders",
      "",
      "| shape | q_len | ours | % of datasheet | FlashInfer | Triton per row | XLA | torch SDPA "
      "| vs FlashInfer | vs Triton | vs XLA | vs torch | diff vs XLA | diff vs FlashInfer |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in base:
      ours = row["ours"]
      share = _share(ours["tbps"], meta["datasheet_tbps"]) if "us" in ours else "-"
      contenders = ("flashinfer", "triton_per_row", "xla", "torch_sdpa")
      cells = [_cell(row.get(c)) for c in contenders]
      ratios = [_ratio(row, c, "ours") for c in contenders]
      lines.append(
        f"| {row['shape']} | {row['q_len']} | {_cell(ours)} | {share} | "
        + " | ".join(cells + ratios)
        + f" | {_number(row.get('max_abs_diff_vs_xla'))} "
        f"| {_number(row.get('flashinfer', {}).get('max_abs_diff_vs_ours'))} |"
      )
  for section, title in (
    ("GLM-4.5 G12", "GLM-4.5 head layout: G 12 (96 query / 8 KV heads), D 128"),
    ("D64", "D 64, G 8"),
  ):
    section_rows = [row for row in rows if row["section"] == section]
    if not section_rows:
      continue
    lines += [
      "",
      f"## {title}: ours and FlashInfer",
      "",
      "| shape | q_len | packed rows | ours | FlashInfer | vs FlashInfer | diff vs XLA "
      "| diff vs FlashInfer |",
      "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in section_rows:
      lines.append(
        f"| {row['shape']} | {row['q_len']} | {row['G'] * row['q_len']} | {_cell(row['ours'])} "
        f"| {_cell(row.get('flashinfer'))} | {_ratio(row, 'flashinfer', 'ours')} "
        f"| {_number(row.get('max_abs_diff_vs_xla'))} "
        f"| {_number(row.get('flashinfer', {}).get('max_abs_diff_vs_ours'))} |"
      )
  fp8_rows = [row for row in rows if row["section"] == "fp8 KV"]
  if fp8_rows:
    lines += [
      "",
      "## fp8 KV pages (e4m3, one scale per KV head): ours on the same values in bf16 and fp8",
      "",
      f"TB/s of each row counts its own pages' bytes (fp8: half). Target: bf16 / fp8 time "
      f"at least {FP8_TARGET_RATIO}.",
      "",
      "| shape | q_len | ours bf16 | ours fp8 | bf16 / fp8 time | diff vs XLA bf16 "
      "| diff vs XLA fp8 |",
      "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in fp8_rows:
      lines.append(
        f"| {row['shape']} | {row['q_len']} | {_cell(row['ours'])} | {_cell(row.get('ours_fp8'))} "
        f"| {_ratio(row, 'ours', 'ours_fp8')} | {_number(row.get('max_abs_diff_vs_xla'))} "
        f"| {_number(row.get('max_abs_diff_vs_xla_fp8'))} |"
      )
  timed_by_kernels = [row for row in rows if "kernel_us" in row["ours"]]
  if timed_by_kernels:
    lines += [
      "",
      "## Device time by CUPTI (`--kernel-time`): ours and FlashInfer",
      "",
      "The sum of the kernels of one call (each kernel's fastest of 10 back-to-back calls, the "
      "calls one after another): the time the device is busy, without the gaps between kernels, "
      "the host's launch path or the overlap of the calls of one timed program, which move the "
      "timings above where a call is short. 'vs FlashInfer' is FlashInfer's sum / ours.",
      "",
      "| section | shape | q_len | ours us (kernels) | FlashInfer us (kernels) | vs FlashInfer "
      "| ours' kernels (us) | FlashInfer's kernels (us) |",
      "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in timed_by_kernels:
      ours, theirs = row["ours"], row.get("flashinfer", {})
      cells = [
        f"{entry['kernel_us']:.1f} ({entry['kernel_count']})" if "kernel_us" in entry else "n/a"
        for entry in (ours, theirs)
      ]
      ratio = f"{theirs['kernel_us'] / ours['kernel_us']:.2f}x" if "kernel_us" in theirs else "n/a"
      lines.append(
        f"| {row['section']} | {row['shape']} | {row['q_len']} | {cells[0]} | {cells[1]} "
        f"| {ratio} | {_listed(ours.get('kernels', []))} | {_listed(theirs.get('kernels', []))} |"
      )
  lines += ["", "Time of ours at the longest q_len / at q_len 1:", ""]
  by_shape = {}
  for row in rows:
    if "us" in row["ours"]:
      key = f"{row['shape']} (G {row['G']}, D {row['D']})"
      by_shape.setdefault(key, {})[row["q_len"]] = row["ours"]["us"]
  for shape, times in by_shape.items():
    if 1 in times and len(times) > 1:
      longest = max(times)
      lines.append(f"- {shape}: q_len {longest} / 1 = {times[longest] / times[1]:.2f}")
  failures = [
    (row["shape"], row["q_len"], name + suffix, entry[key])
    for row in rows
    for name, entry in row.items()
    if isinstance(entry, dict)
    for key, suffix in (("error", ""), ("kernel_error", " (device time)"))
    if key in entry
  ]
  if failures:
    lines += ["", "Contenders that failed:", ""]
    lines += [f"- {shape} q_len {q}: {name}: {error}" for shape, q, name, error in failures]
  if tuning:
    lines += ["", "## Tuning sweep (ours)", ""]
    lines += ["| shape | q_len | G | D | config | time | TB/s |", "| --- " * 7 + "|"]
    for entry in tuning:
      config = ", ".join(f"{k}={v}" for k, v in entry["config"].items())
      result = f"{entry['us']:.1f} us | {entry['tbps']:.2f}" if "us" in entry else "fails | -"
      group, head_dim = entry.get("G", GROUP), entry.get("D", HEAD_DIM)
      lines.append(
        f"| {entry['shape']} | {entry['q_len']} | {group} | {head_dim} | {config} | {result} |"
      )
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
