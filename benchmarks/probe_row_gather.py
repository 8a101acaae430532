"""Probe: can TMA gather the routed experts' rows of ``x`` one row per copy, fast enough?

Why: the routed-expert gate/up kernel reads ``xs``, the rows of ``x`` in route order, which XLA
gathers beforehand (``xs = x[token_of_row]``, 0.54 GB written and read again at GLM-4.5-Air's
8192 tokens; ``benchmarks/NOTES_routed_experts.md``, "What would close the gaps"). Hopper's TMA
copies boxes, not rows by index, so a gather inside the kernel issues one copy per row and K
step: a ``[1, 64]`` box of ``x`` into row ``r`` of a ``(1, 64)``-tiled, 128-byte-swizzled
shared-memory tile (a row copy into the wgmma's ``(8, 64)`` tiling is rejected; the ``(1, 64)``
view holds the same bytes). At 8192 tokens that is about 52M copies in the kernel's 2.2 ms, one
every 5.6 ns per SM, from one issuing thread. This probe measures the rate before anything is
built on it.

Each variant is one persistent Pallas Mosaic GPU kernel: ``blocks_per_sm`` thread blocks per SM,
block ``b`` taking the 128-row tiles ``b, b + blocks, ...`` of the ``R`` gathered rows, and for
each tile the ``H / 64`` column blocks in turn (the K steps of the gate/up kernel), through a
ring of ``stages`` shared-memory slots; a slot is refilled as soon as its step is consumed.

* ``rows``: 128 row copies per step (row ids read from global memory, L1-cached after a tile's
  first step), issued by one thread, or (``w4``) by one lane of each of the warpgroup's 4 warps,
  32 rows each (``pl.kernel`` over a ``plgpu.WarpMesh``); ``tile``: one ``[128, 64]`` box of
  consecutive rows per step, the same bytes with one copy (the pipeline's ceiling without a
  gather);
* ``write_back``: each step's slot is stored to ``out [R, H]`` (a full gather, comparable with
  XLA's ``x[ids]``, which is timed in the same process); without it only each block's last slot
  is stored (``out [blocks, 128, 64]``), so the time is the loads' alone, as in a gate/up kernel.
* ``wgmma_view`` (one variant): the row copies land in the ``(1, 64)``-tiled view and the stores
  read the slot through the ``(8, 64)``-tiled view of the same bytes (a ``plgpu.RefUnion``), the
  layout in which TMA and wgmma read a tile: its output matches ``x[ids]`` only if the two views
  alias row for row, which the gate/up kernel's gather would rely on. ``RefUnion``'s contract
  disclaims reading bytes through a member other than the one that wrote them, and GPU interpret
  mode refuses it (jax 0.11.2), so only a GPU run can tell whether the layouts agree.

Reported: time per call (median, steady state, ``benchmarks/_timing.py``), the rate of the
gathered bytes (``R * H * 2`` / time), and row copies per SM per microsecond.

Usage: ``python benchmarks/probe_row_gather.py [--smoke] [--out DIR]`` (``--smoke``: tiny shapes
in GPU interpret mode, outputs checked against ``x[ids]``; a CPU check, not a measurement).
"""

import argparse
import dataclasses
import datetime
import functools
import pathlib
import sys

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks._results import command_line, write_results  # noqa: E402
from benchmarks._timing import time_jax  # noqa: E402
from jaxspec.kernels.dispatch import num_sms  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
COLS = 64  # one 128-byte swizzled row of bf16: the gate/up kernel's K step
ROWS_PER_TILE = 128  # the gate/up kernel's prefill tile
TOP_K = 8
HIDDEN = 4096  # GLM-4.5-Air
TOKEN_COUNTS = (2048, 8192)
WARPS_PER_WARPGROUP = 4


@dataclasses.dataclass(frozen=True)
class Variant:
  per_row: bool  # one copy per row (the gather) or one box per step
  write_back: bool  # store every step (a full gather) or only each block's last slot
  stages: int = 4
  blocks_per_sm: int = 1
  issuing_warps: int = 1  # per-row copies: issued by one thread, or one per warp (1 or 4)
  # Per-row copies land in the (1, 64)-tiled view; the stores read the same bytes through the
  # (8, 64)-tiled view that TMA and wgmma use for a tile (a RefUnion of the two).
  wgmma_view: bool = False

  @property
  def name(self) -> str:
    kind = "rows" if self.per_row else "tile"
    store = "+store" if self.write_back else ""
    warps = f" w{self.issuing_warps}" if self.issuing_warps > 1 else ""
    view = " via (8,64) view" if self.wgmma_view else ""
    return f"{kind}{store} s{self.stages} b{self.blocks_per_sm}{warps}{view}"


def grid_blocks(num_rows: int, variant: Variant, *, rows_per_tile: int, sms: int) -> int:
  """Thread blocks of the persistent grid: ``blocks_per_sm`` per SM, at most one per tile."""
  return min(num_rows // rows_per_tile, variant.blocks_per_sm * sms)


def gather_kernel(
  num_tokens: int,
  num_rows: int,
  hidden: int,
  variant: Variant,
  *,
  rows_per_tile: int,
  sms: int,
  interpret: bool,
):
  """``fn(ids int32 [R], x bf16 [T, H]) -> out``: ``out [R, H] = x[ids]`` with ``write_back``,
  else ``out [blocks, rows_per_tile, COLS]``, each block's last step (a tile's last columns)."""
  if variant.issuing_warps not in (1, WARPS_PER_WARPGROUP):
    raise ValueError(
      f"issuing_warps must be 1 or {WARPS_PER_WARPGROUP}, got {variant.issuing_warps}"
    )
  if variant.wgmma_view and not variant.per_row:
    raise ValueError("wgmma_view serves per-row copies only")
  if num_tokens % rows_per_tile or num_rows % rows_per_tile or hidden % COLS:
    raise ValueError(
      f"T={num_tokens}, R={num_rows} and H={hidden} must be multiples of {rows_per_tile}, "
      f"{rows_per_tile} and {COLS}"
    )
  num_tiles, k_steps = num_rows // rows_per_tile, hidden // COLS
  num_blocks = grid_blocks(num_rows, variant, rows_per_tile=rows_per_tile, sms=sms)
  stages = variant.stages

  def kernel(ids_ref, x_ref, out_ref, buf, barriers):
    # GMEM: ids_ref int32 [R], x_ref [T, H], out_ref (see above). SMEM: buf [stages, rows, COLS]
    # tiled (1, COLS) and swizzled (with wgmma_view: that view and the (8, COLS)-tiled one of
    # the same bytes); barriers [stages] (rows_per_tile arrivals per-row, else 1).
    row_buf, out_buf = buf if variant.wgmma_view else (buf, buf)  # where copies land / are read
    block = lax.axis_index("block")
    block_tiles = lax.div(num_tiles - block + num_blocks - 1, num_blocks)
    num_steps = block_tiles * k_steps

    def tile_and_column(step):
      return block + lax.div(step, k_steps) * num_blocks, lax.rem(step, k_steps) * COLS

    def issue(step, slot):
      tile, column = tile_and_column(step)
      if not variant.per_row:  # the tile's rows of x, wrapped round its T rows
        rows = pl.ds(lax.rem(tile * rows_per_tile, num_tokens), rows_per_tile)
        plgpu.copy_gmem_to_smem(
          x_ref.at[rows, pl.ds(column, COLS)], row_buf.at[slot], barriers.at[slot]
        )
        return

      def copy_row(row, carry):
        token = ids_ref[tile * rows_per_tile + row]
        plgpu.copy_gmem_to_smem(
          x_ref.at[pl.ds(token, 1), pl.ds(column, COLS)],
          row_buf.at[slot, pl.ds(row, 1)],
          barriers.at[slot],
        )
        return carry

      if variant.issuing_warps == 1:
        lax.fori_loop(0, rows_per_tile, copy_row, None, unroll=8)
        return

      # Each warp of the warpgroup issues the copies of its share of the rows, from one lane.
      @pl.kernel(mesh=plgpu.WarpMesh(axis_name="warp"))
      def per_warp():
        share = rows_per_tile // WARPS_PER_WARPGROUP
        first = lax.axis_index("warp") * share
        lax.fori_loop(0, share, lambda r, c: copy_row(first + r, c), None, unroll=8)

      per_warp()

    for s in range(stages):
      pl.when(s < num_steps)(functools.partial(issue, s, s))

    def step(j, carry):
      slot = lax.rem(j, stages)
      plgpu.barrier_wait(barriers.at[slot])
      if not variant.write_back:  # nothing reads the slot: refill it
        pl.when(j + stages < num_steps)(lambda: issue(j + stages, slot))
        return carry
      tile, column = tile_and_column(j)
      plgpu.copy_smem_to_gmem(
        out_buf.at[slot],
        out_ref.at[pl.ds(tile * rows_per_tile, rows_per_tile), pl.ds(column, COLS)],
      )
      # The previous step's store has read its slot (this step's may still run): refill that.
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      previous = j - 1 + stages
      pl.when((j > 0) & (previous < num_steps))(lambda: issue(previous, lax.rem(previous, stages)))
      return carry

    lax.fori_loop(0, num_steps, step, None)
    if not variant.write_back:
      plgpu.copy_smem_to_gmem(out_buf.at[lax.rem(num_steps - 1, stages)], out_ref.at[block])
    plgpu.wait_smem_to_gmem(0)

  if variant.write_back:
    out_shape = (num_rows, hidden)
  else:
    out_shape = (num_blocks, rows_per_tile, COLS)

  def ring(tile_rows):
    transforms = (plgpu.TilingTransform((tile_rows, COLS)), plgpu.SwizzleTransform(128))
    return plgpu.SMEM((stages, rows_per_tile, COLS), jnp.bfloat16, transforms=transforms)

  arrivals = rows_per_tile if variant.per_row else 1
  return plgpu.kernel(
    kernel,
    out_type=jax.ShapeDtypeStruct(out_shape, jnp.bfloat16),
    scratch_types=[
      plgpu.RefUnion(ring(1), ring(8)) if variant.wgmma_view else ring(1),
      plgpu.Barrier(num_arrivals=arrivals, num_barriers=stages),
    ],
    grid=(num_blocks,),
    grid_names=("block",),
    interpret=plgpu.InterpretGPUParams(detect_races=True) if interpret else False,
  )


def expected(ids, x, variant: Variant, *, rows_per_tile: int, num_blocks: int) -> np.ndarray:
  """What ``gather_kernel`` returns, from NumPy (``tile`` variants read consecutive rows)."""
  ids, x = np.asarray(ids), np.asarray(x)
  num_rows = ids.shape[0]
  rows = ids if variant.per_row else np.arange(num_rows) % x.shape[0]
  gathered = x[rows]
  if variant.write_back:
    return gathered
  num_tiles = num_rows // rows_per_tile
  last = []
  for block in range(num_blocks):
    tile = block + (len(range(block, num_tiles, num_blocks)) - 1) * num_blocks
    last.append(gathered[tile * rows_per_tile : (tile + 1) * rows_per_tile, -COLS:])
  return np.stack(last)


def variants(smoke: bool) -> list[Variant]:
  if smoke:
    return [
      Variant(True, True, 2),
      Variant(True, False, 3),
      Variant(True, True, 2, 1, WARPS_PER_WARPGROUP),
      Variant(False, False, 2),
    ]
  grid = [Variant(False, False), Variant(False, True)]
  grid += [Variant(True, w, s, b) for w in (False, True) for s in (4, 6) for b in (1, 2)]
  # One issuing thread per warp (4 per warpgroup): whether the rate is the issuing thread's.
  grid += [Variant(True, w, 4, b, WARPS_PER_WARPGROUP) for w in (False, True) for b in (1, 2)]
  # Whether the (1, 64) view's rows are where the (8, 64) view (TMA's and wgmma's) reads them.
  grid.append(Variant(True, True, 4, 2, WARPS_PER_WARPGROUP, wgmma_view=True))
  return grid


def run(smoke: bool) -> dict:
  rows_per_tile = 16 if smoke else ROWS_PER_TILE
  hidden = 2 * COLS if smoke else HIDDEN
  sms = 2 if smoke else num_sms(None)
  rng = np.random.default_rng(0)
  rows = []
  for num_tokens in (32,) if smoke else TOKEN_COUNTS:
    num_rows = num_tokens * TOP_K
    key = jax.random.key(int(rng.integers(1 << 31)))
    x = jax.random.normal(key, (num_tokens, hidden), jnp.bfloat16)
    id_sets = [jnp.asarray(rng.integers(0, num_tokens, num_rows), jnp.int32) for _ in range(4)]
    gathered_bytes = num_rows * hidden * 2
    timing = {"reps": 1, "warmup": 0} if smoke else {}
    entries = {}
    if not smoke:
      seconds = time_jax(lambda ids, x: x[ids], id_sets, x, **timing)
      entries["xla x[ids]"] = {"us": seconds * 1e6, "tbps": gathered_bytes / seconds / 1e12}
    for variant in variants(smoke):
      fn = gather_kernel(
        num_tokens, num_rows, hidden, variant, rows_per_tile=rows_per_tile, sms=sms, interpret=smoke
      )
      num_blocks = grid_blocks(num_rows, variant, rows_per_tile=rows_per_tile, sms=sms)
      want = expected(id_sets[0], x, variant, rows_per_tile=rows_per_tile, num_blocks=num_blocks)
      try:
        got = np.asarray(jax.jit(fn)(id_sets[0], x))
      except Exception as error:  # a variant that does not compile or run is reported, not fatal
        if smoke:
          raise
        entries[variant.name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        print(num_tokens, variant.name, entries[variant.name], flush=True)
        continue
      entry = {"matches": bool(np.array_equal(got, want))}
      if smoke and not entry["matches"]:
        raise AssertionError(f"{variant.name}: the kernel's rows differ from x[ids]")
      seconds = time_jax(lambda ids, x, fn=fn: fn(ids, x), id_sets, x, **timing)
      # TMA copies issued: one per row and step, or one per tile and step.
      copies = (num_rows if variant.per_row else num_rows // rows_per_tile) * (hidden // COLS)
      entry.update(
        us=seconds * 1e6,
        tbps=gathered_bytes / seconds / 1e12,
        copies_per_sm_per_us=copies / sms / (seconds * 1e6),
      )
      entries[variant.name] = entry
      print(num_tokens, variant.name, entry, flush=True)
    rows.append({"tokens": num_tokens, "rows": num_rows, "hidden": hidden, "entries": entries})
  return {
    "meta": {
      "gpu": jax.devices()[0].device_kind,
      "jax": jax.__version__,
      "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
      "command": command_line("probe_row_gather.py"),
      "sms": sms,
      "smoke": smoke,
    },
    "rows": rows,
  }


def render(results: dict) -> str:
  meta = results["meta"]
  lines = [
    "# Row gather by TMA: one copy per row against one box per step and XLA's gather",
    "",
    f"{meta['gpu']}, jax {meta['jax']}, {meta['date']}; `{meta['command']}`"
    + (" (interpret-mode smoke run, not a measurement)" if meta["smoke"] else "")
    + f". bf16 `x [T, H]`, top-{TOP_K} random row ids (`R = {TOP_K} T`), {COLS}-column steps.",
    "Variant names: rows = one copy per row, tile = one box per step; +store = every step "
    "stored to `out [R, H]`; sS = ring slots; bB = thread blocks per SM; w4 = the row copies "
    "issued by the 4 warps of the warpgroup (one lane each), else by one thread; via (8,64) "
    "view = stored through the wgmma-tiled view of a RefUnion (matches only if the views alias). "
    "TB/s = gathered bytes (R x H x 2) / time.",
    "",
    "| T | R | variant | us | TB/s | copies per SM per us | ns per copy per SM | output matches |",
    "| --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for row in results["rows"]:
    for name, entry in row["entries"].items():
      if "error" in entry:
        lines.append(f"| {row['tokens']} | {row['rows']} | {name} | fails: {entry['error']} |")
        continue
      rate = entry.get("copies_per_sm_per_us")
      lines.append(
        f"| {row['tokens']} | {row['rows']} | {name} | {entry['us']:.1f} | {entry['tbps']:.2f} | "
        + (f"{rate:.1f} | {1e3 / rate:.2f} | " if rate else "- | - | ")
        + f"{entry.get('matches', '-')} |"
      )
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
  parser.add_argument("--out", default=str(RESULTS))
  args = parser.parse_args()
  results = run(args.smoke)
  write_results(results, render(results), pathlib.Path(args.out) / "row_gather_probe")


if __name__ == "__main__":
  main()
