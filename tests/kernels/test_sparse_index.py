"""convert_topk_to_physical: XLA path and Mosaic GPU kernel against NumPy."""

import jax
import numpy as np
import pytest

from jaxspec.kernels import convert_topk_to_physical
from jaxspec.kernels.sparse_index import mosaic_gpu


def numpy_reference(req_ids, block_table, topk, block_size, block_stride):
  """Element by element in int64, straight from the definition."""
  num_requests, max_blocks = block_table.shape
  physical = np.full(topk.shape, -1, np.int64)
  counts = np.zeros(topk.shape[0], np.int64)
  for t, row in enumerate(topk.astype(np.int64)):
    request = min(max(int(req_ids[t]), 0), num_requests - 1)
    for k, index in enumerate(row):
      block, offset = index // block_size, index % block_size
      if index >= 0 and block < max_blocks:
        physical[t, k] = int(block_table[request, block]) * block_stride + offset
        counts[t] += 1
  return physical, counts


def make_inputs(rng, num_tokens, topk_size, num_requests, max_blocks, block_size):
  """Shuffled block tables over a larger pool, tokens of many requests, and top-k rows
  mixing -1 padding, other negatives, in-table positions and positions past the table."""
  pool = rng.permutation(4 * num_requests * max_blocks)
  block_table = pool[: num_requests * max_blocks].reshape(num_requests, max_blocks)
  req_ids = rng.integers(0, num_requests, num_tokens)
  table_tokens = max_blocks * block_size
  topk = rng.integers(0, table_tokens, (num_tokens, topk_size))
  kind = rng.integers(0, 8, topk.shape)
  topk = np.where(kind == 0, -1, topk)
  topk = np.where(kind == 1, -rng.integers(2, 10 * block_size, topk.shape), topk)
  topk = np.where(kind == 2, table_tokens + rng.integers(0, 3 * block_size, topk.shape), topk)
  return (req_ids.astype(np.int32), block_table.astype(np.int32), topk.astype(np.int32))


def assert_matches(inputs, block_size, block_stride, **kwargs):
  physical, counts = convert_topk_to_physical(
    *inputs, block_size=block_size, block_stride=block_stride, **kwargs
  )
  want_physical, want_counts = numpy_reference(
    *inputs, block_size, block_size if block_stride is None else block_stride
  )
  assert physical.dtype == np.int32 and counts.dtype == np.int32
  np.testing.assert_array_equal(np.asarray(physical), want_physical)
  np.testing.assert_array_equal(np.asarray(counts), want_counts)
  # The inputs must exercise every branch, or the comparison proves little.
  topk = inputs[2]
  assert (want_physical == -1).any() and (want_physical >= 0).any()
  assert (topk < -1).any() and (topk // block_size >= inputs[1].shape[1]).any()


@pytest.mark.parametrize(
  ("block_size", "block_stride", "max_blocks"),
  [(64, None, 8), (16, 40, 12), (4, 4, 7), (3, 5, 6)],
)
def test_xla_matches_numpy(block_size, block_stride, max_blocks):
  rng = np.random.default_rng(block_size * 100 + max_blocks)
  inputs = make_inputs(rng, 37, 300, 9, max_blocks, block_size)
  assert_matches(inputs, block_size, block_stride, impl="xla")


# max_blocks 12 is staged in shared memory; 6 is not a multiple of 4 and is read in place.
@pytest.mark.parametrize(
  ("block_size", "block_stride", "max_blocks", "stage"),
  [(64, None, 12, True), (16, 40, 6, True), (4, 6, 8, False)],
)
def test_kernel_interpret_matches_numpy(block_size, block_stride, max_blocks, stage):
  rng = np.random.default_rng(block_size * 100 + max_blocks)
  inputs = make_inputs(rng, 5, 512, 3, max_blocks, block_size)
  config = mosaic_gpu.TuningConfig(stage_table_in_smem=stage)
  assert_matches(inputs, block_size, block_stride, impl="pallas", interpret=True, config=config)


def test_kernel_interpret_narrow_vectors_and_clamped_requests():
  rng = np.random.default_rng(7)
  req_ids, block_table, topk = make_inputs(rng, 4, 256, 3, 8, 8)
  req_ids[0], req_ids[1] = -2, 5  # outside [0, R): clamped, like an XLA gather
  config = mosaic_gpu.TuningConfig(vector_size=2)
  assert_matches(
    (req_ids, block_table, topk), 8, None, impl="pallas", interpret=True, config=config
  )


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_negative_table_entries_are_trusted_like_vllm(impl):
  # A valid index whose block-table entry is -1 is counted and maps to -stride + offset.
  block_table = np.array([[3, -1, 5, 6]], np.int32)
  topk = np.tile(np.array([64 + 5, 64 + 63, 2 * 64 + 1, -1], np.int32), (1, 128))
  physical, counts = convert_topk_to_physical(
    np.zeros(1, np.int32), block_table, topk, block_size=64, impl=impl, interpret=True
  )
  np.testing.assert_array_equal(np.asarray(physical)[0, :4], [-64 + 5, -1, 5 * 64 + 1, -1])
  np.testing.assert_array_equal(np.asarray(counts), [3 * 128])


def test_kernel_rejects_k_off_its_tile_and_auto_falls_back():
  rng = np.random.default_rng(3)
  inputs = make_inputs(rng, 3, 100, 2, 8, 16)
  with pytest.raises(ValueError, match="multiple of 512"):
    convert_topk_to_physical(*inputs, block_size=16, impl="pallas", interpret=True)
  assert_matches(inputs, 16, None, impl="auto")


def test_bad_inputs_raise():
  req_ids, block_table, topk = make_inputs(np.random.default_rng(4), 3, 512, 2, 8, 64)
  with pytest.raises(ValueError, match="req_ids must have shape"):
    convert_topk_to_physical(req_ids[:2], block_table, topk)
  with pytest.raises(ValueError, match="topk must be int32 of rank 2"):
    convert_topk_to_physical(req_ids, block_table, topk[0])
  with pytest.raises(ValueError, match="block_table must be int32"):
    convert_topk_to_physical(req_ids, block_table.astype(np.float32), topk)
  with pytest.raises(ValueError, match="block_size and block_stride must be positive"):
    convert_topk_to_physical(req_ids, block_table, topk, block_size=0)
  with pytest.raises(ValueError, match="vector_size"):
    mosaic_gpu.TuningConfig(vector_size=3)


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 64, 1000])
def test_kernel_on_gpu_matches_numpy(num_tokens, stage):
  rng = np.random.default_rng(num_tokens)
  inputs = make_inputs(rng, num_tokens, 2048, 97, 260, 64)
  config = mosaic_gpu.TuningConfig(stage_table_in_smem=stage)
  physical, counts = convert_topk_to_physical(
    *inputs, block_size=64, block_stride=80, impl="pallas", config=config
  )
  want_physical, want_counts = numpy_reference_fast(*inputs, 64, 80)
  np.testing.assert_array_equal(np.asarray(physical), want_physical)
  np.testing.assert_array_equal(np.asarray(counts), want_counts)
  assert jax.devices()[0].platform == "gpu"


def numpy_reference_fast(req_ids, block_table, topk, block_size, block_stride):
  """Vectorised int64 NumPy version of `numpy_reference` for the large GPU cases."""
  num_requests, max_blocks = block_table.shape
  topk = topk.astype(np.int64)
  block, offset = topk // block_size, topk % block_size
  valid = (topk >= 0) & (block < max_blocks)
  rows = np.clip(req_ids, 0, num_requests - 1)[:, None]
  entry = block_table.astype(np.int64)[rows, np.where(valid, block, 0)]
  return np.where(valid, entry * block_stride + offset, -1), valid.sum(axis=1)


def test_fast_numpy_reference_agrees_with_the_loop():
  inputs = make_inputs(np.random.default_rng(5), 6, 40, 3, 5, 4)
  fast, loop = numpy_reference_fast(*inputs, 4, 7), numpy_reference(*inputs, 4, 7)
  for got, want in zip(fast, loop, strict=True):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("stage", [True, False])
def test_kernel_lowers_for_cuda_on_any_host(stage):
  # Interpret mode stands in for the inline Mosaic GPU lookup; lowering for CUDA
  # (no GPU needed) checks that the real one builds, with its copies and layouts.
  shapes = [((8,), "int32"), ((16, 260), "int32"), ((8, 2048), "int32")]
  args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
  config = mosaic_gpu.TuningConfig(stage_table_in_smem=stage)
  lowered = (
    jax.jit(
      lambda req_ids, block_table, topk: mosaic_gpu.convert_topk_to_physical_mosaic_gpu(
        req_ids, block_table, topk, block_size=64, block_stride=64, config=config
      )
    )
    .trace(*args)
    .lower(lowering_platforms=("cuda",))
  )
  assert "mosaic_gpu" in lowered.as_text()
