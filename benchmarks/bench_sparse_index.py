"""Sparse-index conversion on one GPU: the Mosaic GPU kernel vs the fused XLA expression.

Shapes of GLM-5 sparse MLA decode with MTP: top-k 2048, block 64, four tokens per
request (q_len 4), context lengths drawn in [1k, 64k) tokens (shorter contexts pad
their top-k rows with -1), block tables shuffled over a larger pool. Contenders
run side by side in one process on the same inputs and are checked against NumPy
before they are timed.

Timing, two ways, both on ``SETS`` distinct input sets per jitted program (so the
inputs are not served from L2 by the previous call):

* ``kernel_us``: device-side kernel time from CUPTI (Mosaic GPU's profiler), the
  sum of the op's kernels per call; median over repetitions, warm-up excluded.
* ``step_us``: the op's share of a jitted program, launch gaps included:
  (wall(2 * SETS calls) - wall(SETS calls)) / SETS, which cancels dispatch and
  synchronisation; median over repetitions.

Effective bandwidth counts the bytes that must move: top-k read plus physical
slots written (8 * T * K) plus request ids and counts (8 * T); the block-table
rows (L2-resident) are left out, as in the issue's 15 us figure.

Usage: ``python benchmarks/bench_sparse_index.py [--out DIR]``.
"""

import argparse
import datetime
import functools
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

from jaxspec.kernels import convert_topk_to_physical
from jaxspec.kernels.sparse_index import mosaic_gpu

TOKEN_COUNTS = (64, 512, 4096)
TOPK = 2048
BLOCK_SIZE = 64
TOKENS_PER_REQUEST = 4
MAX_CONTEXT = 65536
SETS = 8
REPEATS = 30
PEAK_TBPS = 4.5  # the issue's figure for the H200's usable HBM bandwidth

CONTENDERS = {
  "xla": dict(impl="xla"),
  "pallas_smem_table": dict(impl="pallas", config=mosaic_gpu.TuningConfig()),
  "pallas_gmem_table": dict(
    impl="pallas", config=mosaic_gpu.TuningConfig(stage_table_in_smem=False)
  ),
}


def make_inputs(rng, num_tokens):
  num_requests = max(num_tokens // TOKENS_PER_REQUEST, 1)
  max_blocks = MAX_CONTEXT // BLOCK_SIZE
  pool = rng.permutation(2 * num_requests * max_blocks)
  block_table = pool[: num_requests * max_blocks].reshape(num_requests, max_blocks)
  req_ids = np.arange(num_tokens) // TOKENS_PER_REQUEST % num_requests
  seq_lens = rng.integers(1024, MAX_CONTEXT, num_requests)[req_ids]  # [T]
  topk = (rng.random((num_tokens, TOPK)) * seq_lens[:, None]).astype(np.int64)
  # Contexts shorter than top-k: the indexer pads the tail of the row with -1.
  topk = np.where(np.arange(TOPK)[None, :] < seq_lens[:, None], topk, -1)
  return tuple(a.astype(np.int32) for a in (req_ids, block_table, topk))


def numpy_reference(req_ids, block_table, topk):
  block, offset = topk // BLOCK_SIZE, topk % BLOCK_SIZE
  valid = (topk >= 0) & (block < block_table.shape[1])
  entry = block_table.astype(np.int64)[req_ids[:, None], np.where(valid, block, 0)]
  return np.where(valid, entry * BLOCK_SIZE + offset, -1), valid.sum(axis=1)


def program(kwargs, copies):
  """One jitted program converting `copies` input sets back to back."""
  convert = functools.partial(convert_topk_to_physical, block_size=BLOCK_SIZE, **kwargs)
  return jax.jit(lambda sets: [convert(*inputs) for inputs in sets[:copies]])


def wall_us(fn, sets):
  start = time.perf_counter()
  jax.block_until_ready(fn(sets))
  return (time.perf_counter() - start) * 1e6


def bench_kernel_vs_xla():
  rng = np.random.default_rng(0)
  rows = []
  for num_tokens in TOKEN_COUNTS:
    host_sets = [make_inputs(rng, num_tokens) for _ in range(2 * SETS)]
    sets = [tuple(jnp.asarray(a) for a in s) for s in host_sets]
    want = numpy_reference(*host_sets[0])
    moved_bytes = 8 * num_tokens * TOPK + 8 * num_tokens
    row = {"tokens": num_tokens, "moved_bytes": moved_bytes}
    for name, kwargs in CONTENDERS.items():
      single, double = program(kwargs, SETS), program(kwargs, 2 * SETS)
      physical, counts = single(sets)[0]
      np.testing.assert_array_equal(np.asarray(physical), want[0], err_msg=name)
      np.testing.assert_array_equal(np.asarray(counts), want[1], err_msg=name)
      jax.block_until_ready(double(sets))  # warm-up: compilation and first launch
      try:
        _, per_kernel = profiler.measure(single, aggregate=False)(sets)
        _, kernel_ms = profiler.measure(single, iterations=REPEATS)(sets)
        kernel_us = statistics.median(kernel_ms) * 1e3 / SETS
      except RuntimeError as error:  # no CUPTI on this machine: report the step time only
        print(f"{name}: CUPTI timing unavailable ({error})")
        per_kernel, kernel_us = [], float("nan")
      steps = [(wall_us(double, sets) - wall_us(single, sets)) / SETS for _ in range(REPEATS)]
      step_us = statistics.median(steps)
      row[name] = {
        "kernel_us": kernel_us,
        "step_us": step_us,
        "kernels_per_call": len(per_kernel) // SETS,
        "kernel_names": sorted({kernel for kernel, _ in per_kernel}),
        "effective_TBps": moved_bytes / kernel_us / 1e6,
      }
    for name in CONTENDERS:
      if name != "xla":
        row[name]["speedup_kernel"] = row["xla"]["kernel_us"] / row[name]["kernel_us"]
        row[name]["speedup_step"] = row["xla"]["step_us"] / row[name]["step_us"]
    rows.append(row)
  return rows


def markdown(result):
  lines = [
    "# Sparse-index conversion: Mosaic GPU kernel vs fused XLA",
    "",
    f"{result['gpu']}, jax {result['jax']}, {result['date']}. Top-k {TOPK}, block "
    f"{BLOCK_SIZE}, {TOKENS_PER_REQUEST} tokens per request, contexts < {MAX_CONTEXT}. "
    "kernel = CUPTI kernel time per call; step = share of a jitted program incl. launch "
    "gaps; TB/s = (8 T K + 8 T) bytes / kernel time. Medians of "
    f"{REPEATS} runs over {SETS} rotating input sets.",
    "",
    f"floor = bytes that must move at {PEAK_TBPS} TB/s.",
    "",
    "| T | contender | kernels | kernel us | step us | floor us | TB/s | speed-up kernel / step |",
    "| --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for row in result["kernel_vs_xla"]:
    for name in CONTENDERS:
      entry = row[name]
      speedup = (
        f"{entry['speedup_kernel']:.2f}x / {entry['speedup_step']:.2f}x" if name != "xla" else "1"
      )
      lines.append(
        f"| {row['tokens']} | {name} | {entry['kernels_per_call']} | "
        f"{entry['kernel_us']:.1f} | {entry['step_us']:.1f} | "
        f"{row['moved_bytes'] / PEAK_TBPS / 1e6:.1f} | "
        f"{entry['effective_TBps']:.2f} | {speedup} |"
      )
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=pathlib.Path(__file__).parent / "results", type=pathlib.Path)
  parser.add_argument(
    "--table-only", action="store_true", help="rewrite the markdown from the JSON in --out"
  )
  args = parser.parse_args()
  if args.table_only:
    result = json.loads((args.out / "sparse_index.json").read_text())
    (args.out / "sparse_index.md").write_text(markdown(result))
    return
  result = {
    "gpu": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "date": datetime.date.today().isoformat(),
    "kernel_vs_xla": bench_kernel_vs_xla(),
  }
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "sparse_index.json").write_text(json.dumps(result, indent=2) + "\n")
  table = markdown(result)
  (args.out / "sparse_index.md").write_text(table)
  print(table)


if __name__ == "__main__":
  main()
