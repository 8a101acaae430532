"""Routed experts (one MoE layer's expert MLPs) on one GPU: our kernels against their contenders.

Runs side by side in one process, on the same bf16 weights and the same inputs (fresh random
tokens, routing weights and routing for every timed call; uniform random top-8 routing):

* ``ours``: ``routed_experts(impl="pallas")``, the Mosaic GPU grouped-expert kernels;
* ``xla``: ``routed_experts(impl="xla")``, sorted routes + three ``jax.lax.ragged_dot``;
* ``per_route``: each route's expert matrices gathered (``[T, k, H, I]``) and einsummed, the
  model's small-batch path, where the gather fits in memory;
* ``torch_grouped_mm``: torch ``_grouped_mm`` (CUTLASS) for the three projections, with the
  sort, gather, SwiGLU and weighted scatter-add in torch, on the same weights (DLPack).

Shapes: GLM-4.5-Air (E 128, H 4096, I 1408) and GLM-4.5 (E 160, H 5120, I 1536), top-8, tokens
1, 4, 16, 64, 384, 2048, 8192. The limit of a row is ``max(touched-expert bytes / read
bandwidth, FLOPs / bf16 matmul rate)``, both ceilings measured in this process (a float32 sum
over 1 GiB bf16 arrays; a 8192^3 bf16 matmul). Peak device memory of one call at 8192 tokens is
read from XLA's memory analysis of the compiled call (arguments + outputs + temporaries). A
breakdown lists the CUPTI time of every GPU kernel of one call of ours (GLM-4.5-Air at 1, 64, 2048
and 8192 tokens): where the time goes. Writes ``results/moe.json`` and ``.md`` (after every row, so
a cut run keeps its rows).

``--quick`` times fewer token counts; ``--tokens`` and ``--shapes`` choose them; ``--tune`` adds
a sweep of TuningConfigs per token count (GLM-4.5-Air) to choose defaults from, ``--tune-only``
runs the sweep alone (into ``moe_tuning.json`` and ``.md``); ``--crossover`` alone times
``default_config``'s two choices around its threshold, and transposed tiles sized to hold an
expert's routes, on every shape of ``--shapes`` (into ``moe_crossover.json`` and ``.md``);
``--against FILE`` alone times the Mosaic GPU module in ``FILE`` (another version of
``mosaic_gpu.py``: ``git show main:jaxspec/kernels/routed_experts/mosaic_gpu.py > FILE``, say)
against the installed one, each with its own ``default_config``, at ``--tokens`` (default 2048
and 8192): outputs bit for bit, each kind of kernel by CUPTI, and the layer in rounds that
alternate the two (into ``moe_ab.json`` and ``.md``); ``--intermediate N`` sets every shape's I
to N there, so that the down kernel's work items take other numbers of K steps over the same
items, which separates its cost per item from its cost per step.
``--smoke`` runs tiny shapes in GPU interpret mode on any backend (a check of the script, not a
measurement) and writes to a temporary directory unless ``--out`` is given.

Usage: ``python benchmarks/bench_moe.py [--quick] [--tune | --tune-only] [--tokens N ...]
[--shapes NAME ...]``, ``... --crossover [--shapes NAME ...]``, ``... --against FILE [--tokens
N ...] [--shapes NAME ...] [--intermediate N]``, or any of them with ``--smoke``.
"""

import argparse
import dataclasses
import datetime
import functools
import json
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks._modules import load_module  # noqa: E402
from benchmarks._timing import (  # noqa: E402
  ClockLog,
  busy_seconds,
  kernel_seconds,
  time_jax,
  time_torch,
)
from jaxspec.kernels.dispatch import device_num_sms  # noqa: E402
from jaxspec.kernels.routed_experts import mosaic_gpu  # noqa: E402
from jaxspec.kernels.routed_experts.api import routed_experts  # noqa: E402
from jaxspec.kernels.routed_experts.mosaic_gpu import TuningConfig  # noqa: E402

TOP_K = 8
SHAPES = {"GLM-4.5-Air": (128, 4096, 1408), "GLM-4.5": (160, 5120, 1536)}
TOKENS = (1, 4, 16, 64, 384, 2048, 8192)
QUICK_TOKENS = (1, 64, 384, 2048, 8192)
TUNE_TOKENS = (1, 16, 64, 384, 2048, 8192)
QUICK_TUNE_TOKENS = (1, 64, 384, 8192)
# time_jax's repetitions and warm-up launches for the table's rows; each repetition launches the
# timed program once, then twice back to back.
TIMING_REPS, TIMING_WARMUP = 15, 2
TIMING_LAUNCHES = TIMING_WARMUP + 3 * TIMING_REPS
BREAKDOWN_TOKENS = (1, 64, 2048, 8192)
# Mean routes per expert of the --crossover sweep, around default_config's threshold.
CROSSOVER_ROUTES_PER_EXPERT = (40, 48, 56, 64, 72, 80, 88)
# Expected tiles per expert beyond one that the --crossover sweep's transposed tiles may take.
ONE_TILE_EXCESS = 0.01
SMOKE_SHAPES = {"smoke": (8, 128, 128)}
SMOKE_TOKENS = (1, 5)
# --against: token counts by default, and rounds of the layer's timing (each times both modules).
AB_TOKENS = (2048, 8192)
AB_ROUNDS = 3
PER_ROUTE_MAX_BYTES = 24e9  # the per_route gather of one call must fit next to the rest
PEAK_MEMORY_TOKENS = 8192
RESULTS = pathlib.Path(__file__).resolve().parent / "results"
DTYPE = jnp.bfloat16


@dataclasses.dataclass
class Layer:
  name: str
  w_gate: jax.Array  # [E, H, I]
  w_up: jax.Array
  w_down: jax.Array  # [E, I, H]

  @property
  def expert_bytes(self) -> int:
    _, hidden, intermediate = self.w_gate.shape
    return 3 * hidden * intermediate * jnp.dtype(DTYPE).itemsize

  @property
  def weights(self):
    return (self.w_gate, self.w_up, self.w_down)


def make_layer(name, num_experts, hidden, intermediate, seed=0) -> Layer:
  keys = jax.random.split(jax.random.key(seed), 3)
  shapes = [(num_experts, hidden, intermediate)] * 2 + [(num_experts, intermediate, hidden)]
  scales = [hidden**-0.5, hidden**-0.5, intermediate**-0.5]
  w = [
    jax.random.normal(key, shape, DTYPE) * jnp.asarray(scale, DTYPE)
    for key, shape, scale in zip(keys, shapes, scales, strict=True)
  ]
  return Layer(name, *w)


def fresh_inputs(rng, num_tokens, num_experts, hidden, count):
  """``count`` distinct (x, expert_ids, weights): uniform top-k routing, distinct experts."""
  variants = []
  for _ in range(count):
    key = jax.random.key(int(rng.integers(1 << 31)))
    x = jax.random.normal(key, (num_tokens, hidden), DTYPE)
    ids = np.argsort(rng.random((num_tokens, num_experts)), axis=1)[:, :TOP_K]
    weights = rng.uniform(0.05, 0.3, (num_tokens, TOP_K))
    variants.append((x, jnp.asarray(ids, jnp.int32), jnp.asarray(weights, jnp.float32)))
  return variants


def calls_per_program(seconds_per_call: float, limit: int) -> int:
  """Calls per timed program: long enough to outlast its host dispatch, at most ``limit``."""
  return int(np.clip(round(2e-3 / max(seconds_per_call, 1e-6)), 2, limit))


def timed(fn, variants, layer, reps, warmup=2):
  return time_jax(fn, variants, *layer.weights, reps=reps, warmup=warmup)


def jax_contender(impl, config=None, interpret=False):
  def fn(variant, w_gate, w_up, w_down):
    x, ids, weights = variant
    chosen = config
    if interpret and chosen is None:  # the default tuning on a few simulated SMs
      num_tokens, top_k = ids.shape
      num_experts, hidden, intermediate = w_gate.shape
      default = mosaic_gpu.default_config(num_tokens, top_k, num_experts, hidden, intermediate)
      chosen = dataclasses.replace(default, num_sms=4)
    return routed_experts(
      x, ids, weights, w_gate, w_up, w_down, impl=impl, config=chosen, interpret=interpret
    )

  return fn


def per_route(variant, w_gate, w_up, w_down):
  """The model's per_route formula: gather each route's matrices, einsum, weighted sum."""
  x, ids, weights = variant
  gate, up, down = w_gate[ids], w_up[ids], w_down[ids]  # [T, k, H, I], [T, k, I, H]
  g = jnp.einsum("nh,nkhi->nki", x, gate, preferred_element_type=jnp.float32)
  u = jnp.einsum("nh,nkhi->nki", x, up, preferred_element_type=jnp.float32)
  act = (jax.nn.silu(g) * u).astype(DTYPE)
  y = jnp.einsum("nki,nkih->nkh", act, down, preferred_element_type=jnp.float32)
  return jnp.einsum("nkh,nk->nh", y, weights).astype(x.dtype)


def time_torch_grouped_mm(layer, variants):
  """torch ``_grouped_mm`` for the three projections; sort, gather, SwiGLU and scatter-add in
  torch. CUDA events around back-to-back calls over the variants."""
  import torch

  w_gate, w_up, w_down = (torch.from_dlpack(w) for w in layer.weights)
  num_experts = w_gate.shape[0]
  inputs = [tuple(torch.from_dlpack(a) for a in variant) for variant in variants]

  def moe(x, ids, weights):
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // ids.shape[1]
    offsets = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0).to(torch.int32)
    xs = x[token]
    g = torch._grouped_mm(xs, w_gate, offs=offsets)
    u = torch._grouped_mm(xs, w_up, offs=offsets)
    act = torch.nn.functional.silu(g) * u
    y = torch._grouped_mm(act, w_down, offs=offsets).float() * weights.reshape(-1)[order, None]
    return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, token, y)

  state = {"i": 0}

  def call():
    state["i"] = (state["i"] + 1) % len(inputs)
    return moe(*inputs[state["i"]])

  seconds = time_torch(call, inner=len(inputs))
  try:  # the XLA reference may not fit at the largest sizes; the timing stands without it
    want = routed_experts(*variants[0], *layer.weights, impl="xla")
    error = relative_rms(jax.dlpack.from_dlpack(moe(*inputs[0]).contiguous()), want)
  except Exception as failure:
    error = f"not computed: {type(failure).__name__}: {str(failure)[:120]}"
  return seconds, error


def relative_rms(out, want) -> float:
  out, want = (jnp.asarray(a, jnp.float32) for a in (out, want))
  return float(jnp.sqrt(jnp.mean((out - want) ** 2) / jnp.mean(want**2)))


def measure_read_bandwidth(num_bytes=1 << 30):
  """TB/s of float32 sums over four distinct bf16 arrays: a practical read ceiling."""
  keys = jax.random.split(jax.random.key(0), 4)
  arrays = [jax.random.normal(k, (num_bytes // 2,), jnp.bfloat16) for k in keys]
  seconds = time_jax(lambda x: jnp.sum(x.astype(jnp.float32)), arrays)
  return arrays[0].nbytes / seconds / 1e12


def matmul_operands(count, size):
  """``count`` distinct bf16 [size, size] left operands and one right operand."""
  keys = jax.random.split(jax.random.key(1), count)
  lhs = [jax.random.normal(k, (size, size), jnp.bfloat16) for k in keys]
  return lhs, jax.random.normal(jax.random.key(2), (size, size), jnp.bfloat16)


def bf16_matmul(a, b):
  return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def measure_matmul_rate(size=8192):
  """TFLOP/s of a bf16 [size, size] @ [size, size] matmul with float32 accumulation."""
  lhs, rhs = matmul_operands(3, size)
  return 2 * size**3 / time_jax(bf16_matmul, lhs, rhs) / 1e12


def sustained_matmul_rate(seconds_per_launch, ceiling_tflops, size=8192):
  """The matmul rate of ``measure_matmul_rate`` under a load as long as a timed program's.

  A program of as many distinct matmuls as fill ``seconds_per_launch`` at ``ceiling_tflops`` runs
  ``TIMING_LAUNCHES`` times back to back; every kernel is summed as it ran (``busy_seconds``),
  with the SM clock sampled meanwhile (``ClockLog``). The ceiling times programs of three
  matmuls between host synchronisations; a card at its power cap may run a lower clock under
  the longer load of our timed program, and this says whether the matmul rate holds there.
  Returns ``(TFLOP/s, matmuls per launch, clock)``, the clock as ``sustained_load`` gives it."""
  flops = 2 * size**3
  count = max(1, round(seconds_per_launch * ceiling_tflops * 1e12 / flops))
  lhs, rhs = matmul_operands(count, size)
  program = jax.jit(lambda lhs, rhs: [bf16_matmul(a, rhs) for a in lhs])
  busy, clock = sustained_load(lambda: program(lhs, rhs))
  return count * flops / busy / 1e12, count, clock


def sustained_load(call) -> tuple[float, dict | None]:
  """Device seconds per ``call()`` of ``TIMING_LAUNCHES`` back-to-back ones, every kernel as
  it ran (``busy_seconds``), and the ``ClockSummary`` (as a dict, None without ``nvidia-smi``)
  of the SM clock sampled over them. ``call`` runs once before the log starts, so that its
  compilation is not sampled as an idle card."""
  jax.block_until_ready(call())
  with ClockLog() as clocks:
    busy = busy_seconds(call, jax.block_until_ready, iterations=TIMING_LAUNCHES)
  summary = clocks.summary()
  return busy, None if summary is None else dataclasses.asdict(summary)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """XLA's memory analysis of a compiled call, in bytes: its peak is arguments + outputs +
  temporaries - aliased bytes (an output aliasing an argument is counted in both)."""

  arguments: int
  outputs: int
  temporaries: int
  aliased: int

  @classmethod
  def of(cls, compiled) -> "MemoryReport | None":
    analysis = compiled.memory_analysis()
    if analysis is None:
      return None
    return cls(
      int(analysis.argument_size_in_bytes),
      int(analysis.output_size_in_bytes),
      int(analysis.temp_size_in_bytes),
      int(analysis.alias_size_in_bytes),
    )

  @property
  def peak(self) -> int:
    return self.arguments + self.outputs + self.temporaries - self.aliased


def peak_memory(fn, variant, layer):
  """Bytes of one compiled call: arguments + outputs + temporaries (XLA's memory analysis)."""
  report = MemoryReport.of(jax.jit(fn).lower(variant, *layer.weights).compile())
  if report is None:
    return None
  return {"total": report.peak, "temp": report.temporaries}


def layer_flops(layer, num_tokens) -> int:
  """FLOPs of one call: three projections of every route."""
  _, hidden, intermediate = layer.w_gate.shape
  return 2 * num_tokens * TOP_K * 3 * hidden * intermediate


def layer_limit(layer, num_tokens, touched, ceilings) -> tuple[float, str]:
  """(seconds, "memory" or "compute"): the limit of one call that touches ``touched`` experts,
  max(their weight bytes / read ceiling, FLOPs / matmul ceiling)."""
  memory_s = touched * layer.expert_bytes / (ceilings["read_tbps"] * 1e12)
  compute_s = layer_flops(layer, num_tokens) / (ceilings["matmul_tflops"] * 1e12)
  return max(memory_s, compute_s), "memory" if memory_s >= compute_s else "compute"


def estimated_limit(layer, num_tokens, ceilings) -> tuple[float, str]:
  """``layer_limit`` before the routing is drawn: the experts touched by uniform routing in
  expectation."""
  num_experts = layer.w_gate.shape[0]
  touched_estimate = num_experts * (1 - (1 - TOP_K / num_experts) ** num_tokens)
  return layer_limit(layer, num_tokens, touched_estimate, ceilings)


def timed_calls(layer, num_tokens, ceilings) -> int:
  """Calls in a timed program of ``num_tokens`` tokens: one call's time decides it, estimated
  from the limit."""
  return calls_per_program(estimated_limit(layer, num_tokens, ceilings)[0], 16)


def run_row(rng, layer, num_tokens, ceilings, smoke, contenders):
  num_experts, hidden, _ = layer.w_gate.shape
  count = 1 if smoke else timed_calls(layer, num_tokens, ceilings)
  variants = fresh_inputs(rng, num_tokens, num_experts, hidden, count)
  touched = np.mean([len(np.unique(np.asarray(v[1]))) for v in variants])
  limit_s, bound = layer_limit(layer, num_tokens, touched, ceilings)
  row = {
    "shape": layer.name,
    "tokens": num_tokens,
    "experts_touched": float(touched),
    "limit_us": limit_s * 1e6,
    "limit_bound": bound,
    "calls_per_program": count,
  }
  reps = 1 if smoke else TIMING_REPS
  warmup = 0 if smoke else TIMING_WARMUP
  for name in contenders:
    started = time.perf_counter()
    try:
      if name == "ours":
        fn = jax_contender("pallas", interpret=smoke)
        seconds = timed(fn, variants, layer, reps, warmup)
        try:  # the XLA reference may not fit at the largest sizes; the timing stands without it
          out = fn(variants[0], *layer.weights)
          row["ours_error_vs_xla"] = relative_rms(
            out, jax_contender("xla")(variants[0], *layer.weights)
          )
        except Exception as failure:
          row["ours_error_vs_xla"] = f"not computed: {type(failure).__name__}"
      elif name == "xla":
        # The XLA path takes ~0.1 s per call at 2048 tokens: two calls, few repetitions.
        slow = num_tokens >= 384
        few = variants[:2] if slow else variants
        seconds = timed(jax_contender("xla"), few, layer, 3 if slow else reps, warmup)
      elif name == "per_route":
        gather_bytes = num_tokens * TOP_K * layer.expert_bytes
        if gather_bytes > PER_ROUTE_MAX_BYTES:
          continue
        # Several large gathers in one program could be live at once: two calls there.
        few = variants[:2] if gather_bytes > 2e9 else variants
        seconds = timed(per_route, few, layer, reps, warmup)
      elif name == "torch_grouped_mm":
        seconds, row["torch_error_vs_xla"] = time_torch_grouped_mm(layer, variants)
      row[name] = {"us": seconds * 1e6}
    except Exception as error:  # a contender that cannot run is reported, not fatal
      row[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    print(
      layer.name,
      num_tokens,
      name,
      row[name],
      f"({time.perf_counter() - started:.1f} s)",
      flush=True,
    )
  if num_tokens == PEAK_MEMORY_TOKENS and not smoke:
    for name, impl in (("ours", "pallas"), ("xla", "xla")):
      try:
        row[f"{name}_peak_bytes"] = peak_memory(jax_contender(impl), variants[0], layer)
      except Exception as error:
        row[f"{name}_peak_bytes"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    row["activation_bytes"] = 2 * num_tokens * hidden * jnp.dtype(DTYPE).itemsize  # x and out
    row["weight_bytes"] = num_experts * layer.expert_bytes
  return row


def tuning_configs(num_tokens) -> list[TuningConfig]:
  """Alternatives around the default, per regime: at decode sizes the kernels stream weights (N
  blocks, pipeline depth), at prefill sizes they are wgmma bound (tile shapes); both try a
  producer warpgroup with two consumer warpgroups."""
  if num_tokens <= 64:
    grid = [
      dict(block_n_gate_up=64, block_n_down=64),
      dict(block_n_gate_up=128, block_n_down=128),
      dict(block_n_gate_up=128, block_n_down=256),
      dict(block_n_gate_up=64, block_n_down=128, block_k=128, num_stages=3),
      dict(warpgroups=2, block_n_gate_up=128, block_n_down=128),
      dict(warpgroups=2, block_n_gate_up=128, block_n_down=256),
    ]
  else:
    # 128-row tiles over two consumer warpgroups (64 rows each) halve the weight traffic per
    # FLOP that 64-row tiles pull through L2.
    split_m = dict(warpgroups=2, warpgroup_split="m", block_m=128, block_n_gate_up=128)
    grid = [
      dict(block_n_gate_up=128, block_n_down=256),
      dict(block_m=128, block_n_gate_up=64, block_n_down=128),
      dict(warpgroups=2, block_n_gate_up=128, block_n_down=256),
      dict(split_m, block_n_down=128),
      dict(split_m, block_n_down=128, num_stages=3),
      dict(split_m, block_n_down=256, num_stages=2),
      # Down N blocks of 256 staged in column pieces, which leaves room for a deeper ring.
      dict(split_m, block_n_down=256, num_stages=3, epilogue_n=128),
      dict(split_m, block_n_down=256, num_stages=3, epilogue_n=64),
      dict(split_m, block_n_down=256, num_stages=4, epilogue_n=64),
      dict(split_m, warpgroup_split="n", block_n_down=256, num_stages=3, epilogue_n=64),
      dict(split_m, block_n_down=128, block_k=128, num_stages=2),
      dict(warpgroups=2, block_m=128, block_n_gate_up=128, block_n_down=128),
    ]
    # The prefill config in parts (with the one-part entry above: time_config records the peak
    # memory of the default and of the configs that differ from it only in memory_parts).
    grid += [dict(dataclasses.asdict(mosaic_gpu.PREFILL_CONFIG), memory_parts=p) for p in (2, 4)]
    # Transposed tiles (rows as the wgmma N) of other sizes than default_config's choice.
    transposed = dict(
      split_m, warpgroup_split="n", transposed_tiles=True, block_n_down=256, num_stages=3
    )
    grid += [dict(transposed, block_m=rows, epilogue_n=64) for rows in (136, 144, 152, 184)]
    # One-warpgroup kernels with a two-stage ring, once and twice as many CTAs as SMs: both fit
    # twice in an SM's registers and shared memory (sm_90a: 215 and 154 registers, 82 and 98 KB
    # at GLM-4.5-Air), so with two an SM the hardware can run one CTA's epilogue under the
    # other's wgmmas, the overlap a ping-pong kernel schedules by hand. On an H100 the second CTA
    # gained 1.5x, yet both stayed 1.2-1.4x slower than the default (NOTES_routed_experts.md).
    one_warpgroup = dict(block_m=128, block_n_gate_up=64, block_n_down=128, num_stages=2)
    grid += [dict(one_warpgroup, num_sms=ctas * device_num_sms()) for ctas in (1, 2)]
  return [TuningConfig(**changes) for changes in grid]


def sweep_configs(num_tokens, default: TuningConfig) -> list[TuningConfig]:
  """The default first; with two warpgroups, the default with the gate/up kernel's other source
  of rows (``x`` copied in the kernel, or a gathered ``xs``: ``default_config`` decides it by the
  token count); then ``tuning_configs``."""
  configs = [default]
  if default.warpgroups == 2:
    configs.append(dataclasses.replace(default, gather_in_kernel=not default.gather_in_kernel))
  return configs + [c for c in tuning_configs(num_tokens) if c not in configs]


def tune(rng, layer, token_counts, tuning, save, smoke=False):
  """Times the default and the alternatives of ``tuning_configs`` at each token count; the
  one-warpgroup configs of every token count first, the two-warpgroup ones after (should one
  hang, the others are saved)."""
  num_experts, hidden, intermediate = layer.w_gate.shape
  for warpgroups in (1, 2):
    for num_tokens in token_counts:
      default = mosaic_gpu.default_config(num_tokens, TOP_K, num_experts, hidden, intermediate)
      configs = [c for c in sweep_configs(num_tokens, default) if c.warpgroups == warpgroups]
      if smoke:  # the sweep's code path on a few simulated SMs
        configs = [dataclasses.replace(c, num_sms=4) for c in configs[:1]]
      if not configs:
        continue
      count = 1 if smoke else calls_per_program(num_tokens * 2e-6 + 1e-3, 8)
      variants = fresh_inputs(rng, num_tokens, num_experts, hidden, count)
      for config in configs:
        entry = time_config(layer, variants, config, default, smoke)
        print("tune", entry, flush=True)
        tuning.append(entry)
      save()


def time_config(layer, variants, config, default, smoke=False) -> dict:
  """One sweep entry: ours with ``config`` on ``variants``, or why it could not run."""
  num_tokens = variants[0][0].shape[0]
  entry = {"shape": layer.name, "tokens": num_tokens, "config": dataclasses.asdict(config)}
  entry["default"] = config == default
  reason = mosaic_gpu.unsupported_reason(*variants[0], *layer.weights, config=config)
  if reason:
    entry["error"] = f"unsupported: {reason}"
    return entry
  try:
    fn = jax_contender("pallas", config, interpret=smoke)
    entry["us"] = timed(fn, variants, layer, 1 if smoke else 10, 0 if smoke else 2) * 1e6
    if dataclasses.replace(config, memory_parts=default.memory_parts) == default:
      entry["peak_bytes"] = peak_memory(fn, variants[0], layer)
  except Exception as error:
    entry["error"] = f"{type(error).__name__}: {str(error)[:300]}"
  return entry


def one_tile_rows(num_tokens: int, num_experts: int) -> int:
  """The fewest rows, a multiple of 8 from 64 to ``MAX_TRANSPOSED_ROWS``, whose tiles number at
  most ``ONE_TILE_EXCESS`` more than one per expert in expectation under uniformly random
  routing (each expert's weights read about once, as by 128-row tiles at these sizes)."""
  candidates = range(64, mosaic_gpu.MAX_TRANSPOSED_ROWS + 1, mosaic_gpu.ROW_ALIGN)
  for rows in candidates:
    tiles = mosaic_gpu.expected_tile_rows(num_tokens, TOP_K, num_experts, rows) / rows
    if tiles <= 1.0 + ONE_TILE_EXCESS:
      return rows
  return candidates[-1]


def crossover(rng, layer, tuning, save, smoke=False):
  """Times ``default_config``'s two choices, the one-warpgroup ``decode_config`` and
  ``prefill_config``, on both sides of its threshold (``CROSSOVER_ROUTES_PER_EXPERT`` mean
  routes per expert), all on the same inputs; beside them a candidate for that range, the
  prefill kernels with transposed tiles of ``one_tile_rows`` rows, which multiply fewer padded
  rows than 128-row tiles while still reading each expert's weights about once."""
  num_experts, hidden, intermediate = layer.w_gate.shape
  routes_per_expert = CROSSOVER_ROUTES_PER_EXPERT[3:4] if smoke else CROSSOVER_ROUTES_PER_EXPERT
  for per_expert in routes_per_expert:
    num_tokens = per_expert * num_experts // TOP_K
    shapes = (num_tokens, TOP_K, num_experts, hidden, intermediate)
    prefill = mosaic_gpu.prefill_config(hidden, intermediate)
    rows = one_tile_rows(num_tokens, num_experts)
    configs = {
      "decode": mosaic_gpu.decode_config(*shapes),
      "prefill": prefill,
      "transposed": mosaic_gpu.with_transposed_tiles(prefill, rows),
    }
    variants = fresh_inputs(rng, num_tokens, num_experts, hidden, 1 if smoke else 4)
    default = mosaic_gpu.default_config(*shapes)
    for label, config in configs.items():
      if smoke:  # the sweep's code path on a few simulated SMs
        config = dataclasses.replace(config, num_sms=4)
      entry = time_config(layer, variants, config, default, smoke)
      entry["crossover"] = {"routes_per_expert": per_expert, "choice": label}
      print("crossover", entry, flush=True)
      tuning.append(entry)
    save()


def kernel_sums(kernels) -> dict[str, float]:
  """Microseconds of a call's ``(name, us)`` kernels by kind: our gate/up and down kernels (once
  per memory part), the XLA kernels around them, and all."""
  gate_up = sum(t for name, t in kernels if name.startswith("routed_experts_gate_up"))
  down = sum(t for name, t in kernels if name.startswith("routed_experts_down"))
  total = sum(t for _, t in kernels)
  return {"gate_up": gate_up, "down": down, "xla": total - gate_up - down, "all": total}


def against(rng, layer, baseline, token_counts, comparisons, save, smoke=False):
  """The module ``baseline`` against the installed ``mosaic_gpu``, each with its own
  ``default_config``, on the same inputs: whether the outputs agree bit for bit, each kind of
  kernel of one call (CUPTI, every kernel at its fastest of ten back-to-back calls, summed by
  ``kernel_sums``), and the layer timed as the table times it in ``AB_ROUNDS`` rounds, each
  timing the baseline then ours, so that a drift of the card over the run (its clock under the
  power cap, say) shows as a spread rather than as a difference."""
  num_experts, hidden, intermediate = layer.w_gate.shape
  shapes = (TOP_K, num_experts, hidden, intermediate)
  modules = {"baseline": baseline, "ours": mosaic_gpu}
  for num_tokens in token_counts:
    variants = fresh_inputs(rng, num_tokens, num_experts, hidden, 1 if smoke else 2)
    calls, configs = {}, {}
    for label, module in modules.items():
      config = module.default_config(num_tokens, *shapes)
      if smoke:  # a few simulated SMs
        config = dataclasses.replace(config, num_sms=4)
      # The module's entry point trusts its caller (the api) to have asked this.
      reason = module.unsupported_reason(*variants[0], *layer.weights, config=config)
      if reason is not None:
        raise ValueError(
          f"the {label} module cannot serve {layer.name} (I = {intermediate}) at {num_tokens} "
          f"tokens: {reason}"
        )
      configs[label] = dataclasses.asdict(config)

      def call(variant, w_gate, w_up, w_down, module=module, config=config):
        x, ids, weights = variant
        return module.routed_experts_mosaic_gpu(
          x, ids, weights, w_gate, w_up, w_down, config=config, interpret=smoke
        )

      calls[label] = jax.jit(call)
    first = [np.asarray(call(variants[0], *layer.weights)) for call in calls.values()]
    entry = {
      "shape": layer.name,
      "tokens": num_tokens,
      "intermediate": intermediate,
      "configs": configs,
      "bitwise_equal": bool(np.array_equal(first[0].view(np.uint16), first[1].view(np.uint16))),
      "layer_us": {label: [] for label in calls},
    }
    for _ in range(1 if smoke else AB_ROUNDS):
      for label, call in calls.items():
        seconds = timed(call, variants, layer, 1 if smoke else 7, 0 if smoke else 2)
        entry["layer_us"][label].append(seconds * 1e6)
    if not smoke:  # CUPTI needs the GPU
      entry["kernels_us"] = {}
      for label, call in calls.items():
        _, kernels = kernel_seconds(
          functools.partial(call, variants[0], *layer.weights), jax.block_until_ready
        )
        entry["kernels_us"][label] = kernel_sums([(name, s * 1e6) for name, s in kernels])
    print("against", entry, flush=True)
    comparisons.append(entry)
    save()


def breakdown(rng, layer, token_counts, ceilings, breakdowns, save):
  """CUPTI time of every GPU kernel of one call of ours (the plan's XLA kernels, the two
  Mosaic GPU kernels, the combine), fastest of five profiled calls, kernel by kernel; and the
  sum of all the kernels, as they ran, of as many back-to-back launches of the timed program
  (as many calls as the table's timing runs) as that timing makes (``busy_seconds``), per call,
  with the SM clock sampled meanwhile (``ClockLog``): beside the table's time it tells idle time
  between kernels from kernels that ran slower there than at their fastest, and the clock
  tells whether the card held its clock or lowered it (to stay within its power limit, say).
  Where the limit is the matmul rate, bf16 matmuls then run as long a load
  (``sustained_matmul_rate``): the limit at the rate the card holds under it, a reading beside
  the table's limit, which keeps the ceiling's rate."""
  from jax.experimental.mosaic.gpu import profiler

  num_experts, hidden, _ = layer.w_gate.shape
  fn = jax_contender("pallas")
  call = jax.jit(fn)
  program = jax.jit(lambda variants, *weights: [fn(v, *weights) for v in variants])
  for num_tokens in token_counts:
    count = timed_calls(layer, num_tokens, ceilings)
    variants = fresh_inputs(rng, num_tokens, num_experts, hidden, count)
    variant = variants[0]
    entry = {"shape": layer.name, "tokens": num_tokens}
    try:
      jax.block_until_ready(call(variant, *layer.weights))
      kernels = []
      for _ in range(5):
        _, timings = profiler.measure(call, aggregate=False)(variant, *layer.weights)
        if not kernels:
          kernels = [[name, ms * 1e3] for name, ms in timings]
        elif [name for name, _ in timings] == [name for name, _ in kernels]:
          for kernel, (_, ms) in zip(kernels, timings, strict=True):
            kernel[1] = min(kernel[1], ms * 1e3)
        # A call with other kernels (a one-off copy, say) is left out of the minimum.
      entry["kernels_us"] = kernels
      busy, clock = sustained_load(lambda variants=variants: program(variants, *layer.weights))
      entry["timed_program"] = {
        "calls": count,
        "launches": TIMING_LAUNCHES,
        "kernels_us_per_call": busy / count * 1e6,
        "sm_clock": clock,
      }
      if estimated_limit(layer, num_tokens, ceilings)[1] == "compute":
        # busy is per launch of the timed program (count calls of ours): as long a launch.
        tflops, matmuls, clock = sustained_matmul_rate(busy, ceilings["matmul_tflops"])
        entry["sustained_matmul"] = {
          "matmuls_per_launch": matmuls,
          "launches": TIMING_LAUNCHES,
          "tflops": tflops,
          "limit_us": layer_flops(layer, num_tokens) / (tflops * 1e12) * 1e6,
          "sm_clock": clock,
        }
    except Exception as error:
      entry["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    print("breakdown", entry, flush=True)
    breakdowns.append(entry)
    save()


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument(
    "--quick",
    action="store_true",
    help=f"tokens {QUICK_TOKENS} only, and {QUICK_TUNE_TOKENS} for --tune",
  )
  parser.add_argument("--tune", action="store_true", help="sweep TuningConfigs (GLM-4.5-Air)")
  parser.add_argument(
    "--tune-only",
    action="store_true",
    help="the sweep alone: no contender rows, no breakdown (implies --tune)",
  )
  parser.add_argument(
    "--crossover",
    action="store_true",
    help="alone: default_config's two choices around its threshold and transposed tiles of "
    "one_tile_rows rows, every shape of --shapes",
  )
  parser.add_argument(
    "--against",
    metavar="FILE",
    default=None,
    help="alone: the routed-experts mosaic_gpu.py in FILE against the installed one",
  )
  parser.add_argument(
    "--intermediate",
    type=int,
    default=None,
    help="with --against: every shape's I (moe_intermediate) set to this",
  )
  parser.add_argument(
    "--tokens", type=int, nargs="+", default=None, help="token counts of the rows and the sweep"
  )
  parser.add_argument(
    "--shapes", nargs="+", choices=list(SHAPES), default=None, help="shapes of the rows"
  )
  parser.add_argument(
    "--smoke", action="store_true", help="tiny shapes, interpret mode, any backend"
  )
  parser.add_argument("--out", default=None, help="results directory")
  args = parser.parse_args()
  args.tune = args.tune or args.tune_only
  if args.crossover and (args.tune or args.tokens or args.quick):
    parser.error("--crossover runs alone, at token counts of its own")
  if args.against and (args.tune or args.crossover or args.quick):
    parser.error("--against runs alone (with --tokens, --shapes and --intermediate)")
  if args.intermediate is not None and not args.against:
    parser.error("--intermediate needs --against (the table keeps the models' shapes)")
  if args.intermediate is not None and args.intermediate <= 0:
    parser.error(f"--intermediate must be positive, got {args.intermediate}")
  baseline = None
  if args.against:
    if not pathlib.Path(args.against).is_file():
      parser.error(f"--against: no file {args.against}")
    baseline = load_module(args.against, mosaic_gpu)
  if args.out is not None:
    out_dir = pathlib.Path(args.out)
  else:
    out_dir = pathlib.Path(tempfile.mkdtemp()) if args.smoke else RESULTS
  out_dir.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(0)

  if args.smoke:
    shapes, token_counts = SMOKE_SHAPES, SMOKE_TOKENS
    ceilings = {
      "read_tbps": measure_read_bandwidth(1 << 20),
      "matmul_tflops": measure_matmul_rate(256),
    }
    contenders = ("ours", "xla", "per_route")
  else:
    default_tokens = AB_TOKENS if args.against else QUICK_TOKENS if args.quick else TOKENS
    shapes, token_counts = SHAPES, args.tokens or default_tokens
    if args.shapes:
      shapes = {name: SHAPES[name] for name in args.shapes}
    if args.tune_only:  # the sweep runs on GLM-4.5-Air alone
      shapes = {"GLM-4.5-Air": SHAPES["GLM-4.5-Air"]}
    ceilings = {"read_tbps": measure_read_bandwidth(), "matmul_tflops": measure_matmul_rate()}
    contenders = ("ours", "xla", "per_route", "torch_grouped_mm")
  if args.intermediate is not None:  # --against only (checked above)
    shapes = {name: (e, h, args.intermediate) for name, (e, h, _) in shapes.items()}
  print(f"ceilings: {ceilings}", flush=True)
  meta = {
    "gpu": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    "setup": f"bf16 weights, top-{TOP_K}, uniform random routing drawn fresh per call"
    + ("; interpret-mode smoke run on tiny shapes (not a measurement)" if args.smoke else ""),
    "ceilings": ceilings,
    "timing": "jax: median steady-state time per call of a jitted batch of calls on distinct "
    "inputs (wall time of two back-to-back launches minus one); torch: CUDA events around "
    "back-to-back calls; warm-up excluded",
  }
  if args.against:
    meta["against"] = pathlib.Path(args.against).name
  rows, tuning, breakdowns, comparisons = [], [], [], []
  # A sweep alone writes files of its own, so that it never overwrites the contenders' table.
  results_name = (
    "moe_ab"
    if args.against
    else "moe_crossover"
    if args.crossover
    else "moe_tuning"
    if args.tune_only
    else "moe"
  )

  def report():
    return render_markdown(meta, rows, breakdowns, tuning, comparisons)

  def save():
    """Writes what has been measured so far (a run cut short keeps its finished rows)."""
    results = {
      "meta": meta,
      "rows": rows,
      "breakdown": breakdowns,
      "tuning": tuning,
      "against": comparisons,
    }
    (out_dir / f"{results_name}.json").write_text(json.dumps(results, indent=1))
    (out_dir / f"{results_name}.md").write_text(report())

  layers = {}
  for name, (num_experts, hidden, intermediate) in shapes.items():
    layer = make_layer(name, num_experts, hidden, intermediate)
    layers[name] = layer
    meta.setdefault("default_configs", {})[name] = {
      n: dataclasses.asdict(mosaic_gpu.default_config(n, TOP_K, num_experts, hidden, intermediate))
      for n in token_counts
    }
    if args.crossover:
      crossover(rng, layers.pop(name), tuning, save, smoke=args.smoke)
      continue
    if args.against:
      against(rng, layers.pop(name), baseline, token_counts, comparisons, save, smoke=args.smoke)
      continue
    for num_tokens in () if args.tune_only else token_counts:
      rows.append(run_row(rng, layer, num_tokens, ceilings, args.smoke, contenders))
      save()
    if name != "GLM-4.5-Air" and not args.smoke:
      del layers[name]  # free its 7.5 GB before the breakdown and the sweep

  if not args.smoke and not args.tune_only and "GLM-4.5-Air" in layers:
    breakdown(rng, layers["GLM-4.5-Air"], BREAKDOWN_TOKENS, ceilings, breakdowns, save)
  if args.tune and args.smoke:
    tune(rng, layers["smoke"], SMOKE_TOKENS[:1], tuning, save, smoke=True)
  elif args.tune:
    tune_tokens = args.tokens or (QUICK_TUNE_TOKENS if args.quick else TUNE_TOKENS)
    air = layers.get("GLM-4.5-Air") or make_layer("GLM-4.5-Air", *SHAPES["GLM-4.5-Air"])
    tune(rng, air, tune_tokens, tuning, save)
  print(f"results in {out_dir}")
  print(report())


def clock_cell(clock) -> str:
  """A ``ClockSummary`` dict as "mean (min-max; capped share)" in MHz, or "n/a"."""
  if not clock:
    return "n/a"
  return (
    f"{clock['sm_mhz_mean']:.0f} ({clock['sm_mhz_min']:.0f}-{clock['sm_mhz_max']:.0f}; "
    f"{clock['power_capped_share']:.0%} capped)"
  )


def sustained_matmul_lines(breakdowns, rows, ceilings) -> list[str]:
  """A sentence for each breakdown entry with a sustained matmul: its rate and clock, the limit
  at that rate, and the table's time of ours against it."""
  times = {(row["shape"], row["tokens"]): row.get("ours", {}).get("us") for row in rows}
  lines = []
  for entry in breakdowns:
    matmul = entry.get("sustained_matmul")
    if not matmul:
      continue
    ours = times.get((entry["shape"], entry["tokens"]))
    against = f"; the table's {ours:.0f} us is {ours / matmul['limit_us']:.2f}x it" if ours else ""
    clock = matmul["sm_clock"]
    at_clock = f" at an SM clock of {clock_cell(clock)} MHz" if clock else ""
    lines.append(
      f"- {entry['shape']}, {entry['tokens']} tokens: bf16 matmuls run as long a load "
      f"({matmul['launches']} launches of {matmul['matmuls_per_launch']}) reached "
      f"{matmul['tflops']:.0f} TFLOP/s{at_clock} (the table's ceiling: "
      f"{ceilings['matmul_tflops']:.0f}); the limit at that rate is "
      f"{matmul['limit_us']:.0f} us{against}."
    )
  if not lines:
    return []
  return [
    "",
    "The matmul rate under a sustained load, where the limit is the matmul rate:",
    "",
  ] + lines


def render_markdown(meta, rows, breakdowns, tuning, comparisons=()):
  def us(entry):
    return f"{entry['us']:.0f}" if "us" in entry else "fails" if "error" in entry else "n/a"

  def ratio(row, name, reference):
    a, b = row.get(name, {}), row.get(reference, {})
    if "us" in a and "us" in b:
      return f"{a['us'] / b['us']:.2f}"
    return "n/a"

  ceilings = meta["ceilings"]
  lines = [
    "# Routed experts (one MoE layer) on one GPU",
    "",
    f"{meta['gpu']}, jax {meta['jax']}, {meta['date']}; {meta['setup']}.",
    f"Timing: {meta['timing']}. Limit = max(touched experts x expert bytes / "
    f"{ceilings['read_tbps']:.3g} TB/s, FLOPs / {ceilings['matmul_tflops']:.3g} TFLOP/s), "
    "both ceilings measured in this run (bf16 read by a float32 sum; a 8192^3 bf16 matmul).",
  ]
  if rows:
    lines += [
      "",
      "| shape | tokens | experts touched | limit us | ours us | ours / limit | XLA ragged_dot us "
      "| per_route us | torch _grouped_mm us | torch / ours | ours rel. rms error vs XLA |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
  for row in rows:
    ours = row.get("ours", {})
    over = f"{ours['us'] / row['limit_us']:.2f}" if "us" in ours else "n/a"
    error = row.get("ours_error_vs_xla", "n/a")
    error = f"{error:.1e}" if isinstance(error, float) else error
    lines.append(
      f"| {row['shape']} | {row['tokens']} | {row['experts_touched']:.1f} "
      f"| {row['limit_us']:.0f} ({row['limit_bound']}) | {us(ours)} | {over} "
      f"| {us(row.get('xla', {}))} | {us(row.get('per_route', {}))} "
      f"| {us(row.get('torch_grouped_mm', {}))} | {ratio(row, 'torch_grouped_mm', 'ours')} "
      f"| {error} |"
    )
  failures = [
    f"- {row['shape']} {row['tokens']} {name}: {row[name]['error']}"
    for row in rows
    for name in ("ours", "xla", "per_route", "torch_grouped_mm")
    if "error" in row.get(name, {})
  ]
  if failures:
    lines += ["", "Failures:", "", *failures]
  memory = [row for row in rows if "ours_peak_bytes" in row]
  if memory:
    lines += [
      "",
      f"Peak device memory of one call at {PEAK_MEMORY_TOKENS} tokens (arguments + outputs + "
      "temporaries, XLA memory analysis), GB:",
      "",
    ]
    for row in memory:
      parts = []
      for name in ("ours", "xla"):
        entry = row[f"{name}_peak_bytes"]
        if entry and "total" in entry:
          parts.append(f"{name} {entry['total'] / 1e9:.2f} (temporaries {entry['temp'] / 1e9:.2f})")
      weights, activations = row["weight_bytes"] / 1e9, row["activation_bytes"] / 1e9
      lines.append(
        f"- {row['shape']}: " + "; ".join(parts) + f"; weights {weights:.2f}, "
        f"activations (x and out) {activations:.3f}, 4 x activations + weights "
        f"{4 * activations + weights:.2f}"
      )
  timed = [entry for entry in breakdowns if "kernels_us" in entry]
  if timed:
    lines += [
      "",
      "## Where the time goes (CUPTI kernel times of one call of ours)",
      "",
      "Each kernel at its fastest of five calls; then all the kernels of the timed program (as "
      "many calls as the table's timing) as they ran in as many back-to-back launches as that "
      "timing makes, per call, with the SM clock sampled by nvidia-smi meanwhile (mean, range, "
      "share of samples with the software power cap engaged), beside the table's time: a table "
      "time above that sum is idle time between kernels; a sum above the first columns' is "
      "kernels running slower in the long sequence (at a lowered clock, say).",
      "",
      "| shape | tokens | gate/up kernel us | down kernel us | XLA kernels us (count) | sum us "
      "| kernels in the timed program, us per call | SM clock meanwhile, MHz | table's time us |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    table_us = {(row["shape"], row["tokens"]): us(row.get("ours", {})) for row in rows}
    for entry in timed:
      kernels = entry["kernels_us"]
      sums = kernel_sums(kernels)
      # With memory parts a call launches each of our kernels once per part.
      xla = [name for name, _ in kernels if not name.startswith("routed_experts_")]
      program = entry.get("timed_program") or {}
      in_program = f"{program['kernels_us_per_call']:.0f}" if program else "n/a"
      lines.append(
        f"| {entry['shape']} | {entry['tokens']} | {sums['gate_up']:.0f} | {sums['down']:.0f} "
        f"| {sums['xla']:.0f} ({len(xla)}) | {sums['all']:.0f} | {in_program} "
        f"| {clock_cell(program.get('sm_clock'))} "
        f"| {table_us.get((entry['shape'], entry['tokens']), 'n/a')} |"
      )
    lines += sustained_matmul_lines(timed, rows, meta["ceilings"])
  groups = {}  # (shape, tokens, routes per expert) -> {choice: entry}, from --crossover
  for entry in tuning:
    if "crossover" in entry:
      key = (entry["shape"], entry["tokens"], entry["crossover"]["routes_per_expert"])
      groups.setdefault(key, {})[entry["crossover"]["choice"]] = entry
  if groups:
    lines += [
      "",
      "## default_config's two choices around its threshold "
      f"({mosaic_gpu.PREFILL_ROUTES_PER_EXPERT} routes per expert)",
      "",
      "decode: `decode_config` (64-row tiles, one warpgroup); prefill: `prefill_config` (128-row "
      "tiles split by rows over two consumer warpgroups, a producer warpgroup); transposed: the "
      "prefill kernels with transposed tiles of the fewest rows that hold most experts' routes "
      "in one tile (`one_tile_rows`), not a default.",
      "",
      "| shape | tokens | routes per expert | decode us | prefill us | decode / prefill "
      "| transposed rows | transposed us | transposed / prefill |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (shape, tokens, per_expert), entries in groups.items():
      decode, prefill, transposed = (
        entries.get(c, {}) for c in ("decode", "prefill", "transposed")
      )
      rows = transposed.get("config", {}).get("block_m", "n/a")
      lines.append(
        f"| {shape} | {tokens} | {per_expert} | {us(decode)} | {us(prefill)} "
        f"| {ratio(entries, 'decode', 'prefill')} | {rows} | {us(transposed)} "
        f"| {ratio(entries, 'transposed', 'prefill')} |"
      )
  elif tuning:
    lines += [
      "",
      "## Tuning sweep (ours)",
      "",
      "| shape | tokens | config | us | peak memory (temporaries) |",
      "| --- | --- | --- | --- | --- |",
    ]
    for entry in sorted(tuning, key=lambda e: e["tokens"]):  # stable: run order within a count
      config = ", ".join(
        f"{k}={v}" for k, v in entry["config"].items() if not (k == "num_sms" and v is None)
      )
      mark = " (default)" if entry.get("default") else ""
      result = f"{entry['us']:.0f}" if "us" in entry else "fails"
      peak = entry.get("peak_bytes")
      peak = f"{peak['total'] / 1e9:.2f} GB ({peak['temp'] / 1e9:.2f})" if peak else ""
      lines.append(f"| {entry['shape']} | {entry['tokens']} | {config}{mark} | {result} | {peak} |")
  if comparisons:
    lines += against_lines(meta, comparisons)
  return "\n".join(lines) + "\n"


def against_lines(meta, comparisons) -> list[str]:
  """The ``--against`` section: the baseline module against ours, row by row."""
  lines = [
    "",
    f"## {meta['against']} (baseline) against the installed module (ours)",
    "",
    "Each module with its own default_config. Layer: the table's timing in rounds that each "
    "time the baseline then ours (us per call, median of the rounds, and every round); "
    "kernels: CUPTI, each kernel of one call at its fastest of ten back-to-back calls, summed "
    "by kind (baseline / ours, us). Equal: outputs bit for bit.",
    "",
    "| shape | tokens | I | equal | layer baseline / ours | baseline / ours | rounds "
    "| gate/up kernels | down kernels | XLA kernels | all kernels |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for entry in comparisons:
    times = entry["layer_us"]
    base, ours = (float(np.median(times[label])) for label in ("baseline", "ours"))
    rounds = "; ".join(
      f"{b:.0f} / {o:.0f}" for b, o in zip(times["baseline"], times["ours"], strict=True)
    )
    kernels = entry.get("kernels_us")
    cells = [
      f"{kernels['baseline'][kind]:.0f} / {kernels['ours'][kind]:.0f}" if kernels else "n/a"
      for kind in ("gate_up", "down", "xla", "all")
    ]
    lines.append(
      f"| {entry['shape']} | {entry['tokens']} | {entry['intermediate']} "
      f"| {'yes' if entry['bitwise_equal'] else 'NO'} | {base:.0f} / {ours:.0f} "
      f"| {base / ours:.3f} | {rounds} | " + " | ".join(cells) + " |"
    )
  return lines


if __name__ == "__main__":
  main()
