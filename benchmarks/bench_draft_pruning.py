"""MTP draft row pruning on a GLM-4.5-Air-shaped model, and the MoE implementation policy.

Runs side by side in one process on one GPU:

1. Draft first step (q_len = k + 1 rows per request through the MTP layer's attention, then MoE
   and lm head on all rows or, pruned, on one row per request), the whole draft (first step plus
   k - 1 single-row steps), the target verify step, and the verify + draft cycle as the engine
   runs it (`cycle_step`, one program), pruned vs unpruned, for batch 1, 4, 16, 64 and k = 5.
2. The routed-expert MoE of one layer, `per_route` vs `grouped` (`jax.lax.ragged_dot`), and one
   grouped projection through jax's Pallas Mosaic GPU `ragged_dot` kernel, over token counts:
   the crossover sets `choose_moe_impl`'s threshold.

The model has GLM-4.5-Air's real layer sizes (hidden 4096, 96 / 8 heads, 128 experts top-8,
moe_intermediate 1408, vocab 151552) with fewer target layers and random bf16 weights; every
request has `--context` tokens in the cache (random, never zeros). Verify is measured at two
depths so its per-MoE-layer cost can be extrapolated to the real 46 layers.

Timing: each step is called `--iters` times back to back with the donated cache threaded through,
after warm-up; wall time after `block_until_ready` over the calls, median over `--reps` repeats.
Results: benchmarks/results/draft_pruning.{json,md}.
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
from jaxspec.model.config import glm45_air, tiny
from jaxspec.model.metadata import KernelChoices
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.serving.kv_cache import BlockAllocator
from jaxspec.serving.model_graph import split_model
from jaxspec.serving.sampling import GREEDY
from jaxspec.serving.spec_steps import CycleState, DraftInputs, cycle_step, draft_step, verify_step

RESULTS = Path(__file__).parent / "results"


def _model(config, seed):
  return GlmForCausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))


def _random_cache(model, num_pages, page_size, key):
  """The model's cache (target and MTP layers) filled with random values, never zeros."""
  cache = jax.eval_shape(lambda: model.init_cache(num_pages, page_size, draft=True))
  leaves, treedef = jax.tree.flatten(cache)
  keys = jax.random.split(key, len(leaves))
  arrays = [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
  return jax.tree.unflatten(treedef, arrays)


def bench_cycle(model, batch, k, context, page_size, iters, reps, moe, with_draft=True):
  """Times of the draft (first step / all k) pruned and unpruned, verify and the cycle.

  `moe` is `KernelChoices.moe`: "auto" (the model's policy), "xla" (its pick between the XLA
  paths) or one implementation for every pass."""
  config = model.config
  graph, params = split_model(model)
  q_len = k + 1
  pages_per_request = -(-(context + 2 * q_len) // page_size)
  allocator = BlockAllocator(batch * pages_per_request, page_size, shuffle_seed=batch)
  block_tables = jnp.asarray(
    [allocator.allocate(pages_per_request) for _ in range(batch)], jnp.int32
  )
  rng = np.random.default_rng(batch)
  cache = _random_cache(model, allocator.num_pages, page_size, jax.random.key(batch))
  committed = jnp.full((batch,), context, jnp.int32)
  seq_lens = committed + q_len  # of the verify rows
  num_accepted = jnp.asarray(rng.integers(0, k + 1, batch), jnp.int32)
  emitted = jnp.asarray(rng.integers(0, config.vocab_size, (batch, q_len)), jnp.int32)
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch, q_len)), jnp.int32)
  hidden = jax.random.normal(jax.random.key(7), (batch, q_len, config.hidden_size), jnp.bfloat16)
  key = jax.random.key(0)
  # With "auto"/"xla" the model picks the MoE from each pass's unpruned row count.
  statics = dict(sampling=GREEDY, kernels=KernelChoices(moe=moe))
  times = {}

  def verify(cache):
    *_, cache = verify_step(
      graph,
      params,
      cache,
      tokens,
      seq_lens,
      block_tables,
      None,
      key,
      **statics,
    )
    return cache

  times["verify"], cache = time_stateful(verify, cache, iters, reps)
  if not with_draft:
    return times
  for prune in (True, False):
    tag = "pruned" if prune else "unpruned"
    for num_draft, name in ((1, "draft_first_step"), (k, "draft_all")):
      inputs = DraftInputs(
        hidden, emitted, num_accepted, committed + 1 + num_accepted, block_tables
      )

      def draft(cache, num_draft=num_draft, prune=prune, inputs=inputs):
        *_, cache = draft_step(
          graph, params, cache, inputs, key, num_draft=num_draft, prune=prune, **statics
        )
        return cache

      times[f"{name}_{tag}"], cache = time_stateful(draft, cache, iters, reps)

    def cycle(cache, prune=prune):  # the engine's cycle: verify and draft in one program
      state = CycleState(tokens[:, 0], tokens[:, 1:], None, seq_lens)
      *_, cache = cycle_step(
        graph, params, cache, state, block_tables, key, num_draft=k, prune=prune, **statics
      )
      return cache

    times[f"cycle_{tag}"], cache = time_stateful(cycle, cache, iters, reps)
  return times


def bench_moe(model, token_counts, max_per_route_tokens, reps):
  """Seconds per call of one MoE layer's routed experts, per implementation and token count."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

  moe = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
  graphdef, state = nnx.split(moe)
  hidden = model.config.hidden_size
  rows = []
  for n in token_counts:
    xs = [jax.random.normal(jax.random.key(i), (n, hidden), jnp.bfloat16) for i in range(4)]
    row = {"tokens": n}
    impls = ["grouped"] + (["per_route"] if n <= max_per_route_tokens else [])
    for impl in impls:
      row[impl] = time_jax(
        lambda x, s, impl=impl: nnx.merge(graphdef, s)(x, moe_impl=impl), xs, state, reps=reps
      )
    # One grouped projection (gate: [N * k, H] x [E, H, I]), XLA vs Pallas Mosaic GPU.
    weights, expert_ids = jax.jit(lambda x, s: nnx.merge(graphdef, s).gate(x))(xs[0], state)
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat)
    group_sizes = jnp.bincount(flat, length=moe.experts.gate.shape[0]).astype(jnp.int32)
    lhs = [x[order // expert_ids.shape[1]] for x in xs]
    gate = moe.experts.gate[...]
    row["projection_xla"] = time_jax(
      lambda a, w, g: jax.lax.ragged_dot(a, w, g, preferred_element_type=jnp.float32),
      lhs,
      gate,
      group_sizes,
      reps=reps,
    )
    try:
      row["projection_pallas"] = time_jax(
        lambda a, w, g: ragged_dot_mgpu.ragged_dot(
          a,
          w,
          group_sizes=g,
          block_m=64,
          block_n=128,
          block_k=64,
          max_concurrent_steps=4,
          grid_block_n=1,
        ),
        lhs,
        gate,
        group_sizes,
        reps=reps,
      )
    except Exception as error:  # report, do not hide: the kernel's limits are part of the result
      row["projection_pallas_error"] = f"{type(error).__name__}: {str(error)[:200]}"
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
  parser.add_argument("--k", type=int, default=5)
  parser.add_argument("--context", type=int, default=2048)
  parser.add_argument("--page-size", type=int, default=16)
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument(
    "--moe-tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
  )
  parser.add_argument(
    "--moe",
    choices=("auto", "xla", "pallas", "grouped", "per_route"),
    default="auto",
    help="the steps' MoE choice (KernelChoices.moe); 'xla' = the policy before the Pallas kernel",
  )
  parser.add_argument(
    "--no-moe-table", action="store_true", help="skip the per-implementation MoE table"
  )
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, runs on the CPU")
  parser.add_argument("--out", type=Path, default=RESULTS / "draft_pruning")
  args = parser.parse_args()

  if args.smoke:
    base = tiny()
    args.batches, args.context, args.iters, args.reps = [1, 4], 24, 2, 2
    args.moe_tokens = [1, 8]
  else:
    base = glm45_air()
  shallow = _model(base.replace(num_hidden_layers=2), seed=0)  # 1 dense + 1 MoE (+ MTP)
  results = {
    "benchmark": "draft_pruning",
    "device": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "date": datetime.date.today().isoformat(),
    "shape": {
      k: getattr(base, k)
      for k in (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "vocab_size",
      )
    },
    "k": args.k,
    "context": args.context,
    "moe_choice": args.moe,
    "cycles": {},
  }
  for batch in args.batches:
    times = bench_cycle(
      shallow, batch, args.k, args.context, args.page_size, args.iters, args.reps, args.moe
    )
    results["cycles"][batch] = times
    print(
      json.dumps({"batch": batch, **{k: round(v * 1e6, 1) for k, v in times.items()}}), flush=True
    )
  results["moe"] = [] if args.no_moe_table else bench_moe(shallow, args.moe_tokens, 64, args.reps)
  del shallow
  deeper = _model(base.replace(num_hidden_layers=3), seed=1)  # one more MoE layer
  for batch in args.batches:
    verify = bench_cycle(
      deeper,
      batch,
      args.k,
      args.context,
      args.page_size,
      args.iters,
      args.reps,
      args.moe,
      with_draft=False,
    )["verify"]
    results["cycles"][batch]["verify_one_more_moe_layer"] = verify
  write_results(results, args.out)


def write_results(results, out: Path):
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix(".json").write_text(json.dumps(results, indent=2))
  real_moe_layers = 45  # GLM-4.5-Air: 46 layers, the first dense
  lines = [
    f"# MTP draft row pruning ({results['device']}, jax {results['jax']}, {results['date']})",
    "",
    f"GLM-4.5-Air shapes, random bf16 weights, k = {results['k']}, context "
    f"{results['context']} tokens per request, MoE choice '{results.get('moe_choice', 'xla')}'; "
    "microseconds, median.",
    "",
    "| batch | first step unpruned | first step pruned | ratio | draft (k steps) unpruned | "
    "pruned | verify (2 layers) | cycle unpruned | cycle pruned | cycle ratio | "
    "est. cycle ratio at 46 layers |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for batch, t in results["cycles"].items():
    per_moe_layer = t["verify_one_more_moe_layer"] - t["verify"]
    full_verify = t["verify"] + (real_moe_layers - 1) * per_moe_layer
    est_unpruned = full_verify + t["draft_all_unpruned"]
    est_pruned = full_verify + t["draft_all_pruned"]
    lines.append(
      f"| {batch} | {t['draft_first_step_unpruned'] * 1e6:.0f} | "
      f"{t['draft_first_step_pruned'] * 1e6:.0f} | "
      f"{t['draft_first_step_unpruned'] / t['draft_first_step_pruned']:.2f}x | "
      f"{t['draft_all_unpruned'] * 1e6:.0f} | {t['draft_all_pruned'] * 1e6:.0f} | "
      f"{t['verify'] * 1e6:.0f} | {t['cycle_unpruned'] * 1e6:.0f} | "
      f"{t['cycle_pruned'] * 1e6:.0f} | {t['cycle_unpruned'] / t['cycle_pruned']:.3f}x | "
      f"{est_unpruned / est_pruned:.3f}x |"
    )
  if not results["moe"]:
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return
  lines += [
    "",
    "## Routed-expert MoE of one layer (microseconds)",
    "",
    "| tokens | per_route | grouped (ragged_dot) | one projection XLA | "
    "one projection Pallas MGPU |",
    "|---|---|---|---|---|",
  ]
  for row in results["moe"]:

    def us(key, row=row):
      return f"{row[key] * 1e6:.0f}" if key in row else "-"

    lines.append(
      f"| {row['tokens']} | {us('per_route')} | {us('grouped')} | "
      f"{us('projection_xla')} | {us('projection_pallas')} |"
    )
  out.with_suffix(".md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
