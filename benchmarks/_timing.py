"""Timing helpers shared by the benchmarks.

``time_jax`` times a jitted function on the GPU by the steady-state difference
method. One jitted program runs it back to back on ``inner`` distinct inputs (so
XLA cannot merge the calls). Per repetition it times the program launched once
(``t1``: launch, then block) and launched twice back to back (``t2``: launch,
launch, block on the second); ``(t2 - t1) / inner`` is the time per call, and the
median over ``reps`` repetitions (after warm-up; compilation is done before) is
reported. jax dispatches asynchronously, so the second launch is queued while the
first one runs: the difference is the device span of one more program, without
the fixed dispatch and synchronisation cost that a single timed launch includes
(on an H200, one timed launch of four B64 L32k decode-attention calls read about
150 us per call above the calls' CUPTI kernel time). It is what CUDA events
around back-to-back calls measure, as ``time_torch`` does for torch. A program
shorter than its own host dispatch measures the dispatch instead: use larger
``inner`` there.

``time_stateful`` times a step that threads (and donates) its state, such as a KV
cache: wall time of ``iters`` calls back to back, synchronisation included.
``dispatch_seconds`` times only the host's enqueueing of one such call on an idle device.
``profile_stateful`` runs such a step under CUPTI and returns each call's GPU
kernels with their device-side times.

``time_torch`` brackets ``inner`` back-to-back calls with CUDA events (device
side) and reports the median over ``reps`` of the time per call.

``kernel_seconds`` sums, from CUPTI, the device time of the kernels one call launches, for
jax and torch alike: the time the device is busy, without the gaps between kernels or the
host's launch path, so a comparison of small calls that the host paces. Each kernel counts at
its fastest of several calls. ``busy_seconds`` sums every kernel of calls run back to back as
they ran, for setting beside a wall-clock time of as many of the same calls: where the two
differ, the device sat idle between kernels; where they agree but exceed ``kernel_seconds``,
the kernels ran slower in the sequence than at their fastest. A sequence as long as the timing
matters: under a sustained load a card may lower its clock to stay within its power limit (an
H100 SXM at GLM-4.5-Air's 8192-token MoE layer: 700 W, the software power cap engaged, SM
clocks between 1080 and 1980 MHz), which a short burst does not show. ``ClockLog`` samples the
SM clock, the power draw and the throttle reasons meanwhile.
"""

import dataclasses
import os
import select
import shutil
import statistics
import subprocess
import time

import jax
from jax.experimental.mosaic.gpu import profiler


def time_jax(fn, variants, *shared, reps: int = 15, warmup: int = 2) -> float:
  """Median seconds per call of ``fn(variant, *shared)`` over the list ``variants``.

  Steady-state difference method (module docstring): per repetition, (wall time of two
  back-to-back launches of the program of ``len(variants)`` calls minus that of one launch)
  divided by the number of calls. The program is compiled before any timing.
  """
  inner = len(variants)
  program = jax.jit(lambda vs, *rest: [fn(v, *rest) for v in vs])
  program = program.lower(variants, *shared).compile()
  for _ in range(warmup):
    jax.block_until_ready(program(variants, *shared))
  samples = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(program(variants, *shared))
    once = time.perf_counter() - start
    start = time.perf_counter()
    program(variants, *shared)  # queued; the device runs the next launch right after it
    jax.block_until_ready(program(variants, *shared))
    twice = time.perf_counter() - start
    samples.append((twice - once) / inner)
  return statistics.median(samples)


def time_stateful(step, state, iters: int = 10, reps: int = 5, warmup: int = 2):
  """Median seconds per call of ``state = step(state)``, called ``iters`` times back to back.

  For steps that donate their state (a KV cache): the state is threaded from call to call.
  Wall time, synchronisation included once per ``iters`` calls. Returns (seconds, final state).
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


def dispatch_seconds(step, state, reps: int):
  """Median host time for ``state = step(state)`` to return on an idle device: the enqueueing
  alone. A step is host-bound where this approaches its ``time_stateful`` time. Returns
  (seconds, final state)."""
  samples = []
  for _ in range(reps):
    jax.block_until_ready(state)
    start = time.perf_counter()
    state = step(state)
    samples.append(time.perf_counter() - start)
  jax.block_until_ready(state)
  return statistics.median(samples), state


def kernel_seconds(call, block, iterations: int = 10) -> tuple[float, list[tuple[str, float]]]:
  """Device seconds of the kernels of one ``call()`` from CUPTI, and those kernels.

  ``call`` runs once outside the profile, then ``iterations`` times back to back under CUPTI
  (``block`` waits for the list of their outputs); each kernel's fastest of the calls is
  summed. Unlike ``profiler.measure``, which takes jax functions only, this profiles whatever
  ``call`` launches (FlashInfer through torch too; ``_cupti_timings``). Returns (seconds, the
  kernels of a call in launch order as ``(name, fastest seconds)``). Raises ``RuntimeError``
  where the calls launch no kernel or different numbers of them.
  """
  timings = _cupti_timings(call, block, iterations)
  per_call, rest = divmod(len(timings), iterations)
  if per_call == 0 or rest:
    raise RuntimeError(f"{len(timings)} kernels in {iterations} calls: not the same per call")
  kernels = [
    (timings[k][0], min(ms for _, ms in timings[k::per_call]) / 1e3) for k in range(per_call)
  ]
  return sum(seconds for _, seconds in kernels), kernels


def busy_seconds(call, block, iterations: int = 2) -> float:
  """Device seconds of all the kernels that ``iterations`` back-to-back ``call()``s launch,
  per call, each kernel as long as it ran (no fastest-of). ``call`` runs once outside the
  profile. Raises ``RuntimeError`` where the calls launch no kernel."""
  timings = _cupti_timings(call, block, iterations)
  if not timings:
    raise RuntimeError(f"no kernel in {iterations} calls")
  return sum(ms for _, ms in timings) / 1e3 / iterations


def _cupti_timings(call, block, iterations: int) -> list[tuple[str, float]]:
  """(kernel name, ms) of every kernel that ``iterations`` back-to-back ``call()``s launch, in
  launch order, from the CUPTI hooks of jax's Mosaic GPU extension (``profiler.measure``'s),
  which record every kernel of the process; ``block`` waits for the list of the outputs."""
  from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

  extension = mosaic_gpu_lib._mosaic_gpu_ext
  block([call()])
  extension._cupti_init()
  try:
    block([call() for _ in range(iterations)])
  finally:
    timings = extension._cupti_get_timings(True)
  return timings


class _ThreadedStep(jax.stages.Wrapped):
  """``outputs, state = step(state)`` as a call without arguments; the state lives here.

  ``profiler.measure`` calls its function several times with the same arguments (a warm-up,
  then the profiled calls), and wraps any function that is not a ``jax.stages.Wrapped`` in
  ``jax.jit``, which would make the state a constant and drop its donation. As a ``Wrapped``
  this is called as it is, and every call hands ``step`` the state the previous call returned.
  Only the outputs are returned: an earlier call's state is deleted by the next call's donation.
  """

  def __init__(self, step, state):
    self.step = step
    self.state = state

  def __call__(self):
    outputs, self.state = self.step(self.state)
    return outputs


class ProfileFailed(RuntimeError):
  """A profiled run failed; ``state`` is the state its last call returned (the one passed in
  was donated by then), for the caller to go on with."""

  def __init__(self, message: str, state):
    super().__init__(message)
    self.state = state


def profile_stateful(step, state, iterations: int = 10):
  """GPU kernels of ``iterations`` calls of ``outputs, state = step(state)``, from CUPTI.

  One unprofiled call runs first (``profiler.measure``'s warm-up); the state is threaded
  through all calls. Returns (for each profiled call its kernels in launch order as
  ``(name, device seconds)``, final state). Raises ``ProfileFailed`` with the live state when
  profiling fails, before any call where CUPTI is unavailable (the CPU). With several
  iterations the profiler requires the same kernel names in every call, which a program over
  several GPUs (whose kernels interleave in any order) does not give: profile those with one.
  """
  threaded = _ThreadedStep(step, state)
  try:
    _, timings = profiler.measure(threaded, aggregate=False, iterations=iterations)()
  except Exception as error:
    raise ProfileFailed(f"{type(error).__name__}: {error}", threaded.state) from error
  if timings is None:
    raise ProfileFailed("the step launched no GPU kernel", threaded.state)
  per_call = [timings] if iterations == 1 else timings
  return [[(name, ms * 1e-3) for name, ms in call] for call in per_call], threaded.state


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


# Bit of nvidia-smi's clocks_throttle_reasons.active: the clock is lowered to hold the power
# limit (NVML's nvmlClocksThrottleReasonSwPowerCap).
SW_POWER_CAP = 0x4


@dataclasses.dataclass(frozen=True)
class ClockSummary:
  """The samples of a ``ClockLog``: SM clock (MHz) mean, min and max, mean power draw (W), and
  the share of samples with the software power cap engaged."""

  samples: int
  sm_mhz_mean: float
  sm_mhz_min: float
  sm_mhz_max: float
  power_w_mean: float
  power_capped_share: float


def summarize_clock_samples(lines: list[str]) -> ClockSummary | None:
  """``ClockSummary`` of ``nvidia-smi --query-gpu=clocks.sm,power.draw,
  clocks_throttle_reasons.active --format=csv,noheader,nounits`` lines ("1980, 647.95,
  0x0000000000000004"); lines that do not parse (a "[N/A]" field, a message) are skipped.
  None where none parses."""
  parsed = []
  for line in lines:
    fields = [field.strip() for field in line.split(",")]
    try:
      parsed.append((float(fields[0]), float(fields[1]), int(fields[2], 16)))
    except (IndexError, ValueError):
      continue
  if not parsed:
    return None
  clocks = [clock for clock, _, _ in parsed]
  return ClockSummary(
    samples=len(parsed),
    sm_mhz_mean=statistics.mean(clocks),
    sm_mhz_min=min(clocks),
    sm_mhz_max=max(clocks),
    power_w_mean=statistics.mean(power for _, power, _ in parsed),
    power_capped_share=sum(bool(reasons & SW_POWER_CAP) for _, _, reasons in parsed) / len(parsed),
  )


class ClockLog:
  """Samples the first GPU's SM clock, power draw and throttle reasons with ``nvidia-smi`` every
  ``period_ms`` while its ``with`` block runs; ``summary()`` afterwards gives a
  ``ClockSummary``, or None where ``nvidia-smi`` is missing or gave no sample (the block runs
  all the same).

  The block starts only once the first sample has been printed (or after ``start_timeout_s``):
  ``nvidia-smi`` takes a fraction of a second to start, as long as a whole burst of kernels
  may last. Whatever runs in the block counts, so compile before it: samples taken while the
  host compiles show an idle card's clock and power."""

  QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"

  def __init__(self, period_ms: int = 50, start_timeout_s: float = 10.0):
    self.period_ms = period_ms
    self.start_timeout_s = start_timeout_s
    self._process = None
    self._head = b""
    self._lines: list[str] = []

  def __enter__(self):
    executable = shutil.which("nvidia-smi")
    if executable is not None:
      # Unbuffered bytes, so that what the first-line wait reads is not held in a buffer that
      # ``communicate`` (which reads the file descriptor) would skip.
      self._process = subprocess.Popen(
        [executable, "--id=0", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits"]
        + ["-lms", str(self.period_ms)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        bufsize=0,
      )
      self._head = self._first_line()
    return self

  def _first_line(self) -> bytes:
    """What the sampler printed up to its first newline, waiting at most ``start_timeout_s``;
    less where it printed nothing in time or exited."""
    descriptor = self._process.stdout.fileno()
    head = b""
    deadline = time.monotonic() + self.start_timeout_s
    while b"\n" not in head:
      left = deadline - time.monotonic()
      if left <= 0 or not select.select([descriptor], [], [], left)[0]:
        break
      chunk = os.read(descriptor, 4096)
      if not chunk:  # the sampler exited
        break
      head += chunk
    return head

  def __exit__(self, *exc_info):
    if self._process is not None:
      self._process.terminate()
      try:
        output, _ = self._process.communicate(timeout=10)
      except subprocess.TimeoutExpired:  # it ignored the terminate: no sampler left behind
        self._process.kill()
        output, _ = self._process.communicate()
      self._lines = (self._head + output).decode(errors="replace").splitlines()
    return False

  def summary(self) -> ClockSummary | None:
    return summarize_clock_samples(self._lines)
