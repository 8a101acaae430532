"""Routed experts as two grouped-expert GEMMs in Pallas Mosaic GPU (Hopper: TMA + wgmma).

Algorithm (the grouped-GEMM MoE of vLLM's fused_moe / ``moe_align_block_size``, with the
device-side tile table of tokamax's Mosaic GPU ragged_dot):

1. Plan, in XLA on the device (``plan_routes``): the ``T * k`` routes are sorted by expert
   (out-of-range ids dropped) by counting, not by a sort kernel: a route's rank within its
   expert is the count of earlier routes of that expert, found by comparisons within blocks of
   routes and per-block counts across them. Expert ``e`` with ``c`` routes owns a span of
   ``ceil(c / 8) * 8`` buffer rows starting at a multiple of 8 (a TMA copy into 8-row-tiled
   shared memory must start on a tile row), cut into ``ceil(c / block_m)`` M tiles. ``x`` is
   gathered into buffer-row order, ``xs [rows + block_m, H]`` with
   ``rows = route_rows(T * k, E)``. A tile table lists each used tile's expert, first buffer
   row and rows to store; experts no route reaches have no tile, so their weights are never
   read. The table has a static size, a bound on the tiles any routing can need
   (``max_tiles``); only its used prefix runs. At decode sizes (up to
   ``COMPARE_PLAN_MAX_ROUTES`` routes) all-pairs comparisons over all routes replace the blocks
   and the scatter: on the H200 the layer's XLA kernels went from 16 (21 us, with a sort) to 9
   (12 us) at one token.
2. Kernel ``gate_up``: one pass over ``w_gate[e]`` and ``w_up[e]`` per (tile, N block of I):
   two wgmma accumulators over the same ``xs`` tile, ``silu(g) * u`` in the epilogue, rounded to
   the weights' dtype, stored as ``act [rows + block_m, I]``. With
   ``TuningConfig.gather_in_kernel`` (the default up to one memory part, below) there is no
   ``xs``: the kernel's producer warpgroup copies each tile's rows of ``x`` by token with
   ``cp.async``, 16 bytes a thread, into the same swizzled ring slots the TMA would fill.
3. Kernel ``down``: ``act`` tile @ ``w_down[e]`` per (tile, N block of H), rounded to the
   weights' dtype, ``y [rows, H]``.
4. Combine, in XLA: ``out[t] = sum_j weights[t, j] * y[row of (t, j)]`` in float32; one fused
   gather-and-sum, so the ``[T * k, H]`` intermediate is written once and read once.

``xs`` and ``y`` are ``T * k`` rows of H each (0.54 GB in bf16 at GLM-4.5-Air's shapes and 8192
tokens) and each is alive beside ``act``. ``TuningConfig.memory_parts`` bounds them: step 2 runs
over equal parts of the buffer rows, each part gathering only its own slice of ``xs`` (rows
follow the expert order, so a part re-reads only the weights of the expert at its boundary) and
storing into the same ``act``; steps 3 and 4 run over column ranges of H (each range reads its
own columns of ``w_down`` and writes its columns of ``out`` in place; every output element is
the same sum in the same order).

Both kernels are persistent (the construct of jax's ``ragged_dot_mgpu``/``hopper_matmul_mgpu``):
one block per SM walks the (tile, N block) work items with ``plgpu.nd_loop`` (item ``i`` on SM
``i % num_sms``; the number of items is read from the plan on the device, so unused table slots
cost nothing), and each item streams its K dimension through a pipeline, a ring of
``num_stages`` TMA-filled shared-memory slots feeding wgmma: ``plgpu.emit_pipeline`` in one
warpgroup, or (``TuningConfig.warpgroups = 2``) ``plgpu.emit_pipeline_warp_specialized`` with a
producer warpgroup that runs ahead into the next item while two consumer warpgroups finish the
epilogue. Each consumer stages its output tile in shared memory for the TMA stores, whole or in
column pieces (``TuningConfig.epilogue_n``), which leaves room for a deeper ring. Items are
ordered tile-major (the N blocks of one tile are consecutive), so the tiles of one expert run at
the same time on neighbouring SMs and share each weight block through L2 (on the H200 the
gate/up kernel read 3.36 GB from DRAM for 2.95 GB of weights at 2048 tokens, where half the
experts have two tiles). At decode sizes (a few rows per expert) the kernels stream weights,
and the N blocks are chosen so that the items cover every SM (``default_config``); at prefill
sizes every M tile is full but the last of each expert, and the kernels are held by the L2's
throughput (2048 tokens) or the wgmmas (8192; ``benchmarks/NOTES_routed_experts.md``).

Transposed tiles (``TuningConfig.transposed_tiles``): a tile's rows are the wgmma N dimension
(``out^T = W^T lhs^T``: the weight block a transposed A operand, the tile's rows a transposed
B), so ``block_m`` can be any multiple of 8 up to 256, not only the 64 rows of a warpgroup's
wgmma M. At prefill sizes ``default_config`` sizes the tiles to the routes an expert is expected
to get (GLM-4.5-Air at 2048 tokens: 128 +- 11 routes per expert, tiles of 144 rows pad 1.20
rows per route where 128-row tiles pad 1.48, since half the experts need a second, nearly empty
one). Each consumer warpgroup stores its ``[columns, rows]`` accumulator transposed into a
``[rows, 64]`` staging tile.

A tile always loads ``block_m`` rows from its first row on, so its rows past the expert's span
belong to the next expert or to the tail of ``xs``/``act`` (padding, never written by the plan
or the kernels). Their output rows are computed and discarded: the epilogue stores only the
tile's own rows, with a ladder of power-of-two TMA stores (as jax's ``ragged_dot_mgpu``). A
wgmma output row depends only on its own input row, so whatever the padding rows hold (NaN
included) stays in discarded rows, and the combine reads only the rows of valid routes.

Numerics: float32 accumulation in both GEMMs; the activation and each route's down projection
are rounded to the weights' dtype (as the reference); the combine is float32. ``silu`` uses the
fast ``exp`` (``approx_math``), so an activation can differ from the reference by one rounding
step.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core as jax_core
from jax._src import tree_util
from jax._src.pallas.mosaic_gpu import core as gpu_core
from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering
from jax._src.pallas.mosaic_gpu import primitives as mgpu_primitives
from jax._src.state import primitives as state_primitives
from jax.experimental.mosaic import gpu as mgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref

from jaxspec.kernels.dispatch import num_sms, validate_config_fields
from jaxspec.kernels.routed_experts.reference import combine_routes

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ROWS_PER_WGMMA = 64  # the wgmma M of one warpgroup
ROW_ALIGN = 8  # buffer rows of a tile start at multiples of the 8-row SMEM tiling
MAX_WGMMA_N = 256
SMEM_BYTES = 227 * 1024  # usable shared memory per SM on Hopper
# Accumulator elements per consumer warpgroup (all accumulators of a kernel together): 128
# float32 registers per thread at most, so the epilogue and the addressing keep theirs.
MAX_ACC_ELEMENTS = 128 * 128
# The same with transposed tiles, whose consumer warpgroups run beside a producer warpgroup
# holding 40 registers a thread (232 each for the consumers): ptxas reported no spills for either
# kernel of tiles of up to this many rows (gate/up: 2 x 64 x 184 accumulators; H100, jax 0.11.2).
MAX_TRANSPOSED_ROWS = 184
MAX_ACC_ELEMENTS_TRANSPOSED = MAX_TRANSPOSED_ROWS * 128
# Mean routes per expert from which default_config takes 128-row two-warpgroup tiles: with the
# current prefill config both GLM shapes cross over between 48 and 56 routes per expert on the
# H200 and the H100 (default_config's docstring).
PREFILL_ROUTES_PER_EXPERT = 56
# Routes up to which plan_routes compares all pairs instead of counting by blocks (128 tokens at
# top-8: decode batches and short verify steps): its [rows, T * k] comparison grows quadratically.
COMPARE_PLAN_MAX_ROUTES = 1024
# Routes per block of plan_routes' counting sort beyond COMPARE_PLAN_MAX_ROUTES: a route's rank
# within its block comes from all pairs of the block ([blocks, 256, 256] comparisons), its rank
# across blocks from per-block counts summed over the earlier blocks ([blocks, blocks, E]).
COUNT_BLOCK_ROUTES = 256
# Routes per memory part from which default_config splits the layer (TuningConfig.memory_parts):
# the routed-row buffers (xs, y) then hold at most this many rows of H at a time. On the H200 at
# GLM-4.5-Air's shapes and 8192 tokens (65536 routes) 1 / 2 / 4 parts took 4386 / 4544 / 4741
# us with a peak of 5.30 / 5.09 / 4.94 GB (4 parts now 4.89: parts cut by rows, combine in
# place); at 2048 tokens (16384 routes, one part) 2 parts cost 10% and saved no memory (4.65 GB
# either way).
MAX_ROUTES_PER_PART = 16384
# Tokens a gathering gate/up kernel stages per tile (a multiple of the warpgroup's 128 threads
# that holds MAX_WGMMA_N rows, so one vector load of the token array fills it).
TOKEN_SLOTS = 256
# Registers per thread of the producer warpgroup in the gathering gate/up kernel, and of each of
# its two consumer warpgroups (what emit_pipeline_warp_specialized gives with 40 for the producer).
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """Static tuning knobs of the two kernels.

  Attributes:
    block_m: buffer rows per M tile (64 or 128); each expert's routes fill whole tiles but its
      last, so small values waste less at decode sizes and large ones reuse weights more.
    block_n_gate_up: N block of the gate/up kernel (over I), a multiple of 64 dividing I.
    block_n_down: N block of the down kernel (over H), a multiple of 64 dividing H.
    block_k: K step of both pipelines, a multiple of 64 dividing H and I.
    num_stages: shared-memory slots of each pipeline (TMA copies in flight).
    warpgroups: 1: one warpgroup copies and multiplies (``plgpu.emit_pipeline``); 2: a producer
      warpgroup copies and two consumer warpgroups multiply
      (``plgpu.emit_pipeline_warp_specialized``).
    warpgroup_split: with two consumer warpgroups, how they share a block: "n" (each takes half
      of the N block, which must then be a multiple of 128) or "m" (each takes 64 rows of a
      ``block_m`` = 128 tile).
    epilogue_n: with two consumer warpgroups, the columns of each warpgroup's output tile that
      go through shared memory at a time (a multiple of 64 dividing them; ``None``: all at
      once). Smaller pieces leave shared memory to a deeper ring: the two 64 x 256 bf16 down tiles
      of a 128-row tile staged whole take 64 KiB.
    num_sms: SMs the persistent grid covers; ``None`` asks the device.
    transposed_tiles: with two consumer warpgroups split by columns, the tile's rows are the
      wgmma N dimension (``out^T = W^T lhs^T``, the weight block a transposed A, the tile's rows
      a transposed B), so ``block_m`` can be any multiple of 8 up to 256 instead of 64 or 128:
      tiles sized to the routes an expert gets pad fewer rows. The output tile is stored
      transposed into shared memory, then to the buffer's rows.
    memory_parts: bounds the temporaries at prefill sizes (``routed_experts_mosaic_gpu``): the
      gate/up kernel runs over this many parts of the tile table, each reading its own slice of
      ``xs``, into one ``act``; the down kernel and the combine run over this many column ranges
      of H. 1 runs each kernel once over everything.
    gather_in_kernel: the gate/up kernel's producer warpgroup copies the tiles' rows of ``x``
      by token into its ring with ``cp.async`` (``_copy_rows_async``) instead of TMA copies of a
      gathered ``xs``: no XLA gather and no ``xs``, and the gate/up kernel runs once over the
      whole table whatever ``memory_parts`` (which then splits only the down kernel and the
      combine). Needs ``warpgroups=2`` and ``block_k=64``.
    gather_rows_signal: with ``gather_in_kernel``, how a slot's rows are signalled to the
      consumers. "late": after issuing a step's copies the producer waits for the previous
      step's (``cp.async.wait_group 1``) and arrives for them, so it never waits for a load it
      has just issued but holds at most one step of rows in flight. "copies": each producer
      thread's copies arrive on the slot's barrier themselves when they land
      (``cp.async.mbarrier.arrive.noinc``, ``_rows_arrive``), the producer never waits for
      them, and the consumers fence the proxies after their wait: rows of every slot of the
      ring can be in flight at once.
  """

  block_m: int = 64
  block_n_gate_up: int = 128
  block_n_down: int = 128
  block_k: int = 64
  num_stages: int = 4
  warpgroups: int = 1
  warpgroup_split: str = "n"
  epilogue_n: int | None = None
  num_sms: int | None = None
  transposed_tiles: bool = False
  memory_parts: int = 1
  gather_in_kernel: bool = False
  gather_rows_signal: str = "late"

  def __post_init__(self):
    fields = (
      "block_m",
      "block_n_gate_up",
      "block_n_down",
      "block_k",
      "num_stages",
      "warpgroups",
      "memory_parts",
    )
    validate_config_fields(self, positive=fields + ("epilogue_n",))
    if self.transposed_tiles:
      if self.warpgroups != 2 or self.warpgroup_split != "n":
        raise ValueError(
          "TuningConfig.transposed_tiles needs warpgroups=2 and warpgroup_split='n' (the "
          "consumer warpgroups share the weight columns of a tile)"
        )
      if self.block_m % ROW_ALIGN or self.block_m > MAX_WGMMA_N:
        raise ValueError(
          f"TuningConfig.block_m must be a multiple of {ROW_ALIGN} up to {MAX_WGMMA_N} with "
          f"transposed_tiles (the wgmma N), got {self.block_m}"
        )
    elif self.block_m not in (64, 128):
      raise ValueError(f"TuningConfig.block_m must be 64 or 128, got {self.block_m}")
    for name in ("block_n_gate_up", "block_n_down", "block_k"):
      if getattr(self, name) % 64:
        raise ValueError(f"TuningConfig.{name} must be a multiple of 64, got {getattr(self, name)}")
    if self.num_stages < 2:
      raise ValueError(f"TuningConfig.num_stages must be at least 2, got {self.num_stages}")
    if self.warpgroups not in (1, 2):
      raise ValueError(f"TuningConfig.warpgroups must be 1 or 2, got {self.warpgroups}")
    if self.warpgroup_split not in ("n", "m"):
      raise ValueError(
        f"TuningConfig.warpgroup_split must be 'n' or 'm', got {self.warpgroup_split!r}"
      )
    if self.warpgroups == 2 and self.warpgroup_split == "m" and self.block_m != 128:
      raise ValueError("TuningConfig.warpgroup_split='m' needs block_m=128 (64 rows per warpgroup)")
    if self.warpgroups == 2 and self.warpgroup_split == "n":
      for name in ("block_n_gate_up", "block_n_down"):
        if getattr(self, name) % 128:
          raise ValueError(
            f"TuningConfig.warpgroup_split='n' needs {name} to be a multiple of 128 (64 columns "
            f"per warpgroup at least), got {getattr(self, name)}"
          )
    if self.gather_in_kernel and self.warpgroups != 2:
      raise ValueError(
        "TuningConfig.gather_in_kernel needs warpgroups=2 (a producer warpgroup copies the rows)"
      )
    if self.gather_in_kernel and self.block_k != 64:
      raise ValueError(
        f"TuningConfig.gather_in_kernel needs block_k=64 (each copied row fills one 128-byte "
        f"row of the swizzled (8, 64) tile), got {self.block_k}"
      )
    if self.gather_rows_signal not in ("late", "copies"):
      raise ValueError(
        f"TuningConfig.gather_rows_signal must be 'late' or 'copies', got "
        f"{self.gather_rows_signal!r}"
      )
    if self.epilogue_n is not None:
      if self.warpgroups != 2:
        raise ValueError(
          "TuningConfig.epilogue_n needs warpgroups=2 (the one-warpgroup kernel "
          "stages its whole tile)"
        )
      for name in ("block_n_gate_up", "block_n_down"):
        columns = self.accumulator_shape(getattr(self, name))[1]
        if self.epilogue_n % 64 or columns % self.epilogue_n:
          raise ValueError(
            f"TuningConfig.epilogue_n must be a multiple of 64 dividing each warpgroup's "
            f"{columns} columns of {name}, got {self.epilogue_n}"
          )

  def epilogue_shape(self, block_n: int) -> tuple[int, int]:
    """The [rows, columns] one warpgroup stages in shared memory at a time."""
    rows, columns = self.accumulator_shape(block_n)
    return rows, self.epilogue_n or columns

  def accumulator_shape(self, block_n: int) -> tuple[int, int]:
    """The [rows, columns] accumulated by one consumer warpgroup for an N block of ``block_n``
    (with ``transposed_tiles`` the accumulator is its transpose, [columns, rows])."""
    if self.warpgroups == 1:
      return (self.block_m, block_n)
    if self.warpgroup_split == "m":
      return (self.block_m // 2, block_n)
    return (self.block_m, block_n // 2)


def max_tiles(num_routes: int, num_experts: int, block_m: int) -> int:
  """M tiles any routing of ``num_routes`` routes over ``num_experts`` experts can need.

  ``sum_e ceil(c_e / m) <= (sum_e c_e + n * (m - 1)) / m`` over the ``n <= min(E, T * k)``
  experts with a route.
  """
  return (num_routes + min(num_experts, num_routes) * (block_m - 1)) // block_m


def _pick_block_n(size: int, tiles: int, sms: int, candidates: tuple[int, ...]) -> int:
  """The largest N block of ``candidates`` dividing ``size`` whose items fill every SM twice,
  else the one with the most items (the smallest)."""
  fitting = [b for b in candidates if size % b == 0]
  for block in sorted(fitting, reverse=True):
    if tiles * (size // block) >= 2 * sms:
      return block
  return min(fitting) if fitting else candidates[-1]


# default_config's choice from PREFILL_ROUTES_PER_EXPERT routes per expert (where I and H are
# multiples of its N blocks): 128-row tiles split by rows over two consumer warpgroups, down N
# blocks of 256 staged in two 128-column pieces so that a 3-deep ring fits beside them.
PREFILL_CONFIG = TuningConfig(
  block_m=128,
  block_n_gate_up=128,
  block_n_down=256,
  num_stages=3,
  warpgroups=2,
  warpgroup_split="m",
  epilogue_n=128,
)
# The same where H is a multiple of 128 but not of 256: down N blocks of 128, staged whole beside
# a 4-deep ring (the prefill default measured before the 256 one).
PREFILL_CONFIG_N128 = dataclasses.replace(
  PREFILL_CONFIG, block_n_down=128, num_stages=4, epilogue_n=None
)


def default_config(
  num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int
) -> TuningConfig:
  """Heuristic defaults from the shapes (host-side numbers only), chosen from H200 sweeps
  (``benchmarks/bench_moe.py --tune``, GLM-4.5-Air shapes).

  Decode and verify sizes (fewer than ``PREFILL_ROUTES_PER_EXPERT`` routes per expert on
  average): ``block_m`` 64, the smallest wgmma M, since a tile holds a few routes; one
  warpgroup with a 4-deep ring. The N blocks are as large as the register and shared-memory
  budgets allow (128 for the two gate/up accumulators, 256 for the down one), unless the
  expected tiles (``min(T * k, E)`` touched experts, or ``T * k / 64`` full tiles) would give
  fewer than two work items per SM: then smaller blocks split each expert over more SMs.

  Prefill sizes: 128-row tiles split over two consumer warpgroups (64 rows each) fed by a
  producer warpgroup. A 64-row tile pulls a whole weight block through L2 for 64 rows, and at
  these sizes that traffic, not the wgmmas, set the pace: at 2048 tokens 2151 -> 1749 us, at
  8192 6071 -> 4814 us; at 384 tokens (24 routes per expert) 1155 -> 1165 us, no gain. The down
  kernel takes N blocks of 256 (``PREFILL_CONFIG``): twice the wgmma work per lhs block and per
  pipeline step of the 128 blocks, which left it at 75% of the matmul rate; staging its output
  (then float32) in 128-column pieces left room for a 3-deep ring. Against the 128 blocks (4-deep
  ring), one process, GLM-4.5-Air / GLM-4.5: 1712 -> 1602 / 2256 -> 2166 us at 2048 tokens,
  4694 -> 4570 / 6966 -> 6565 us at 8192, 1247 -> 1235 / 2028 -> 1987 us at 1024. In
  between, the one-warpgroup config's time over the prefill config's (H200, both timed in one
  process; GLM-4.5-Air / GLM-4.5) was 0.94 / 0.94 at 48 routes per expert, 0.96 / 0.98 at 56,
  1.11 / 1.17 at 64, 1.25 / 1.29 at 72 and 1.31 / 1.32 at 88
  (``benchmarks/NOTES_routed_experts.md``; ``benchmarks/bench_moe.py --crossover`` re-times both
  choices). Re-timed with the 256-wide down blocks: 0.96 / 0.98 at 48, 1.01 / 1.02 at 56, 1.14 /
  1.19 at 64; on an H100, two runs: 0.99 / 0.98-0.99 at 48, 1.03 / 1.05 at 56, 1.19 /
  1.23-1.24 at 64. Hence the threshold at 56. With the down output in bf16 a 4-deep ring fits
  beside the 128-column pieces too, but it was no faster (one process, GLM-4.5-Air / GLM-4.5, 3
  -> 4 stages): 1556 -> 1612 / 2029 -> 2078 us at 2048 tokens, 4391 -> 4255 / 6357 -> 6481 us at
  8192.

  At prefill sizes the tiles then take the multiple of 8 rows from 128 to
  ``MAX_TRANSPOSED_ROWS`` that pads the fewest rows under random routing
  (``prefill_tile_rows``): on an H100, one process, outputs bit for bit equal, GLM-4.5-Air 1919
  -> 1762-1816 us at 2048 tokens (144 rows) and 4538-4631 -> 4263-4476 us at 8192 (136 rows),
  GLM-4.5 6635-6696 -> 6026-6030 us at 8192 (144 rows); at equal rows (GLM-4.5, 2048 tokens)
  the transposed tiles took 2821-2850 us against 2873-2884, so 128 rows keep the row tiles.

  From ``MAX_ROUTES_PER_PART`` routes on, the prefill configs run in ``memory_parts`` (so the
  routed-row buffers stay under that many rows of H at any chunk size): at GLM-4.5-Air's shapes
  and 8192 tokens 4 parts cost 8% of the time and keep the layer's peak under 4 x its
  activations plus its weights (5.30 -> 4.89 GB; ``memory_parts=1`` buys the time back).

  Up to ``MAX_ROUTES_PER_PART`` routes (one memory part) the gate/up kernel copies the rows of
  ``x`` itself (``gather_in_kernel``), where the shared memory allows: on an H100, one process,
  outputs bit for bit equal, GLM-4.5-Air 1806 -> 1658 us and GLM-4.5 2866 -> 2663 us at 2048
  tokens (the XLA gather gone, and the gate/up kernel faster too: 1108 -> 1011 us). At 8192
  tokens the same kernel took 4269 -> 4700 us (GLM-4.5-Air) and 6166 -> 6350 us (GLM-4.5): its
  gate/up kernel 2254 -> 2900 us, where ``x`` (67 MB) no longer fits the L2.
  """
  config = prefill_config(hidden, intermediate)
  if config is None or num_tokens * top_k < PREFILL_ROUTES_PER_EXPERT * num_experts:
    return decode_config(num_tokens, top_k, num_experts, hidden, intermediate)
  parts = memory_parts(num_tokens * top_k, hidden // config.block_n_down)
  config = prefill_tile_rows(
    dataclasses.replace(config, memory_parts=parts), num_tokens, top_k, num_experts
  )
  gathering = dataclasses.replace(config, gather_in_kernel=True)
  smem = _smem_bytes(  # of the gate/up kernel, the one that gathers, with 16-bit weights
    gathering, config.block_n_gate_up, num_rhs=2, itemsize=2, gathered=True
  )
  if parts == 1 and smem <= SMEM_BYTES:
    return gathering
  return config


def prefill_config(hidden: int, intermediate: int) -> TuningConfig | None:
  """``PREFILL_CONFIG``, or ``PREFILL_CONFIG_N128`` where ``hidden`` is a multiple of 128 but
  not of 256; None where the N blocks of neither divide ``intermediate`` and ``hidden``."""
  for config in (PREFILL_CONFIG, PREFILL_CONFIG_N128):
    if intermediate % config.block_n_gate_up == 0 and hidden % config.block_n_down == 0:
      return config
  return None


def prefill_tile_rows(
  config: TuningConfig, num_tokens: int, top_k: int, num_experts: int
) -> TuningConfig:
  """``config`` (128-row tiles) or, where tiles of another multiple of 8 between 128 and
  ``MAX_TRANSPOSED_ROWS`` rows multiply fewer rows in expectation (``expected_tile_rows``), the
  same kernels with transposed tiles of that many rows (``with_transposed_tiles``).

  Below 128 rows a tile is held by its weight block's traffic through L2 rather than by its
  rows (``benchmarks/NOTES_routed_experts.md``), so smaller tiles are not considered. Outputs are
  bit for bit those of the 128-row tiles: each route's row sees the same products in the same
  order.
  """
  candidates = range(config.block_m, MAX_TRANSPOSED_ROWS + 1, ROW_ALIGN)
  rows = min(candidates, key=lambda r: expected_tile_rows(num_tokens, top_k, num_experts, r))
  return config if rows == config.block_m else with_transposed_tiles(config, rows)


def with_transposed_tiles(config: TuningConfig, rows: int) -> TuningConfig:
  """``config``'s N blocks with transposed tiles of ``rows`` rows (a multiple of 8 up to
  ``MAX_TRANSPOSED_ROWS``): 3-deep rings, each warpgroup's output staged in 64-column pieces
  (the larger tiles' rows take the shared memory of a deeper ring)."""
  return dataclasses.replace(
    config,
    block_m=rows,
    num_stages=3,
    warpgroup_split="n",
    transposed_tiles=True,
    epilogue_n=ROWS_PER_WGMMA,
  )


@functools.lru_cache(maxsize=64)
def _route_count_pmf(num_tokens: int, top_k: int, num_experts: int):
  """(counts, probabilities) of one expert's routes under uniformly random routing,
  ``Binomial(num_tokens, top_k / num_experts)`` (each token picks ``top_k`` distinct experts),
  over the counts within 12 standard deviations of the mean (the rest weighs below 1e-30)."""
  p = min(top_k / num_experts, 1.0)
  if p == 1.0:
    return np.array([num_tokens]), np.array([1.0])
  mean, sd = num_tokens * p, math.sqrt(num_tokens * p * (1.0 - p))
  first, last = max(0, math.floor(mean - 12 * sd)), min(num_tokens, math.ceil(mean + 12 * sd))
  counts = np.arange(first, last + 1)
  log_first = (
    math.lgamma(num_tokens + 1)
    - math.lgamma(first + 1)
    - math.lgamma(num_tokens - first + 1)
    + first * math.log(p)
    + (num_tokens - first) * math.log1p(-p)
  )
  # log P(c + 1) - log P(c) = log((T - c) / (c + 1)) + log(p / (1 - p))
  steps = np.log((num_tokens - counts[:-1]) / (counts[:-1] + 1)) + math.log(p / (1.0 - p))
  return counts, np.exp(log_first + np.concatenate([[0.0], np.cumsum(steps)]))


def expected_tile_rows(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> float:
  """Rows the tiles of ``block_m`` rows multiply per expert, in expectation over uniformly
  random routing (``_route_count_pmf``): an expert with ``c`` routes takes ``ceil(c / block_m)``
  tiles."""
  counts, pmf = _route_count_pmf(num_tokens, top_k, num_experts)
  return float(np.sum(pmf * -(-counts // block_m) * block_m))


def memory_parts(num_routes: int, down_blocks: int) -> int:
  """``default_config``'s ``memory_parts``: the fewest parts of at most ``MAX_ROUTES_PER_PART``
  routes each, raised to a divisor of the down kernel's ``down_blocks`` N blocks (each column
  range of H takes whole blocks)."""
  parts = min(-(-num_routes // MAX_ROUTES_PER_PART), down_blocks)
  while down_blocks % parts:
    parts += 1
  return parts


def decode_config(
  num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int
) -> TuningConfig:
  """``default_config``'s choice below ``PREFILL_ROUTES_PER_EXPERT`` routes per expert: 64-row
  tiles, one warpgroup, N blocks that give every SM two work items where the shapes allow."""
  routes = num_tokens * top_k
  tiles = max(min(routes, num_experts), routes // ROWS_PER_WGMMA)
  sms = num_sms(None)
  return TuningConfig(
    block_m=64,
    block_n_gate_up=_pick_block_n(intermediate, tiles, sms, (128, 64)),
    block_n_down=_pick_block_n(hidden, tiles, sms, (256, 128, 64)),
    block_k=64,
    num_stages=4,
  )


def _smem_bytes(config: TuningConfig, block_n, num_rhs, itemsize, gathered: bool) -> int:
  """The ring of ``config.num_stages`` (lhs, rhs...) blocks and the output staging tile(s), all
  of ``itemsize`` bytes (both kernels store the weights' dtype); a ``gathered`` lhs adds the
  tile's int32 tokens."""
  block_m, block_k = config.block_m, config.block_k
  ring = config.num_stages * (block_m * block_k + num_rhs * block_k * block_n) * itemsize
  tokens = TOKEN_SLOTS * 4 if gathered else 0
  rows, columns = config.epilogue_shape(block_n)
  return ring + tokens + config.warpgroups * rows * columns * itemsize


def unsupported_reason(
  x, expert_ids, weights, w_gate, w_up, w_down, *, config: TuningConfig
) -> str | None:
  """Why the kernels cannot serve these inputs with ``config``, or ``None`` when they can."""
  del x, expert_ids, weights, w_up, w_down  # any values the api accepts are served
  _, hidden, intermediate = w_gate.shape
  dtype = jnp.dtype(w_gate.dtype)
  if dtype not in SUPPORTED_DTYPES:
    return f"the Mosaic GPU kernels need bf16 or fp16 expert weights, got {dtype}"
  for name, size in (("H", hidden), ("I", intermediate)):
    if size % config.block_k:
      return f"{name}={size} must be a multiple of block_k={config.block_k}"
  if intermediate % config.block_n_gate_up:
    return f"I={intermediate} must be a multiple of block_n_gate_up={config.block_n_gate_up}"
  if hidden % (config.memory_parts * config.block_n_down):
    return (
      f"H={hidden} must be a multiple of memory_parts * block_n_down = {config.memory_parts} * "
      f"{config.block_n_down} (the down kernel's column ranges)"
    )
  for kernel, block_n, num_rhs, gathered in (
    ("gate_up", config.block_n_gate_up, 2, config.gather_in_kernel),
    ("down", config.block_n_down, 1, False),
  ):
    rows, columns = config.accumulator_shape(block_n)
    budget = MAX_ACC_ELEMENTS_TRANSPOSED if config.transposed_tiles else MAX_ACC_ELEMENTS
    if num_rhs * rows * columns > budget:
      return (
        f"the {kernel} kernel's accumulators ({num_rhs} x {rows} x {columns} per warpgroup) "
        f"exceed {budget} float32 elements (the register budget)"
      )
    smem = _smem_bytes(config, block_n, num_rhs, dtype.itemsize, gathered)
    if smem > SMEM_BYTES:
      return f"the {kernel} kernel needs {smem} bytes of shared memory, more than {SMEM_BYTES}"
  return None


def route_rows(num_routes: int, num_experts: int) -> int:
  """Rows of the sorted buffers for any routing: each expert's span is rounded up to 8 rows."""
  padded = num_routes + min(num_experts, num_routes) * (ROW_ALIGN - 1)
  return -(-padded // ROW_ALIGN) * ROW_ALIGN


@dataclasses.dataclass(frozen=True)
class RoutePlan:
  """Where each route's rows live in the sorted buffers, and the M tiles over them.

  Attributes:
    route_of_row: int32 [rows], the route (``t * k + j``) of each buffer row, -1 for padding.
    position: int32 [T * k], the buffer row of each route (0 for dropped routes).
    valid: bool [T * k], whether the route's expert id is in ``[0, E)``.
    num_tiles: int32 [1], the used M tiles.
    table: int32 [3, max_tiles]: each tile's expert, first buffer row, and rows to store (a
      multiple of 8; 0 for unused slots). Used tiles come first.
  """

  route_of_row: jax.Array
  position: jax.Array
  valid: jax.Array
  num_tiles: jax.Array
  table: jax.Array


def _exclusive_cumsum(values: jax.Array) -> jax.Array:
  """``cumsum(values, axis=0) - values`` of a short leading axis as one masked sum over
  ``[n, n, ...]``: unlike a scan, XLA fuses it with its producer and with sibling sums into one
  small kernel."""
  index = jnp.arange(values.shape[0])
  earlier = (index[None, :] < index[:, None]).reshape(
    (values.shape[0],) * 2 + (1,) * (values.ndim - 1)
  )
  return jnp.sum(jnp.where(earlier, values[None], 0), axis=1, dtype=values.dtype)


def _rows_by_counting(expert_ids, valid, span_start, rows: int):
  """(position, route_of_row) from a counting sort by blocks of ``COUNT_BLOCK_ROUTES`` routes.

  A route's rank within its expert is the number of earlier routes of that expert in its own
  block (all pairs of the block) plus that expert's routes in the earlier blocks (per-block
  counts summed over the blocks before); one scatter then lists each row's route. Stable, so
  the plan equals the sort's, without XLA's sort kernels (48 of the 194 us of XLA kernels at
  GLM-4.5-Air's 2048 tokens, where the sort and its two scatters ran).
  """
  flat = expert_ids.reshape(-1)  # [T * k]
  num_routes, num_experts = flat.shape[0], span_start.shape[0]
  block = COUNT_BLOCK_ROUTES
  blocks = -(-num_routes // block)
  # The tail of the last block gets id -1, which no valid route has: it changes no valid rank.
  ids = jnp.pad(flat, (0, blocks * block - num_routes), constant_values=-1).reshape(blocks, block)
  lane = jnp.arange(block)
  earlier = lane[None, :] < lane[:, None]  # [B, B]: lane j before lane i
  same_earlier = (ids[:, :, None] == ids[:, None, :]) & earlier  # [blocks, B, B]
  rank_in_block = jnp.sum(same_earlier, axis=2, dtype=jnp.int32)  # [blocks, B]
  experts = jnp.arange(num_experts, dtype=jnp.int32)
  block_counts = jnp.sum(ids[:, :, None] == experts, axis=1, dtype=jnp.int32)  # [blocks, E]
  earlier_blocks = _exclusive_cumsum(block_counts)  # [blocks, E]
  safe_ids = jnp.clip(ids, 0, num_experts - 1)
  rank = rank_in_block + jnp.take_along_axis(earlier_blocks, safe_ids, axis=1)  # [blocks, B]
  rank = rank.reshape(-1)[:num_routes]
  position = jnp.where(valid, span_start[safe_ids.reshape(-1)[:num_routes]] + rank, 0)
  route = jnp.arange(num_routes, dtype=jnp.int32)
  target = jnp.where(valid, position, rows)  # dropped routes: out of range, dropped by the scatter
  route_of_row = jnp.full((rows,), -1, jnp.int32).at[target].set(route, mode="drop")
  # Materialised here: left as an expression, XLA fused the rank sums into the combine, which
  # gathers each route's row for every one of its H columns, and recomputed them per element
  # (GLM-4.5-Air at 384 tokens: 270 us more of XLA kernels on the H200).
  return lax.optimization_barrier((position, route_of_row))


def _rows_by_comparing(expert_ids, valid, span_start, rows: int):
  """(position, route_of_row) from all-pairs comparisons, no sort or scatter.

  A route's rank within its expert counts the earlier routes with its id (``[T * k, T * k]``)
  and a buffer row finds its route among all routes (``[rows, T * k]``): quadratic, but a few
  fused kernels where the sort and the scatters are a dozen launches (decode sizes).
  """
  flat = expert_ids.reshape(-1)  # [T * k]
  route = jnp.arange(flat.shape[0], dtype=jnp.int32)
  same_earlier = (flat[None, :] == flat[:, None]) & (route[None, :] < route[:, None])
  rank = jnp.sum(same_earlier, axis=1, dtype=jnp.int32)
  safe_expert = jnp.clip(flat, 0, span_start.shape[0] - 1)
  position = jnp.where(valid, span_start[safe_expert] + rank, 0)
  hits = (position[None, :] == jnp.arange(rows, dtype=jnp.int32)[:, None]) & valid[None, :]
  # At most one valid route per row: the sum of (route + 1) over hits, minus 1, is it or -1.
  route_of_row = jnp.sum(jnp.where(hits, route[None, :] + 1, 0), axis=1, dtype=jnp.int32) - 1
  return position, route_of_row


def plan_routes(expert_ids: jax.Array, num_experts: int, block_m: int, rows: int) -> RoutePlan:
  """Sorts the routes by expert into ``rows`` buffer rows and lists the tiles (XLA, on device).

  Expert ``e`` with ``c`` valid routes owns the span of ``ceil(c / 8) * 8`` rows starting at a
  multiple of 8 (a TMA copy into 8-row-tiled shared memory must start on a tile row); its
  routes fill the span in token order, the rest of the span is padding. The span is cut into
  ``ceil(c / block_m)`` M tiles. Routes with ids outside ``[0, E)`` get no row.

  Up to ``COMPARE_PLAN_MAX_ROUTES`` routes the rows come from all-pairs comparisons (a few
  fused kernels), beyond from a counting sort by blocks and one scatter; both give the plan of
  a stable sort by expert.
  """
  num_routes = expert_ids.size
  flat = expert_ids.reshape(-1)
  valid = (flat >= 0) & (flat < num_experts)
  experts = jnp.arange(num_experts, dtype=jnp.int32)
  counts = jnp.sum(flat[:, None] == experts[None, :], axis=0, dtype=jnp.int32)  # [E]
  spans = lax.div(counts + (ROW_ALIGN - 1), ROW_ALIGN) * ROW_ALIGN  # [E]
  span_start = _exclusive_cumsum(spans)  # [E], first row of each expert
  if num_routes <= COMPARE_PLAN_MAX_ROUTES:
    position, route_of_row = _rows_by_comparing(expert_ids, valid, span_start, rows)
  else:
    position, route_of_row = _rows_by_counting(expert_ids, valid, span_start, rows)

  tiles = lax.div(counts + (block_m - 1), block_m)  # [E]
  tile_start = _exclusive_cumsum(tiles)  # [E], each expert's first tile
  slot = jnp.arange(max_tiles(num_routes, num_experts, block_m), dtype=jnp.int32)
  # The expert of tile `slot`: how many experts end at or before it (E for unused slots).
  expert = jnp.sum((tile_start + tiles)[None, :] <= slot[:, None], axis=1, dtype=jnp.int32)
  expert = jnp.minimum(expert, num_experts - 1)
  local = slot - tile_start[expert]  # the tile's index within its expert
  row_start = span_start[expert] + local * block_m
  tile_rows = jnp.clip(spans[expert] - local * block_m, 0, block_m)
  table = jnp.stack([expert, row_start, tile_rows]).astype(jnp.int32)
  num_tiles = jnp.sum(tiles, keepdims=True, dtype=jnp.int32)
  return RoutePlan(route_of_row, position, valid, num_tiles, table)


def _store_rows(out_smem, out_ref, rows, row_start, columns, max_rows: int) -> None:
  """Copies the first ``rows`` rows of ``out_smem`` to ``out_ref[row_start:, columns]``.

  ``rows`` (a multiple of 8, at most ``max_rows``) is only known on the device, and a TMA copy
  has a static shape: one copy per set bit of ``rows``, largest first (jax's ragged_dot_mgpu).
  The offsets are multiples of 8, whole rows of the staging tile's (8, 64) tiling: Mosaic GPU's
  layout inference gives ``out_smem`` that tiling and a 128-byte swizzle, and the epilogue writes
  it with ``stmatrix`` (both kernels at GLM-4.5-Air's 8192-token config, compiled for sm_90a by
  ``benchmarks/compile_for_h200.py``).
  """
  offset = 0  # static for the first (largest) copy, traced after
  size = 1 << (max_rows.bit_length() - 1)  # rows < 2 * size: no higher bit is set
  while size >= ROW_ALIGN:
    part = rows & size

    @pl.when(part != 0)
    def _copy():
      plgpu.copy_smem_to_gmem(  # runs at once, with this iteration's offset and size
        out_smem.at[pl.ds(offset, size)],  # noqa: B023
        out_ref.at[pl.ds(row_start + offset, size), columns],  # noqa: B023
      )

    offset = offset + part
    size //= 2


def _copy_rows_async(
  x_ref,  # [T', block_k] columns of x in global memory (row stride H)
  token_smem,  # int32 [TOKEN_SLOTS], the token of each of the tile's rows, -1 for padding
  slot_ref,  # [rows, block_k], a ring slot: (8, 64)-tiled, 128-byte swizzled
  *,
  hidden: int,  # H, the row stride of x
  rows: int,
  pad_row: int | None,
  transforms,
  commit_group: bool,
) -> None:
  """``slot_ref[r] = x_ref[token_smem[r]]`` for ``r < rows``, as ``cp.async`` copies of 16
  bytes issued by every thread of the calling warpgroup, committed as one group when
  ``commit_group`` (``_wait_rows`` waits for it; copies that arrive on a barrier themselves,
  ``_rows_arrive``, need no group).

  ``cp.async`` (LDGSTS) moves global memory into shared memory without passing through
  registers, so the issuing threads never wait for the loads. An in-kernel gather that loaded the
  rows into registers and stored them stalled its warps at the first use of each load (0.78-0.98x
  of the XLA gather's call on the H200, ``benchmarks/NOTES_routed_experts.md``); TMA copies one
  row per instruction at 30 rows per SM per us from one thread (the row-gather probe). Thread
  ``t`` copies the 16-byte chunk ``c = t % 8`` of rows ``t // 8 + 16 i``, so a warp moves four
  whole 128-byte rows per instruction; row ``r``'s chunk ``c`` lands at byte
  ``r * 128 + (c ^ (r % 8)) * 16`` of the slot, the (8, 64) tile's 128-byte swizzle that the TMA
  unit applies to the weights' blocks. Rows whose token is -1 copy ``x_ref``'s row ``pad_row``,
  or are zero-filled (a source size of 0) when it is ``None``. GPU only: the interpreter takes
  the rows with ``jnp.take`` (``_grouped_matmul``).
  """
  row_bytes = hidden * jnp.dtype(x_ref.dtype).itemsize

  @plgpu.inline_mgpu(
    arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(transforms=transforms)),
  )
  def issue(_, x, tokens, slot):
    i32, i64, i8 = (ir.IntegerType.get_signless(n) for n in (32, 64, 8))
    index = ir.IndexType.get()

    def const(value, kind=i32):
      return arith.constant(kind, value)

    thread = arith.remui(mgpu.utils.thread_idx(), const(128))
    chunk, group = arith.andi(thread, const(7)), arith.shrui(thread, const(3))
    # r % 8 == group % 8 for every row r = group + 16 i of this thread.
    swizzled = arith.shli(arith.xori(chunk, arith.andi(group, const(7))), const(4))
    chunk_bytes = arith.extui(i64, arith.shli(chunk, const(4)))
    x_ptr, slot_ptr = mgpu.utils.memref_ptr(x), mgpu.utils.memref_ptr(slot)
    for first in range(0, rows, 16):
      row = arith.addi(group, const(first))
      partial = first + 16 > rows  # the last rows, not a whole 16 of them
      in_tile = arith.cmpi(arith.CmpIPredicate.ult, row, const(rows)) if partial else None
      loaded_row = arith.minui(row, const(rows - 1)) if partial else row
      token = memref.load(tokens, [arith.index_cast(index, loaded_row)])
      present = arith.cmpi(arith.CmpIPredicate.sge, token, const(0))
      source_row = arith.select(present, token, const(pad_row or 0))
      source_offset = arith.muli(arith.extui(i64, source_row), const(row_bytes, i64))
      source = mgpu.utils.getelementptr(x_ptr, [arith.addi(source_offset, chunk_bytes)], i8)
      target = mgpu.utils.getelementptr(
        slot_ptr, [arith.addi(arith.muli(row, const(128)), swizzled)], i8
      )
      size = const(16) if pad_row is not None else arith.select(present, const(16), const(0))
      mgpu.utils.inline_ptx(
        "cp.async.cg.shared.global [$0], [$1], 16, $2;", target, source, size, predicate=in_tile
      )
    if commit_group:
      mgpu.utils.inline_ptx("cp.async.commit_group;")

  issue(x_ref, token_smem, slot_ref)


_rows_arrive_p = jax_core.Primitive("jaxspec_cp_async_rows_arrive")
_rows_arrive_p.multiple_results = True


@_rows_arrive_p.def_effectful_abstract_eval
def _rows_arrive_abstract_eval(barrier, *flat_transforms, transforms_treedef):
  del barrier, flat_transforms, transforms_treedef
  return (), {gpu_core._memory_effect}


@mgpu_lowering.register_lowering_rule(_rows_arrive_p, mgpu.LoweringSemantics.Lane)
@mgpu_lowering.register_lowering_rule(_rows_arrive_p, mgpu.LoweringSemantics.Warpgroup)
def _rows_arrive_lowering(ctx, barrier, *flat_transforms, transforms_treedef):
  transforms = transforms_treedef.unflatten(flat_transforms)
  index = mgpu_primitives._get_barrier_base_index(ctx.avals_in[0], transforms)
  if index is not None:
    barrier = barrier[index]
  mgpu.utils.inline_ptx(
    "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", barrier.get_ptr(), has_side_effects=True
  )
  return ()


def _rows_arrive(barrier) -> None:
  """Arrives on ``barrier`` (one barrier of a ``plgpu.Barrier`` ring, indexed with ``.at``) from
  every thread of the calling warpgroup once all of the thread's ``cp.async`` copies issued so far
  have landed (``cp.async.mbarrier.arrive.noinc``), without waiting for them: the copies
  themselves complete the arrival. A Pallas barrier of one arrival counts one arrival from each
  of the warpgroup's 128 threads, so the phase completes when every thread's rows are in.
  Readers through the async proxy (wgmma) fence after their wait (``_rows_fence``).

  Pallas Mosaic GPU (jax 0.11.2) exposes no barrier address to ``plgpu.inline_mgpu``; this
  primitive lowers like ``plgpu.barrier_arrive`` (the same indexing of the barrier ring) with the
  copy-tracking arrival in place of a plain one. GPU only: the interpreter has no ``cp.async``.
  Mosaic GPU's own ``cp.async`` copies signal a barrier from the copies too (without
  ``.noinc``: each thread's instruction adds a pending arrival that its copies remove, and one
  thread then arrives for all)."""
  barrier, transforms = state_primitives.get_ref_and_transforms(barrier, None, "rows_arrive")
  flat_transforms, transforms_treedef = tree_util.tree_flatten(transforms)
  _rows_arrive_p.bind(barrier, *flat_transforms, transforms_treedef=transforms_treedef)


def _rows_fence() -> None:
  """Orders ``cp.async`` rows this thread has seen land (its own after ``cp.async.wait_group``,
  any thread's after a barrier wait) before shared-memory accesses through the async proxy (the
  wgmmas read shared memory through it, ``cp.async`` writes through the generic proxy)."""

  @plgpu.inline_mgpu()
  def fence(_):
    mgpu.utils.inline_ptx("fence.proxy.async.shared::cta;")

  fence()


def _wait_rows(pending: int) -> None:
  """Waits until at most ``pending`` of this thread's ``_copy_rows_async`` groups are in
  flight, then orders their writes before the async proxy (the wgmmas read shared memory
  through it; ``cp.async`` writes through the generic proxy)."""

  @plgpu.inline_mgpu()
  def wait(_):
    mgpu.utils.inline_ptx(f"cp.async.wait_group {pending};")

  wait()
  _rows_fence()


def _grouped_matmul(
  lhs: jax.Array,  # [L, K], sorted rows from buffer row lhs_row (L >= any tile's end - lhs_row)
  rhs: tuple[jax.Array, ...],  # each [E, K, N]
  num_tiles: jax.Array,  # int32 [1]
  table: jax.Array,  # int32 [3, S], see plan_routes
  lhs_row: jax.Array,  # int32 [1], the buffer row of lhs[0]
  *,
  out: jax.Ref | None = None,  # [out_rows, columns], stored into instead of a new array
  out_rows: int,
  out_dtype,
  epilogue: Callable[..., jax.Array],
  block_n: int,
  columns: tuple[int, int] | None = None,  # (first, count) of rhs's N columns; None: all
  gather: tuple[jax.Array, int | None] | None = None,  # (tokens, pad row)
  config: TuningConfig,
  name: str,
  interpret: bool,
) -> jax.Array | None:  # [out_rows, count], out_dtype (None with out); tiles' own rows written
  """One persistent kernel: for every used tile t and N block n of ``columns``,
  ``out[rows of t, n] = epilogue(*(lhs[rows of t] @ w[expert of t][:, n] for w in rhs))``, rows
  counted in buffer rows (``lhs`` holds them from ``lhs_row`` on) and columns from ``columns``'s
  first.

  With ``config.warpgroups == 1`` one warpgroup issues the TMA copies and the wgmmas of a
  ``plgpu.emit_pipeline`` per work item. With 2, a producer warpgroup issues the copies and two
  consumer warpgroups split the block (``config.warpgroup_split``) in a
  ``plgpu.emit_pipeline_warp_specialized`` per item (jax's ``hopper_matmul_mgpu``): the producer
  moves on to the next item's first blocks while the consumers run the epilogue.

  With ``gather`` (``config.gather_in_kernel``), ``lhs`` is ``x [T', K]`` and buffer row ``r``
  of a tile is ``x[tokens[r]]`` (``tokens`` int32 ``[out_rows + TOKEN_SLOTS]``, -1 for padding:
  row ``pad row`` of ``x``, or zeros where it is None): the pipeline is written out by hand
  (``gathered``), since ``emit_pipeline_warp_specialized``'s producer only issues TMA copies.
  """
  block_m, block_k = config.block_m, config.block_k
  k_steps = lhs.shape[1] // block_k
  column_start, num_columns = columns or (0, rhs[0].shape[2])
  n_blocks, first_n_block = num_columns // block_n, column_start // block_n
  swizzle = plgpu.find_swizzle(block_k * jnp.dtype(lhs.dtype).itemsize * 8)
  swizzle_elems = swizzle // jnp.dtype(lhs.dtype).itemsize
  transforms = (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))
  # One warpgroup releases a slot one step late (delay_release=1): step s's wgmmas run while
  # the slot of step s - 1 is refilled. With a producer warpgroup a slot is released once its
  # wgmmas are complete (delay_release=0, as jax's hopper_matmul_mgpu): the producer starts the
  # next item's copies as soon as the last step's slot is released, so a late release would let
  # it overwrite a slot that the last step's wgmmas may still read.
  delay_release = 1 if config.warpgroups == 1 else 0

  def specs(n_block):
    lhs_spec = plgpu.BlockSpec(
      (block_m, block_k), lambda k: (0, k), transforms=transforms, delay_release=delay_release
    )
    rhs_spec = plgpu.BlockSpec(
      (block_k, block_n),
      lambda k: (k, first_n_block + n_block),
      transforms=transforms,
      delay_release=delay_release,
    )
    return [lhs_spec] + [rhs_spec] * len(rhs)

  def work_item(table_ref, lhs_row_ref, item):
    """(N block within ``columns``, expert, first buffer row, its row in ``lhs``, rows to
    store) of work item ``item``."""
    tile = lax.div(item, n_blocks)
    row_start = pl.multiple_of(table_ref[1, tile], ROW_ALIGN)  # see plan_routes
    lhs_start = pl.multiple_of(row_start - lhs_row_ref[0], ROW_ALIGN)  # lhs_row: a tile's row
    return lax.rem(item, n_blocks), table_ref[0, tile], row_start, lhs_start, table_ref[2, tile]

  transposed = config.transposed_tiles

  def mma_step(acc_refs, lhs_smem, rhs_smems):
    for acc_ref, rhs_smem in zip(acc_refs, rhs_smems, strict=True):
      if transposed:  # out^T [columns, rows] = rhs^T @ lhs^T
        plgpu.wgmma(acc_ref, rhs_smem.transpose((1, 0)), lhs_smem.transpose((1, 0)))
      else:
        plgpu.wgmma(acc_ref, lhs_smem, rhs_smem)
    # Wait until the wgmmas of the steps whose slots are released next are complete: the
    # previous step's (one warpgroup; this step's run on) or this step's (with a producer).
    plgpu.wgmma_wait(len(acc_refs) * delay_release)

  def single_warpgroup(num_tiles_ref, table_ref, lhs_row_ref, lhs_ref, *refs):
    rhs_refs, out_ref = refs[:-1], refs[-1]

    @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM((block_m, block_n), out_dtype))
    def _scope(out_smem):
      @plgpu.nd_loop((num_tiles_ref[0] * n_blocks,), collective_axes="sm")
      def _item(loop_info):
        n_block, expert, row_start, lhs_start, rows = work_item(
          table_ref, lhs_row_ref, loop_info.index[0]
        )

        def accumulate(*acc_refs):
          plgpu.emit_pipeline(
            lambda _, lhs_smem, *rhs_smems: mma_step(acc_refs, lhs_smem, rhs_smems),
            grid=(k_steps,),
            in_specs=specs(n_block),
            max_concurrent_steps=config.num_stages,
          )(lhs_ref.at[pl.ds(lhs_start, block_m)], *(ref.at[expert] for ref in rhs_refs))
          return tuple(acc_ref[...] for acc_ref in acc_refs)

        accs = pl.run_scoped(
          accumulate, *(plgpu.ACC((block_m, block_n), jnp.float32) for _ in rhs_refs)
        )
        result = epilogue(*accs).astype(out_dtype)  # [block_m, block_n]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's copies are out
        out_smem[...] = result
        plgpu.commit_smem()
        _store_rows(out_smem, out_ref, rows, row_start, pl.ds(n_block * block_n, block_n), block_m)

      plgpu.wait_smem_to_gmem(0)

  split_m = config.warpgroup_split == "m"
  wg_rows, wg_cols = config.accumulator_shape(block_n)  # with two consumer warpgroups
  acc_shape = (wg_cols, wg_rows) if transposed else (wg_rows, wg_cols)
  epi_cols = config.epilogue_shape(block_n)[1]

  def warpgroup_mma_step(acc_refs, wg, lhs_smem, rhs_smems):
    """One K step of consumer warpgroup ``wg``'s share of the tile."""
    wg_row_slice = pl.ds(wg * wg_rows, wg_rows) if split_m else slice(None)
    wg_col_slice = slice(None) if split_m else pl.ds(wg * wg_cols, wg_cols)
    rhs_smems = [rhs_smem.at[:, wg_col_slice] for rhs_smem in rhs_smems]
    mma_step(acc_refs, lhs_smem.at[wg_row_slice], rhs_smems)

  def store_warpgroup_tile(acc_refs, wg, n_block, row_start, rows, out_smem, out_ref):
    """The epilogue of consumer warpgroup ``wg``'s share of a tile, staged in ``out_smem[wg]``
    (whole or in column pieces) and stored to its rows of ``out_ref``."""
    result = epilogue(*(acc_ref[...] for acc_ref in acc_refs)).astype(out_dtype)
    if split_m:  # this warpgroup's rows of the tile
      own_rows = jnp.clip(rows - wg * wg_rows, 0, wg_rows)
      first_row, first_column = row_start + wg * wg_rows, n_block * block_n
    else:  # this warpgroup's columns
      own_rows, first_row = rows, row_start
      first_column = n_block * block_n + wg * wg_cols
    for piece in range(wg_cols // epi_cols):  # static: whole tile or column pieces
      piece_columns = slice(piece * epi_cols, (piece + 1) * epi_cols)
      # The previous piece's (or item's) copies must have read the staging tile.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      if transposed:  # [columns, rows] registers into the [rows, columns] tile
        out_smem.at[wg].transpose((1, 0))[...] = result[piece_columns]
      else:
        out_smem[wg] = result[:, piece_columns]
      plgpu.commit_smem()
      columns = pl.ds(first_column + piece * epi_cols, epi_cols)
      _store_rows(out_smem.at[wg], out_ref, own_rows, first_row, columns, wg_rows)

  def warp_specialized(num_tiles_ref, table_ref, lhs_row_ref, lhs_ref, *refs):
    rhs_refs, out_ref = refs[:-1], refs[-1]

    def pipeline(body, compute_context, n_block):
      return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_steps,),
        memory_registers=40,
        in_specs=specs(n_block),
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=config.num_stages,
        compute_context=compute_context,
      )

    def ignore(*_, **__):
      return None

    # Allocated once for all items, so that items do not synchronise the warpgroups.
    allocations = pipeline(ignore, ignore, 0).get_allocations(
      lhs_ref.at[pl.ds(0, block_m)], *(ref.at[0] for ref in rhs_refs)
    )

    @functools.partial(
      pl.run_scoped,
      allocations=allocations,
      out_smem=plgpu.SMEM((2, wg_rows, epi_cols), out_dtype),
      collective_axes="wg",
    )
    def _scope(allocations, out_smem):
      wg = lax.axis_index("wg")  # 0 and 1 compute, 2 produces

      @plgpu.nd_loop((num_tiles_ref[0] * n_blocks,), collective_axes="sm")
      def _item(loop_info):
        n_block, expert, row_start, lhs_start, rows = work_item(
          table_ref, lhs_row_ref, loop_info.index[0]
        )

        def compute_context(eval_pipeline):
          @functools.partial(pl.run_scoped, acc_refs=[plgpu.ACC(acc_shape) for _ in rhs_refs])
          def _accumulate(acc_refs):
            eval_pipeline(acc_refs)
            store_warpgroup_tile(acc_refs, wg, n_block, row_start, rows, out_smem, out_ref)

        def body(_, lhs_smem, *rhs_smems_and_accs):
          *rhs_smems, acc_refs = rhs_smems_and_accs
          warpgroup_mma_step(acc_refs, wg, lhs_smem, rhs_smems)
          return acc_refs

        pipeline(body, compute_context, n_block)(
          lhs_ref.at[pl.ds(lhs_start, block_m)],
          *(ref.at[expert] for ref in rhs_refs),
          allocations=allocations,
        )

    plgpu.wait_smem_to_gmem(0)

  def gathered(num_tiles_ref, table_ref, lhs_row_ref, x_ref, token_ref, *refs):
    """Two consumer warpgroups and a producer warpgroup that fills the ring by hand: per K step
    a TMA copy of each weight block and the tile's rows of ``x`` copied by token
    (``_copy_rows_async``), signalled on ``x_full`` as ``config.gather_rows_signal`` says.
    "late": after issuing step ``s``'s copies the producer waits for step ``s - 1``'s, which have
    had a step's time to land, so it never waits for a load it has just issued. Steps are counted
    across this SM's work items, so an item's last copies land while the next item's first are
    issued; only the kernel's end waits for the last. (Two steps late, with the three-slot rings
    that fit at prefill sizes, was slower: the consumers then wait for each issue;
    ``benchmarks/NOTES_routed_experts.md``.) "copies": the copies arrive on ``x_full`` when they
    land and the consumers fence before their wgmmas, so the producer runs ahead by the whole
    ring; the interpreter, which writes the rows at once, arrives right after them."""
    rhs_refs, out_ref = refs[:-1], refs[-1]
    pad_row = gather[1]
    stages = config.num_stages
    signal_late = config.gather_rows_signal == "late"

    @functools.partial(
      pl.run_scoped,
      x_ring=plgpu.SMEM((stages, block_m, block_k), x_ref.dtype, transforms=transforms),
      rhs_rings=[
        plgpu.SMEM((stages, block_k, block_n), ref.dtype, transforms=transforms) for ref in rhs_refs
      ],
      token_smem=plgpu.SMEM((TOKEN_SLOTS,), jnp.int32),
      out_smem=plgpu.SMEM((2, wg_rows, epi_cols), out_dtype),
      rhs_full=plgpu.Barrier(num_arrivals=len(rhs_refs), num_barriers=stages),
      x_full=plgpu.Barrier(num_barriers=stages),
      consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      collective_axes="wg",
    )
    def _scope(x_ring, rhs_rings, token_smem, out_smem, rhs_full, x_full, consumed):
      wg = lax.axis_index("wg")  # 0 and 1 compute, 2 produces
      num_items = num_tiles_ref[0] * n_blocks

      def copy_rows(k, slot):
        x_columns = x_ref.at[:, pl.ds(pl.multiple_of(k * block_k, block_k), block_k)]
        if interpret:  # the same rows, padding rows included, through the interpreter's gather
          tokens = token_smem[pl.ds(0, block_m)]  # [block_m]
          present = (tokens >= 0)[:, None]
          rows = jnp.take(x_columns[...], jnp.where(tokens >= 0, tokens, pad_row or 0), axis=0)
          x_ring[slot] = rows if pad_row is not None else jnp.where(present, rows, 0)
          plgpu.commit_smem()
        else:
          _copy_rows_async(
            x_columns,
            token_smem,
            x_ring.at[slot],
            hidden=x_ref.shape[1],
            rows=block_m,
            pad_row=pad_row,
            transforms=transforms,
            commit_group=signal_late,
          )

      @pl.when(wg == 2)
      def _produce():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        @plgpu.nd_loop((num_items,), collective_axes="sm")
        def _item(loop_info):
          n_block, expert, row_start, _, _ = work_item(table_ref, lhs_row_ref, loop_info.index[0])
          first_step = loop_info.local_index * k_steps  # this SM's steps so far pick the slots
          columns = pl.ds((first_n_block + n_block) * block_n, block_n)
          # Every thread has issued the previous item's copies: they read their tokens at issue, so
          # the copies still in flight need token_smem no more.
          plgpu.commit_smem()
          token_smem[...] = token_ref[pl.ds(row_start, TOKEN_SLOTS)]
          plgpu.commit_smem()

          def fill(k, _):
            step = first_step + k
            slot = lax.rem(step, stages)

            @pl.when(step >= stages)
            def _wait_for_slot():
              plgpu.barrier_wait(consumed.at[slot])

            for ref, ring in zip(rhs_refs, rhs_rings, strict=True):
              plgpu.copy_gmem_to_smem(
                ref.at[expert, pl.ds(k * block_k, block_k), columns],
                ring.at[slot],
                rhs_full.at[slot],
              )
            copy_rows(k, slot)
            if signal_late:

              @pl.when(step >= 1)
              def _signal_previous():
                if not interpret:
                  _wait_rows(1)
                plgpu.barrier_arrive(x_full.at[lax.rem(step - 1, stages)])

            elif interpret:
              plgpu.barrier_arrive(x_full.at[slot])
            else:
              _rows_arrive(x_full.at[slot])

          lax.fori_loop(0, k_steps, fill, None)

        sm, sms = lax.axis_index("sm"), lax.axis_size("sm")
        total_steps = lax.div(jnp.maximum(num_items - sm, 0) + sms - 1, sms) * k_steps
        last_step = total_steps - 1
        if signal_late:

          @pl.when(last_step >= 0)
          def _signal_last():
            if not interpret:
              _wait_rows(0)
            plgpu.barrier_arrive(x_full.at[lax.rem(last_step, stages)])

        # Observe the consumption of the last slots filled, so that every barrier phase has been
        # waited for when the kernel ends.
        for back in range(stages, 0, -1):
          last = total_steps - back

          @pl.when(last >= 0)
          def _drain():
            plgpu.barrier_wait(consumed.at[lax.rem(last, stages)])  # noqa: B023

      @pl.when(wg < 2)
      def _consume():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")

        @plgpu.nd_loop((num_items,), collective_axes="sm")
        def _item(loop_info):
          n_block, _, row_start, _, rows = work_item(table_ref, lhs_row_ref, loop_info.index[0])
          first_step = loop_info.local_index * k_steps

          @functools.partial(pl.run_scoped, acc_refs=[plgpu.ACC(acc_shape) for _ in rhs_refs])
          def _accumulate(acc_refs):
            def step(k, _):
              slot = lax.rem(first_step + k, stages)
              plgpu.barrier_wait(rhs_full.at[slot])
              plgpu.barrier_wait(x_full.at[slot])
              if not (signal_late or interpret):
                _rows_fence()
              warpgroup_mma_step(
                acc_refs, wg, x_ring.at[slot], [ring.at[slot] for ring in rhs_rings]
              )
              plgpu.barrier_arrive(consumed.at[slot])

            lax.fori_loop(0, k_steps, step, None)
            store_warpgroup_tile(acc_refs, wg, n_block, row_start, rows, out_smem, out_ref)

        plgpu.wait_smem_to_gmem(0)

  specialized = config.warpgroups == 2
  out_type = () if out is not None else jax.ShapeDtypeStruct((out_rows, num_columns), out_dtype)
  if gather is not None:
    body, operands = gathered, (num_tiles, table, lhs_row, lhs, gather[0], *rhs)
  else:
    body = warp_specialized if specialized else single_warpgroup
    operands = (num_tiles, table, lhs_row, lhs, *rhs)
  result = plgpu.kernel(
    body,
    out_type=out_type,
    grid=(num_sms(config.num_sms),),
    grid_names=("sm",),
    num_threads=3 if specialized else None,
    thread_name="wg" if specialized else None,
    compiler_params=plgpu.CompilerParams(approx_math=True),
    interpret=plgpu.InterpretGPUParams(detect_races=True) if interpret else False,
    kernel_name=name,
  )(*operands, *(() if out is None else (out,)))
  return None if out is not None else result


def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  """``silu(g) * u`` in float32 (``silu(g) = g / (1 + exp(-g))``)."""
  return gate / (1.0 + jnp.exp(-gate)) * up


def _gather_rows(
  x: jax.Array,  # [T, H], 16-bit
  route_of_row: jax.Array,  # int32 [rows], -1 for padding
  top_k: int,
  padding: float,
) -> jax.Array:  # [rows, H]
  """``xs[r] = x[route_of_row[r] // top_k]``, or ``padding`` where ``route_of_row[r] < 0``.

  Moved as 32-bit words, two 16-bit values each: XLA's loop emitter gives each thread four
  elements of the gather, so words make each thread's share 16 bytes instead of 8 (the bf16
  gather wrote 1.5 TB/s on the H200, 92 us at GLM-4.5-Air's 2048 tokens). Bit for bit the same
  rows. The row's token is computed once per row, not per element of the row.
  """
  num_tokens, hidden = x.shape
  token_of_row = lax.div(jnp.maximum(route_of_row, 0), top_k)
  token_of_row, keep = lax.optimization_barrier((token_of_row, route_of_row >= 0))
  words = lax.bitcast_convert_type(x.reshape(num_tokens, hidden // 2, 2), jnp.uint32)
  fill = np.full(2, padding, x.dtype).view(np.uint32)[0]  # a constant: padding is static
  gathered = words.at[token_of_row].get(mode="promise_in_bounds")  # tokens are in [0, T)
  rows = jnp.where(keep[:, None], gathered, fill)  # [rows, H / 2]
  return lax.bitcast_convert_type(rows, x.dtype).reshape(route_of_row.shape[0], hidden)


def _gate_up_in_parts(x, plan: RoutePlan, w_gate, w_up, *, top_k, rows, config, interpret, padding):
  """``act [rows + block_m, I]``: ``silu(xs @ w_gate) * (xs @ w_up)`` for every tile's rows,
  in ``config.memory_parts`` parts of the buffer rows, each with its own slice of ``xs``.

  Part ``p`` owns the ``part_rows`` buffer rows from ``p * part_rows`` (a multiple of 8) and runs
  the tiles that start there; a tile reads ``block_m`` rows from its start, so the part's slice
  of ``xs`` holds ``part_rows + block_m`` rows, gathered from its static slice of the routes.
  Used tiles start on distinct multiples of 8 in ascending order (``plan_routes``), so a part's
  tiles are a run of the table found on the device, at most ``part_rows / 8`` of them. Rows that
  belong to no valid route (the tail past ``rows``, the spans' padding) hold ``padding``. The
  parts after the first store into the first's array, in place (a ``jax.Ref`` operand).

  Cutting by rows, not by table slots, gathers each row once plus ``block_m`` per part: a slot
  may be an expert's short last tile or unused, so equal runs of slots gathered 82688 rows for
  the 65536 routes of GLM-4.5-Air's 8192 tokens (now 66976), and the last part held few tiles.

  With ``config.gather_in_kernel`` there is no ``xs``: one kernel over the whole table copies
  each tile's rows of ``x`` by token (``_grouped_matmul``'s ``gather``).
  """
  block_m, parts = config.block_m, config.memory_parts
  x = x.astype(w_gate.dtype)  # once for all parts
  gate_up = functools.partial(
    _grouped_matmul,
    out_rows=rows + block_m,  # the down kernel reads tiles of block_m rows from any span start
    out_dtype=w_gate.dtype,
    epilogue=_swiglu,
    block_n=config.block_n_gate_up,
    config=config,
    name="routed_experts_gate_up",
    interpret=interpret,
  )
  if config.gather_in_kernel:  # no xs: one pass over the whole table
    route_of_row = jnp.concatenate([plan.route_of_row, jnp.full((TOKEN_SLOTS,), -1, jnp.int32)])
    tokens = jnp.where(route_of_row >= 0, lax.div(route_of_row, top_k), -1)
    pad_row = None  # zero-filled padding rows, as the gathered xs holds by default
    if padding != 0.0:  # (NaN, in tests): the kernel copies padding rows from an extra row
      pad_row = x.shape[0]
      x = jnp.concatenate([x, jnp.full((1, x.shape[1]), padding, x.dtype)])
    zero = jnp.zeros(1, jnp.int32)
    return gate_up(x, (w_gate, w_up), plan.num_tiles, plan.table, zero, gather=(tokens, pad_row))
  part_rows = -(-rows // (parts * ROW_ALIGN)) * ROW_ALIGN
  xs_rows = part_rows + block_m
  padded_rows = parts * part_rows + block_m - rows
  route_of_row = jnp.concatenate([plan.route_of_row, jnp.full((padded_rows,), -1, jnp.int32)])
  if parts == 1:  # the whole table from row 0: no operation added to the one-pass program
    runs = [(plan.num_tiles, plan.table)]
  else:
    slots = plan.table.shape[1]
    used = jnp.arange(slots) < plan.num_tiles  # [slots]
    bounds = jnp.arange(parts + 1, dtype=jnp.int32) * part_rows
    before = used[None, :] & (plan.table[1][None, :] < bounds[:, None])  # [parts + 1, slots]
    first_tile = jnp.sum(before, axis=1, dtype=jnp.int32)  # [parts + 1]
    run = min(slots, part_rows // ROW_ALIGN)
    table = jnp.concatenate([plan.table, jnp.zeros((3, run), jnp.int32)], axis=1)  # no clamping
    runs = [
      (
        first_tile[p + 1 : p + 2] - first_tile[p : p + 1],
        lax.dynamic_slice(table, (0, first_tile[p]), (3, run)),
      )
      for p in range(parts)
    ]
  act = None
  for part, (num_part_tiles, part_table) in enumerate(runs):
    first_row = part * part_rows
    part_routes = route_of_row[first_row : first_row + xs_rows]
    if act is not None:  # the previous part's kernel first: one slice of xs alive at a time
      act, part_routes = lax.optimization_barrier((act, part_routes))
    part_gate_up = functools.partial(
      gate_up,
      _gather_rows(x, part_routes, top_k, padding),  # [xs_rows, H]
      (w_gate, w_up),
      num_part_tiles,
      part_table,
      jnp.full((1,), first_row, jnp.int32),
    )
    if act is None:
      act = part_gate_up()
    else:
      act_ref = jax.new_ref(act)
      part_gate_up(out=act_ref)
      act = act_ref[...]
  return act


def _down_and_combine_in_ranges(
  act, plan: RoutePlan, weights, w_down, *, out_dtype, rows, config, interpret
):
  """``out [T, H]``: each route's ``act @ w_down`` (``y``, rounded to the weights' dtype) summed
  in float32 over the token's routes, then rounded to ``out_dtype``; in ``config.memory_parts``
  column ranges of H, so that one range of ``y [rows, H / parts]`` is alive at a time.

  The ranges' combines write ``out`` itself, not range arrays to concatenate (that read and
  wrote all of ``out`` once more: 81 us of 4.3 ms at GLM-4.5-Air's 8192 tokens on an H100): XLA
  fuses the first range's combine with the zeros of the other columns into one pad fusion and
  each later one into an in-place dynamic-update-slice fusion.
  """
  num_tokens, hidden = weights.shape[0], w_down.shape[2]
  width = hidden // config.memory_parts
  out = None
  for first_column in range(0, hidden, width):
    if out is not None:  # the previous range's combine first
      act, out = lax.optimization_barrier((act, out))
    y = _grouped_matmul(
      act,
      (w_down,),
      plan.num_tiles,
      plan.table,
      jnp.zeros(1, jnp.int32),
      out_rows=rows,
      out_dtype=w_down.dtype,
      epilogue=lambda down: down,
      block_n=config.block_n_down,
      columns=(first_column, width),
      config=config,
      name="routed_experts_down",
      interpret=interpret,
    )  # [rows, width]
    combined = combine_routes(y, plan.position, plan.valid, weights).astype(out_dtype)
    if width == hidden:
      return combined
    if out is None:
      out = jnp.zeros((num_tokens, hidden), out_dtype)
    out = lax.dynamic_update_slice(out, combined, (0, first_column))
  return out


@functools.partial(jax.jit, static_argnames=("config", "interpret", "padding_value"))
def routed_experts_mosaic_gpu(
  x: jax.Array,  # [T, H]
  expert_ids: jax.Array,  # int32 [T, k]
  weights: jax.Array,  # f32 [T, k]
  w_gate: jax.Array,  # [E, H, I]
  w_up: jax.Array,  # [E, H, I]
  w_down: jax.Array,  # [E, I, H]
  *,
  config: TuningConfig,
  interpret: bool = False,
  padding_value: float = 0.0,
) -> jax.Array:  # [T, H], x.dtype
  """Plan, gate/up kernel, down kernel, combine (module docstring; inputs checked by the api).

  With ``config.memory_parts`` > 1 the gate/up kernel runs over parts of the tile table and the
  down kernel and the combine over column ranges of H, one after the other, to bound the
  temporaries; every output element is the same sum as in one pass.

  ``padding_value`` fills the rows of ``xs`` that belong to no valid route (the tail read by
  the last tiles, and the rows of dropped routes); tests set it to NaN to show that such rows
  never reach the output.
  """
  num_tokens, top_k = expert_ids.shape
  num_experts = w_gate.shape[0]
  rows = route_rows(num_tokens * top_k, num_experts)
  plan = plan_routes(expert_ids, num_experts, config.block_m, rows)
  common = dict(rows=rows, config=config, interpret=interpret)
  act = _gate_up_in_parts(
    x, plan, w_gate, w_up, top_k=top_k, padding=padding_value, **common
  )  # [rows + block_m, I]
  return _down_and_combine_in_ranges(
    act, plan, weights, w_down, out_dtype=x.dtype, **common
  )  # [T, H]
