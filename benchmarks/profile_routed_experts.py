"""One routed-experts call for a profiler: a warm-up call, then the call to profile.

Hardware counters of the Pallas kernels at GLM-4.5-Air's shapes and 8192 tokens, for instance
(``--kernels`` prints how many Pallas kernels one call launches there, the skip and the count;
command buffers off so that each kernel is launched, and profiled, on its own):

  XLA_FLAGS=--xla_gpu_enable_command_buffer= ncu --clock-control none \\
    --section SpeedOfLight --section MemoryWorkloadAnalysis -k regex:routed_experts \\
    --launch-skip 8 --launch-count 8 python benchmarks/profile_routed_experts.py --tokens 8192

The call is ``routed_experts(impl="pallas")`` with ``default_config``, on ``bench_moe.py``'s
weights and uniformly random routing. ``--smoke`` runs tiny shapes in GPU interpret mode on any
backend (a check of the script, not a measurement).
"""

import argparse
import pathlib
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.bench_moe import (  # noqa: E402
  SHAPES,
  SMOKE_SHAPES,
  TOP_K,
  fresh_inputs,
  jax_contender,
  make_layer,
)
from jaxspec.kernels.routed_experts import mosaic_gpu  # noqa: E402


def shape_dims(shape: str) -> tuple[int, int, int]:
  """(E, H, I) of a shape of ``bench_moe.py``'s, the smoke one included."""
  return {**SHAPES, **SMOKE_SHAPES}[shape]


def kernels_per_call(shape: str, num_tokens: int) -> int:
  """Pallas kernels one call launches with ``default_config``: a gate/up kernel per memory part
  and a down kernel per column range."""
  num_experts, hidden, intermediate = shape_dims(shape)
  config = mosaic_gpu.default_config(num_tokens, TOP_K, num_experts, hidden, intermediate)
  return 2 * config.memory_parts


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description="one routed-experts call after a warm-up")
  parser.add_argument("--shape", choices=list(SHAPES), default="GLM-4.5-Air")
  parser.add_argument("--tokens", type=int, default=8192)
  parser.add_argument(
    "--kernels", action="store_true", help="only print the Pallas kernels of one call"
  )
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode")
  args = parser.parse_args(argv)
  if args.tokens < 1:
    parser.error(f"--tokens must be positive, got {args.tokens}")
  if args.smoke:
    args.shape = next(iter(SMOKE_SHAPES))
  return args


def main(argv: list[str]) -> None:
  args = parse_args(argv)
  kernels = kernels_per_call(args.shape, args.tokens)
  if args.kernels:
    print(kernels)
    return
  num_experts, hidden, intermediate = shape_dims(args.shape)
  layer = make_layer(args.shape, num_experts, hidden, intermediate)
  (variant,) = fresh_inputs(np.random.default_rng(0), args.tokens, num_experts, hidden, 1)
  call = jax.jit(jax_contender("pallas", interpret=args.smoke))
  jax.block_until_ready(call(variant, *layer.weights))  # compiles; the warm-up launches
  out = jax.block_until_ready(call(variant, *layer.weights))  # the launches to profile
  print(f"profiled: {args.shape}, {args.tokens} tokens, {kernels} Pallas kernels, out {out.shape}")


if __name__ == "__main__":
  main(sys.argv[1:])
