"""The race-detector helper sees a race in any kernel of a call, not only in the last one."""

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from races import races_found

PARAMS = plgpu.InterpretGPUParams(detect_races=True)
TILE = jax.ShapeDtypeStruct((128, 128), jnp.float32)


def _racy(o_ref):
  # Both warpgroups write the whole shared tile with nothing ordering the two writes.
  @functools.partial(pl.run_scoped, tile=plgpu.SMEM((128, 128), jnp.float32), collective_axes="wg")
  def _(tile):
    tile[...] = jnp.zeros((128, 128), jnp.float32) + lax.axis_index("wg").astype(jnp.float32)
    plgpu.commit_smem()

    @pl.when(lax.axis_index("wg") == 0)
    def _():
      plgpu.copy_smem_to_gmem(tile, o_ref)
      plgpu.wait_smem_to_gmem(0)


def _clean(o_ref):
  @functools.partial(pl.run_scoped, tile=plgpu.SMEM((128, 128), jnp.float32))
  def _(tile):
    tile[...] = jnp.ones((128, 128), jnp.float32)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile, o_ref)
    plgpu.wait_smem_to_gmem(0)


def _run(body, **mesh):
  kernel = plgpu.kernel(
    body, out_type=TILE, grid=(1,), grid_names=("sm",), interpret=PARAMS, **mesh
  )
  return jax.block_until_ready(kernel())


def test_a_race_in_an_earlier_kernel_is_reported_after_a_clean_one():
  _run(_racy, num_threads=2, thread_name="wg")
  _run(_clean)  # the detector's record of the last kernel alone would say "no race"
  assert races_found()
  _run(_clean)
  assert not races_found()
