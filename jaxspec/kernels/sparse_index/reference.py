"""Plain-jnp reference for the top-k index conversion of sparse MLA.

Semantics (shared by every implementation of the op, and matching vLLM's
``triton_convert_req_index_to_global_index`` in
``vllm/v1/attention/backends/mla/sparse_utils.py`` with
``return_valid_counts=True``): for token ``t`` with request ``r = req_ids[t]``
and logical index ``i = topk[t, k]``

* ``i`` is *valid* when ``i >= 0`` and its block ``i // block_size`` lies
  inside the table (``< max_blocks``);
* a valid ``i`` maps to
  ``block_table[r, i // block_size] * block_stride + i % block_size``;
* an invalid ``i`` maps to ``-1``;
* ``valid_counts[t]`` is the number of valid entries of row ``t``.

As in vLLM, block-table *entries* are trusted: a valid index whose block-table
entry is negative is still counted and yields ``entry * block_stride + offset``
(negative, not necessarily ``-1``). With non-negative entries for every block a
request owns, ``valid_counts[t]`` equals the number of outputs of row ``t``
that are not ``-1``. Request ids are clamped into ``[0, R)``, as an XLA gather
clamps its indices.
"""

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames=("block_size", "block_stride"))
def convert_topk_to_physical_reference(
  req_ids: jax.Array,  # int32 [T]
  block_table: jax.Array,  # int32 [R, max_blocks]
  topk: jax.Array,  # int32 [T, K]
  *,
  block_size: int,
  block_stride: int,
) -> tuple[jax.Array, jax.Array]:  # (int32 [T, K], int32 [T])
  """One fused XLA expression: a gather from the table plus elementwise math."""
  num_requests, max_blocks = block_table.shape
  block = topk // block_size  # [T, K]; floor division, so i < 0 gives block < 0
  offset = topk % block_size  # [T, K]
  valid = (topk >= 0) & (block < max_blocks)  # [T, K]
  rows = jnp.clip(req_ids, 0, num_requests - 1)[:, None]  # [T, 1]
  # Invalid entries read block 0 of their row (always in bounds); `where` drops it.
  entry = block_table[rows, jnp.where(valid, block, 0)]  # [T, K]
  physical = jnp.where(valid, entry * block_stride + offset, -1)
  valid_counts = jnp.sum(valid, axis=1, dtype=jnp.int32)  # [T]
  return physical, valid_counts
