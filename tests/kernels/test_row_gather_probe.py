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
