"""Plain-jnp reference for the top-k index conversion of sparse MLA.

Semantics (shared by every implementation of the op). This is vLLM's
``triton_convert_req_index_to_global_index`` (``vllm/v1/attention/backends/mla/sparse_utils.py``,
``return_valid_counts=True``) where its inputs are sane, and a defined, safe result where they are
not. For token ``t`` with request ``r = req_ids[t]`` and logical index ``i = topk[t, k]``:

* ``i`` is *valid* when ``i >= 0``, its block ``i // block_size`` lies inside the table
  (``< max_blocks``), ``r`` is a row of the table (``0 <= r < R``) and the block's entry
  ``e = block_table[r, i // block_size]`` is *in range*: ``0 <= e <= max_table_entry``, i.e.
  ``0 <= e * block_stride + block_size - 1 < 2**31``, so every slot of the block is a
  non-negative int32;
* a valid ``i`` maps to ``e * block_stride + i % block_size``, an invalid one to ``-1``;
* ``valid_counts[t]`` is the number of valid entries of row ``t``, so it always equals the number
  of outputs of row ``t`` that are not ``-1``.

The device-value contract (``api.convert_topk_to_physical`` checks it eagerly, and under ``jit``
in ``jaxspec.contracts.checked`` mode) is that request ids are rows of the table and that every
entry a valid-looking index reaches is in range. An index that is negative or past the table is
*not* a breach: it is how the indexer pads its rows (``-1``), and maps to ``-1`` as in vLLM.

Where vLLM differs, on inputs outside the contract: vLLM trusts negative entries (counted, mapped
to a negative slot), lets ``entry * block_size + offset`` wrap around int32 (a block-table entry
of 40,000,000 with block 64 gave a negative slot counted as valid), and reads whatever row an
out-of-range request id points at (an XLA gather clamps it to the first or last request: another
request's blocks). A consumer that reads ``physical`` up to ``valid_counts`` would then read a
slot that does not exist or belongs to someone else; here those entries are ``-1`` and not
counted, on every implementation.
"""

import functools

import jax
import jax.numpy as jnp

INT32_MAX = 2**31 - 1


def max_table_entry(block_size: int, block_stride: int) -> int:
  """The largest block-table entry whose block's slots all fit in int32."""
  return (INT32_MAX + 1 - block_size) // block_stride


def requests_in_table(req_ids: jax.Array, num_requests: int) -> jax.Array:
  """bool [T]: the request id is a row of the block table."""
  return (req_ids >= 0) & (req_ids < num_requests)


def entries_in_range(entry: jax.Array, block_size: int, block_stride: int) -> jax.Array:
  """bool, elementwise: every slot of the block ``entry`` is a non-negative int32."""
  return (entry >= 0) & (entry <= max_table_entry(block_size, block_stride))


def _lookup(req_ids, block_table, topk, block_size):
  """The block-table entry of every top-k index and whether the index selects one.

  Returns (entry int32 [T, K], selects bool [T, K]): ``selects`` is the validity of the index
  alone (non-negative, inside the table, request in the table); ``entry`` is meaningful where it
  holds (elsewhere: block 0 of the clamped request's row, always in bounds).
  """
  num_requests, max_blocks = block_table.shape
  block = topk // block_size  # [T, K]; floor division, so i < 0 gives block < 0
  selects = (topk >= 0) & (block < max_blocks) & requests_in_table(req_ids, num_requests)[:, None]
  rows = jnp.clip(req_ids, 0, num_requests - 1)[:, None]  # [T, 1]
  entry = block_table[rows, jnp.where(selects, block, 0)]  # [T, K]
  return entry, selects


@functools.partial(jax.jit, static_argnames=("block_size", "block_stride"))
def convert_topk_to_physical_reference(
  req_ids: jax.Array,  # int32 [T]
  block_table: jax.Array,  # int32 [R, max_blocks], R >= 1 and max_blocks >= 1
  topk: jax.Array,  # int32 [T, K]
  *,
  block_size: int,
  block_stride: int,
) -> tuple[jax.Array, jax.Array]:  # (int32 [T, K], int32 [T])
  """One fused XLA expression: a gather from the table plus elementwise math."""
  entry, selects = _lookup(req_ids, block_table, topk, block_size)
  valid = selects & entries_in_range(entry, block_size, block_stride)  # [T, K]
  # In range, entry * block_stride + offset <= 2**31 - 1: no int32 wrap-around where it is kept.
  physical = jnp.where(valid, entry * block_stride + topk % block_size, -1)
  valid_counts = jnp.sum(valid, axis=1, dtype=jnp.int32)  # [T]
  return physical, valid_counts


@functools.partial(jax.jit, static_argnames=("block_size", "block_stride"))
def device_contract(
  req_ids: jax.Array,  # int32 [T]
  block_table: jax.Array,  # int32 [R, max_blocks], R >= 1 and max_blocks >= 1
  topk: jax.Array,  # int32 [T, K]
  *,
  block_size: int,
  block_stride: int,
) -> tuple[jax.Array, jax.Array]:  # (bool [], bool [])
  """Whether the inputs keep the device-value contract (module docstring).

  Returns (every request id is a row of the table, every entry reached is in range).
  """
  entry, selects = _lookup(req_ids, block_table, topk, block_size)
  in_range = entries_in_range(entry, block_size, block_stride)
  return jnp.all(requests_in_table(req_ids, block_table.shape[0])), jnp.all(in_range | ~selects)
