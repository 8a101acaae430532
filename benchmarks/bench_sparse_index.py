"""Sparse-index conversion on one GPU: Mosaic GPU kernel variants vs the fused XLA expression.

Shapes of GLM-5 sparse MLA decode with MTP: block 64, four tokens per request (q_len 4), context
lengths drawn in [1k, 64k) tokens (shorter contexts pad their top-k rows with -1), block tables
shuffled over a larger pool; top-k K in {2048 (GLM-5), 2047 (off every tile and not a multiple
of 4), 512 and 128 (vLLM's test widths)} at T in {64, 512, 4096} tokens. Contenders run side by
side in one process on the same inputs and are checked against NumPy before they are timed:

* at K = 2048, every kernel variant of ``VARIANTS`` (``TuningConfig`` alternatives: one block
  per token group or a persistent grid of ``blocks_per_sm`` blocks per SM, ``num_stages`` SMEM
  slots, block table staged in SMEM or read in place);
* at the other K, XLA, the default configuration and the variants of ``ANY_TOPK_VARIANTS``.

Timing, two ways, both on ``SETS`` distinct input sets per jitted program (so the inputs are not
served from L2 by the previous call):

* ``kernel_us``: device-side kernel time from CUPTI (Mosaic GPU's profiler), the sum of the op's
  kernels per call; median over repetitions, warm-up excluded.
* ``step_us``: the op's share of a jitted program, launch gaps included:
  (wall(2 * SETS calls) - wall(SETS calls)) / SETS, which cancels dispatch and synchronisation;
  median over repetitions.

Effective bandwidth counts the bytes that must move: top-k read plus physical slots written
(8 * T * K) plus request ids and counts (8 * T); the block-table rows (L2-resident) are left out,
as in the issue's 14.9 us floor at T = 4096, K = 2048.
At T = 4096, K = 2048 the same run also times two *copy ceilings*, the conversion's traffic
without its lookups, so the kernel can be judged against what this GPU does for such traffic: XLA
reading the top-k and writing an int32 array of its shape in one fused elementwise kernel, and,
where torch with CUDA is importable, the CUDA driver's device-to-device memcpy of the same bytes
(``torch.Tensor.copy_``, its ``Memcpy DtoD`` time from torch's CUPTI-based profiler); and where
Triton is importable too, the fastest of a sweep of plain-load Triton copies and of the whole
conversion written as plain vector loads and stores (``triton_index_contenders.py``).

Usage: ``python benchmarks/bench_sparse_index.py [--out DIR] [--target-only] [--table-only]``;
about 3 minutes on an H200. ``--target-only`` times T = 4096, K = 2048 only (under a minute) and
writes ``sparse_index_target.{json,md}`` instead of ``sparse_index.{json,md}``.
"""

import argparse
import dataclasses
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
from jaxspec.kernels.sparse_index import mosaic_gpu, reference

TOKEN_COUNTS = (64, 512, 4096)
TOPK = 2048  # GLM-5's top-k: every variant is timed here
OTHER_TOPKS = (2047, 512, 128)
TARGET = (4096, 2048)  # (T, K) of the target
TARGET_US = 16.5
BLOCK_SIZE = 64
TOKENS_PER_REQUEST = 4
MAX_CONTEXT = 65536
SETS = 8
REPEATS = 30
PEAK_TBPS = 4.5  # the issue's figure for the H200's usable HBM bandwidth

TuningConfig = mosaic_gpu.TuningConfig
VARIANTS = {
  "pallas_smem_table": TuningConfig(),  # the default configuration
  "pallas_gmem_table": TuningConfig(stage_table_in_smem=False),
  "pallas_persistent_4x3": TuningConfig(blocks_per_sm=4, num_stages=3),
  "pallas_persistent_8x2": TuningConfig(blocks_per_sm=8, num_stages=2),
  "pallas_persistent_4x3_gmem": TuningConfig(
    blocks_per_sm=4, num_stages=3, stage_table_in_smem=False
  ),
  "pallas_persistent_8x2_chunk1024": TuningConfig(blocks_per_sm=8, num_stages=2, chunk=1024),
  "pallas_chunk1024": TuningConfig(chunk=1024),  # one block per token, two pipelined segments
  "pallas_persistent_4x3_contiguous": TuningConfig(
    blocks_per_sm=4, num_stages=3, contiguous_groups=True
  ),
  "pallas_persistent_4x3_gmem_contiguous": TuningConfig(
    blocks_per_sm=4, num_stages=3, stage_table_in_smem=False, contiguous_groups=True
  ),
  "pallas_persistent_8x2_gmem_contiguous": TuningConfig(
    blocks_per_sm=8, num_stages=2, stage_table_in_smem=False, contiguous_groups=True
  ),
}
ANY_TOPK_VARIANTS = (
  "pallas_smem_table",
  "pallas_persistent_4x3",
  "pallas_persistent_8x2_gmem_contiguous",
)
DEFAULT = "pallas_smem_table"
# time_torch_ceilings' entries -> the target row's keys.
CEILING_KEYS = {
  "memcpy": "memcpy_ceiling",
  "triton_copy": "triton_copy_ceiling",
  "triton_convert": "triton_convert",
}
assert VARIANTS[DEFAULT] == mosaic_gpu.default_config()


def contenders_for(topk_size):
  names = VARIANTS if topk_size == TOPK else ANY_TOPK_VARIANTS
  return {"xla": dict(impl="xla")} | {
    name: dict(impl="pallas", config=VARIANTS[name]) for name in names
  }


def make_inputs(rng, num_tokens, topk_size):
  num_requests = max(num_tokens // TOKENS_PER_REQUEST, 1)
  max_blocks = MAX_CONTEXT // BLOCK_SIZE
  pool = rng.permutation(2 * num_requests * max_blocks)
  block_table = pool[: num_requests * max_blocks].reshape(num_requests, max_blocks)
  req_ids = np.arange(num_tokens) // TOKENS_PER_REQUEST % num_requests
  seq_lens = rng.integers(1024, MAX_CONTEXT, num_requests)[req_ids]  # [T]
  topk = (rng.random((num_tokens, topk_size)) * seq_lens[:, None]).astype(np.int64)
  # Contexts shorter than top-k: the indexer pads the tail of the row with -1.
  topk = np.where(np.arange(topk_size)[None, :] < seq_lens[:, None], topk, -1)
  return tuple(a.astype(np.int32) for a in (req_ids, block_table, topk))


def numpy_reference(req_ids, block_table, topk):
  """In int64; every entry of these tables is in range and every request id is a row."""
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


def copy_program(copies):
  """One jitted program that reads each set's top-k and writes an int32 array of its shape (one
  fused elementwise kernel per set): the top-k traffic of a conversion, with no lookup."""
  return jax.jit(lambda sets: [jnp.bitwise_xor(inputs[2], 1) for inputs in sets[:copies]])


def time_contender(kwargs, sets, want, name):
  single, double = program(kwargs, SETS), program(kwargs, 2 * SETS)
  physical, counts = single(sets)[0]
  np.testing.assert_array_equal(np.asarray(physical), want[0], err_msg=name)
  np.testing.assert_array_equal(np.asarray(counts), want[1], err_msg=name)
  return time_programs(single, double, sets, name)


def time_copy_ceiling(sets, num_tokens, topk_size):
  """CUPTI time of XLA's read-and-write of the top-k bytes alone (see ``copy_program``)."""
  single, double = copy_program(SETS), copy_program(2 * SETS)
  copied = np.asarray(single(sets)[0])
  np.testing.assert_array_equal(copied, np.asarray(sets[0][2]) ^ 1, err_msg="copy")
  entry = time_programs(single, double, sets, "copy")
  entry["effective_TBps"] = 8 * num_tokens * topk_size / entry["kernel_us"] / 1e6
  return entry


def _torch_device_us(launch, count: int) -> tuple[float, list[str]]:
  """Median device time of ``launch(i)`` for i in range(count), each ``REPEATS`` times, from
  torch's CUPTI-based profiler; and the kernels' names. One device event per launch, or the
  timing would mean something else."""
  import torch

  torch.cuda.synchronize()
  with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(REPEATS):
      for i in range(count):
        launch(i)
    torch.cuda.synchronize()
  events = [e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0]
  if len(events) != REPEATS * count:
    raise RuntimeError(f"{len(events)} device events for {REPEATS * count} launches")
  return statistics.median(e.device_time for e in events), sorted({e.name for e in events})


def time_torch_ceilings(host_sets, want) -> dict | None:
  """Where torch with CUDA is importable, on the first ``SETS`` input sets: the CUDA driver's
  device-to-device memcpy of the top-k bytes into a fresh array (torch ``copy_``), and, with
  Triton, the fastest of ``triton_index_contenders``' plain-load copies and conversions (every
  output checked; the conversion against NumPy). None without torch and CUDA. Run after every
  JAX contender: once torch's profiler has held CUPTI, Mosaic GPU's profiler cannot subscribe to
  it."""
  try:
    import torch
  except ImportError:
    return None
  if not torch.cuda.is_available():
    return None
  inputs = [tuple(torch.from_numpy(a).cuda() for a in s) for s in host_sets[:SETS]]
  num_tokens, topk_size = host_sets[0][2].shape
  traffic = 8 * num_tokens * topk_size

  def entry(launch, check, **extra):
    for i in range(SETS):
      launch(i)
    check()
    kernel_us, names = _torch_device_us(launch, SETS)
    return (
      {"kernel_us": kernel_us, "effective_TBps": traffic / kernel_us / 1e6}
      | extra
      | {"kernel_names": names}
    )

  copies = [torch.empty_like(s[2]) for s in inputs]
  ceilings = {
    "memcpy": entry(
      lambda i: copies[i].copy_(inputs[i][2]),
      lambda: _require(
        all(torch.equal(c, s[2]) for c, s in zip(copies, inputs, strict=True)), "memcpy"
      ),
    )
  }
  try:
    import triton_index_contenders as tic
  except ImportError:  # no Triton: the memcpy alone
    return ceilings
  flipped = [torch.empty_like(s[2]) for s in inputs]

  def check_copy():
    _require(all(torch.equal(f, s[2] ^ 1) for f, s in zip(flipped, inputs, strict=True)), "copy")

  copy_configs = [c for c in tic.COPY_CONFIGS if (num_tokens * topk_size) % c[0] == 0]
  ceilings["triton_copy"] = min(
    (
      entry(
        lambda i, config=config: tic.copy(inputs[i][2], flipped[i], config),
        check_copy,
        config=config,
        configs_swept=len(copy_configs),
      )
      for config in copy_configs
    ),
    key=lambda e: e["kernel_us"],
  )
  physical = [torch.empty_like(s[2]) for s in inputs]
  counts = [torch.empty(num_tokens, dtype=torch.int32, device="cuda") for _ in inputs]
  max_entry = reference.max_table_entry(BLOCK_SIZE, BLOCK_SIZE)

  def convert(i, config):
    tic.convert(
      *inputs[i], physical[i], counts[i], block_size=BLOCK_SIZE, max_entry=max_entry, config=config
    )

  def check_conversion():
    np.testing.assert_array_equal(physical[0].cpu().numpy(), want[0], err_msg="triton convert")
    np.testing.assert_array_equal(counts[0].cpu().numpy(), want[1], err_msg="triton convert")

  convert_configs = [c for c in tic.CONVERT_CONFIGS if topk_size % min(c[0], topk_size) == 0]
  ceilings["triton_convert"] = min(
    (
      entry(
        functools.partial(convert, config=config),
        check_conversion,
        config=config,
        configs_swept=len(convert_configs),
      )
      for config in convert_configs
    ),
    key=lambda e: e["kernel_us"],
  )
  return ceilings


def _require(ok: bool, name: str) -> None:
  if not ok:
    raise RuntimeError(f"{name}: an output differs from what it must be")


def time_programs(single, double, sets, name):
  jax.block_until_ready(double(sets))  # warm-up: compilation and first launch
  try:
    _, per_kernel = profiler.measure(single, aggregate=False)(sets)
    _, kernel_ms = profiler.measure(single, iterations=REPEATS)(sets)
    kernel_us = statistics.median(kernel_ms) * 1e3 / SETS
  except RuntimeError as error:  # no CUPTI on this machine: report the step time only
    print(f"{name}: CUPTI timing unavailable ({error})")
    per_kernel, kernel_us = [], float("nan")
  steps = [(wall_us(double, sets) - wall_us(single, sets)) / SETS for _ in range(REPEATS)]
  return {
    "kernel_us": kernel_us,
    "step_us": statistics.median(steps),
    "kernels_per_call": len(per_kernel) // SETS,
    "kernel_names": sorted({kernel for kernel, _ in per_kernel}),
  }


def make_sets(rng, num_tokens, topk_size):
  """``2 * SETS`` input sets (host arrays): a program of ``2 * SETS`` calls reads each once."""
  return [make_inputs(rng, num_tokens, topk_size) for _ in range(2 * SETS)]


def bench_shape(host_sets):
  num_tokens, topk_size = host_sets[0][2].shape
  sets = [tuple(jnp.asarray(a) for a in s) for s in host_sets]
  want = numpy_reference(*host_sets[0])
  moved_bytes = 8 * num_tokens * topk_size + 8 * num_tokens
  row = {"tokens": num_tokens, "topk": topk_size, "moved_bytes": moved_bytes}
  if (num_tokens, topk_size) == TARGET:
    row["copy_ceiling"] = time_copy_ceiling(sets, num_tokens, topk_size)
    print(f"T={num_tokens:5d} K={topk_size:5d} copy ceiling: {row['copy_ceiling']}", flush=True)
  for name, kwargs in contenders_for(topk_size).items():
    started = time.perf_counter()
    entry = time_contender(kwargs, sets, want, name)
    entry["effective_TBps"] = moved_bytes / entry["kernel_us"] / 1e6
    if name != "xla":
      entry["speedup_kernel"] = row["xla"]["kernel_us"] / entry["kernel_us"]
      entry["speedup_step"] = row["xla"]["step_us"] / entry["step_us"]
    row[name] = entry
    print(
      f"T={num_tokens:5d} K={topk_size:5d} {name:34s} kernel {entry['kernel_us']:7.1f} us  "
      f"step {entry['step_us']:7.1f} us  ({time.perf_counter() - started:.1f} s)",
      flush=True,
    )
  return row


def pallas_names(row):
  return [name for name in row if name.startswith("pallas_")]


def best_variant(row):
  return min(pallas_names(row), key=lambda name: row[name]["kernel_us"])


def markdown(result):
  lines = [
    "# Sparse-index conversion: Mosaic GPU kernel variants vs fused XLA",
    "",
    f"{result['gpu']}, jax {result['jax']}, {result['date']}. Block {BLOCK_SIZE}, "
    f"{TOKENS_PER_REQUEST} tokens per request, contexts < {MAX_CONTEXT}. kernel = CUPTI kernel "
    "time per call; step = share of a jitted program incl. launch gaps; TB/s = (8 T K + 8 T) "
    f"bytes / kernel time; floor = those bytes at {PEAK_TBPS} TB/s. Medians of {REPEATS} runs "
    f"over {SETS} rotating input sets. Variants (TuningConfig fields):",
    "",
  ]
  for name, fields in result["variants"].items():
    lines.append(f"- `{name}`: {fields}")
  lines += [
    "",
    "| T | K | contender | kernels | kernel us | step us | floor us | TB/s "
    "| speed-up kernel / step |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  rows = result["kernel_vs_xla"] + result["any_topk"]
  for row in rows:
    for name in ["xla", *pallas_names(row)]:
      entry = row[name]
      speedup = (
        f"{entry['speedup_kernel']:.2f}x / {entry['speedup_step']:.2f}x" if name != "xla" else "1"
      )
      lines.append(
        f"| {row['tokens']} | {row.get('topk', TOPK)} | {name} | {entry['kernels_per_call']} | "
        f"{entry['kernel_us']:.1f} | {entry['step_us']:.1f} | "
        f"{row['moved_bytes'] / PEAK_TBPS / 1e6:.1f} | {entry['effective_TBps']:.2f} | {speedup} |"
      )
  lines += [
    "",
    "Summary (kernel us): the default configuration, the fastest variant, and the target "
    f"(<= {TARGET_US} us at T = {TARGET[0]}, K = {TARGET[1]}).",
    "",
    "| T | K | floor | xla | default | fastest variant | fastest us |",
    "| --- | --- | --- | --- | --- | --- | --- |",
  ]
  for row in rows:
    best = best_variant(row)
    lines.append(
      f"| {row['tokens']} | {row.get('topk', TOPK)} | {row['moved_bytes'] / PEAK_TBPS / 1e6:.1f} "
      f"| {row['xla']['kernel_us']:.1f} | {row[DEFAULT]['kernel_us']:.1f} | {best} | "
      f"{row[best]['kernel_us']:.1f} |"
    )
  for row in rows:
    if ceiling := row.get("copy_ceiling"):
      lines += [
        "",
        f"Copy ceiling at T = {row['tokens']}, K = {row.get('topk', TOPK)}: XLA reading the top-k "
        f"and writing an int32 array of its shape (one fused elementwise kernel, the same "
        f"{8 * row['tokens'] * row.get('topk', TOPK) / 1e6:.1f} MB with no lookup) takes "
        f"{ceiling['kernel_us']:.1f} us ({ceiling['effective_TBps']:.2f} TB/s); the default "
        f"kernel takes {row[DEFAULT]['kernel_us'] / ceiling['kernel_us']:.2f}x that.",
      ]
    if memcpy := row.get("memcpy_ceiling"):
      lines += [
        "",
        f"The CUDA driver's device-to-device memcpy of the same bytes (torch `copy_`, "
        f"{', '.join(memcpy['kernel_names'])}) takes {memcpy['kernel_us']:.1f} us "
        f"({memcpy['effective_TBps']:.2f} TB/s); the target ({TARGET_US} us) is "
        f"{TARGET_US / memcpy['kernel_us']:.2f}x that, the default kernel "
        f"{row[DEFAULT]['kernel_us'] / memcpy['kernel_us']:.2f}x.",
      ]
    if (copy := row.get("triton_copy_ceiling")) and memcpy:
      lines += [
        "",
        f"The fastest plain-load copy of {copy['configs_swept']} Triton configurations (block, "
        f"warps, cache hints; `triton_index_contenders.py`), {copy['config']}: "
        f"{copy['kernel_us']:.1f} us ({copy['effective_TBps']:.2f} TB/s), "
        f"{copy['kernel_us'] / memcpy['kernel_us']:.3f}x the memcpy; the target is "
        f"{TARGET_US / copy['kernel_us']:.3f}x it, the default kernel "
        f"{row[DEFAULT]['kernel_us'] / copy['kernel_us']:.2f}x.",
      ]
    if convert := row.get("triton_convert"):
      lines += [
        "",
        f"The whole conversion as plain vector loads and stores (Triton, one program per token, "
        f"table entries read through L1; fastest of {convert['configs_swept']} configurations, "
        f"{convert['config']}, output checked against NumPy): {convert['kernel_us']:.1f} us; "
        f"the default kernel takes {row[DEFAULT]['kernel_us'] / convert['kernel_us']:.3f}x "
        "that.",
      ]
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=pathlib.Path(__file__).parent / "results", type=pathlib.Path)
  parser.add_argument(
    "--table-only", action="store_true", help="rewrite the markdown from the JSON in --out"
  )
  parser.add_argument(
    "--target-only", action="store_true", help=f"time only T, K = {TARGET} (all variants)"
  )
  args = parser.parse_args()
  if args.table_only:
    result = json.loads((args.out / "sparse_index.json").read_text())
    (args.out / "sparse_index.md").write_text(markdown(result))
    return
  rng = np.random.default_rng(0)
  token_counts = (TARGET[0],) if args.target_only else TOKEN_COUNTS
  other_topks = () if args.target_only else OTHER_TOPKS
  target_sets = make_sets(rng, *TARGET)

  def sets_for(tokens, topk_size):
    return target_sets if (tokens, topk_size) == TARGET else make_sets(rng, tokens, topk_size)

  result = {
    "gpu": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "date": datetime.date.today().isoformat(),
    "variants": {name: dataclasses.asdict(config) for name, config in VARIANTS.items()},
    # K = 2048 rows (the notebook reads this section), then the other widths.
    "kernel_vs_xla": [bench_shape(sets_for(tokens, TOPK)) for tokens in token_counts],
    "any_topk": [bench_shape(sets_for(t, k)) for k in other_topks for t in token_counts],
  }
  # After every JAX contender (see time_torch_ceilings), beside the XLA copy ceiling.
  target_row = next(row for row in result["kernel_vs_xla"] if row["tokens"] == TARGET[0])
  ceilings = time_torch_ceilings(target_sets, numpy_reference(*target_sets[0])) or {}
  for name, key in CEILING_KEYS.items():
    if name in ceilings:
      target_row[key] = ceilings[name]
      print(f"T={TARGET[0]:5d} K={TARGET[1]:5d} {key}: {ceilings[name]}", flush=True)
  # A target-only run keeps the full results (the notebook reads them) and writes beside them.
  stem = "sparse_index_target" if args.target_only else "sparse_index"
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
  table = markdown(result)
  (args.out / f"{stem}.md").write_text(table)
  print(table)


if __name__ == "__main__":
  main()
