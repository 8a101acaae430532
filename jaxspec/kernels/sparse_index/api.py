"""Public entry point: ``convert_topk_to_physical``."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import contracts
from jaxspec.kernels.dispatch import KernelOp, check_impl
from jaxspec.kernels.sparse_index import mosaic_gpu, reference

_SHAPES = {"req_ids": "[T]", "block_table": "[R, max_blocks]", "topk": "[T, K]"}


def _check_array(name: str, array) -> None:
  """``TypeError`` unless ``array`` is an int32 array; ``ValueError`` for the wrong rank.

  Nothing is cast: an int64 top-k index of 2**32 + 5 cast to int32 would become a valid 5.
  """
  expected = f"an int32 array {_SHAPES[name]}"
  if not (hasattr(array, "dtype") and hasattr(array, "shape")):
    raise TypeError(f"{name} must be {expected}, got {type(array).__name__}")
  if array.dtype != jnp.int32:
    raise TypeError(
      f"{name} must be {expected}, got dtype {array.dtype} (cast it yourself after checking "
      "that its values fit in int32)"
    )
  if array.ndim != _SHAPES[name].count(",") + 1:
    raise ValueError(f"{name} must be {expected}, got shape {list(array.shape)}")


def _check_block_int(name: str, value) -> int:
  """``block_size`` / ``block_stride``: a Python (or NumPy) int in ``[1, 2**31 - 1]``."""
  if isinstance(value, bool) or not isinstance(value, int | np.integer):
    raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
  if not 1 <= value <= reference.INT32_MAX:
    raise ValueError(f"{name} must be in [1, 2**31 - 1], got {value}")
  return int(value)


def _check_inputs(req_ids, block_table, topk, block_size, block_stride, config) -> tuple[int, int]:
  """Host-side checks, before any compilation; returns ``(block_size, block_stride)``."""
  for name, array in (("req_ids", req_ids), ("block_table", block_table), ("topk", topk)):
    _check_array(name, array)
  num_tokens = topk.shape[0]
  if req_ids.shape[0] != num_tokens:
    raise ValueError(
      f"req_ids must have shape [T] = [{num_tokens}] like topk [T, K], got {list(req_ids.shape)}"
    )
  if block_table.shape[0] == 0 and num_tokens > 0:
    raise ValueError(
      f"block_table [R, max_blocks] needs at least one row (request) for the {num_tokens} "
      f"tokens of req_ids, got shape {list(block_table.shape)}"
    )
  block_size = _check_block_int("block_size", block_size)
  block_stride = (
    block_size if block_stride is None else _check_block_int("block_stride", block_stride)
  )
  if block_stride < block_size:
    raise ValueError(
      f"block_stride must be >= block_size = {block_size} (blocks must not overlap, or two "
      f"tokens would map to one slot), got {block_stride}"
    )
  if config is not None and not isinstance(config, mosaic_gpu.TuningConfig):
    raise TypeError(f"config must be a sparse_index TuningConfig or None, got {config!r}")
  return block_size, block_stride


def _is_traced(*arrays) -> bool:
  return any(isinstance(array, jax.core.Tracer) for array in arrays)


def _check_device_contract(req_ids, block_table, topk, block_size, block_stride) -> None:
  """The device-value contract (``reference``): eagerly on concrete arrays, and under a trace in
  ``jaxspec.contracts.checked`` mode; a traced call outside checked mode computes nothing here."""
  if _is_traced(req_ids, block_table, topk) and not contracts.is_checked():
    return
  num_requests, max_blocks = block_table.shape
  if max_blocks == 0 or topk.shape[1] == 0:  # no entry can be reached: only the request ids
    requests_ok = jnp.all(reference.requests_in_table(jnp.asarray(req_ids), num_requests))
    entries_ok = jnp.asarray(True)
  else:
    requests_ok, entries_ok = reference.device_contract(
      req_ids, block_table, topk, block_size=block_size, block_stride=block_stride
    )
  contracts.require(
    requests_ok, f"req_ids: every request id must be a row of block_table, in [0, {num_requests})"
  )
  contracts.require(
    entries_ok,
    "block_table: every entry reached by a top-k index must satisfy 0 <= entry * block_stride + "
    f"block_size - 1 < 2**31, i.e. 0 <= entry <= "
    f"{reference.max_table_entry(block_size, block_stride)} for block_size {block_size}, "
    f"block_stride {block_stride}",
  )


OP = KernelOp(
  name="convert_topk_to_physical",
  reference=reference.convert_topk_to_physical_reference,
  kernel=mosaic_gpu.convert_topk_to_physical_mosaic_gpu,
  default_config=mosaic_gpu.default_config,
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
  row ``t`` that are not ``-1``. This is vLLM's
  ``triton_convert_req_index_to_global_index`` (sparse MLA of DeepSeek V3.2 /
  GLM-5, ``return_valid_counts=True``) on inputs that keep the contract below;
  ``reference.py`` spells out the semantics and where they differ from vLLM's.

  Contract on device values (checked eagerly when the arrays are concrete, and
  under ``jit`` inside ``jaxspec.contracts.checked()``; a breach raises
  ``ValueError``): every request id is a row of ``block_table``, and every
  block-table entry that a top-k index reaches satisfies
  ``0 <= entry * block_stride + block_size - 1 < 2**31``. Under plain ``jit``
  nothing is checked and a breaching entry maps to ``-1`` and is not counted,
  on every implementation (never a negative or wrapped-around slot, never
  another request's block).

  Args:
    req_ids: int32 [T], the request (row of ``block_table``) of each token.
    block_table: int32 [R, max_blocks], physical block ids per request.
    topk: int32 [T, K], logical token positions chosen by the indexer, ``-1``
      for unused slots; any K >= 0.
    block_size: tokens per KV-cache block, an int in [1, 2**31).
    block_stride: physical slots between consecutive blocks, an int in
      [block_size, 2**31); defaults to ``block_size`` (larger when other
      layers' pages sit in between).
    impl: "pallas" (Mosaic GPU kernel), "xla" (the fused jnp expression) or
      "auto" (see ``jaxspec.kernels.dispatch``): the kernel on a Hopper GPU where
      it can serve the inputs (``mosaic_gpu.unsupported_reason``), xla otherwise.
    interpret: run the Pallas kernel in GPU interpret mode (any backend).
    config: kernel tuning knobs; ``None`` takes ``mosaic_gpu.default_config``.

  Returns:
    ``(physical int32 [T, K], valid_counts int32 [T])``.

  Raises:
    TypeError: an array that is not int32 (nothing is cast), a ``block_size`` /
      ``block_stride`` that is not an int, a ``config`` of the wrong type.
    ValueError: wrong ranks or shapes, ``block_stride < block_size``, numbers
      out of range, an empty table for a non-empty batch, a bad ``impl``, or a
      breach of the device-value contract seen eagerly or in checked mode.
  """
  check_impl(impl, interpret)
  block_size, block_stride = _check_inputs(
    req_ids, block_table, topk, block_size, block_stride, config
  )
  num_tokens, topk_size = topk.shape
  if num_tokens == 0:  # nothing to convert: no launch, whichever path
    return jnp.zeros(topk.shape, jnp.int32), jnp.zeros((0,), jnp.int32)
  _check_device_contract(req_ids, block_table, topk, block_size, block_stride)
  if topk_size == 0 or block_table.shape[1] == 0:
    # No index, or a table without blocks (every index lies past it): no launch either.
    return jnp.full(topk.shape, -1, jnp.int32), jnp.zeros((num_tokens,), jnp.int32)
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
