"""Probe: each decode-attention kernel's step floor, with its KV served from L2.

The H100 and the H200 share the SM (GH100, the same clocks) and differ in HBM, so a call whose
pages all lie in a pool small enough for L2 takes the time its steps take on either card; on the
H200 a call then takes at least max(KV bytes / read ceiling, that floor)
(``benchmarks/NOTES_decode_attention.md``, "Each kernel's step floor"). For B64 L32k, Hkv 8,
D 128, page 16, shuffled pages, G 8 and 12 at several q_len, bf16 and fp8 pages: CUPTI device
time of one default call (``_timing.kernel_seconds``, fastest of three), ours and FlashInfer's
best path (bf16 only), on the pages as made and with ``block_tables % POOL`` (256 page ids,
16 MiB of bf16 K and V).

Usage (a GPU; FlashInfer optional): ``python benchmarks/probe_step_floor.py [--no-flashinfer]
[--out DIR]``; writes ``step_bound.json`` under ``DIR`` (default ``$OUT``, else the working
directory).
"""

import argparse
import dataclasses
import json
import os
import sys

import bench_decode_attention as bda
import jax
import numpy as np

POOL = 256  # page ids: 256 x 8 KV heads x 16 x 128 x 2 B x 2 = 16 MiB of bf16 K and V
SHAPES = [  # (pages, G, q_len)
  ("bf16", 8, 1),
  ("bf16", 8, 3),
  ("bf16", 8, 7),
  ("bf16", 12, 1),
  ("bf16", 12, 6),
  ("bf16", 12, 7),
  ("fp8", 8, 1),
  ("fp8", 8, 3),
  ("fp8", 8, 7),
  ("fp8", 12, 7),
]


def in_l2_pool(batch):
  """The same batch with every page id folded into the first ``POOL`` pages, no copies."""
  return dataclasses.replace(
    batch,
    k_pages=batch.k_pages[:, :POOL],
    v_pages=batch.v_pages[:, :POOL],
    block_tables=batch.block_tables % POOL,
    page_copies=(),
  )


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description="decode-attention step floors, KV from L2")
  parser.add_argument("--no-flashinfer", action="store_true", help="leave FlashInfer out")
  parser.add_argument(
    "--out", default=os.environ.get("OUT", "."), help="directory of step_bound.json"
  )
  return parser.parse_args(argv)


def main(argv: list[str] | None = None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  flashinfer = not args.no_flashinfer
  rng = np.random.default_rng(0)
  base = bda.make_batch(rng, [32768] * 64)
  fp8 = bda.to_fp8(base)
  batches = {"bf16": (base, in_l2_pool(base)), "fp8": (fp8, in_l2_pool(fp8))}
  rows = []
  for kind, group, q_len in SHAPES:
    queries = bda.fresh_queries(rng, 64, q_len, 2, group=group)
    row = {"kind": kind, "G": group, "q": q_len}
    for where, batch in zip(("hbm", "l2"), batches[kind], strict=True):
      row[f"ours_{where}_us"] = min(
        bda.kernel_time_ours(batch, queries)["kernel_us"] for _ in range(3)
      )
      if flashinfer and kind == "bf16":
        notes = {}
        try:
          bda.time_flashinfer(batch, queries, notes, kernel_time=True)
          row[f"fi_{where}_us"] = notes.get("kernel_us")
          row[f"fi_{where}_diff"] = notes.get("max_abs_diff_vs_ours")
        except Exception as error:  # reported in the row, not fatal
          row[f"fi_{where}_err"] = repr(error)[:200]
    rows.append(row)
    cells = " | ".join(
      f"{key} {row[key]:8.1f}"
      for key in ("ours_hbm_us", "ours_l2_us", "fi_hbm_us", "fi_l2_us")
      if isinstance(row.get(key), float)
    )
    print(f"{kind} G{group:2d} q{q_len}: {cells}", flush=True)
  result = {
    "gpu": jax.devices()[0].device_kind,
    "kv_bytes_bf16": base.kv_bytes,
    "pool_pages": POOL,
    "rows": rows,
  }
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "step_bound.json"), "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
