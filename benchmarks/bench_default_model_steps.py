"""Where the embedded default model's decode time goes: the plain step against the MTP cycle.

The default model (8 target layers + 1 MTP layer, hidden 256) is far too small to be bound by
its weights or its KV: at batch 1 a step is a few hundred small kernels, and the speed-up of
speculative decoding over plain decoding is set by how many of them, and how fast the host
launches them, a k = 3 cycle (verify the last token and 3 drafts, then 3 MTP passes) costs
against one plain decode step. In one process, at batch 1 with `--context` cached tokens:

1. per step (`decode_step`, and `cycle_step` with k drafts, pruned as the engine runs it): the
   GPU kernels it launches and their summed device time (CUPTI; GPU only), its time back to back
   (`time_stateful`), and the host time for one call to return on an idle device
   (`dispatch_seconds`), next to a no-op program that takes the same parameters and cache;
2. end to end, `Generator` against `SpeculativeGenerator` on the README's prompt (greedy,
   `--max-new-tokens`, the median of `--repeats` alternating runs), as `generate --compare`.

`--moe` repeats the step measurements with other routed-expert implementations
(`KernelChoices.moe`); the end-to-end runs use the engine's own choice. `--shapes` also measures
the two steps of other shapes of the same size with random weights (the sweep that chose the
default model's depth, `SHAPES`): the router's choices differ from a trained model's, and with
them a few kernels (145 against 151 for the 4-layer model's plain step).
Results: `--out`.json / .md. `--smoke` runs a few repeats on the CPU (no kernel profile).
"""

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks._results import command_line, write_results
from benchmarks._timing import ProfileFailed, dispatch_seconds, profile_stateful, time_stateful
from jaxspec.__main__ import DEFAULT_MODEL
from jaxspec.model.metadata import KernelChoices
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.model.weights import load_pretrained
from jaxspec.serving.engine import EngineConfig, Generator
from jaxspec.serving.kv_cache import BlockAllocator
from jaxspec.serving.model_graph import split_model
from jaxspec.serving.sampling import GREEDY
from jaxspec.serving.spec_steps import CycleState, cycle_step
from jaxspec.serving.speculative import SpeculativeConfig, SpeculativeGenerator
from jaxspec.serving.steps import decode_step
from jaxspec.tokenizer import load_tokenizer
from jaxspec.training.trainer import default_model_config

RESULTS = Path(__file__).parent / "results"
PROMPT = "def fibonacci(n):"
# Shapes of about the default model's size (6.5-6.9M parameters at vocabulary 2048), from wide and
# shallow to deep and narrow: {name: changes to default_model_config}.
SHAPES = {
  "4 layers, hidden 320, experts of 96": dict(
    num_hidden_layers=4, hidden_size=320, intermediate_size=640, moe_intermediate_size=96
  ),
  "6 layers, hidden 320, experts of 64": dict(
    num_hidden_layers=6, hidden_size=320, intermediate_size=640, moe_intermediate_size=64
  ),
  "8 layers, hidden 256, experts of 64": dict(
    num_hidden_layers=8, hidden_size=256, intermediate_size=512, moe_intermediate_size=64
  ),
  "10 layers, hidden 224, experts of 64": dict(
    num_hidden_layers=10, hidden_size=224, intermediate_size=448, moe_intermediate_size=64
  ),
  "12 layers, hidden 192, experts of 64": dict(
    num_hidden_layers=12, hidden_size=192, intermediate_size=384, moe_intermediate_size=64
  ),
}


def paged_cache(model, batch: int, num_tokens: int, page_size: int):
  """(block_tables int32 [batch, pages], zeroed cache with the MTP layer's pages) for `batch`
  requests of up to `num_tokens` tokens each, on shuffled pages."""
  pages = -(-num_tokens // page_size)
  allocator = BlockAllocator(batch * pages, page_size, shuffle_seed=0)
  block_tables = jnp.asarray([allocator.allocate(pages) for _ in range(batch)], jnp.int32)
  return block_tables, model.init_cache(allocator.num_pages, page_size, draft=True)


def step_programs(model, kernels: KernelChoices, context: int, num_draft: int, page_size: int):
  """(cache, {name: step}) for one request of `context` cached tokens: `plain` is a decode
  step, `cycle` a verify + draft cycle; each step maps the cache to (outputs, cache)."""
  graph, params = split_model(model)
  block_tables, cache = paged_cache(model, 1, context + 2 * (num_draft + 1), page_size)
  key = jax.random.key_data(jax.random.key(0))
  seq_lens = jnp.asarray([context], jnp.int32)
  statics = dict(sampling=GREEDY, kernels=kernels)

  def plain(cache):
    tokens = jnp.ones((1,), jnp.int32)
    return decode_step(graph, params, cache, tokens, seq_lens, block_tables, key, **statics)

  def cycle(cache):
    last, drafts = jnp.ones((1,), jnp.int32), jnp.ones((1, num_draft), jnp.int32)
    state = CycleState(last, drafts, None, seq_lens)
    *outputs, cache = cycle_step(
      graph, params, cache, state, block_tables, key, num_draft=num_draft, prune=True, **statics
    )
    return outputs, cache

  noop = jax.jit(lambda params, cache: cache, donate_argnums=1)

  def no_op(cache):
    cache = noop(params, cache)
    return cache, cache

  return cache, {"plain": plain, "cycle": cycle, "no_op": no_op}


def measure_steps(model, kernels, args) -> dict:
  cache, steps = step_programs(model, kernels, args.context, args.spec_tokens, args.page_size)
  row = {}
  for name, step in steps.items():
    seconds, cache = time_stateful(lambda c, step=step: step(c)[1], cache, args.iters, args.reps)
    dispatch, cache = dispatch_seconds(lambda c, step=step: step(c)[1], cache, 5 * args.reps)
    row[name] = {"step_s": seconds, "dispatch_s": dispatch}
    if name == "no_op":
      continue
    try:
      per_call, cache = profile_stateful(step, cache, iterations=3)
    except ProfileFailed as error:  # the CPU: no CUPTI
      cache = error.state
      row[name]["profile"] = str(error)[:200]
      continue
    kernel_seconds = [sum(t for _, t in call) for call in per_call]
    row[name].update(kernels=len(per_call[0]), gpu_s=statistics.median(kernel_seconds))
  return row


def measure_shapes(vocab_size: int, args) -> dict:
  """`measure_steps` for each of `SHAPES`, random bf16 weights; with each its parameter count."""
  results = {}
  for name, changes in SHAPES.items():
    model = GlmForCausalLM(
      default_model_config(vocab_size).replace(**changes), dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
    )
    params = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    results[name] = {"params": params, **measure_steps(model, KernelChoices(), args)}
    print(name, json.dumps(results[name]), flush=True)
  return results


def measure_loops(model, kernels, args) -> dict:
  """Seconds per step of `--loop-steps` plain steps and k-draft cycles, driven two ways in
  alternating rounds: `read_first` copies each step's tokens to the host before it dispatches the
  next (the engine's loop before it ran one step ahead: the plain step's next input, the cycle's
  lengths, come from the host), `ahead` dispatches step i + 1 before it reads step i's tokens (the
  engine's loop now). Returns {"B{batch} {plain|cycle}": {"read_first"|"ahead": [s per round]}}."""
  results = {}
  for batch in args.loop_batches:
    cache, loops = step_loops(model, kernels, batch, args)
    for kind, (launch, from_host, first) in loops.items():
      times = {"read_first": [], "ahead": []}
      for round_ in range(args.reps + 1):  # round 0 compiles
        for name in times:
          seconds, cache = _drive(launch, from_host, first, cache, args.loop_steps, name == "ahead")
          if round_:
            times[name].append(seconds)
      results[f"B{batch} {kind}"] = times
      print(kind, batch, json.dumps(times), flush=True)
  return results


def step_loops(model, kernels, batch: int, args):
  """(cache, {"plain" | "cycle": (launch, from_host, first input)}) for `batch` requests:
  `launch(cache, state, i)` dispatches step i and returns (its tokens, the next state, cache);
  `from_host(state, tokens)` is the next state made from the tokens read to the host."""
  graph, params = split_model(model)
  k, steps = args.spec_tokens, args.loop_steps
  statics = dict(sampling=GREEDY, kernels=kernels)
  tables, cache = paged_cache(model, batch, args.context + (steps + 1) * (k + 1), args.page_size)
  keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), steps)))
  context = np.full((batch,), args.context, np.int32)

  def plain(cache, tokens, i):
    tokens, cache = decode_step(
      graph, params, cache, tokens, context + i + 1, tables, keys[i], **statics
    )
    return tokens, tokens, cache

  def cycle(cache, state, i):
    emitted, state, cache = cycle_step(
      graph, params, cache, state, tables, keys[i], num_draft=k, prune=True, **statics
    )
    return emitted, state, cache

  def cycle_from_host(state, emitted):  # the lengths computed on the host, from the tokens
    lengths = np.asarray(state.seq_lens) + (emitted >= 0).sum(axis=1).astype(np.int32)
    return dataclasses.replace(state, seq_lens=lengths)

  tokens = np.ones((batch,), np.int32)
  first_state = CycleState(tokens, np.ones((batch, k), np.int32), None, context + k + 1)
  return cache, {
    "plain": (plain, lambda state, tokens: tokens, tokens),
    "cycle": (cycle, cycle_from_host, first_state),
  }


def _drive(launch, from_host, state, cache, steps: int, ahead: bool):
  """(seconds per step, cache) of `steps` launches; every step's tokens are read to the host."""
  start = time.perf_counter()
  if ahead:
    pending, state, cache = launch(cache, state, 0)
    for i in range(1, steps + 1):
      following = None
      if i < steps:
        following, state, cache = launch(cache, state, i)
      np.asarray(pending)
      pending = following
  else:
    for i in range(steps):
      out, state, cache = launch(cache, state, i)
      state = from_host(state, np.asarray(out))
  return (time.perf_counter() - start) / steps, cache


def measure_generation(model, args) -> dict:
  """Median tokens/s of plain and speculative generation (alternating runs), as `generate
  --compare` measures them (the engine's own kernel choices)."""
  prompt = load_tokenizer(DEFAULT_MODEL).encode_prompt(PROMPT)
  config = EngineConfig(max_batch_size=1, max_seq_len=len(prompt) + args.max_new_tokens)
  engines = {
    "speculative": SpeculativeGenerator(model, config, SpeculativeConfig(args.spec_tokens)),
    "plain": Generator(model, config),
  }
  launches = {name: _time_launches(engine) for name, engine in engines.items()}
  runs = {name: [] for name in engines}
  for repeat in range(args.repeats + 1):  # the first round compiles
    for name, engine in engines.items():
      launches[name].clear()
      out = engine.generate([prompt], max_new_tokens=args.max_new_tokens, sampling=GREEDY)
      if repeat:
        runs[name].append((out.metrics, statistics.mean(launches[name])))
  result = {}
  for name, measured in runs.items():
    median, launch_s = sorted(measured, key=lambda run: run[0].tokens_per_s)[len(measured) // 2]
    result[name] = {
      "tokens_per_s": median.tokens_per_s,
      "tokens": median.generated_tokens,
      "tokens_per_step": median.mean_accepted_length if name == "speculative" else 1.0,
      # Host seconds per step: the whole loop iteration, and its dispatch of the next step.
      "step_s": median.itl_s * median.mean_accepted_length,
      "launch_s": launch_s,
    }
  result["speed_up"] = result["speculative"]["tokens_per_s"] / result["plain"]["tokens_per_s"]
  return result


def _time_launches(engine) -> list[float]:
  """The host seconds of each step the engine dispatches (its strategy's `launch`), appended to
  the returned list: where the engine's loop spends its time besides waiting for tokens."""
  seconds, begin = [], engine.strategy.begin

  def timed_begin(*args, **kwargs):
    decoder = begin(*args, **kwargs)
    launch = decoder.launch

    def timed_launch(wave):
      start = time.perf_counter()
      emitted = launch(wave)
      seconds.append(time.perf_counter() - start)
      return emitted

    decoder.launch = timed_launch
    return decoder

  engine.strategy.begin = timed_begin
  return seconds


def render(results) -> str:
  meta = results["meta"]
  lines = [
    "# The default model's plain decode step against its speculative cycle",
    "",
    f"{meta['device']}, jax {meta['jax']}, {meta['date']}; batch 1, {meta['context']} cached "
    f"tokens, k = {meta['spec_tokens']}, bf16; XLA_FLAGS: `{meta['xla_flags'] or '(none)'}`. "
    "Step: back-to-back time per call; dispatch: host time for one call to return on an idle "
    "device; kernels and GPU time: CUPTI, one call. Command: "
    f"`{meta['command']}`.",
    "",
    "| MoE | step | kernels | GPU time | step time | host dispatch |",
    "| --- | --- | --- | --- | --- | --- |",
  ]

  def ms(value):
    return f"{value * 1e3:.3f} ms" if value is not None else "n/a"

  for moe, row in results["steps"].items():
    for name in ("plain", "cycle", "no_op"):
      entry = row[name]
      lines.append(
        f"| {moe} | {name} | {entry.get('kernels', 'n/a')} | {ms(entry.get('gpu_s'))} "
        f"| {ms(entry['step_s'])} | {ms(entry['dispatch_s'])} |"
      )
    plain, cycle = row["plain"], row["cycle"]
    ratios = [f"time {cycle['step_s'] / plain['step_s']:.2f}x"]
    if "kernels" in plain and "kernels" in cycle:
      ratios.append(f"kernels {cycle['kernels'] / plain['kernels']:.2f}x")
      ratios.append(f"GPU time {cycle['gpu_s'] / plain['gpu_s']:.2f}x")
    lines.append(f"| {moe} | cycle / plain | {' / '.join(ratios)} | | | |")
  if "shapes" in results:
    lines += [
      "",
      "Other shapes of the same size (random weights), plain step against k-draft cycle:",
      "",
      "| shape | parameters | plain: kernels / GPU time / step | cycle: kernels / GPU time / step "
      "| cycle / plain: kernels / GPU time |",
      "| --- | --- | --- | --- | --- |",
    ]
    for name, row in results["shapes"].items():
      plain, cycle = row["plain"], row["cycle"]
      cells = [
        f"{entry.get('kernels', 'n/a')} / {ms(entry.get('gpu_s'))} / {ms(entry['step_s'])}"
        for entry in (plain, cycle)
      ]
      ratio = "n/a"
      if "kernels" in plain and "kernels" in cycle:
        ratio = (
          f"{cycle['kernels'] / plain['kernels']:.2f}x / {cycle['gpu_s'] / plain['gpu_s']:.2f}x"
        )
      lines.append(f"| {name} | {row['params'] / 1e6:.2f}M | {cells[0]} | {cells[1]} | {ratio} |")
  if "loops" in results:
    lines += [
      "",
      f"Step loops ({meta.get('loop_steps', 64)} steps, the median of alternating rounds), "
      "reading each step's tokens before the next dispatch against dispatching one step ahead:",
      "",
      "| steps | read first | one step ahead | gain |",
      "| --- | --- | --- | --- |",
    ]
    for name, times in results["loops"].items():
      first, ahead = (statistics.median(times[loop]) for loop in ("read_first", "ahead"))
      lines.append(f"| {name} | {ms(first)} | {ms(ahead)} | {first / ahead:.2f}x |")
  generation = results["generation"]
  lines += [
    "",
    f"End to end (`{PROMPT}`, greedy, {meta['max_new_tokens']} new tokens at most, the median "
    f"of {meta['repeats']} alternating runs): plain "
    f"{generation['plain']['tokens_per_s']:.0f} tok/s, speculative "
    f"{generation['speculative']['tokens_per_s']:.0f} tok/s "
    f"({generation['speculative']['tokens_per_step']:.2f} tokens per cycle, "
    f"{generation['speculative']['tokens']} tokens): {generation['speed_up']:.2f}x.",
  ]
  if "step_s" in generation["plain"]:
    plain, speculative = generation["plain"], generation["speculative"]
    lines.append(
      f"In the engine's loop a plain step took {ms(plain['step_s'])} ({ms(plain['launch_s'])} "
      f"of it dispatching), a cycle {ms(speculative['step_s'])} "
      f"({ms(speculative['launch_s'])} dispatching)."
    )
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--moe", nargs="+", default=["auto"], help="KernelChoices.moe values")
  parser.add_argument("--context", type=int, default=70)
  parser.add_argument("--spec-tokens", type=int, default=3)
  parser.add_argument("--page-size", type=int, default=16)
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--reps", type=int, default=7)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--loop-batches", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--loop-steps", type=int, default=64)
  parser.add_argument("--shapes", action="store_true", help="also measure the SHAPES sweep")
  parser.add_argument("--smoke", action="store_true", help="few repeats, for a CPU check")
  parser.add_argument("--out", type=Path, default=RESULTS / "default_model_steps")
  args = parser.parse_args()
  if args.smoke:
    args.iters, args.reps, args.repeats, args.max_new_tokens, args.loop_steps = 2, 1, 1, 8, 8
  model = load_pretrained(DEFAULT_MODEL, jnp.bfloat16)
  results = {
    "meta": {
      "device": jax.devices()[0].device_kind,
      "jax": jax.__version__,
      "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "command": command_line("bench_default_model_steps.py"),
      **{
        k: getattr(args, k)
        for k in ("context", "spec_tokens", "max_new_tokens", "repeats", "loop_steps")
      },
    },
    "steps": {},
  }
  for moe in args.moe:
    results["steps"][moe] = measure_steps(model, KernelChoices(moe=moe), args)
    print(moe, json.dumps(results["steps"][moe]), flush=True)
  if args.shapes:
    results["shapes"] = measure_shapes(model.config.vocab_size, args)
  results["loops"] = measure_loops(model, KernelChoices(), args)
  results["generation"] = measure_generation(model, args)
  write_results(results, render(results), args.out)


if __name__ == "__main__":
  main()
