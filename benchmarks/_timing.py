"""Timing helpers shared by the benchmarks.

``time_jax`` times a jitted function on the GPU: one jitted program runs it
back to back on ``inner`` distinct inputs (so XLA cannot merge the calls), the
wall time of that program after ``block_until_ready`` is divided by ``inner``,
and the median over ``reps`` repetitions (after warm-up) is reported.
``time_stateful`` times a step that threads (and donates) its state, such as a KV cache. Dispatch
of the one program is amortised over ``inner`` calls; for kernels of a few
microseconds raise ``inner``.

``time_torch`` brackets ``inner`` back-to-back calls with CUDA events (device
side) and reports the median over ``reps`` of the time per call.
"""

import statistics
import time

import jax


def time_jax(fn, variants, *shared, reps: int = 15, warmup: int = 2) -> float:
  """Median seconds per call of ``fn(variant, *shared)`` over the list ``variants``."""
  inner = len(variants)
  batched = jax.jit(lambda vs, *rest: [fn(v, *rest) for v in vs])
  for _ in range(warmup):
    jax.block_until_ready(batched(variants, *shared))
  samples = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(batched(variants, *shared))
    samples.append((time.perf_counter() - start) / inner)
  return statistics.median(samples)


def time_stateful(step, state, iters: int = 10, reps: int = 5, warmup: int = 2):
  """Median seconds per call of ``state = step(state)``, called ``iters`` times back to back.

  For steps that donate their state (a KV cache): the state is threaded from call to call.
  Returns (seconds, final state).
  """
  for _ in range(warmup):
    state = step(state)
  jax.block_until_ready(state)
  samples = []
  for _ in range(reps):
    start = time.perf_counter()
    for _ in range(iters):
      state = step(state)
    jax.block_until_ready(state)
    samples.append((time.perf_counter() - start) / iters)
  return statistics.median(samples), state


def time_torch(fn, inner: int = 20, reps: int = 15, warmup: int = 3) -> float:
  """Median seconds per call of ``fn()`` by CUDA events around ``inner`` calls."""
  import torch

  for _ in range(warmup):
    fn()
  torch.cuda.synchronize()
  samples = []
  for _ in range(reps):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(inner):
      fn()
    stop.record()
    torch.cuda.synchronize()
    samples.append(start.elapsed_time(stop) / 1e3 / inner)
  return statistics.median(samples)
