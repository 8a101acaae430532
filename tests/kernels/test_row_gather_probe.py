"""The row-gather probe (``benchmarks/probe_row_gather.py``) gathers the rows it claims to, with
no data race, so that its GPU timings measure a correct kernel."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from races import races_found

PROBE = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "probe_row_gather.py"
_spec = importlib.util.spec_from_file_location("probe_row_gather", PROBE)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)

ROWS_PER_TILE, NUM_TOKENS, HIDDEN, SMS = 16, 32, 2 * probe.COLS, 2


@pytest.mark.parametrize(
  "variant",
  [
    probe.Variant(per_row=True, write_back=True, stages=2),
    probe.Variant(per_row=True, write_back=False, stages=3, blocks_per_sm=2),
    probe.Variant(per_row=True, write_back=True, stages=2, issuing_warps=4),
    probe.Variant(per_row=True, write_back=False, stages=3, blocks_per_sm=2, issuing_warps=4),
    probe.Variant(per_row=False, write_back=True, stages=2),
    probe.Variant(per_row=False, write_back=False, stages=4),
  ],
  ids=lambda v: v.name,
)
def test_probe_kernel_gathers_the_rows_of_x(variant):
  num_rows = 5 * ROWS_PER_TILE  # tiles not a multiple of the blocks: uneven shares
  x = jax.random.normal(jax.random.key(0), (NUM_TOKENS, HIDDEN), jnp.bfloat16)
  ids = jax.random.randint(jax.random.key(1), (num_rows,), 0, NUM_TOKENS, jnp.int32)
  fn = probe.gather_kernel(
    NUM_TOKENS, num_rows, HIDDEN, variant, rows_per_tile=ROWS_PER_TILE, sms=SMS, interpret=True
  )
  got = np.asarray(fn(ids, x))
  num_blocks = probe.grid_blocks(num_rows, variant, rows_per_tile=ROWS_PER_TILE, sms=SMS)
  want = probe.expected(ids, x, variant, rows_per_tile=ROWS_PER_TILE, num_blocks=num_blocks)
  np.testing.assert_array_equal(got, want)
  assert not races_found()


def test_probe_kernel_rejects_shapes_off_its_tiles():
  with pytest.raises(ValueError, match="multiples"):
    probe.gather_kernel(
      NUM_TOKENS, 40, HIDDEN, probe.Variant(True, False), rows_per_tile=16, sms=2, interpret=True
    )


def test_probe_kernel_rejects_other_issuing_warp_counts():
  with pytest.raises(ValueError, match="issuing_warps must be 1 or 4"):
    probe.gather_kernel(
      NUM_TOKENS,
      80,
      HIDDEN,
      probe.Variant(True, False, issuing_warps=2),
      rows_per_tile=16,
      sms=2,
      interpret=True,
    )


def test_probe_kernel_rejects_a_wgmma_view_of_tile_copies():
  with pytest.raises(ValueError, match="wgmma_view serves per-row copies only"):
    probe.gather_kernel(
      NUM_TOKENS,
      80,
      HIDDEN,
      probe.Variant(False, True, wgmma_view=True),
      rows_per_tile=16,
      sms=2,
      interpret=True,
    )


def test_wgmma_view_variant_lowers_for_cuda():
  """The RefUnion of the (1, 64)- and (8, 64)-tiled views lowers at the probe's full size (its
  values can only be checked natively: interpret mode refuses a read through the other view)."""
  variant = probe.Variant(True, True, 4, 2, probe.WARPS_PER_WARPGROUP, wgmma_view=True)
  fn = probe.gather_kernel(8192, 65536, 4096, variant, rows_per_tile=128, sms=132, interpret=False)
  args = (
    jax.ShapeDtypeStruct((65536,), jnp.int32),
    jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16),
  )
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.gpu
def test_wgmma_view_aliases_the_row_view_on_the_gpu():
  """Natively: rows copied into the (1, 64)-tiled view read back through the (8, 64)-tiled one
  are ``x[ids]``, so a gather could feed wgmma through the union."""
  variant = probe.Variant(True, True, 2, 1, probe.WARPS_PER_WARPGROUP, wgmma_view=True)
  num_rows = 5 * 128
  x = jax.random.normal(jax.random.key(0), (256, HIDDEN), jnp.bfloat16)
  ids = jax.random.randint(jax.random.key(1), (num_rows,), 0, 256, jnp.int32)
  fn = probe.gather_kernel(
    256, num_rows, HIDDEN, variant, rows_per_tile=128, sms=2, interpret=False
  )
  np.testing.assert_array_equal(np.asarray(fn(ids, x)), np.asarray(x)[np.asarray(ids)])
