"""Pallas Mosaic GPU kernel for the top-k index conversion of sparse MLA.

Semantics in ``reference.py``; the op is memory bound: ``8 * T * K`` bytes of top-k in and
physical slots out, the block table is small and stays in L2.

Any top-k width K: token groups on 16-byte boundaries
-------------------------------------------------------
The kernel sees ``topk`` and ``physical`` as flat int32 arrays of ``N = T * K`` entries (a free
reshape). Bulk copies (``cp.async.bulk``) move whole 16-byte units between 16-byte aligned
addresses: runs of 4 int32 that start at a multiple of 4. Token ``t``'s row starts at ``t * K``,
which is such a boundary for every ``t`` only when ``K % 4 == 0``; a 2-D TMA over ``[T, K]`` needs
the same (its row stride must be a multiple of 16 bytes). So the unit of work is a *token group*:
``G`` consecutive tokens with ``G`` a multiple of ``4 / gcd(K, 4)`` (1, 2 or 4), so that every
group starts on a 16-byte boundary and spans whole units. A small K gets more tokens per group (up
to ``MAX_TOKENS_PER_GROUP``) so that a group fills its vector tile.

A group's ``G * K`` entries are converted in *segments* of at most ``chunk`` entries (the
register tile: ``chunk / 128`` entries per thread). Each segment is one bulk copy in and one bulk
copy out of exactly its length, so a store never touches another group's entries and blocks never
race. Inside the tile, entries past the segment's length are masked (the tail of the last vector
tile), and tokens are told apart by comparing the entry's position with the token boundaries,
which are static. Two ends need care:

* the last group may have fewer than ``G`` tokens: its missing tokens are masked and their counts
  not written;
* when ``N % 4 != 0``, the final ``N % 4`` entries of the array are not a whole 16-byte unit and
  cannot be bulk-copied at all: the block that converted the last group converts them after its
  loop with scalar loads and stores, and adds them to their tokens' counts.

Grid and pipeline
-----------------
``TuningConfig.blocks_per_sm = None`` launches one thread block (one warpgroup) per group;
an int launches a persistent grid of at most ``blocks_per_sm * num_sms`` blocks, block ``b``
taking groups ``b, b + num_blocks, ...``, or with ``contiguous_groups`` a run of consecutive
groups (the tokens of one request then stay on one SM, where lookups of its table row in global
memory hit L1). Either way a block runs its steps (group, segment)
through a ring of ``num_stages`` shared-memory slots: the loads of step ``j + num_stages - 1``
(the top-k segment and, when staged, the block-table rows of the group's requests, copied again
for every segment of a group wider than ``chunk``) are issued before step ``j`` is converted, so
loads overlap lookups and stores; step ``j``'s result is written over its input
in the slot and bulk-stored, and a slot is refilled only once the store that last used it has
read it. Per step a block

1. waits for the slot's loads, loads the segment into registers (``vector_size`` consecutive
   entries per thread: 16-byte shared-memory accesses for the default 4);
2. computes block and offset, looks the block up in the table (one scalar load per entry, see
   below), checks the entry's range, forms ``entry * block_stride + offset`` or ``-1``, and adds
   the valid entries to the counts of the group's tokens;
3. writes the result into the slot and bulk-stores it; after a group's last segment it writes the
   group's ``valid_counts``.

Why the lookup is written with ``plgpu.inline_mgpu``: Pallas Mosaic GPU has no gather primitive.
Its loads and stores move whole arrays in a register layout (``ref[...]``, ``plgpu.load``) or
scalars at a uniform index; a ref indexed by an array is rejected ("Arrays are not supported as
indices"), and ``lax.gather`` has no lowering rule. The only per-element gather available in Mosaic
GPU is the TMA gather4, which fetches whole rows (Blackwell only), not 4-byte elements. So the
lookup drops to Mosaic GPU's own level: ``inline_mgpu`` receives the index array as a
``FragmentedArray`` and emits one ``memref.load`` per element, which becomes ``ld.shared`` (table
staged in shared memory) or ``ld.global`` (table read in place through L1/L2). GPU interpret mode
cannot run ``inline_mgpu`` code that returns a value, so under ``interpret`` the same lookup is
the interpreter's own ``jnp.take`` on the same ref; the copies, barriers, layouts, masking,
reductions and stores around it are the kernel's own in both modes.

Measured on an H200 (this design, ``benchmarks/bench_sparse_index.py``, block 64): at top-k 2048,
20.0 us at T = 4096 (3.35 TB/s; 2.6x the fused XLA expression; XLA's elementwise read-and-write
of the same top-k bytes, with no lookup, takes 17.3 us, and the CUDA driver's device-to-device
memcpy of them 17.1-17.2 us) and 2.0 us at T = 64 (2.0x). Where a
group packs several tokens the per-token counts cost more: at K = 128, T = 4096, 5.8 us against
XLA's 5.5; at K = 2047, T = 64 (16 groups of 4 tokens for 132 SMs), 4.9 us against 4.5.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, vector

from jaxspec.kernels import dispatch
from jaxspec.kernels.sparse_index.reference import INT32_MAX, max_table_entry

WARPGROUP_SIZE = 128
# A bulk copy moves a multiple of 16 bytes between 16-byte aligned addresses.
BULK_COPY_ALIGN_ELEMENTS = 4
# Small K packs tokens into a group up to this many (the per-entry token selection is a chain of
# `where`s over the tokens a segment spans).
MAX_TOKENS_PER_GROUP = 8
# Shared memory a block may spend on staged block-table rows; beyond it the table is read in place.
TABLE_SMEM_BUDGET_BYTES = 96 * 1024
MAX_CHUNK = 8192
# The GPU kernel's name in profiles (CUPTI, Nsight): Pallas Mosaic GPU names a kernel after its
# body function, here `convert_topk_kernel`, with the suffix `_mosaic_gpu_kernel`.
KERNEL_NAME = "convert_topk_kernel_mosaic_gpu_kernel"


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """Tuning knobs of the conversion kernel (module docstring: "Grid and pipeline").

  Attributes:
    stage_table_in_smem: copy the block-table rows of a group's requests into shared memory and
      look blocks up there; otherwise look them up in global memory (through L1/L2). Staging
      needs ``max_blocks`` to be a multiple of 4 (bulk copies move 16-byte units) and the rows
      to fit ``TABLE_SMEM_BUDGET_BYTES``; other tables are read in place.
    vector_size: consecutive top-k entries per thread and register; 4 makes every shared-memory
      load and store of the segment 16 bytes wide.
    chunk: the most top-k entries one step converts (the register tile); a multiple of
      ``128 * vector_size``, at most ``MAX_CHUNK``.
    blocks_per_sm: ``None``: one thread block per token group. An int: a persistent grid of
      ``blocks_per_sm * num_sms`` blocks (fewer when there are fewer groups) that loop over the
      groups.
    contiguous_groups: on a persistent grid, each block takes a run of consecutive groups
      instead of every ``num_blocks``-th one.
    num_stages: shared-memory slots per block: loads run ``num_stages - 1`` steps ahead of the
      conversion. Only a block with several steps (persistent grid, or a group of several
      segments) uses more than one.
    num_sms: SMs the persistent grid is sized for; ``None``: the device's
      (``dispatch.num_sms``).
  """

  stage_table_in_smem: bool = True
  vector_size: int = 4
  chunk: int = 2048
  blocks_per_sm: int | None = None
  contiguous_groups: bool = False
  num_stages: int = 2
  num_sms: int | None = None

  def __post_init__(self):
    for name in ("stage_table_in_smem", "contiguous_groups"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
    if self.vector_size not in (1, 2, 4) or isinstance(self.vector_size, bool):
      raise ValueError(f"vector_size must be 1, 2 or 4, got {self.vector_size!r}")
    dispatch.validate_config_fields(self, positive=("chunk", "blocks_per_sm", "num_stages"))
    tile = WARPGROUP_SIZE * self.vector_size
    if self.chunk % tile or self.chunk > MAX_CHUNK:
      raise ValueError(
        f"chunk must be a multiple of 128 * vector_size = {tile} and at most {MAX_CHUNK}, "
        f"got {self.chunk}"
      )


def default_config(*_, **__) -> TuningConfig:
  """The configuration used when ``config=None``."""
  return TuningConfig()


@dataclasses.dataclass(frozen=True)
class WorkPlan:
  """The static decomposition of the conversion into groups, segments and blocks.

  Lengths count int32 entries of the flat arrays; "bulk" lengths are multiples of 4.
  """

  num_tokens: int  # T
  topk_size: int  # K
  tokens_per_group: int  # G
  chunk: int  # C: the register tile of one step, a multiple of 128 * vector_size
  num_groups: int
  num_blocks: int
  contiguous_groups: bool  # block b converts groups b * groups_per_block + i, else b + i * blocks
  num_stages: int
  stage_table: bool

  @property
  def group_size(self) -> int:
    """Entries of a full group: G tokens of K."""
    return self.tokens_per_group * self.topk_size

  @property
  def segments_per_group(self) -> int:
    """Steps of C entries a group takes, the last possibly partial."""
    return -(-self.group_size // self.chunk)

  @property
  def total_size(self) -> int:
    """N = T * K, the entries of the whole top-k."""
    return self.num_tokens * self.topk_size

  @property
  def last_group(self) -> int:
    """Index of the last group."""
    return self.num_groups - 1

  @property
  def last_group_tokens(self) -> int:
    """Tokens of the last group: fewer than G where G does not divide T."""
    return self.num_tokens - self.last_group * self.tokens_per_group

  @property
  def groups_per_block(self) -> int:
    """Groups a block converts at most."""
    return -(-self.num_groups // self.num_blocks)

  @property
  def last_group_block(self) -> int:
    """The block that converts the last group."""
    if self.contiguous_groups:
      return self.last_group // self.groups_per_block
    return self.last_group % self.num_blocks

  def segment_length(self, segment: int, last_group: bool) -> int:
    """Entries of ``segment`` that the bulk copies move (a multiple of 4, possibly 0)."""
    group_size = self.last_group_tokens * self.topk_size if last_group else self.group_size
    length = min(max(group_size - segment * self.chunk, 0), self.chunk)
    return length - length % BULK_COPY_ALIGN_ELEMENTS

  def segment_tokens(self, segment: int) -> range:
    """The tokens of a group (0..G-1) that have entries in ``segment``."""
    start = segment * self.chunk
    end = min(start + self.chunk, self.group_size)
    return range(start // self.topk_size, (end - 1) // self.topk_size + 1)

  @property
  def array_tail(self) -> range:
    """Flat positions no bulk copy can move: the final ``N % 4`` entries of the array."""
    return range(self.total_size - self.total_size % BULK_COPY_ALIGN_ELEMENTS, self.total_size)


def work_plan(num_tokens, topk_size, max_blocks, config: TuningConfig) -> WorkPlan:
  """Groups, segments, grid and staging for ``T`` tokens of top-k width ``K`` (both >= 1)."""
  alignment_tokens = BULK_COPY_ALIGN_ELEMENTS // math.gcd(topk_size, BULK_COPY_ALIGN_ELEMENTS)
  tile = WARPGROUP_SIZE * config.vector_size
  # Fill a chunk with whole aligned runs of tokens, within MAX_TOKENS_PER_GROUP.
  runs = min(
    config.chunk // (alignment_tokens * topk_size), MAX_TOKENS_PER_GROUP // alignment_tokens
  )
  tokens_per_group = alignment_tokens * max(runs, 1)
  group_size = tokens_per_group * topk_size
  chunk = min(config.chunk, -(-group_size // tile) * tile)
  num_groups = -(-num_tokens // tokens_per_group)
  if config.blocks_per_sm is None:
    num_blocks = num_groups
  else:
    num_blocks = min(num_groups, config.blocks_per_sm * dispatch.num_sms(config.num_sms))
    if config.contiguous_groups:  # runs of equal length; no block left without a group
      num_blocks = -(-num_groups // -(-num_groups // num_blocks))
  steps_per_block = -(-num_groups // num_blocks) * -(-group_size // chunk)
  num_stages = min(config.num_stages, steps_per_block)
  table_bytes = num_stages * tokens_per_group * max_blocks * 4
  stage_table = (
    config.stage_table_in_smem
    and max_blocks % BULK_COPY_ALIGN_ELEMENTS == 0
    and table_bytes <= TABLE_SMEM_BUDGET_BYTES
  )
  return WorkPlan(
    num_tokens=num_tokens,
    topk_size=topk_size,
    tokens_per_group=tokens_per_group,
    chunk=chunk,
    num_groups=num_groups,
    num_blocks=num_blocks,
    contiguous_groups=config.contiguous_groups,
    num_stages=num_stages,
    stage_table=stage_table,
  )


def unsupported_reason(
  req_ids, block_table, topk, *, config: TuningConfig, block_size: int, block_stride: int
) -> str | None:
  """Why the kernel cannot serve these inputs, or ``None`` when it can (any K >= 1)."""
  del req_ids, config, block_size, block_stride  # the kernel serves any values
  num_tokens, topk_size = topk.shape
  # Flat offsets are int32, up to the end of the last (padded) token group.
  if (num_tokens + MAX_TOKENS_PER_GROUP) * topk_size > INT32_MAX:
    return f"topk: T * K = {num_tokens * topk_size} entries exceed int32 indexing"
  if block_table.size > INT32_MAX:
    return f"block_table: {block_table.size} entries exceed int32 indexing"
  if num_tokens == 0 or topk_size == 0 or block_table.size == 0:
    return "empty inputs need no kernel"
  return None


def _lookup_mgpu(table_ref, index):
  """``table_ref[index]`` elementwise: one scalar load per element of ``index``."""
  index_type = ir.IndexType.get()
  registers = index.registers.copy()  # np.ndarray of vector<vec x i32>
  for position, register in enumerate(index.registers.flat):
    register_type = ir.VectorType(register.type)
    gathered = register
    for lane in range(register_type.shape[0]):
      element = vector.extract(register, dynamic_position=[], static_position=[lane])
      value = memref.load(table_ref, [arith.index_cast(index_type, element)])
      gathered = vector.insert(value, gathered, dynamic_position=[], static_position=[lane])
    registers.flat[position] = gathered
  return mgpu.FragmentedArray(_registers=registers, _layout=index.layout, _is_signed=True)


def _lookup(table_ref, index, layout, interpret: bool):
  """Per-element gather from a 1-D int32 ref (see the module docstring)."""
  if interpret:
    return jnp.take(table_ref[...], index)

  @plgpu.inline_mgpu(
    arg_types=(plgpu.RefType(), layout),
    return_type=plgpu.ShapeDtypeStruct(index.shape, jnp.int32, layout=layout),
  )
  def lookup(_, table, index_fragments):
    return _lookup_mgpu(table, index_fragments)

  return lookup(table_ref, index)


def _select_by_token(position, starts, values):
  """Per entry, the value of its token: ``values[i]`` from position ``starts[i]`` on (ascending,
  ``starts[0] == 0``); a single value stays a scalar."""
  selected = values[0]
  for start, value in zip(starts[1:], values[1:], strict=True):
    selected = jnp.where(position >= start, value, selected)
  return selected


def _token_mask(position, start, end, size):
  """The entries ``start <= position < end`` of a tile of ``size``; ``None`` when that is all.

  Built from comparisons only: jax 0.11.2's Mosaic GPU fails to lower ``~`` of a boolean vector
  in the strided layout (an i1 x 4 register conversion).
  """
  mask = None
  if start > 0:
    mask = position >= start
  if end < size:
    mask = position < end if mask is None else mask & (position < end)
  return mask


@functools.partial(jax.jit, static_argnames=("block_size", "block_stride", "config", "interpret"))
def convert_topk_to_physical_mosaic_gpu(
  req_ids: jax.Array,  # int32 [T]
  block_table: jax.Array,  # int32 [R, max_blocks]
  topk: jax.Array,  # int32 [T, K]
  *,
  block_size: int,
  block_stride: int,
  config: TuningConfig,
  interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (int32 [T, K], int32 [T])
  """The conversion as one Pallas Mosaic GPU launch; shapes are checked by ``api``."""
  num_tokens, topk_size = topk.shape
  num_requests, max_blocks = block_table.shape
  plan = work_plan(num_tokens, topk_size, max_blocks, config)
  tokens_per_group, chunk, stages = plan.tokens_per_group, plan.chunk, plan.num_stages
  segments = plan.segments_per_group
  layout = plgpu.Layout.WG_STRIDED((chunk,), vec_size=config.vector_size)
  largest_entry = max_table_entry(block_size, block_stride)
  arrivals_per_step = 1 + (tokens_per_group if plan.stage_table else 0)

  def convert_topk_kernel(req_ids_ref, table_ref, topk_ref, physical_ref, counts_ref, *scratch):
    # GMEM: req_ids_ref [T], table_ref [R * max_blocks], topk_ref / physical_ref [N], counts_ref
    # [T]. SMEM: rows_smem [stages, chunk] (a segment in, its physical slots out),
    # [table_smem [stages, G * max_blocks] (the group's table rows),] barriers [stages].
    rows_smem, *table_smem, barriers = scratch
    block_id = lax.axis_index("block")

    def group_of(local_group):  # the block's `local_group`-th group
      if plan.contiguous_groups:
        return block_id * plan.groups_per_block + local_group
      return block_id + local_group * plan.num_blocks

    def slot_of(local_group, segment):
      return (local_group * segments + segment) % stages

    def token_request(group, token_in_group):
      """(request clamped into the table, whether the id is a row of the table) of a token."""
      token = jnp.minimum(group * tokens_per_group + token_in_group, num_tokens - 1)
      request = req_ids_ref[token]
      in_table = (request >= 0) & (request < num_requests)
      return jnp.clip(request, 0, num_requests - 1), in_table

    def for_group_kind(group, segment, body):
      """Calls ``body(static length)`` for the segment's bulk length in ``group``'s kind."""
      full, last = plan.segment_length(segment, False), plan.segment_length(segment, True)
      if full == last:
        body(full)
        return
      is_last = group == plan.last_group
      pl.when(is_last)(lambda: body(last))
      pl.when(~is_last)(lambda: body(full))

    def issue_loads(local_group, segment):
      group = group_of(local_group)
      slot = slot_of(local_group, segment)
      barrier = barriers.at[slot]
      start = group * plan.group_size + segment * chunk

      def copy_segment(length):
        if length == 0:  # nothing to move: arrive so that the slot's barrier still completes
          plgpu.barrier_arrive(barrier)
          return
        plgpu.copy_gmem_to_smem(
          topk_ref.at[pl.ds(start, length)],
          rows_smem.at[slot, pl.ds(0, length)],
          barrier,
          oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,
        )

      # A step past the block's last group loads nothing (and is never waited for).
      @pl.when((local_group < plan.groups_per_block) & (group < plan.num_groups))
      def _():
        for_group_kind(group, segment, copy_segment)
        if plan.stage_table:
          (table_smem_ref,) = table_smem
          for token_in_group in range(tokens_per_group):
            request, _ = token_request(group, token_in_group)
            plgpu.copy_gmem_to_smem(
              table_ref.at[pl.ds(request * max_blocks, max_blocks)],
              table_smem_ref.at[slot, pl.ds(token_in_group * max_blocks, max_blocks)],
              barrier,
              oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,
            )

    def convert_segment(local_group, segment, counts):
      """Converts one segment in its slot and stores it; returns ``counts`` (one per token of
      the group) plus the segment's valid entries."""
      group = group_of(local_group)
      slot = slot_of(local_group, segment)
      plgpu.barrier_wait(barriers.at[slot])
      index = plgpu.load(rows_smem.at[slot], layout=layout)  # [chunk]
      tokens = plan.segment_tokens(segment)
      full, last = plan.segment_length(segment, False), plan.segment_length(segment, True)
      masked_tail = min(full, last) < chunk
      position = None
      if len(tokens) > 1 or masked_tail:
        position = plgpu.broadcasted_iota(jnp.int32, (chunk,), 0, layout=layout)
      # Where the segment's tokens start and end (static).
      starts = [max(t * topk_size - segment * chunk, 0) for t in tokens]
      ends = [min((t + 1) * topk_size - segment * chunk, chunk) for t in tokens]

      # Truncating division equals floor division on the entries kept (index >= 0).
      block = lax.div(index, block_size)
      offset = lax.rem(index, block_size)
      requests = [token_request(group, t) for t in tokens]
      # A token whose request is not a row of the table has no blocks at all.
      blocks_of_token = [jnp.where(in_table, max_blocks, 0) for _, in_table in requests]
      valid = (index >= 0) & (block < _select_by_token(position, starts, blocks_of_token))
      if masked_tail:  # the tail of the last vector tile holds stale or uninitialised entries
        length = full if full == last else jnp.where(group == plan.last_group, last, full)
        valid = valid & (position < length)
      # Masked entries look up block 0 of a row they may read, which is always in bounds.
      block = jnp.where(valid, block, 0)
      if plan.stage_table:
        rows = [t * max_blocks for t in tokens]
        entry = _lookup(
          table_smem[0].at[slot],
          block + _select_by_token(position, starts, rows),
          layout,
          interpret,
        )
      else:
        rows = [request * max_blocks for request, _ in requests]
        entry = _lookup(
          table_ref, block + _select_by_token(position, starts, rows), layout, interpret
        )
      valid = valid & (entry >= 0) & (entry <= largest_entry)
      # In range, entry * block_stride + offset < 2**31: no wrap-around where it is kept.
      physical = jnp.where(valid, entry * block_stride + offset, -1)
      counts = list(counts)
      for t, start, end in zip(tokens, starts, ends, strict=True):
        mask = _token_mask(position, start, end, chunk)
        counted = valid if mask is None else valid & mask
        counts[t] = counts[t] + jnp.sum(jnp.where(counted, 1, 0))

      rows_smem.at[slot][...] = physical
      plgpu.commit_smem()  # make the generic-proxy stores visible to the bulk copy

      def store_segment(length):
        if length:
          start = group * plan.group_size + segment * chunk
          plgpu.copy_smem_to_gmem(
            rows_smem.at[slot, pl.ds(0, length)], physical_ref.at[pl.ds(start, length)]
          )

      for_group_kind(group, segment, store_segment)
      return counts

    def write_counts(group, counts):
      for token_in_group, count in enumerate(counts):
        token = group * tokens_per_group + token_in_group

        def write(token=token, count=count):
          counts_ref[token] = count

        if token_in_group < plan.last_group_tokens:
          write()
        else:  # a token the last group does not have
          pl.when(group != plan.last_group)(write)

    def prefetch(local_group, segment, distance):
      """Issues the loads of the step ``distance`` steps after (local_group, segment)."""
      groups_ahead, ahead_segment = divmod(segment + distance, segments)
      issue_loads(local_group + groups_ahead, ahead_segment)

    for step in range(stages - 1):  # prologue: fill all slots but one
      prefetch(0, 0, step)

    def convert_group(local_group, carry):
      group = group_of(local_group)

      @pl.when(group < plan.num_groups)  # later groups of this block are out of range too
      def _():
        counts = [jnp.int32(0)] * tokens_per_group
        for segment in range(segments):
          # The slot refilled now was last stored from one step ago: wait until it is read.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          prefetch(local_group, segment, stages - 1)
          counts = convert_segment(local_group, segment, counts)
        write_counts(group, counts)

      return carry

    lax.fori_loop(0, plan.groups_per_block, convert_group, 0)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if plan.array_tail:  # the array's final N % 4 entries: scalar loads and stores

      @pl.when(block_id == plan.last_group_block)
      def _():
        for flat in plan.array_tail:
          token = flat // topk_size
          request, in_table = token_request(token // tokens_per_group, token % tokens_per_group)
          index = topk_ref[flat]
          block = lax.div(index, block_size)
          valid = (index >= 0) & (block < max_blocks) & in_table
          entry = table_ref[request * max_blocks + jnp.where(valid, block, 0)]
          valid = valid & (entry >= 0) & (entry <= largest_entry)
          physical_ref[flat] = jnp.where(
            valid, entry * block_stride + lax.rem(index, block_size), -1
          )
          counts_ref[token] = counts_ref[token] + jnp.where(valid, 1, 0)

  scratch_types = [plgpu.SMEM((stages, chunk), jnp.int32)]
  if plan.stage_table:
    scratch_types.append(plgpu.SMEM((stages, tokens_per_group * max_blocks), jnp.int32))
  scratch_types.append(plgpu.Barrier(num_arrivals=arrivals_per_step, num_barriers=stages))

  kernel = plgpu.kernel(
    convert_topk_kernel,
    out_type=(
      jax.ShapeDtypeStruct((plan.total_size,), jnp.int32),
      jax.ShapeDtypeStruct((num_tokens,), jnp.int32),
    ),
    scratch_types=scratch_types,
    grid=(plan.num_blocks,),
    grid_names=("block",),
    interpret=plgpu.InterpretGPUParams(detect_races=True) if interpret else None,
  )
  table_flat = block_table.reshape(num_requests * max_blocks)  # free
  physical, counts = kernel(req_ids, table_flat, topk.reshape(plan.total_size))
  return physical.reshape(num_tokens, topk_size), counts
