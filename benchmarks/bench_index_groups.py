"""GLM-5.3-shaped decode step: top-k index conversion once per index group vs once per layer.

GLM-5.3 runs the DSA indexer in 21 of its 78 layers ("full" layers; index_topk_freq 4, offset
3); the "shared" layers reuse the full layer's top-k. The conversion of top-k positions into
physical cache slots (`convert_topk_to_physical`) can run once per group (21 launches) or once
per layer (78), which is what vLLM changed (3.5-3.9x less conversion time there).

Side by side in one process: the decode step with `index_sharing="per_group"` and
`"per_layer"`, the same weights (same seed) and one cache of random bf16 rows that every step
updates in place (the cache is donated and threaded from step to step). The layer stack is
GLM-5.3's (78 layers, its grouping, top-k 2048, block 64) at a small hidden size, so the step is
a long chain of tiny kernels. For each batch size and mode:

* conversions: `convert_topk_to_physical` calls in the step's jaxpr;
* conversion kernel time (the headline): CUPTI device time of the conversion kernels
  (`mosaic_gpu.KERNEL_NAME`) summed over one decode step. Their number per step must equal the
  jaxpr count: fewer launches mean XLA merged identical conversions (common-subexpression
  elimination), and the script fails, after writing its results;
* step kernel time: CUPTI device time of all kernels of one step, summed, and their number.
  It is the time the GPU spends in kernels, not the step's span: the gaps between launches
  are left out;
* step wall time: host time per step over 10 back-to-back steps. Secondary: the step is host
  launch bound (~200 us of tiny kernels per layer), so this mostly measures dispatch.

CUPTI figures are medians over `--profiled` profiled steps, after one unprofiled step; wall
times are medians over `--reps` runs. Each (mode, batch) step is traced and compiled once; the
compilations run in parallel threads (XLA compiles without holding the GIL).

Usage: python benchmarks/bench_index_groups.py [--batches 1 8 32] [--context 4096]
[--out results/index_groups] [--smoke] (`--out` without suffix). `--smoke`: a 10-layer stack
on the CPU, a check of the script (no CUPTI there).
Results: benchmarks/results/index_groups.{json,md}.
"""

import argparse
import datetime
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks._timing import ProfileFailed, profile_stateful, time_stateful
from jaxspec.jaxpr_utils import count_calls
from jaxspec.kernels.sparse_index import api as sparse_index_api
from jaxspec.kernels.sparse_index.mosaic_gpu import KERNEL_NAME
from jaxspec.model.dsa_config import glm53_small
from jaxspec.model.metadata import KernelChoices
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.serving.kv_cache import BlockAllocator
from jaxspec.serving.model_graph import split_model
from jaxspec.serving.sampling import GREEDY
from jaxspec.serving.steps import decode_step

RESULTS = Path(__file__).parent / "results"
CONVERSION = sparse_index_api.OP.backend_names
MODES = ("per_group", "per_layer")
PAGE_SIZE = 64


def random_cache(model, num_pages):
  """Latent cache of all target layers with random bf16 rows (never zeros)."""
  cache = jax.eval_shape(lambda: model.init_cache(num_pages, PAGE_SIZE, dtype=jnp.bfloat16))
  keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(cache))))
  return jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype), cache)


def compile_steps(config, batches, context, impl, progress):
  """Traces and compiles the decode step once per (mode, batch), over one shared cache.

  Every batch size reads the same cache (pages for the largest batch, shuffled); batch b uses
  the first b requests. Returns (steps {(mode, batch): (compiled, params, step inputs)},
  jaxpr conversion counts {(mode, batch): int}, cache).
  """
  pages_per_request = -(-(context + 1) // PAGE_SIZE)
  allocator = BlockAllocator(max(batches) * pages_per_request, PAGE_SIZE, shuffle_seed=0)
  block_tables = jnp.asarray(
    [allocator.allocate(pages_per_request) for _ in range(max(batches))], jnp.int32
  )  # [max batch, pages_per_request]
  model = GlmForCausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  graph, params = split_model(model)
  cache = random_cache(model, allocator.num_pages)
  rng = np.random.default_rng(0)
  inputs = {
    batch: (
      jnp.asarray(rng.integers(0, config.vocab_size, (batch,)), jnp.int32),  # tokens [B]
      jnp.full((batch,), context + 1, jnp.int32),  # seq_lens [B]: the new token is the last
      block_tables[:batch],
      jax.random.key(batch),
    )
    for batch in batches
  }
  lowered, conversions = {}, {}
  for mode in MODES:
    kernels = KernelChoices(
      attention=impl, index_conversion=impl, index_sharing=mode, moe="per_route"
    )
    for batch in batches:
      traced = decode_step.trace(
        graph, params, cache, *inputs[batch], sampling=GREEDY, kernels=kernels
      )
      conversions[mode, batch] = count_calls(traced.jaxpr, CONVERSION)
      lowered[mode, batch] = traced.lower()
      progress(f"traced {mode} batch {batch}: {conversions[mode, batch]} conversions")
  steps = {}
  with ThreadPoolExecutor(max_workers=len(lowered)) as pool:
    futures = {pool.submit(program.compile): key for key, program in lowered.items()}
    for future in as_completed(futures):
      mode, batch = futures[future]
      steps[mode, batch] = (future.result(), params, inputs[batch])
      progress(f"compiled {mode} batch {batch}")
  return steps, conversions, cache


def measure(compiled, params, inputs, cache, iters, reps, profiled):
  """Wall time and CUPTI kernels of one compiled decode step. Returns (figures, cache)."""

  def step(cache):  # -> (next tokens [B], cache)
    return compiled(params, cache, *inputs)

  wall_s, cache = time_stateful(lambda cache: step(cache)[1], cache, iters, reps)
  figures = {"step_wall_s": wall_s}
  try:
    per_step, cache = profile_stateful(step, cache, profiled)
  except ProfileFailed as error:  # no CUPTI (the CPU): wall time only
    figures["cupti"] = f"unavailable: {error}"
    return figures, error.state
  conversion_s = [sum(s for name, s in kernels if name == KERNEL_NAME) for kernels in per_step]
  figures.update(
    conversion_kernels=sum(name == KERNEL_NAME for name, _ in per_step[0]),
    conversion_kernel_s=statistics.median(conversion_s),
    conversion_kernel_s_per_step=conversion_s,
    step_kernels=len(per_step[0]),
    step_kernel_s=statistics.median(sum(s for _, s in kernels) for kernels in per_step),
  )
  return figures, cache


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--context", type=int, default=4096)
  parser.add_argument("--iters", type=int, default=10, help="steps per wall-time run")
  parser.add_argument("--reps", type=int, default=5, help="wall-time runs")
  parser.add_argument("--profiled", type=int, default=10, help="profiled steps")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, runs on the CPU")
  parser.add_argument("--out", type=Path, default=RESULTS / "index_groups")
  args = parser.parse_args()
  if args.smoke:
    config = glm53_small(
      num_hidden_layers=10,
      indexer_types=("full",) * 3 + ("shared",) * 3 + ("full",) * 4,
      index_topk=128,
    )
    args.batches, args.context, args.iters, args.reps, args.profiled = [1, 2], 256, 2, 2, 2
    impl = "xla"
  else:
    config = glm53_small(index_topk=2048)
    impl = "auto"
  start = time.perf_counter()

  def progress(message):
    print(f"[{time.perf_counter() - start:6.1f} s] {message}", flush=True)

  steps, conversions, cache = compile_steps(config, args.batches, args.context, impl, progress)
  results = {
    "benchmark": "index_groups",
    "device": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "date": datetime.date.today().isoformat(),
    "layers": config.num_hidden_layers,
    "groups": len(config.index_groups),
    "index_topk": config.index_topk,
    "context": args.context,
    "profiled_steps": args.profiled,
    "wall_steps": f"{args.reps} runs of {args.iters}",
    "rows": [],
  }
  mismatches = []
  for batch in args.batches:
    row = {"batch": batch}
    for mode in MODES:
      figures, cache = measure(*steps[mode, batch], cache, args.iters, args.reps, args.profiled)
      figures["conversions"] = conversions[mode, batch]
      if figures.get("conversion_kernels", figures["conversions"]) != figures["conversions"]:
        mismatches.append(
          f"{mode} batch {batch}: {figures['conversion_kernels']} {KERNEL_NAME} launches per "
          f"step, {figures['conversions']} conversions in the jaxpr"
        )
      row[mode] = figures
      progress(f"measured {mode} batch {batch}: {json.dumps(figures)}")
    results["rows"].append(row)
  write_results(results, args.out)
  # Checked after the results are written, so that a failing run still leaves its figures.
  assert not mismatches, "\n".join(mismatches)


def write_results(results, out: Path):
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix(".json").write_text(json.dumps(results, indent=2))

  def pair(row, key, scale=1e6):
    group, layer = row["per_group"].get(key), row["per_layer"].get(key)
    if group is None:
      return "n/a", "n/a"
    values = f"{group * scale:.1f} / {layer * scale:.1f}" if scale else f"{group} / {layer}"
    return values, f"{layer / group:.2f}x"

  lines = [
    f"# Index conversion per group vs per layer ({results['device']}, jax {results['jax']}, "
    f"{results['date']})",
    "",
    f"{results['layers']} layers in {results['groups']} index groups, top-k "
    f"{results['index_topk']}, block 64, context {results['context']}. Per decode step: "
    "conversions counted in the step's jaxpr and conversion kernels launched (CUPTI); CUPTI "
    "device time of the conversion kernels and of all kernels of the step, each summed over the "
    "step (gaps between launches are not in it), medians over "
    f"{results['profiled_steps']} profiled steps; host wall time per step, median of "
    f"{results['wall_steps']} back-to-back steps (launch bound, so secondary). Cells: per group "
    "/ per layer; ratios: per layer / per group.",
    "",
    "| batch | conversions (jaxpr) | conversion launches | conversion kernel time (us) | ratio "
    "| kernels | step kernel time (us) | ratio | step wall (us) | ratio |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for row in results["rows"]:
    cells = [
      str(row["batch"]),
      pair(row, "conversions", None)[0],
      pair(row, "conversion_kernels", None)[0],
      *pair(row, "conversion_kernel_s"),
      pair(row, "step_kernels", None)[0],
      *pair(row, "step_kernel_s"),
      *pair(row, "step_wall_s"),
    ]
    lines.append("| " + " | ".join(cells) + " |")
  if "cupti" in results["rows"][0]["per_group"]:
    lines += ["", f"CUPTI {results['rows'][0]['per_group']['cupti']}."]
  out.with_suffix(".md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
