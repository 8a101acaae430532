"""Inputs, cases and a float64 oracle shared by the decode-attention tests.

Inputs are drawn fresh: a shuffled page pool where every page no request owns is NaN, NaN past
each request's length inside its last page, and garbage ids (out of range or pointing at NaN
pages) in the block-table entries past a request's pages, so that any read beyond what a request
may attend shows in the output. fp8 pages hold real values ~N(0, 1) quantised with a per-KV-head
scale (amax / 400, as a calibrated cache would); the oracle reads the same fp8 values.
"""

import dataclasses
import math
import zlib
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels.decode_attention.mosaic_gpu import TuningConfig

FP8 = jnp.float8_e4m3fn
# Output tolerances per query dtype. The inputs are exact in their dtype (the float64 oracle
# reads the same rounded values, fp8 ones included, and fp8 -> bf16/fp16 is exact), so the error
# comes from rounding the probabilities and the output to the query dtype (bf16: 8 bits).
TOLERANCES = {
  jnp.dtype(jnp.float32): 2e-5,
  jnp.dtype(jnp.bfloat16): 2e-2,
  jnp.dtype(jnp.float16): 4e-3,
}
_DTYPE_NAMES = {
  jnp.dtype(jnp.float32): "f32",
  jnp.dtype(jnp.bfloat16): "bf16",
  jnp.dtype(jnp.float16): "f16",
}


class Inputs(NamedTuple):
  q: jax.Array  # [B, q_len, Hq, D]
  k_pages: jax.Array  # [Hkv, num_pages, page_size, D]
  v_pages: jax.Array
  block_tables: jax.Array  # int32 [B, max_pages]
  seq_lens: jax.Array  # int32 [B]
  k_scale: jax.Array | None = None  # f32 [Hkv] with fp8 pages
  v_scale: jax.Array | None = None

  @property
  def arrays(self) -> tuple[jax.Array, ...]:
    """The five positional arguments of ``paged_decode_attention``."""
    return self[:5]

  @property
  def scales(self) -> dict[str, jax.Array]:
    """The keyword scales (empty for 16/32-bit pages)."""
    if self.k_scale is None:
      return {}
    return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def make_inputs(
  rng,
  seq_lens,
  q_len,
  num_kv_heads,
  group,
  head_dim,
  page_size,
  dtype,
  fp8=False,
  spare_pages=3,
) -> Inputs:
  """Random inputs with a shuffled page pool; every page no request owns is NaN."""
  seq_lens = np.asarray(seq_lens, np.int32)
  batch = len(seq_lens)
  pages_needed = [math.ceil(s / page_size) for s in seq_lens]
  max_pages = max([*pages_needed, 1]) + 1
  num_pages = sum(pages_needed) + spare_pages
  order = rng.permutation(num_pages)
  block_tables = rng.integers(-5, num_pages + 5, size=(batch, max_pages)).astype(np.int32)
  next_page = 0
  for b, needed in enumerate(pages_needed):
    block_tables[b, :needed] = order[next_page : next_page + needed]
    next_page += needed
  shape = (num_kv_heads, num_pages, page_size, head_dim)
  k_pages = rng.standard_normal(shape).astype(np.float32)
  v_pages = rng.standard_normal(shape).astype(np.float32)
  scales = {}
  if fp8:
    for name, pages in (("k_scale", k_pages), ("v_scale", v_pages)):
      scale = np.abs(pages).max(axis=(1, 2, 3)) / 400.0  # [Hkv], e4m3's largest value is 448
      scale *= rng.uniform(0.9, 1.1, size=scale.shape)  # no two heads alike
      pages /= scale[:, None, None, None]
      scales[name] = jnp.asarray(scale, jnp.float32)
  unused = order[next_page:]
  k_pages[:, unused] = np.nan
  v_pages[:, unused] = np.nan
  # Positions past each request's length inside its last page are NaN too.
  for b, s in enumerate(seq_lens):
    if s % page_size:
      last = block_tables[b, pages_needed[b] - 1]
      k_pages[:, last, s % page_size :] = np.nan
      v_pages[:, last, s % page_size :] = np.nan
  q = rng.standard_normal((batch, q_len, num_kv_heads * group, head_dim)).astype(np.float32)
  kv_dtype = FP8 if fp8 else dtype
  return Inputs(
    jnp.asarray(q, dtype),
    jnp.asarray(k_pages, kv_dtype),
    jnp.asarray(v_pages, kv_dtype),
    jnp.asarray(block_tables),
    jnp.asarray(seq_lens),
    **scales,
  )


class KernelCase(NamedTuple):
  """One set of shapes (and a kernel config) to test, with a readable pytest id."""

  seq_lens: tuple[int, ...]
  q_len: int
  num_kv_heads: int
  group: int
  head_dim: int
  page_size: int
  dtype: Any
  config: TuningConfig | None = None
  fp8: bool = False

  @property
  def id(self) -> str:
    parts = [
      "S" + "-".join(map(str, self.seq_lens)),
      f"q{self.q_len}",
      f"Hkv{self.num_kv_heads}",
      f"G{self.group}",
      f"D{self.head_dim}",
      f"page{self.page_size}",
      _DTYPE_NAMES[jnp.dtype(self.dtype)] + ("-fp8kv" if self.fp8 else ""),
    ]
    if self.config is not None:
      defaults = TuningConfig()
      parts += [
        f"{field.name}={getattr(self.config, field.name)}"
        for field in dataclasses.fields(self.config)
        if getattr(self.config, field.name) != getattr(defaults, field.name)
      ]
    return "_".join(parts)

  def inputs(self) -> Inputs:
    """Fresh inputs, seeded by the case so that a failure reproduces."""
    rng = np.random.default_rng(zlib.crc32(self.id.encode()))
    return make_inputs(
      rng,
      self.seq_lens,
      self.q_len,
      self.num_kv_heads,
      self.group,
      self.head_dim,
      self.page_size,
      self.dtype,
      fp8=self.fp8,
    )


def case_params(cases):
  """``pytest.param``-ready ids for a list of ``KernelCase``."""
  return {"argvalues": cases, "ids": [case.id for case in cases]}


def _float64(array) -> np.ndarray:
  return np.asarray(jnp.asarray(array).astype(jnp.float32), np.float64)


def oracle(inputs: Inputs, sm_scale: float) -> np.ndarray:
  """Row-by-row float64 attention, written independently of the jnp reference.

  Follows the op's rule on every input, in contract or not: row ``j`` of request ``b``
  attends position ``p`` iff ``p < S - q_len + j + 1``, ``p`` is inside the block table's
  capacity and its page id is in ``[0, num_pages)``.
  """
  q, k_pages, v_pages = (_float64(x) for x in inputs[:3])
  if inputs.k_scale is not None:
    k_pages = k_pages * _float64(inputs.k_scale)[:, None, None, None]
    v_pages = v_pages * _float64(inputs.v_scale)[:, None, None, None]
  block_tables, seq_lens = np.asarray(inputs.block_tables), np.asarray(inputs.seq_lens)
  batch, q_len, num_q_heads, head_dim = q.shape
  num_kv_heads, num_pages, page_size, _ = k_pages.shape
  capacity = block_tables.shape[1] * page_size
  group = num_q_heads // num_kv_heads
  out = np.zeros(q.shape, np.float64)
  for b in range(batch):
    for j in range(q_len):
      limit = min(int(seq_lens[b]) - q_len + j + 1, capacity)
      pos = np.arange(max(limit, 0))
      pages = block_tables[b, pos // page_size]
      in_pool = (pages >= 0) & (pages < num_pages)
      pos, pages = pos[in_pool], pages[in_pool]
      if not len(pos):
        continue
      for h in range(num_q_heads):
        keys = k_pages[h // group, pages, pos % page_size]  # [visible, D]
        values = v_pages[h // group, pages, pos % page_size]
        scores = keys @ q[b, j, h] * sm_scale
        probs = np.exp(scores - scores.max())
        out[b, j, h] = probs @ values / probs.sum()
  return out


def check(out, inputs: Inputs, sm_scale: float | None = None) -> None:
  """``out`` has q's shape and dtype, is finite and matches the float64 oracle everywhere."""
  q = inputs.q
  chex.assert_shape(out, q.shape)
  chex.assert_type(out, q.dtype)
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(q.shape[-1])
  actual = _float64(out)
  assert np.all(np.isfinite(actual)), "output holds NaN or inf"
  tol = TOLERANCES[jnp.dtype(q.dtype)]
  chex.assert_trees_all_close(actual, oracle(inputs, sm_scale), rtol=tol, atol=tol)
