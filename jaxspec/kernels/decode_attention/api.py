"""Public entry point of paged multi-row (MTP) decode attention."""

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.contracts import require
from jaxspec.kernels.decode_attention import mosaic_gpu
from jaxspec.kernels.decode_attention.reference import paged_decode_attention_reference
from jaxspec.kernels.dispatch import KernelOp, check_impl, gpu_device_kind

MAX_Q_LEN = 8
Q_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
# Positions are int32: the block table's capacity plus the query rows must fit.
MAX_CAPACITY = 2**31 - 1 - MAX_Q_LEN


def _check_array(name: str, value, ndim: int, layout: str) -> None:
  """``TypeError`` unless ``value`` is an array; ``ValueError`` unless it has rank ``ndim``."""
  if not isinstance(value, (jax.Array, np.ndarray)):
    raise TypeError(f"{name} must be a jax.Array {layout}, got {type(value).__name__}")
  if value.ndim != ndim:
    raise ValueError(f"{name} must be {layout}, got shape {tuple(value.shape)}")


def _check_positive_dims(name: str, shape, names: tuple[str, ...], allow_zero=()) -> None:
  for dim_name, size in zip(names, shape, strict=True):
    if size < 1 and dim_name not in allow_zero:
      raise ValueError(
        f"{name} must be [{', '.join(names)}] with {dim_name} >= 1, got shape {tuple(shape)}"
      )


def _check_inputs(q, k_pages, v_pages, block_tables, seq_lens) -> None:
  """Raises a ``TypeError``/``ValueError`` naming the argument whose type, shape or dtype is
  wrong. Zero-size dimensions are refused except the batch (``B = 0`` is an empty call)."""
  _check_array("q", q, 4, "[B, q_len, Hq, D]")
  batch, q_len, num_q_heads, head_dim = q.shape
  if not 1 <= q_len <= MAX_Q_LEN:
    raise ValueError(f"q_len (q.shape[1]) must be in 1..{MAX_Q_LEN}, got {q_len}")
  _check_positive_dims("q", q.shape, ("B", "q_len", "Hq", "D"), allow_zero=("B",))
  if q.dtype not in Q_DTYPES:
    raise ValueError(f"q must be bf16, fp16 or fp32, got {q.dtype}")

  _check_array("k_pages", k_pages, 4, f"[Hkv, num_pages, page_size, D={head_dim}]")
  if k_pages.shape[3] != head_dim:
    raise ValueError(
      f"k_pages must be [Hkv, num_pages, page_size, D={head_dim}] (D from q), "
      f"got shape {tuple(k_pages.shape)}"
    )
  _check_positive_dims("k_pages", k_pages.shape, ("Hkv", "num_pages", "page_size", "D"))
  _check_array("v_pages", v_pages, 4, f"[Hkv, num_pages, page_size, D] = {tuple(k_pages.shape)}")
  if v_pages.shape != k_pages.shape:
    raise ValueError(
      f"v_pages must have k_pages' shape {tuple(k_pages.shape)}, got {tuple(v_pages.shape)}"
    )
  num_kv_heads = k_pages.shape[0]
  if num_q_heads % num_kv_heads:
    raise ValueError(f"Hq={num_q_heads} (q.shape[2]) must be a multiple of Hkv={num_kv_heads}")
  for name, array in (("k_pages", k_pages), ("v_pages", v_pages)):
    if array.dtype not in (q.dtype, FP8_DTYPE):
      raise ValueError(
        f"{name} must have q's dtype {q.dtype} or be float8_e4m3fn, got {array.dtype}"
      )
  if v_pages.dtype != k_pages.dtype:
    raise ValueError(f"v_pages must have k_pages' dtype {k_pages.dtype}, got {v_pages.dtype}")

  _check_array("block_tables", block_tables, 2, f"int32 [B={batch}, max_pages_per_req]")
  if block_tables.shape[0] != batch or block_tables.shape[1] < 1:
    raise ValueError(
      f"block_tables must be int32 [B={batch}, max_pages_per_req >= 1], "
      f"got shape {tuple(block_tables.shape)}"
    )
  _check_array("seq_lens", seq_lens, 1, f"int32 [B={batch}]")
  if seq_lens.shape != (batch,):
    raise ValueError(f"seq_lens must be int32 [B={batch}], got shape {tuple(seq_lens.shape)}")
  for name, array in (("block_tables", block_tables), ("seq_lens", seq_lens)):
    if array.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32, got {array.dtype}")
  capacity = block_tables.shape[1] * k_pages.shape[2]
  if capacity > MAX_CAPACITY:
    raise ValueError(
      f"block_tables' capacity max_pages_per_req * page_size = {block_tables.shape[1]} * "
      f"{k_pages.shape[2]} = {capacity} must be at most {MAX_CAPACITY} (int32 positions)"
    )


def _positive_float(name: str, value) -> float:
  """A finite positive real Python number as a float, else ``TypeError``/``ValueError``."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a Python float, got {type(value).__name__} {value!r}")
  value = float(value)
  if not (math.isfinite(value) and value > 0.0):
    raise ValueError(f"{name} must be finite and positive, got {value}")
  return value


def _kv_scale(name: str, value, k_pages) -> jax.Array | None:
  """The per-KV-head dequantisation scale as float32 [Hkv] (fp8 pages), or ``None``."""
  num_kv_heads = k_pages.shape[0]
  if k_pages.dtype != FP8_DTYPE:
    if value is not None:
      raise ValueError(f"{name} applies to float8_e4m3fn pages only; the pages are {k_pages.dtype}")
    return None
  if value is None:
    value = 1.0
  if isinstance(value, (jax.Array, np.ndarray)):
    if value.shape != (num_kv_heads,) or value.dtype != jnp.float32:
      raise ValueError(
        f"{name} must be a Python float or float32 [Hkv={num_kv_heads}], "
        f"got {value.dtype}{list(value.shape)}"
      )
    require(
      jnp.isfinite(value) & (value > 0.0),
      f"{name} must be finite and positive for every KV head",
    )
    return jnp.asarray(value)
  return jnp.full((num_kv_heads,), _positive_float(name, value), jnp.float32)


def _first_index(breach: jax.Array) -> tuple[int, ...]:
  """Index of the first True element of a concrete bool array."""
  return tuple(int(i) for i in np.argwhere(np.asarray(breach))[0])


@functools.partial(jax.jit, static_argnames=("num_pages", "page_size"))
def _contract_breaches(
  block_tables: jax.Array,  # int32 [B, P]
  seq_lens: jax.Array,  # int32 [B]
  *,
  num_pages: int,
  page_size: int,
) -> tuple[jax.Array, jax.Array]:  # bool [B], bool [B, P]
  """Where the device contract breaks: lengths outside ``[0, capacity]`` and page ids inside a
  live length outside ``[0, num_pages)``. One program, so that an eager call compiles the check
  once per shape rather than once per elementwise op."""
  capacity = block_tables.shape[1] * page_size
  length_breach = (seq_lens < 0) | (seq_lens > capacity)
  live = jnp.arange(block_tables.shape[1], dtype=jnp.int32)[None, :] * page_size < seq_lens[:, None]
  page_breach = live & ((block_tables < 0) | (block_tables >= num_pages))
  return length_breach, page_breach


def _require_device_contract(block_tables, seq_lens, num_pages: int, page_size: int) -> None:
  """``0 <= seq_lens[b] <= capacity``; page ids inside each live length in ``[0, num_pages)``.

  Concrete arrays: a ``ValueError`` naming the first breach. Traced arrays: a checkify check in
  checked mode (``jaxspec.contracts.checked``), nothing otherwise.
  """
  max_pages = block_tables.shape[1]
  capacity = max_pages * page_size
  table = f"the block table's capacity {capacity} ({max_pages} pages of {page_size})"
  pages = f"[0, {num_pages})"
  length_breach, page_breach = _contract_breaches(
    block_tables, seq_lens, num_pages=num_pages, page_size=page_size
  )
  if isinstance(length_breach, jax.core.Tracer):
    require(~length_breach, f"seq_lens must be in [0, capacity]: [0, {capacity}], {table}")
    require(
      ~page_breach,
      f"block_tables: every page id inside a request's length must be in {pages} "
      "(the pages of k_pages / v_pages)",
    )
    return
  length_breach, page_breach = np.asarray(length_breach), np.asarray(page_breach)
  if length_breach.any():
    (b,) = _first_index(length_breach)
    length = int(seq_lens[b])
    raise ValueError(
      f"seq_lens[{b}] = {length} is negative"
      if length < 0
      else f"seq_lens[{b}] = {length} exceeds {table}"
    )
  if page_breach.any():
    b, i = _first_index(page_breach)
    raise ValueError(
      f"block_tables[{b}, {i}] = {int(block_tables[b, i])} is not a page id in {pages}, but "
      f"request {b} uses page {i} (seq_lens[{b}] = {int(seq_lens[b])}, pages of {page_size})"
    )


def _default_config(q, k_pages, *_, **__) -> mosaic_gpu.TuningConfig:
  return mosaic_gpu.default_config(
    q.shape[-1],
    k_pages.shape[2],
    k_pages.dtype,
    num_rows=mosaic_gpu.packed_rows(q, k_pages),
    num_pairs=q.shape[0] * k_pages.shape[0],
    device_kind=gpu_device_kind(),
  )


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
  *,
  k_scale: float | jax.Array | None = None,  # fp8 pages: Python float or f32 [Hkv]
  v_scale: float | jax.Array | None = None,
) -> jax.Array:  # [B, q_len, Hq, D], q.dtype
  """Causal multi-row attention of ``q_len`` new rows over a paged KV cache.

  Row ``j`` of a request of total length ``S`` sees KV positions
  ``< S - q_len + j + 1``; query head ``h`` uses KV head ``h // (Hq // Hkv)``.
  Padding slots (``S = 0``) and rows that see nothing return zeros. A batch of
  ``B = 0`` requests returns an empty ``[0, q_len, Hq, D]`` array on every path.

  Device-value contract (``reference.py`` states what every path does outside it):
  ``0 <= seq_lens[b] <= max_pages_per_req * page_size``, and every page id a
  request uses inside its length, ``block_tables[b, i]`` for
  ``i < ceil(seq_lens[b] / page_size)``, is in ``[0, num_pages)``. Entries past
  a request's pages are never read and may hold anything. On concrete arrays a
  breach raises ``ValueError`` here; under ``jit`` it is checked only in checked
  mode (``jaxspec.contracts.checked`` / ``checked_jit``); otherwise positions
  past the capacity or on an out-of-range page id are not attended, alike on
  every path.

  Args:
    q: [B, q_len, Hq, D] bf16, fp16 or fp32, q_len in 1..8.
    k_pages, v_pages: [Hkv, num_pages, page_size, D] in q's dtype, or both
      ``float8_e4m3fn`` (with ``k_scale`` / ``v_scale``).
    block_tables: int32 [B, max_pages_per_req], physical page ids per request.
    seq_lens: int32 [B], total KV length of each request incl. its q_len rows.
    sm_scale: softmax scale, a finite positive Python float (static: a new value
      compiles anew); ``None`` gives ``1 / sqrt(D)``.
    impl: "auto", "pallas" or "xla" (see ``jaxspec.kernels.dispatch``); "auto"
      falls back to XLA where the kernel cannot serve the inputs (e.g. fp32),
      "pallas" raises a ``ValueError`` there.
    interpret: run the Pallas kernel in GPU interpret mode (any backend).
    config: the kernel's tuning knobs (heuristic when ``None``).
    k_scale, v_scale: only with fp8 pages: the real value of a stored entry of
      KV head ``h`` is ``stored * scale[h]``. A finite positive Python float (one
      scale for all heads) or a float32 [Hkv] array (per KV head); ``None`` is
      1.0. Neither is a static argument: both enter the computation as device
      values (a float as a constant), so a new scale never recompiles, and an
      array may be traced (e.g. a scale per layer under ``lax.scan``). Array
      scales must be finite and positive (checked eagerly like the contract
      above). The kernel folds ``k_scale`` into the score scale and ``v_scale``
      into the output normalisation (exact: both are per-head scalars).

  Raises:
    TypeError / ValueError: a host-side argument of the wrong type, shape, dtype
      or value (zero-size dimensions other than ``B`` included), raised before
      any compilation; ``ValueError`` for a concrete breach of the contract.
  """
  _check_inputs(q, k_pages, v_pages, block_tables, seq_lens)
  if not isinstance(impl, str):
    raise TypeError(f"impl must be a str, one of 'auto', 'pallas', 'xla', got {impl!r}")
  if not isinstance(interpret, bool):
    raise TypeError(f"interpret must be a bool, got {interpret!r}")
  check_impl(impl, interpret)
  if config is not None and not isinstance(config, mosaic_gpu.TuningConfig):
    raise TypeError(f"config must be a decode_attention TuningConfig or None, got {config!r}")
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(q.shape[-1])
  sm_scale = _positive_float("sm_scale", sm_scale)  # a static kernel parameter
  k_scale = _kv_scale("k_scale", k_scale, k_pages)
  v_scale = _kv_scale("v_scale", v_scale, k_pages)
  _require_device_contract(block_tables, seq_lens, k_pages.shape[1], k_pages.shape[2])
  return OP(
    q,
    k_pages,
    v_pages,
    block_tables,
    seq_lens,
    k_scale,
    v_scale,
    sm_scale=sm_scale,
    impl=impl,
    interpret=interpret,
    config=config,
  )
