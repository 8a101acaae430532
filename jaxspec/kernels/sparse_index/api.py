"""Public entry point: ``convert_topk_to_physical``."""

import jax
import jax.numpy as jnp

from jaxspec.kernels.dispatch import KernelOp
from jaxspec.kernels.sparse_index import mosaic_gpu, reference


def _check_inputs(req_ids, block_table, topk, block_size, block_stride):
  for name, array, ndim in (
    ("req_ids", req_ids, 1),
    ("block_table", block_table, 2),
    ("topk", topk, 2),
  ):
    if array.ndim != ndim or array.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32 of rank {ndim}, got {array.dtype}{list(array.shape)}")
  if req_ids.shape[0] != topk.shape[0]:
    raise ValueError(
      f"req_ids must have shape [T] = [{topk.shape[0]}] like topk [T, K], got {list(req_ids.shape)}"
    )
  if block_table.shape[0] < 1 or block_table.shape[1] < 1:
    raise ValueError(
      f"block_table [R, max_blocks] must be non-empty, got {list(block_table.shape)}"
    )
  if block_size < 1 or block_stride < 1:
    raise ValueError(
      f"block_size and block_stride must be positive, got {block_size}, {block_stride}"
    )


OP = KernelOp(
  name="convert_topk_to_physical",
  reference=reference.convert_topk_to_physical_reference,
  kernel=mosaic_gpu.convert_topk_to_physical_mosaic_gpu,
  default_config=lambda *_, **__: mosaic_gpu.TuningConfig(),
  unsupported_reason=mosaic_gpu.unsupported_reason,
)


def convert_topk_to_physical(
  req_ids: jax.Array,  # int32 [T]
  block_table: jax.Array,  # int32 [R, max_blocks]
  topk: jax.Array,  # int32 [T, K]
  *,
  block_size: int = 64,
  block_stride: int | None = None,
  impl: str = "auto",
  interpret: bool = False,
  config: mosaic_gpu.TuningConfig | None = None,
) -> tuple[jax.Array, jax.Array]:  # (int32 [T, K], int32 [T])
  """Converts request-local top-k token indices to physical KV-cache slots.

  ``physical[t, k] = block_table[r, i // block_size] * block_stride + i % block_size``
  with ``r = req_ids[t]`` and ``i = topk[t, k]``; ``-1`` where ``i < 0`` or
  ``i // block_size >= max_blocks``. ``valid_counts[t]`` counts the entries of
  row ``t`` that passed those two checks. This is vLLM's
  ``triton_convert_req_index_to_global_index`` (sparse MLA of DeepSeek V3.2 /
  GLM-5, ``return_valid_counts=True``); ``reference.py`` spells out the edge
  cases (negative block-table entries are trusted, request ids are clamped).

  Args:
    req_ids: int32 [T], the request (row of ``block_table``) of each token.
    block_table: int32 [R, max_blocks], physical block ids per request.
    topk: int32 [T, K], logical token positions chosen by the indexer, ``-1``
      for unused slots.
    block_size: tokens per KV-cache block.
    block_stride: physical slots between consecutive blocks; defaults to
      ``block_size`` (larger when other layers' pages sit in between).
    impl: "pallas" (Mosaic GPU kernel), "xla" (the fused jnp expression) or
      "auto" (see ``jaxspec.kernels.dispatch``): the kernel on a Hopper GPU where
      it can serve the inputs (``mosaic_gpu.unsupported_reason``), xla otherwise.
    interpret: run the Pallas kernel in GPU interpret mode (any backend).
    config: kernel tuning knobs; ``None`` takes the defaults.

  Returns:
    ``(physical int32 [T, K], valid_counts int32 [T])``.
  """
  block_stride = block_size if block_stride is None else block_stride
  _check_inputs(req_ids, block_table, topk, block_size, block_stride)
  if topk.shape[0] == 0:  # nothing to convert: no launch, whichever path
    return jnp.zeros(topk.shape, jnp.int32), jnp.zeros((0,), jnp.int32)
  return OP(
    req_ids,
    block_table,
    topk,
    block_size=block_size,
    block_stride=block_stride,
    impl=impl,
    interpret=interpret,
    config=config,
  )
