"""GLM-5.3-shaped decode step: top-k index conversion shared per layer group vs per layer.

GLM-5.3 runs the DSA indexer in 21 of its 78 layers ("full" layers; index_topk_freq 4, offset
3); the "shared" layers reuse the full layer's top-k. The conversion of top-k positions into
physical cache slots (`convert_topk_to_physical`) can run once per group (21 launches) or once
per layer (78), which is what vLLM changed (3.5-3.9x less conversion time there).

Side by side in one process: the same model and cache with `index_conversion="per_group"` and
`"per_layer"`; for each, the number of conversions in the compiled decode step (counted in its
jaxpr), the decode step time, and the conversion time alone (count x one conversion of the step's
B tokens, timed standalone with the step's shapes). The layer stack is GLM-5.3's (78 layers, its
grouping, top-k 2048, block 64) at a small hidden size so it fits one GPU with random bf16 weights.

Usage: python benchmarks/bench_index_groups.py [--batches 1 8 32] [--context 4096] [--smoke]
Results: benchmarks/results/index_groups.{json,md}.
"""

import argparse
import datetime
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks._timing import time_jax, time_stateful
from jaxspec.jaxpr_utils import count_calls
from jaxspec.kernels import convert_topk_to_physical
from jaxspec.model.dsa_config import glm53_small
from jaxspec.model.dsa_transformer import GlmDsaForCausalLM
from jaxspec.serving.kv_cache import BlockAllocator
from jaxspec.serving.latent_cache import create_latent_cache
from jaxspec.serving.sampling import GREEDY
from jaxspec.serving.steps import decode_step

RESULTS = Path(__file__).parent / "results"
CONVERSION = "convert_topk_to_physical"


def bench_mode(config, index_conversion, batch, context, page_size, iters, reps, impl):
  model = GlmDsaForCausalLM(
    config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), index_conversion=index_conversion
  )
  graphdef, params = nnx.split(model)
  pages_per_request = -(-(context + 1) // page_size)
  allocator = BlockAllocator(batch * pages_per_request, page_size, shuffle_seed=batch)
  block_tables = jnp.asarray(
    [allocator.allocate(pages_per_request) for _ in range(batch)], jnp.int32
  )
  cache = create_latent_cache(
    config, config.num_hidden_layers, allocator.num_pages, page_size, jnp.bfloat16
  )
  keys = iter(jax.random.split(jax.random.key(batch), len(jax.tree.leaves(cache))))
  cache = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype), cache)
  tokens = jnp.asarray(
    np.random.default_rng(batch).integers(0, config.vocab_size, (batch, 1)), jnp.int32
  )
  seq_lens = jnp.full((batch,), context + 1, jnp.int32)
  statics = dict(sampling=GREEDY, moe_impl="per_route", attention_impl=impl)
  args = (tokens, seq_lens, block_tables, jax.random.key(0))
  conversions = count_calls(
    decode_step.trace(graphdef, params, cache, *args, **statics).jaxpr, CONVERSION
  )

  def step(cache):
    _, cache = decode_step(graphdef, params, cache, *args, **statics)
    return cache

  seconds, _ = time_stateful(step, cache, iters, reps)
  return conversions, seconds, block_tables


def conversion_seconds(config, block_tables, context, page_size, reps, impl):
  """One conversion of a decode step's B tokens (one row each), timed standalone on 8 fresh
  random top-k sets (distinct inputs per call, so no call reuses another's result)."""
  batch = block_tables.shape[0]
  rng = np.random.default_rng(0)
  topks = [
    jnp.asarray(rng.integers(0, context, (batch, config.index_topk)), jnp.int32) for _ in range(8)
  ]
  req_ids = jnp.arange(batch, dtype=jnp.int32)
  return time_jax(
    lambda topk: convert_topk_to_physical(
      req_ids, block_tables, topk, block_size=page_size, impl=impl
    )[0],
    topks,
    reps=reps,
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--context", type=int, default=4096)
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, runs on the CPU")
  parser.add_argument("--out", type=Path, default=RESULTS / "index_groups")
  args = parser.parse_args()
  page_size = 64
  if args.smoke:
    config = glm53_small(
      num_hidden_layers=10,
      indexer_types=("full",) * 3 + ("shared",) * 3 + ("full",) * 4,
      index_topk=128,
    )
    args.batches, args.context, args.iters, args.reps = [2], 256, 2, 2
    impl = "xla"
  else:
    config = glm53_small(index_topk=2048)
    impl = "auto"
  results = {
    "benchmark": "index_groups",
    "device": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "date": datetime.date.today().isoformat(),
    "layers": config.num_hidden_layers,
    "groups": len(config.index_groups),
    "index_topk": config.index_topk,
    "context": args.context,
    "rows": [],
  }
  for batch in args.batches:
    row = {"batch": batch}
    for mode in ("per_group", "per_layer"):
      conversions, seconds, block_tables = bench_mode(
        config, mode, batch, args.context, page_size, args.iters, args.reps, impl
      )
      row[mode] = {"conversions": conversions, "step_s": seconds}
    one = conversion_seconds(config, block_tables, args.context, page_size, args.reps, impl)
    for mode in ("per_group", "per_layer"):
      row[mode]["conversion_s"] = row[mode]["conversions"] * one
    row["one_conversion_s"] = one
    results["rows"].append(row)
    print(json.dumps(row), flush=True)
  write_results(results, args.out)


def write_results(results, out: Path):
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix(".json").write_text(json.dumps(results, indent=2))
  lines = [
    f"# Index conversion per group vs per layer ({results['device']}, jax {results['jax']}, "
    f"{results['date']})",
    "",
    f"{results['layers']} layers in {results['groups']} index groups, top-k "
    f"{results['index_topk']}, block 64, context {results['context']}; median times.",
    "",
    "| batch | conversions per group / per layer | conversion time per group / per layer (us) "
    "| ratio | decode step per group / per layer (us) | step ratio |",
    "|---|---|---|---|---|---|",
  ]
  for row in results["rows"]:
    group, layer = row["per_group"], row["per_layer"]
    lines.append(
      f"| {row['batch']} | {group['conversions']} / {layer['conversions']} | "
      f"{group['conversion_s'] * 1e6:.0f} / {layer['conversion_s'] * 1e6:.0f} | "
      f"{layer['conversion_s'] / group['conversion_s']:.2f}x | "
      f"{group['step_s'] * 1e6:.0f} / {layer['step_s'] * 1e6:.0f} | "
      f"{layer['step_s'] / group['step_s']:.3f}x |"
    )
  out.with_suffix(".md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
