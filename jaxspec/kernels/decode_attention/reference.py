"""Plain-jnp float32 reference for paged multi-row decode attention.

Semantics (shared by every implementation of the op): request ``b`` has
``S = seq_lens[b]`` KV positions, the last ``q_len`` of them belonging to the
query rows. Row ``j`` sees KV positions ``p < S - q_len + j + 1`` (causal among
the draft rows). Query head ``h`` reads KV head ``h // G`` with
``G = Hq // Hkv``. Rows that see nothing (``S - q_len + j + 1 <= 0``, which
includes padding slots with ``S = 0``) return zeros.

Device-value contract: ``0 <= S <= max_pages_per_req * page_size`` (the block
table's capacity), and every page id a request uses inside its length,
``block_tables[b, i]`` for ``i < ceil(S / page_size)``, is in ``[0, num_pages)``.
The public function checks it eagerly (``jaxspec.contracts``). Outside the
contract every implementation follows one rule, so that no path reads a page
the table does not name and all paths agree: row ``j`` attends position ``p``
only if, besides the causal limit above, ``p < max_pages_per_req * page_size``
and ``0 <= block_tables[b, p // page_size] < num_pages``. Positions past the
table's capacity and positions on an out-of-range page id are not attended
(never clamped onto a page that may belong to another request); a negative
``S`` sees nothing.

fp8 pages: ``k_pages`` / ``v_pages`` in ``float8_e4m3fn`` come with float32
``k_scale`` / ``v_scale`` of shape ``[Hkv]``; the real value of a stored entry of
KV head ``h`` is ``stored * scale[h]``, dequantised here in float32.

The pages of each request are gathered into a contiguous
``[B, Hkv, max_pages * page_size, D]`` view and attended to with one masked
softmax. Masking is done with ``where`` (never by multiplying with 0) so that
NaN or garbage in pages a request does not own cannot leak into its output.
"""

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def paged_decode_attention_reference(
  q: jax.Array,  # [B, q_len, Hq, D]
  k_pages: jax.Array,  # [Hkv, num_pages, page_size, D]
  v_pages: jax.Array,  # [Hkv, num_pages, page_size, D]
  block_tables: jax.Array,  # int32 [B, max_pages_per_req]
  seq_lens: jax.Array,  # int32 [B]
  k_scale: jax.Array | None,  # f32 [Hkv] with fp8 pages, else None
  v_scale: jax.Array | None,  # f32 [Hkv] with fp8 pages, else None
  *,
  sm_scale: float,
) -> jax.Array:  # [B, q_len, Hq, D], q.dtype
  """Masked softmax attention over the gathered pages, in float32."""
  batch, q_len, num_q_heads, head_dim = q.shape
  num_kv_heads, num_pages, page_size, _ = k_pages.shape
  max_pages = block_tables.shape[1]
  group = num_q_heads // num_kv_heads
  kv_len = max_pages * page_size

  # Out-of-range ids are masked below; clamping only keeps the gather in bounds.
  page_in_range = (block_tables >= 0) & (block_tables < num_pages)  # [B, P]
  page_ids = jnp.where(page_in_range, block_tables, 0)

  def gather(pages, scale):  # [Hkv, N, page, D] -> f32 [B, Hkv, P * page, D]
    gathered = pages[:, page_ids]  # [Hkv, B, P, page, D]
    gathered = jnp.swapaxes(gathered, 0, 1).reshape(batch, num_kv_heads, kv_len, head_dim)
    gathered = gathered.astype(jnp.float32)
    if scale is not None:  # fp8: real value = stored * scale of the KV head
      gathered = gathered * scale[None, :, None, None]
    return gathered

  keys = gather(k_pages, k_scale)
  values = gather(v_pages, v_scale)

  # Lengths past the capacity (plus q_len) see the same positions as the capacity plus q_len;
  # clipping keeps the int32 row limits below from overflowing.
  seq_lens = jnp.clip(seq_lens, 0, kv_len + q_len)
  positions = jnp.arange(kv_len, dtype=jnp.int32)  # [L]
  attendable = jnp.repeat(page_in_range, page_size, axis=1)  # [B, L]
  in_length = (positions[None, :] < seq_lens[:, None]) & attendable  # [B, L]
  # Zero values outside the request: their probability is 0, but 0 * NaN = NaN.
  values = jnp.where(in_length[:, None, :, None], values, 0.0)

  # Row j sees positions < S - q_len + j + 1.
  row_limits = seq_lens[:, None] - q_len + 1 + jnp.arange(q_len, dtype=jnp.int32)  # [B, q_len]
  visible = (positions[None, None, :] < row_limits[:, :, None]) & attendable[:, None, :]

  queries = q.astype(jnp.float32).reshape(batch, q_len, num_kv_heads, group, head_dim)
  # On a GPU XLA's default float32 matmul rounds its inputs to TF32 (10-bit mantissa). bf16 and
  # fp16 values are exact in it, and with 16-bit queries the rounding of dequantised fp8 keys and
  # of the probabilities (2^-11) stays below the 16-bit output's own; float32 queries ask for
  # float32 results, so their products are computed in full float32.
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  scores = jnp.einsum("bjhgd,bhld->bhgjl", queries, keys, precision=precision) * sm_scale
  # scores: [B, Hkv, G, q_len, L]
  mask = visible[:, None, None, :, :]
  scores = jnp.where(mask, scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  # Rows that see nothing have max -inf; shift by 0 instead so exp stays finite.
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  probs = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
  denom = jnp.sum(probs, axis=-1, keepdims=True)
  out = jnp.einsum("bhgjl,bhld->bjhgd", probs, values, precision=precision)  # [B, q_len, Hkv, G, D]
  denom = jnp.moveaxis(denom, 3, 1)  # [B, q_len, Hkv, G, 1]
  out = out / jnp.where(denom > 0.0, denom, 1.0)
  return out.reshape(batch, q_len, num_q_heads, head_dim).astype(q.dtype)
