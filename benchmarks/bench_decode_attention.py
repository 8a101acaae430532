"""Paged multi-row decode attention on one GPU: our kernel against its contenders.

Runs side by side in one process, on identical inputs (bf16, Hkv 8, G 8, D 128,
page 16, shuffled page tables, fresh random data):

* ``ours``: ``paged_decode_attention(impl="pallas")``, the packed-row Mosaic GPU kernel;
* ``triton_per_row``: jax's Pallas Triton ``paged_attention`` with one work item
  per draft row (every row a separate sequence of its own causal length), the
  way a JAX user runs MTP today;
* ``xla``: our XLA reference (gather + einsum), where it fits in memory;
* ``torch_sdpa``: torch ``scaled_dot_product_attention`` on contiguous KV with a
  lower-right causal mask (the same values, gathered once outside the timing).

Shapes: B in {1, 8, 64} x L in {8k, 32k} x q_len in {1, 3, 7}, plus a ragged
batch of 64 requests with lengths drawn from 1k..32k. Effective bandwidth is
unique KV bytes (K and V of every request's ``S`` positions) / time. Writes
``results/decode_attention.json`` and ``.md``; ``--tune`` adds a sweep of
tuning configs on three shapes.

``--two-warpgroup-check`` instead times only our kernel at G 12 (GLM-4.5), where
``G * q_len > 64``: the default 64-row tiles (each reads the KV) against one
128-row tile of two warpgroups (``TuningConfig.two_warpgroup_tiles``), at B8 and
B64, L 8k, q_len 6 and 7, and writes ``results/two_warpgroup_tiles.{json,md}``;
with ``--smoke`` it runs the same steps on tiny shapes in GPU interpret mode
(a CPU check of the script, not a measurement).

``--breakdown`` instead lists, for a few shapes, every GPU kernel one call of ours
launches (Q packing, the attention kernel, the chunk merge, the row unpacking) with
its CUPTI time, next to the steady-state time per call: where the time of small shapes goes.

Usage: ``python benchmarks/bench_decode_attention.py [--tune] [--quick]``,
``python benchmarks/bench_decode_attention.py --two-warpgroup-check [--smoke]`` or
``python benchmarks/bench_decode_attention.py --breakdown``.
"""

import argparse
import dataclasses
import datetime
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks._timing import time_jax, time_torch  # noqa: E402
from jaxspec.kernels.decode_attention.api import paged_decode_attention  # noqa: E402
from jaxspec.kernels.decode_attention.mosaic_gpu import TuningConfig, default_config  # noqa: E402

NUM_KV_HEADS, GROUP, HEAD_DIM, PAGE_SIZE = 8, 8, 128, 16
DTYPE = jnp.bfloat16
DATASHEET_TBPS = 4.8  # H200 HBM3e
RESULTS = pathlib.Path(__file__).resolve().parent / "results"
IMPLS = ("pallas", "xla")


@dataclasses.dataclass
class Batch:
  seq_lens: np.ndarray  # [B]
  k_pages: jax.Array  # [Hkv, num_pages, page, D]
  v_pages: jax.Array
  block_tables: jax.Array  # int32 [B, max_pages]
  kv_bytes: int  # unique K and V bytes the step must read


def make_batch(rng, seq_lens) -> Batch:
  seq_lens = np.asarray(seq_lens, np.int32)
  pages_needed = -(-seq_lens // PAGE_SIZE)
  # Triton's paged_attention needs k_splits (16) * pages_per_compute_block (8) | max_pages.
  max_pages = int(-(-pages_needed.max() // 128) * 128)
  num_pages = int(pages_needed.sum())
  order = rng.permutation(num_pages).astype(np.int32)
  block_tables = np.zeros((len(seq_lens), max_pages), np.int32)
  offsets = np.concatenate([[0], np.cumsum(pages_needed)])
  for b, needed in enumerate(pages_needed):
    block_tables[b, :needed] = order[offsets[b] : offsets[b + 1]]
  key_k, key_v = jax.random.split(jax.random.key(int(rng.integers(1 << 31))))
  shape = (NUM_KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM)
  kv_bytes = int(seq_lens.sum()) * NUM_KV_HEADS * HEAD_DIM * 2 * jnp.dtype(DTYPE).itemsize
  return Batch(
    seq_lens,
    jax.random.normal(key_k, shape, DTYPE),
    jax.random.normal(key_v, shape, DTYPE),
    jnp.asarray(block_tables),
    kv_bytes,
  )


def fresh_queries(rng, batch, q_len, count, group=GROUP):
  keys = jax.random.split(jax.random.key(int(rng.integers(1 << 31))), count)
  shape = (batch, q_len, NUM_KV_HEADS * group, HEAD_DIM)
  return [jax.random.normal(k, shape, DTYPE) for k in keys]


def inner_count(kv_bytes):
  """Calls per timed program: enough that a program outlasts its own host dispatch (the
  steady-state timing then measures the device), few enough to keep compile time short."""
  return int(np.clip(2e10 / max(kv_bytes, 1), 4, 16))


def time_ours(batch, queries, config=None, interpret=False, **timing):
  def fn(q, k, v, tables, lens):
    return paged_decode_attention(
      q, k, v, tables, lens, impl="pallas", config=config, interpret=interpret
    )

  return time_jax(
    fn,
    queries,
    batch.k_pages,
    batch.v_pages,
    batch.block_tables,
    jnp.asarray(batch.seq_lens),
    **timing,
  )


def time_xla(batch, queries):
  def fn(q, k, v, tables, lens):
    return paged_decode_attention(q, k, v, tables, lens, impl="xla")

  return time_jax(
    fn, queries, batch.k_pages, batch.v_pages, batch.block_tables, jnp.asarray(batch.seq_lens)
  )


def time_triton_per_row(batch, queries):
  from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

  b, q_len, num_heads, head_dim = queries[0].shape
  rows = np.arange(q_len)
  row_lens = np.maximum(batch.seq_lens[:, None] - q_len + 1 + rows[None, :], 0).reshape(-1)
  row_tables = jnp.repeat(batch.block_tables, q_len, axis=0)  # [B * q_len, max_pages]

  def fn(q, k, v, tables, lens):
    return paged_attention(q.reshape(b * q_len, num_heads, head_dim), k, v, tables, lens)

  return time_jax(
    fn, queries, batch.k_pages, batch.v_pages, row_tables, jnp.asarray(row_lens, jnp.int32)
  )


def time_torch_sdpa(batch, queries):
  """Contiguous KV [B, Hkv, L, D] (uniform lengths only), GQA, lower-right causal mask."""
  import torch
  import torch.nn.functional as F
  from torch.nn.attention.bias import causal_lower_right

  length = int(batch.seq_lens[0])
  b, q_len = queries[0].shape[:2]

  def contiguous(pages):
    gathered = pages[:, batch.block_tables].reshape(NUM_KV_HEADS, b, -1, HEAD_DIM)
    return torch.from_dlpack(jnp.swapaxes(gathered[:, :, :length], 0, 1))

  keys, values = contiguous(batch.k_pages), contiguous(batch.v_pages)
  qs = [torch.from_dlpack(q).permute(0, 2, 1, 3).contiguous() for q in queries]
  mask = None if q_len == 1 else causal_lower_right(q_len, length)
  state = {"i": 0}

  def call():
    state["i"] = (state["i"] + 1) % len(qs)
    return F.scaled_dot_product_attention(
      qs[state["i"]], keys, values, attn_mask=mask, enable_gqa=True
    )

  return time_torch(call, inner=len(qs))


def measure_read_bandwidth():
  """TB/s of float32 sums over four distinct 1 GiB bf16 arrays: a practical read ceiling.

  Distinct arrays, not one array with a distinct scale per call: XLA rewrites
  ``sum(x * v)`` into ``v * sum(x)`` and then computes the sum only once.
  """
  keys = jax.random.split(jax.random.key(0), 4)
  arrays = [jax.random.normal(k, (1 << 29,), jnp.bfloat16) for k in keys]
  seconds = time_jax(lambda x: jnp.sum(x.astype(jnp.float32)), arrays)
  return arrays[0].nbytes / seconds / 1e12


def run_shape(rng, name, seq_lens, q_lens, contenders):
  batch = make_batch(rng, seq_lens)
  rows = []
  for q_len in q_lens:
    queries = fresh_queries(rng, len(seq_lens), q_len, inner_count(batch.kv_bytes))
    row = {"shape": name, "B": len(seq_lens), "q_len": q_len, "kv_bytes": batch.kv_bytes}
    if "xla" in contenders:  # ours against the XLA reference on the first input (bf16 rounding)
      lens = jnp.asarray(batch.seq_lens)
      args = (queries[0], batch.k_pages, batch.v_pages, batch.block_tables, lens)
      try:
        outs = [paged_decode_attention(*args, impl=impl).astype(jnp.float32) for impl in IMPLS]
        row["max_abs_diff_vs_xla"] = float(jnp.max(jnp.abs(outs[0] - outs[1])))
      except Exception as error:  # reported with the timings, not fatal
        row["check_error"] = f"{type(error).__name__}: {str(error)[:300]}"
    for contender, timer in contenders.items():
      try:
        seconds = timer(batch, queries)
        row[contender] = {"us": seconds * 1e6, "tbps": batch.kv_bytes / seconds / 1e12}
      except Exception as error:  # a contender that cannot run is reported, not fatal
        row[contender] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
      print(name, q_len, contender, row[contender], flush=True)
    rows.append(row)
  del batch
  return rows


def two_warpgroup_check(rng, out_dir, smoke=False):
  """G 12: default 64-row tiles against one 128-row tile of two warpgroups, same inputs.

  Also reports the largest difference between the two outputs on one input (bf16
  rounding of differently split chunks, ~1e-2; a broken tile shows as NaN or ~1).
  """
  group = 12
  old_config = default_config(HEAD_DIM, PAGE_SIZE)
  new_config = dataclasses.replace(old_config, two_warpgroup_tiles=True)
  if smoke:  # interpret mode: tiny, unsplit, one timed call
    old_config = dataclasses.replace(old_config, num_chunks=1)
    new_config = dataclasses.replace(new_config, num_chunks=1)
  shapes = [("B2 L200", [200, 77])] if smoke else [("B8 L8k", [8192] * 8), ("B64 L8k", [8192] * 64)]
  timing = {"reps": 1, "warmup": 0} if smoke else {}
  rows = []
  for name, seq_lens in shapes:
    batch = make_batch(rng, seq_lens)
    lens = jnp.asarray(batch.seq_lens)
    for q_len in (6, 7):
      count = 1 if smoke else min(16, inner_count(batch.kv_bytes))  # bounds compile time
      queries = fresh_queries(rng, len(seq_lens), q_len, count, group=group)
      row = {"shape": name, "q_len": q_len, "G": group, "kv_bytes": batch.kv_bytes}
      outputs = {}
      for label, config in (("tiles_64", old_config), ("two_warpgroups", new_config)):
        try:
          outputs[label] = paged_decode_attention(
            queries[0],
            batch.k_pages,
            batch.v_pages,
            batch.block_tables,
            lens,
            impl="pallas",
            config=config,
            interpret=smoke,
          )
          seconds = time_ours(batch, queries, config, interpret=smoke, **timing)
          row[label] = {"us": seconds * 1e6, "tbps": batch.kv_bytes / seconds / 1e12}
        except Exception as error:  # reported in the table, not fatal
          row[label] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        print(name, q_len, label, row[label], flush=True)
      if len(outputs) == 2:
        difference = jnp.abs(
          outputs["two_warpgroups"].astype(jnp.float32) - outputs["tiles_64"].astype(jnp.float32)
        )
        row["max_abs_difference"] = float(jnp.max(difference))
      rows.append(row)
    del batch
  meta = {
    "gpu": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    "setup": f"bf16, Hkv {NUM_KV_HEADS}, G {group}, D {HEAD_DIM}, page {PAGE_SIZE}"
    + (", interpret-mode smoke run (not a measurement)" if smoke else ""),
    "configs": {
      "tiles_64": dataclasses.asdict(old_config),
      "two_warpgroups": dataclasses.asdict(new_config),
    },
  }
  (out_dir / "two_warpgroup_tiles.json").write_text(
    json.dumps({"meta": meta, "rows": rows}, indent=1)
  )

  def cell(entry):
    return f"{entry['us']:.1f} us / {entry['tbps']:.2f}" if "us" in entry else "fails"

  lines = [
    "# 128-row tile of two warpgroups against 64-row tiles (G * q_len > 64)",
    "",
    f"{meta['gpu']}, jax {meta['jax']}, {meta['date']}; {meta['setup']}. "
    "Time per call / effective KV TB/s (unique KV bytes / time); "
    f"share of the datasheet's {DATASHEET_TBPS} TB/s in brackets.",
    "",
    "| shape | q_len | 64-row tiles (default) | 128-row tile, two warpgroups | speedup "
    "| max abs difference |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for row in rows:
    old, new = row["tiles_64"], row["two_warpgroups"]
    cells = []
    for entry in (old, new):
      share = f" ({100 * entry['tbps'] / DATASHEET_TBPS:.0f}%)" if "us" in entry else ""
      cells.append(cell(entry) + share)
    speedup = f"{old['us'] / new['us']:.2f}x" if "us" in old and "us" in new else "n/a"
    difference = f"{row['max_abs_difference']:.3g}" if "max_abs_difference" in row else "n/a"
    lines.append(
      f"| {row['shape']} | {row['q_len']} | {cells[0]} | {cells[1]} | {speedup} | {difference} |"
    )
  markdown = "\n".join(lines) + "\n"
  (out_dir / "two_warpgroup_tiles.md").write_text(markdown)
  print(markdown)


def breakdown(rng, out_dir):
  """CUPTI time of every kernel of one call of ours, and the steady-state time per call."""
  from jax.experimental.mosaic.gpu import profiler

  rows = []
  for name, seq_lens, q_len in [
    ("B1 L8k", [8192], 1),
    ("B1 L8k", [8192], 7),
    ("B8 L32k", [32768] * 8, 1),
    ("B64 L32k", [32768] * 64, 1),
    ("B64 L32k", [32768] * 64, 7),
  ]:
    batch = make_batch(rng, seq_lens)
    queries = fresh_queries(rng, len(seq_lens), q_len, inner_count(batch.kv_bytes))
    lens = jnp.asarray(batch.seq_lens)
    call = jax.jit(
      lambda q, k, v, t, s: paged_decode_attention(q, k, v, t, s, impl="pallas")  # noqa: B023
    )
    args = (queries[0], batch.k_pages, batch.v_pages, batch.block_tables, lens)
    jax.block_until_ready(call(*args))
    kernels = []
    for _ in range(5):  # keep the fastest of five profiled calls, kernel by kernel
      _, timings = profiler.measure(call, aggregate=False)(*args)
      if not kernels:
        kernels = [[kernel, ms * 1e3] for kernel, ms in timings]
      else:
        for entry, (_, ms) in zip(kernels, timings, strict=True):
          entry[1] = min(entry[1], ms * 1e3)
    wall_us = time_ours(batch, queries) * 1e6
    row = {"shape": name, "q_len": q_len, "wall_us": wall_us, "kernels": kernels}
    print(json.dumps(row), flush=True)
    rows.append(row)
    del batch
  (out_dir / "decode_attention_breakdown.json").write_text(json.dumps(rows, indent=1))
  lines = [
    "# Where one call of ours spends its time",
    "",
    f"{jax.devices()[0].device_kind}, jax {jax.__version__}; CUPTI time of each kernel (fastest "
    "of five profiled calls) and the steady-state time per call in a jitted batch of calls.",
    "",
    "| shape | q_len | per call us | sum of kernels us | kernels (us) |",
    "| --- | --- | --- | --- | --- |",
  ]
  for row in rows:
    listed = "; ".join(f"{kernel[:40]} {us:.1f}" for kernel, us in row["kernels"])
    total = sum(us for _, us in row["kernels"])
    lines.append(
      f"| {row['shape']} | {row['q_len']} | {row['wall_us']:.1f} | {total:.1f} | {listed} |"
    )
  markdown = "\n".join(lines) + "\n"
  (out_dir / "decode_attention_breakdown.md").write_text(markdown)
  print(markdown)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--tune", action="store_true", help="sweep tuning configs too")
  parser.add_argument("--quick", action="store_true", help="B1 and B64 at L 8k only")
  parser.add_argument(
    "--two-warpgroup-check", action="store_true", help="only G 12: 64-row tiles vs two warpgroups"
  )
  parser.add_argument("--smoke", action="store_true", help="with --two-warpgroup-check: CPU run")
  parser.add_argument("--breakdown", action="store_true", help="only: time each kernel of a call")
  parser.add_argument("--out", default=str(RESULTS))
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  if args.two_warpgroup_check:
    two_warpgroup_check(rng, out_dir, smoke=args.smoke)
    return
  if args.breakdown:
    breakdown(rng, out_dir)
    return

  read_tbps = measure_read_bandwidth()
  print(f"read ceiling {read_tbps:.2f} TB/s", flush=True)
  meta = {
    "gpu": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    "setup": f"bf16, Hkv {NUM_KV_HEADS}, G {GROUP}, D {HEAD_DIM}, page {PAGE_SIZE}",
    "read_ceiling_tbps": read_tbps,  # shares below are of the datasheet figure
    "datasheet_tbps": DATASHEET_TBPS,
    "timing": "jax: median steady-state time per call of a jitted batch of calls on distinct "
    "inputs (wall time of two back-to-back launches minus one); torch: CUDA events around "
    "back-to-back calls; warm-up excluded",
    "default_config": dataclasses.asdict(default_config(HEAD_DIM, PAGE_SIZE)),
  }
  rows, tuning = [], []

  def save():
    """Writes what has been measured so far (a run cut short keeps its finished shapes)."""
    (out_dir / "decode_attention.json").write_text(
      json.dumps({"meta": meta, "rows": rows, "tuning": tuning}, indent=1)
    )
    (out_dir / "decode_attention.md").write_text(render_markdown(meta, rows, tuning))

  everyone = {
    "ours": time_ours,
    "triton_per_row": time_triton_per_row,
    "xla": time_xla,
    "torch_sdpa": time_torch_sdpa,
  }
  batches = (1, 64) if args.quick else (1, 8, 64)
  lengths = (8192,) if args.quick else (8192, 32768)
  for b in batches:
    for length in lengths:
      contenders = dict(everyone)
      if b * length > 8 * 32768:  # the XLA gather of f32 K/V would not fit next to the rest
        del contenders["xla"]
      rows += run_shape(rng, f"B{b} L{length // 1024}k", [length] * b, (1, 3, 7), contenders)
      save()
  ragged = rng.integers(1024, 32768 + 1, size=64)
  contenders = {"ours": time_ours, "triton_per_row": time_triton_per_row}
  rows += run_shape(rng, "B64 ragged 1k..32k", ragged, (1, 3, 7), contenders)
  save()

  if args.tune:
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
    for name, seq_lens, q_len in [
      ("B64 L32k", [32768] * 64, 7),
      ("B8 L32k", [32768] * 8, 1),
      ("B64 ragged 1k..32k", rng.integers(1024, 32768 + 1, size=64), 7),
    ]:
      batch = make_batch(rng, seq_lens)
      queries = fresh_queries(rng, len(seq_lens), q_len, inner_count(batch.kv_bytes))
      for config in configs:
        entry = {"shape": name, "q_len": q_len, "config": dataclasses.asdict(config)}
        try:
          seconds = time_ours(batch, queries, config)
          entry.update(us=seconds * 1e6, tbps=batch.kv_bytes / seconds / 1e12)
        except Exception as error:
          entry["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        print("tune", entry, flush=True)
        tuning.append(entry)
      del batch
      save()

  print(render_markdown(meta, rows, tuning))


def render_markdown(meta, rows, tuning):
  def cell(entry):
    return f"{entry['us']:.1f} us / {entry['tbps']:.2f}" if "us" in entry else "fails"

  def speedup(row, contender):
    if "us" in row.get(contender, {}) and "us" in row["ours"]:
      return f"{row[contender]['us'] / row['ours']['us']:.1f}x"
    return "n/a"

  lines = [
    "# Paged decode attention (packed-row MTP) on one GPU",
    "",
    f"{meta['gpu']}, jax {meta['jax']}, {meta['date']}; {meta['setup']}.",
    f"Timing: {meta['timing']}. Effective bandwidth = unique KV bytes / time (TB/s); "
    f"share of the datasheet's {meta['datasheet_tbps']} TB/s; read ceiling measured in the "
    "same process: "
    + (
      f"{ceiling:.2f} TB/s." if (ceiling := meta["read_ceiling_tbps"]) else "not valid in this run."
    ),
    "Ours runs its default tuning: "
    + ", ".join(f"{k}={v}" for k, v in meta.get("default_config", {}).items())
    + ". Cells: time per call / effective TB/s; the last column is the largest difference "
    "between our output and the XLA reference's on the first input, where that fits.",
    "",
    "| shape | q_len | ours | % of datasheet | Triton per row | XLA | torch SDPA "
    "| vs Triton | vs XLA | vs torch | max abs diff vs XLA |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for row in rows:
    ours = row["ours"]
    share = f"{100 * ours['tbps'] / meta['datasheet_tbps']:.0f}%" if "us" in ours else "-"
    others = [cell(row[c]) if c in row else "n/a" for c in ("triton_per_row", "xla", "torch_sdpa")]
    lines.append(
      f"| {row['shape']} | {row['q_len']} | {cell(ours)} | {share} | "
      + " | ".join(others)
      + f" | {speedup(row, 'triton_per_row')} | {speedup(row, 'xla')} "
      f"| {speedup(row, 'torch_sdpa')} | {row.get('max_abs_diff_vs_xla', float('nan')):.3g} |"
    )
  lines += ["", "q_len 7 / q_len 1 time of ours:", ""]
  by_shape = {}
  for row in rows:
    if "us" in row["ours"]:
      by_shape.setdefault(row["shape"], {})[row["q_len"]] = row["ours"]["us"]
  for shape, times in by_shape.items():
    if 1 in times and 7 in times:
      lines.append(f"- {shape}: {times[7] / times[1]:.2f}")
  if tuning:
    lines += ["", "## Tuning sweep (ours)", "", "| shape | q_len | config | time | TB/s |"]
    lines.append("| --- | --- | --- | --- | --- |")
    for entry in tuning:
      config = ", ".join(f"{k}={v}" for k, v in entry["config"].items())
      result = f"{entry['us']:.1f} us | {entry['tbps']:.2f}" if "us" in entry else "fails | -"
      lines.append(f"| {entry['shape']} | {entry['q_len']} | {config} | {result} |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
