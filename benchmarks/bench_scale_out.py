"""GLM-4.5-Air at full size on a tensor-parallel mesh: decode, verify, draft and the MTP cycle.

Runs on the GPUs of one host (two H200s for GLM-4.5-Air: 212 GB of bf16 weights do not fit one).
The model is GLM-4.5-Air's (46 layers + the MTP layer, hidden 4096, 96 / 8 heads, 128 routed
experts top-8 + 1 shared, partial RoPE 0.5, bf16) with random weights created directly in their
shards (one small program per parameter shape), and a paged cache of random values (never zeros)
holding `--context` tokens per request. In one process:

1. ceilings, measured here: per-GPU read bandwidth (a float32 sum over a bf16 array of 4 GiB per
   GPU) and the latency of one all-reduce of `[rows, hidden]` bf16 over the mesh, alone;
2. the decode step (one token per request) at each `--batches` size, against the roofline
   `bytes the step must read per GPU / per-GPU read bandwidth + all-reduces x their latency`,
   where the bytes are every non-expert weight the step reads (lm head included, embedding rows
   not), the routed experts the batch touches (expected count for uniform routing:
   `E * (1 - (1 - k / E) ** B)` per layer) and the KV cache of the batch;
3. verify steps (k = 1, 3, 5) and the draft step (pruned and unpruned), the speculative cycle
   (verify + k drafts in one program, `cycle_step`, as the engine runs it) against one plain
   decode step, at `--spec-batches`;
4. the largest batch x context that fits beside the weights (from the free device memory);
5. the GPU kernels of one decode step (CUPTI): attention, routed experts, collectives, the rest,
   and the gap to the wall time.

Every step is compiled once, before timing, in parallel threads. Results are written after every
measurement to `--out`.json / .md (the last table is printed at the end).

Usage (two GPUs; NVLink multicast stays off):
  NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python benchmarks/bench_scale_out.py
  python benchmarks/bench_scale_out.py --smoke   # CPU, tiny model, one device
"""

import argparse
import datetime
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxspec
from benchmarks._timing import ProfileFailed, dispatch_seconds, profile_stateful, time_stateful
from jaxspec.model import sharding
from jaxspec.model.config import glm45_air, tiny
from jaxspec.model.metadata import KernelChoices
from jaxspec.serving.kv_cache import BlockAllocator
from jaxspec.serving.model_graph import split_model
from jaxspec.serving.sampling import GREEDY
from jaxspec.serving.spec_steps import CycleState, DraftInputs, cycle_step, draft_step, verify_step
from jaxspec.serving.steps import decode_step

RESULTS = Path(__file__).parent / "results"
KERNELS = KernelChoices()


def _write(results, out: Path) -> None:
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix(".json").write_text(json.dumps(results, indent=2, default=float))
  out.with_suffix(".md").write_text(_markdown(results))


def _wall_seconds(fn, args_list, iters: int) -> float:
  """Median over 3 repeats of the wall time of `iters` back-to-back calls (cycling through
  `args_list`), synchronised once, per call. For programs over several devices, where the
  launch-difference method of `time_jax` does not hold."""
  jax.block_until_ready(fn(*args_list[0]))
  samples = []
  for _ in range(3):
    start = time.perf_counter()
    out = None
    for i in range(iters):
      out = fn(*args_list[i % len(args_list)])
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - start) / iters)
  return float(np.median(samples))


def _read_bandwidth(mesh, gib_per_device: float) -> float:
  """Bytes per second one GPU reads (float32 sum of a bf16 array, per device)."""
  devices = mesh.devices.size
  rows = int(gib_per_device * 2**30 / (2 * 8192)) * devices
  spec = NamedSharding(mesh, P(("ep", "tp")))
  make = jax.jit(lambda k: jax.random.normal(k, (rows, 8192), jnp.bfloat16), out_shardings=spec)
  xs = [(make(jax.random.key(i)),) for i in range(2)]
  seconds = _wall_seconds(jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)), xs, 20)
  return rows // devices * 8192 * 2 / seconds


def _allreduce_latency(mesh, rows: int, hidden: int) -> float:
  """Seconds of one all-reduce of [rows, hidden] bf16 over every mesh device: one program runs
  `repeats` dependent all-reduces back to back, so launch costs drop out."""
  repeats = 64

  def chain(x):
    def body(_, a):
      return jax.lax.psum(a, ("ep", "tp")) * 0.5

    return jax.lax.fori_loop(0, repeats, body, x)

  run = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
  x = jax.random.normal(jax.random.key(0), (rows, hidden), jnp.bfloat16)
  return _wall_seconds(run, [(x,)], 5) / repeats


def _random_cache(model, num_pages, page_size, key):
  """The model's cache (target and MTP layers) in its shards, filled with random values.

  Each array is created random where it lives, one at a time: beside 102 GiB of weights per GPU,
  zeroed pages filled afterwards (two copies of a page array at a time, whenever XLA does not
  reuse the donated one) ran out of memory.
  """
  abstract = jax.eval_shape(lambda: model.init_cache(num_pages, page_size, draft=True))
  leaves, treedef = jax.tree.flatten(abstract)
  shardings = jax.tree.leaves(sharding.cache_shardings(abstract, model.config, model.mesh))
  fills = {}  # one compiled fill per (shape, dtype, sharding), shared by the layers
  filled = []
  for i, (leaf, placement) in enumerate(zip(leaves, shardings, strict=True)):
    signature = (leaf.shape, leaf.dtype, placement)
    if signature not in fills:
      fills[signature] = jax.jit(
        lambda k, shape=leaf.shape, dtype=leaf.dtype: jax.random.normal(k, shape, dtype),
        out_shardings=placement,
      )
    filled.append(fills[signature](jax.random.fold_in(key, i)))
  return jax.tree.unflatten(treedef, filled)


def _gib_in_use() -> str:
  stats = [d.memory_stats() or {} for d in jax.local_devices()]
  return ", ".join(f"{s.get('bytes_in_use', 0) / 2**30:.1f}" for s in stats) + " GiB in use"


def _random_model(config, mesh, seed: int):
  """GLM weights of the config's shapes created parameter by parameter in their shards: N(0, 0.02)
  matrices (the modules' init), norm weights 1 and biases 0.

  One small program per distinct (shape, dtype, sharding), shared by all layers: the whole model
  as one initialisation program took 206 s to compile at 46 layers.
  """

  def build():
    return jaxspec.GlmForCausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed), mesh=mesh)

  abstract = nnx.eval_shape(build)
  graphdef, abstract_state = nnx.split(abstract)
  specs = sharding.param_specs(abstract, sharding.sharding_rules(config, mesh))
  makers = {}
  flat = []
  for i, (path, variable) in enumerate(nnx.to_flat_state(abstract_state)):
    shape, dtype = tuple(variable.shape), variable.get_value().dtype
    target = NamedSharding(mesh, specs[path])
    if len(shape) >= 2:
      kind = "normal"
    elif path[-1] == "weight" and "e_score_correction_bias" not in path:
      kind = "ones"
    else:
      kind = "zeros"
    signature = (shape, dtype, target, kind)
    if signature not in makers:

      def make(k, shape=shape, dtype=dtype, kind=kind):
        if kind == "normal":
          return (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
        return (jnp.ones if kind == "ones" else jnp.zeros)(shape, dtype)

      makers[signature] = jax.jit(make, out_shardings=target)
    flat.append((path, variable.replace(makers[signature](jax.random.key(seed * 100003 + i)))))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _weight_bytes(model, batch: int) -> tuple[float, float]:
  """(non-expert weight bytes a decode step reads, expected routed-expert bytes for `batch`
  tokens), whole model (all devices together)."""
  config = model.config
  dense, expert = 0, 0
  for path, variable in nnx.to_flat_state(nnx.state(model.model, nnx.Param)):
    nbytes = math.prod(variable.shape) * jnp.dtype(variable.get_value().dtype).itemsize
    if path[-1] == "embedding":
      continue  # a step reads only its tokens' rows
    if path[-3:-1] == ("mlp", "experts"):
      expert += nbytes
    else:
      dense += nbytes
  if model.lm_head is not None:
    dense += model.lm_head.kernel.size * model.lm_head.kernel.dtype.itemsize
  e, k = config.n_routed_experts, config.num_experts_per_tok
  touched = e * (1 - (1 - k / e) ** batch)
  return dense, expert * touched / e


def _kv_bytes_per_token(model) -> float:
  """Cache bytes one token occupies in all target layers (all devices together)."""
  cache = jax.eval_shape(lambda: model.init_cache(1, 1))
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache.layers))


def _categorise(kernels) -> dict[str, float]:
  totals = {"attention": 0.0, "routed_experts": 0.0, "collectives": 0.0, "other": 0.0}
  for name, seconds in kernels:
    lower = name.lower()
    if "nccl" in lower or "allreduce" in lower or "all_reduce" in lower:
      totals["collectives"] += seconds
    elif "attention" in lower:
      totals["attention"] += seconds
    elif "gate_up" in lower or "down_kernel" in lower or "routed" in lower:
      totals["routed_experts"] += seconds
    else:
      totals["other"] += seconds
  return totals


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=46)
  parser.add_argument("--tp", type=int, default=2)
  parser.add_argument("--ep", type=int, default=1)
  parser.add_argument("--context", type=int, default=4096)
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
  parser.add_argument("--spec-batches", type=int, nargs="+", default=[1, 64])
  parser.add_argument("--ks", type=int, nargs="+", default=[1, 3, 5])
  parser.add_argument("--page-size", type=int, default=16)
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--no-profile", action="store_true")
  parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
  parser.add_argument("--out", type=Path, default=RESULTS / "scale_out")
  args = parser.parse_args()
  started = time.perf_counter()

  def log(message):
    print(f"[{time.perf_counter() - started:6.1f} s] {message}", flush=True)

  if args.smoke:
    config = tiny(num_nextn_predict_layers=1)
    args.tp = min(args.tp, len(jax.devices()))
    args.batches, args.spec_batches, args.ks = [1, 4], [1, 4], [1, 3]
    args.context, args.page_size, args.iters, args.reps = 24, 4, 2, 2
    bandwidth_gib = 0.001
  else:
    config = glm45_air().replace(num_hidden_layers=args.layers)
    bandwidth_gib = 4.0
  mesh = jaxspec.make_mesh(tp=args.tp, ep=args.ep)
  results = {
    "benchmark": "scale_out",
    "device": jax.devices()[0].device_kind,
    "num_devices": mesh.devices.size,
    "jax": jax.__version__,
    "date": datetime.date.today().isoformat(),
    "mesh": {"tp": args.tp, "ep": args.ep},
    "model": {"layers": config.num_hidden_layers, "preset": "tiny" if args.smoke else "glm45_air"},
    "context": args.context,
    "page_size": args.page_size,
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }

  read_bw = _read_bandwidth(mesh, bandwidth_gib)
  results["read_bandwidth_per_gpu"] = read_bw
  q_lens = [1, *(k + 1 for k in args.ks)]
  rows_needed = sorted({b * q for b in args.batches + args.spec_batches for q in q_lens})
  results["allreduce_s"] = {
    rows: _allreduce_latency(mesh, rows, config.hidden_size) for rows in rows_needed
  }
  log(f"read bandwidth {read_bw / 1e12:.2f} TB/s per GPU; all-reduce {results['allreduce_s']}")
  _write(results, args.out)

  t0 = time.perf_counter()
  model = _random_model(config, mesh, seed=0)
  jax.block_until_ready(nnx.state(model))
  results["init_s"] = time.perf_counter() - t0
  log(f"model created in its shards in {results['init_s']:.1f} s ({_gib_in_use()})")
  graph, params = split_model(model)

  max_batch = max(args.batches + args.spec_batches)
  max_q = max(args.ks) + 1
  pages_per_request = -(-(args.context + 2 * max_q + 1) // args.page_size)
  allocator = BlockAllocator(max_batch * pages_per_request, args.page_size, shuffle_seed=0)
  block_tables = jnp.asarray(
    [allocator.allocate(pages_per_request) for _ in range(max_batch)], jnp.int32
  )
  cache = _random_cache(model, allocator.num_pages, args.page_size, jax.random.key(1))
  jax.block_until_ready(cache)
  log(f"cache of {allocator.num_pages} pages created ({_gib_in_use()})")
  stats = jax.devices()[0].memory_stats() or {}
  kv_per_token = _kv_bytes_per_token(model)
  results["kv_bytes_per_token"] = kv_per_token
  if stats:
    free = stats["bytes_limit"] - stats["bytes_in_use"]
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache)) / mesh.devices.size
    tokens = (free + cache_bytes) * mesh.devices.size / kv_per_token
    results["capacity"] = {
      "free_bytes_per_gpu_beside_weights": free + cache_bytes,
      "max_tokens": tokens,
      "max_batch_at_context": {ctx: int(tokens // ctx) for ctx in (4096, 32768, 131072)},
    }
    log(f"capacity: {results['capacity']}")
  _write(results, args.out)

  rng = np.random.default_rng(0)
  vocab = config.vocab_size

  def tokens(batch, width):
    return jnp.asarray(rng.integers(0, vocab, (batch, width)), jnp.int32)

  # Phase 1: the decode steps (compiled together in threads), timed against the roofline.
  lowered = {}
  for batch in args.batches:
    lowered[batch] = decode_step.trace(
      graph,
      params,
      cache,
      tokens(batch, 1)[:, 0],
      jnp.full((batch,), args.context + 1, jnp.int32),
      block_tables[:batch],
      jax.random.key(0),
      sampling=GREEDY,
      kernels=KERNELS,
    ).lower()
  compiled = _compile_all(lowered, results, log)
  _write(results, args.out)

  def decode_call(batch):
    """`cache -> (next_tokens, cache)`: the compiled decode step of `batch` requests."""
    step, token_ids = compiled[batch], tokens(batch, 1)[:, 0]
    seq_lens = jnp.full((batch,), args.context + 1, jnp.int32)
    return lambda cache: step(
      params, cache, token_ids, seq_lens, block_tables[:batch], jax.random.key(0)
    )

  results["decode"] = {}
  dense_bytes, _ = _weight_bytes(model, 1)
  for batch in args.batches:
    if batch not in compiled:
      continue
    decode = decode_call(batch)

    def run(cache, decode=decode):
      return decode(cache)[1]

    seconds, cache = time_stateful(run, cache, args.iters, args.reps)
    dispatch, cache = dispatch_seconds(run, cache, args.reps)
    _, expert_bytes = _weight_bytes(model, batch)
    kv_bytes = batch * (args.context + 1) * kv_per_token
    per_gpu = (dense_bytes + expert_bytes + kv_bytes) / mesh.devices.size
    collectives = 2 * config.num_hidden_layers * results["allreduce_s"][batch]
    roofline = per_gpu / read_bw + collectives
    results["decode"][batch] = {
      "step_s": seconds,
      "dispatch_s": dispatch,
      "tokens_per_s": batch / seconds,
      "bytes_per_gpu": per_gpu,
      "roofline_s": roofline,
      "collectives_s": collectives,
      "ratio_to_roofline": seconds / roofline,
    }
    log(
      f"decode B{batch}: {seconds * 1e3:.2f} ms (host dispatch {dispatch * 1e3:.2f} ms), "
      f"roofline {roofline * 1e3:.2f} ms"
    )
    _write(results, args.out)

  # What a step's host dispatch costs before any kernel: a program that takes the same
  # parameters and (donated) cache and does nothing. The rest of a step's dispatch is its own
  # kernel launches.
  noop = jax.jit(lambda params, cache: cache, donate_argnums=1)
  cache = noop(params, cache)  # compiles
  results["noop_dispatch_s"], cache = dispatch_seconds(
    lambda cache: noop(params, cache), cache, args.reps
  )
  log(f"no-op program with the step's arguments: {results['noop_dispatch_s'] * 1e3:.2f} ms")
  _write(results, args.out)

  # Phase 2: verify, draft (pruned and unpruned) and the cycle.
  lowered = {}
  for batch in args.spec_batches:
    for k in args.ks:
      q_len = k + 1
      lowered["verify", batch, k] = verify_step.trace(
        graph,
        params,
        cache,
        tokens(batch, q_len),
        jnp.full((batch,), args.context + q_len, jnp.int32),
        block_tables[:batch],
        None,
        jax.random.key(0),
        sampling=GREEDY,
        kernels=KERNELS,
      ).lower()
      inputs = _draft_inputs(config, batch, k, args.context, block_tables[:batch], rng)
      for prune in (True, False):
        drafting = dict(num_draft=k, sampling=GREEDY, kernels=KERNELS, prune=prune)
        state = CycleState(
          tokens(batch, 1)[:, 0],
          tokens(batch, k),
          None,
          jnp.full((batch,), args.context + q_len, jnp.int32),
        )
        lowered["cycle", batch, k, prune] = cycle_step.trace(
          graph,
          params,
          cache,
          state,
          block_tables[:batch],
          jax.random.key(0),
          **drafting,
        ).lower()
        lowered["draft", batch, k, prune] = draft_step.trace(
          graph, params, cache, inputs, jax.random.key(0), **drafting
        ).lower()
  compiled.update(_compile_all(lowered, results, log))
  results["speculative"] = {}
  key = jax.random.key(0)
  for batch in args.spec_batches:
    for k in args.ks:
      q_len = k + 1
      needed = [("verify", batch, k)] + [
        (name, batch, k, prune) for name in ("draft", "cycle") for prune in (True, False)
      ]
      if not all(name in compiled for name in needed):
        continue
      verify = compiled["verify", batch, k]
      token_ids = tokens(batch, q_len)
      seq_lens = jnp.full((batch,), args.context + q_len, jnp.int32)
      inputs = _draft_inputs(config, batch, k, args.context, block_tables[:batch], rng)

      def run_verify(cache, verify=verify, token_ids=token_ids, seq_lens=seq_lens, batch=batch):
        return verify(params, cache, token_ids, seq_lens, block_tables[:batch], None, key)[-1]

      row = {}
      row["verify_s"], cache = time_stateful(run_verify, cache, args.iters, args.reps)
      for prune in (True, False):
        draft, cycle = compiled["draft", batch, k, prune], compiled["cycle", batch, k, prune]

        def run_draft(cache, draft=draft, inputs=inputs):
          return draft(params, cache, inputs, key)[-1]

        def run_cycle(cache, cycle=cycle, token_ids=token_ids, seq_lens=seq_lens, batch=batch):
          state = CycleState(token_ids[:, 0], token_ids[:, 1:], None, seq_lens)
          return cycle(params, cache, state, block_tables[:batch], key)[-1]

        tag = "pruned" if prune else "unpruned"
        row[f"draft_{tag}_s"], cache = time_stateful(run_draft, cache, args.iters, args.reps)
        row[f"cycle_{tag}_s"], cache = time_stateful(run_cycle, cache, args.iters, args.reps)
      plain = results["decode"].get(batch, {}).get("step_s")
      if plain:
        row["cycle_over_plain_step"] = row["cycle_pruned_s"] / plain
      row["pruning_gain"] = row["cycle_unpruned_s"] / row["cycle_pruned_s"]
      results["speculative"][f"B{batch} k{k}"] = row
      shown = {n: round(v * 1e3, 3) if n.endswith("_s") else round(v, 3) for n, v in row.items()}
      log(f"B{batch} k{k} (ms, ratios): {json.dumps(shown)}")
      _write(results, args.out)

  if not args.no_profile:
    results["profile"] = {}
    for batch in sorted({min(args.batches), max(args.batches)}):
      if batch not in compiled:
        continue
      try:  # one profiled call: over two GPUs kernels interleave differently from call to call
        per_call, cache = profile_stateful(decode_call(batch), cache, iterations=1)
      except ProfileFailed as error:  # a profiler failure is reported, not fatal
        cache = error.state
        results["profile"][batch] = f"unavailable: {str(error)[:300]}"
        log(f"profile B{batch}: {results['profile'][batch]}")
        _write(results, args.out)
        continue
      kernels = per_call[-1]
      totals = _categorise(kernels)
      wall = results["decode"][batch]["step_s"]
      devices = mesh.devices.size
      results["profile"][batch] = {
        "kernels": len(kernels),
        **{f"{name}_s_per_gpu": value / devices for name, value in totals.items()},
        "gap_s": wall - sum(totals.values()) / devices,
        "top": sorted(kernels, key=lambda item: -item[1])[:12],
      }
      log(f"profile B{batch}: {json.dumps(results['profile'][batch], default=str)[:400]}")
      _write(results, args.out)
  print(_markdown(results))


def _compile_all(lowered: dict, results: dict, log) -> dict:
  """Compiles the lowered steps in parallel threads; a failure is recorded, not fatal."""

  def compile_one(program):
    try:
      return program.compile()
    except Exception as error:  # recorded in the results and skipped
      return error

  started = time.perf_counter()
  with ThreadPoolExecutor(max_workers=min(16, len(lowered))) as pool:
    outcomes = dict(zip(lowered, pool.map(compile_one, lowered.values()), strict=True))
  failures = {
    str(k): f"{type(v).__name__}: {str(v)[:300]}"
    for k, v in outcomes.items()
    if isinstance(v, Exception)
  }
  results.setdefault("compile_failures", {}).update(failures)
  log(
    f"compiled {len(lowered) - len(failures)} of {len(lowered)} steps in "
    f"{time.perf_counter() - started:.1f} s; failures: {failures}"
  )
  return {k: v for k, v in outcomes.items() if not isinstance(v, Exception)}


def _draft_inputs(config, batch, k, context, block_tables, rng) -> DraftInputs:
  q_len = k + 1
  num_accepted = jnp.asarray(rng.integers(0, k + 1, batch), jnp.int32)
  return DraftInputs(
    target_hidden=jax.random.normal(
      jax.random.key(7), (batch, q_len, config.hidden_size), jnp.bfloat16
    ),
    emitted=jnp.asarray(rng.integers(0, config.vocab_size, (batch, q_len)), jnp.int32),
    num_accepted=num_accepted,
    committed_lens=jnp.full((batch,), context + 1, jnp.int32) + num_accepted,
    block_tables=block_tables,
  )


def _markdown(results) -> str:
  lines = [
    f"# Scale-out: GLM-4.5-Air on {results['num_devices']} x {results['device']} "
    f"(tp {results['mesh']['tp']}, ep {results['mesh']['ep']}; jax {results['jax']}, "
    f"{results['date']})",
    "",
    f"{results['model']['layers']} layers + MTP, bf16, random weights, context "
    f"{results['context']}, page {results['page_size']}. Measured read bandwidth per GPU: "
    f"{results.get('read_bandwidth_per_gpu', 0) / 1e12:.2f} TB/s.",
    "",
  ]
  if results.get("xla_flags"):
    lines += [f"XLA_FLAGS: `{results['xla_flags']}`.", ""]
  if "allreduce_s" in results:
    cells = ", ".join(f"{r} rows {s * 1e6:.0f} us" for r, s in results["allreduce_s"].items())
    lines += [f"All-reduce alone (bf16 x hidden): {cells}.", ""]
  if results.get("decode"):
    lines += [
      "| batch | decode step | host dispatch | tokens/s | roofline (bytes/BW + collectives) "
      "| ratio |",
      "|---|---|---|---|---|---|",
    ]
    for batch, row in results["decode"].items():
      lines.append(
        f"| {batch} | {row['step_s'] * 1e3:.2f} ms | {row['dispatch_s'] * 1e3:.2f} ms | "
        f"{row['tokens_per_s']:.0f} | "
        f"{row['roofline_s'] * 1e3:.2f} ms ({row['bytes_per_gpu'] / 1e9:.1f} GB/GPU, "
        f"{row['collectives_s'] * 1e3:.2f} ms) | {row['ratio_to_roofline']:.2f}x |"
      )
    if "noop_dispatch_s" in results:
      lines.append(
        f"\nHost dispatch of a no-op program with the same parameters and cache: "
        f"{results['noop_dispatch_s'] * 1e3:.2f} ms (the rest of a step's dispatch is its own "
        "kernel launches)."
      )
    lines.append("")
  if results.get("speculative"):
    lines += [
      "| step | verify | draft pruned | draft unpruned | cycle pruned | cycle / plain step | "
      "pruning gain |",
      "|---|---|---|---|---|---|---|",
    ]
    for name, row in results["speculative"].items():
      ratio = row.get("cycle_over_plain_step")
      lines.append(
        f"| {name} | {row['verify_s'] * 1e3:.2f} ms | {row['draft_pruned_s'] * 1e3:.2f} ms | "
        f"{row['draft_unpruned_s'] * 1e3:.2f} ms | {row['cycle_pruned_s'] * 1e3:.2f} ms | "
        f"{'-' if ratio is None else f'{ratio:.2f}x'} | {row['pruning_gain']:.3f}x |"
      )
    lines.append("")
  if "capacity" in results:
    capacity = results["capacity"]
    fits = ", ".join(f"{b} x {c}" for c, b in capacity["max_batch_at_context"].items())
    lines += [f"Fits beside the weights (batch x context): {fits}.", ""]
  for batch, row in results.get("profile", {}).items():
    if isinstance(row, dict):
      parts = ", ".join(
        f"{name[:-10]} {value * 1e3:.2f} ms"
        for name, value in row.items()
        if name.endswith("_per_gpu")
      )
      lines.append(f"Decode B{batch} kernels per GPU: {parts}; gap {row['gap_s'] * 1e3:.2f} ms.")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
