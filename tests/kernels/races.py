"""The one place the tests read the result of Pallas' GPU race detector.

GPU interpret mode (``plgpu.InterpretGPUParams(detect_races=True)``) prints each data race it
finds and records it in its module state, but jax 0.11.2 exposes no public function to read that
record (``jax.experimental.pallas.mosaic_gpu`` exports the parameters, not the result). The
record is ``get_races()`` of the private interpreter module, so this helper imports it there,
and nothing else in the tests touches private jax API. When jax makes the result public, only
this file changes.
"""

from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races


def races_found() -> bool:
  """Whether the race detector saw a data race in the last kernel run in GPU interpret mode."""
  return get_races().races_found
