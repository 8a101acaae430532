"""Public entry point of paged multi-row (MTP) decode attention."""

import math

import jax
import jax.numpy as jnp

from jaxspec.kernels.decode_attention import mosaic_gpu
from jaxspec.kernels.decode_attention.reference import paged_decode_attention_reference
from jaxspec.kernels.dispatch import KernelOp

MAX_Q_LEN = 8
_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _check_inputs(q, k_pages, v_pages, block_tables, seq_lens) -> None:
  """Raises a ``ValueError`` naming the argument whose shape or dtype is wrong."""
  if q.ndim != 4:
    raise ValueError(f"q must be [B, q_len, Hq, D], got shape {q.shape}")
  batch, q_len, num_q_heads, head_dim = q.shape
  if not 1 <= q_len <= MAX_Q_LEN:
    raise ValueError(f"q_len (q.shape[1]) must be in 1..{MAX_Q_LEN}, got {q_len}")
  if k_pages.ndim != 4 or k_pages.shape[3] != head_dim:
    raise ValueError(
      f"k_pages must be [Hkv, num_pages, page_size, D={head_dim}], got shape {k_pages.shape}"
    )
  if v_pages.shape != k_pages.shape:
    raise ValueError(f"v_pages must have k_pages' shape {k_pages.shape}, got {v_pages.shape}")
  num_kv_heads = k_pages.shape[0]
  if num_q_heads % num_kv_heads:
    raise ValueError(f"Hq={num_q_heads} (q.shape[2]) must be a multiple of Hkv={num_kv_heads}")
  if block_tables.ndim != 2 or block_tables.shape[0] != batch:
    raise ValueError(
      f"block_tables must be [B={batch}, max_pages_per_req], got shape {block_tables.shape}"
    )
  if seq_lens.shape != (batch,):
    raise ValueError(f"seq_lens must be [B={batch}], got shape {seq_lens.shape}")
  for name, array in (("block_tables", block_tables), ("seq_lens", seq_lens)):
    if array.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32, got {array.dtype}")
  if q.dtype not in _DTYPES:
    raise ValueError(f"q must be bf16, fp16 or fp32, got {q.dtype}")
  for name, array in (("k_pages", k_pages), ("v_pages", v_pages)):
    if array.dtype != q.dtype:
      raise ValueError(f"{name} must have q's dtype {q.dtype}, got {array.dtype}")


def _default_config(q, k_pages, *_, **__) -> mosaic_gpu.TuningConfig:
  return mosaic_gpu.default_config(q.shape[-1], k_pages.shape[2])


OP = KernelOp(
  name="paged_decode_attention",
  reference=paged_decode_attention_reference,
  kernel=mosaic_gpu.paged_decode_attention_mosaic_gpu,
  default_config=_default_config,
  unsupported_reason=mosaic_gpu.unsupported_reason,
)


def paged_decode_attention(
  q: jax.Array,  # [B, q_len, Hq, D]
  k_pages: jax.Array,  # [Hkv, num_pages, page_size, D]
  v_pages: jax.Array,  # [Hkv, num_pages, page_size, D]
  block_tables: jax.Array,  # int32 [B, max_pages_per_req]
  seq_lens: jax.Array,  # int32 [B], total KV length incl. the q_len new rows; 0 = padding
  sm_scale: float | None = None,  # a Python float
  impl: str = "auto",
  interpret: bool = False,
  config: mosaic_gpu.TuningConfig | None = None,
) -> jax.Array:  # [B, q_len, Hq, D], q.dtype
  """Causal multi-row attention of ``q_len`` new rows over a paged KV cache.

  Row ``j`` of a request of total length ``S`` sees KV positions
  ``< S - q_len + j + 1``; query head ``h`` uses KV head ``h // (Hq // Hkv)``.
  Padding slots (``S = 0``) and rows that see nothing return zeros.
  ``sm_scale`` defaults to ``1 / sqrt(D)``. ``impl`` is "auto", "pallas" or
  "xla" (see ``jaxspec.kernels.dispatch``); "auto" falls back to XLA where the
  kernel cannot serve the inputs (e.g. fp32), "pallas" raises a ``ValueError``
  there. ``config`` holds the kernel's tuning knobs (heuristic when ``None``).
  """
  _check_inputs(q, k_pages, v_pages, block_tables, seq_lens)
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(q.shape[-1])
  sm_scale = float(sm_scale)  # a static kernel parameter
  return OP(
    q,
    k_pages,
    v_pages,
    block_tables,
    seq_lens,
    sm_scale=sm_scale,
    impl=impl,
    interpret=interpret,
    config=config,
  )
