"""convert_topk_to_physical: the XLA path and the Mosaic GPU kernel against an int64 NumPy oracle.

The kernel runs in GPU interpret mode with race detection on the CPU; a CUDA lowering test builds
every kernel variant without a GPU; `gpu`-marked tests run the same checks natively on an H200.
"""

import functools
from typing import NamedTuple

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxspec import contracts
from jaxspec.jaxpr_utils import count_calls
from jaxspec.kernels import convert_topk_to_physical
from jaxspec.kernels.sparse_index import api, mosaic_gpu

INT32_LIMIT = 2**31
RACE_MESSAGE = "RACE DETECTED"  # what GPU interpret mode prints for a data race


def numpy_oracle(req_ids, block_table, topk, block_size, block_stride):
  """Element by element in Python ints, straight from the contract in `reference.py`."""
  num_requests, max_blocks = block_table.shape
  physical = np.full(topk.shape, -1, np.int64)
  counts = np.zeros(topk.shape[0], np.int64)
  for t, row in enumerate(topk.tolist()):
    request = int(req_ids[t])
    if not 0 <= request < num_requests:
      continue
    for k, index in enumerate(row):
      block, offset = index // block_size, index % block_size
      if index < 0 or block >= max_blocks:
        continue
      entry = int(block_table[request, block])
      if 0 <= entry * block_stride + block_size - 1 < INT32_LIMIT:
        physical[t, k] = entry * block_stride + offset
        counts[t] += 1
  return physical, counts


def _oracle_lookup(req_ids, block_table, topk, block_size):
  """Vectorised in int64: (entry reached per index, whether the index selects a block)."""
  num_requests, max_blocks = block_table.shape
  block = topk.astype(np.int64) // block_size
  request_ok = (req_ids >= 0) & (req_ids < num_requests)
  selects = (topk >= 0) & (block < max_blocks) & request_ok[:, None]
  rows = np.clip(req_ids, 0, num_requests - 1)[:, None]
  return block_table.astype(np.int64)[rows, np.where(selects, block, 0)], selects


def _in_int32(entry, block_size, block_stride):
  last_slot = entry * block_stride + block_size - 1
  return (last_slot >= 0) & (last_slot < INT32_LIMIT)


def numpy_oracle_fast(req_ids, block_table, topk, block_size, block_stride):
  """Vectorised int64 version of `numpy_oracle` for the large GPU cases."""
  entry, selects = _oracle_lookup(req_ids, block_table, topk, block_size)
  valid = selects & _in_int32(entry, block_size, block_stride)
  return np.where(valid, entry * block_stride + topk % block_size, -1), valid.sum(axis=1)


def contract_breaches(req_ids, block_table, topk, block_size, block_stride):
  """(a request id is not a row of the table, an entry reached is out of range)."""
  entry, selects = _oracle_lookup(req_ids, block_table, topk, block_size)
  bad_request = ((req_ids < 0) | (req_ids >= block_table.shape[0])).any()
  return bad_request, (selects & ~_in_int32(entry, block_size, block_stride)).any()


def make_inputs(rng, num_tokens, topk_size, num_requests, max_blocks, block_size):
  """Shuffled block tables over a larger pool, tokens of many requests, and top-k rows mixing
  -1 padding, other negatives, in-table positions and positions past the table."""
  pool = rng.permutation(4 * num_requests * max_blocks)
  block_table = pool[: num_requests * max_blocks].reshape(num_requests, max_blocks)
  req_ids = rng.integers(0, num_requests, num_tokens)
  table_tokens = max_blocks * block_size
  topk = rng.integers(0, table_tokens, (num_tokens, topk_size))
  kind = rng.integers(0, 8, topk.shape)
  topk = np.where(kind == 0, -1, topk)
  topk = np.where(kind == 1, -rng.integers(2, 10 * block_size, topk.shape), topk)
  topk = np.where(kind == 2, table_tokens + rng.integers(0, 3 * block_size, topk.shape), topk)
  return req_ids.astype(np.int32), block_table.astype(np.int32), topk.astype(np.int32)


def convert(inputs, block_size, block_stride, **kwargs):
  physical, counts = convert_topk_to_physical(
    *inputs, block_size=block_size, block_stride=block_stride, **kwargs
  )
  chex.assert_type([physical, counts], jnp.int32)
  chex.assert_shape([physical, counts], [inputs[2].shape, inputs[2].shape[:1]])
  return np.asarray(physical), np.asarray(counts)


def assert_matches_oracle(inputs, block_size, block_stride, **kwargs):
  physical, counts = convert(inputs, block_size, block_stride, **kwargs)
  stride = block_size if block_stride is None else block_stride
  want_physical, want_counts = numpy_oracle(*inputs, block_size, stride)
  np.testing.assert_array_equal(physical, want_physical)
  np.testing.assert_array_equal(counts, want_counts)
  return want_physical


def assert_exercises_every_branch(inputs, want_physical, block_size):
  """Random inputs prove little unless they hit valid slots, -1 padding, other negatives and
  positions past the table."""
  topk, max_blocks = inputs[2], inputs[1].shape[1]
  assert (want_physical == -1).any() and (want_physical >= 0).any()
  assert (topk < -1).any() and (topk // block_size >= max_blocks).any()


def test_oracles_agree():
  rng = np.random.default_rng(5)
  inputs = make_inputs(rng, 6, 40, 3, 5, 4)
  inputs[0][1] = 3  # a request id outside the table
  inputs[1][0, :2] = [-1, 2**28]  # a negative entry, and one whose slots overflow int32
  for block_size, stride in ((4, 7), (4, 2**20)):
    fast, loop = (
      numpy_oracle_fast(*inputs, block_size, stride),
      numpy_oracle(*inputs, block_size, stride),
    )
    for got, want in zip(fast, loop, strict=True):
      np.testing.assert_array_equal(got, want)


class XlaCase(NamedTuple):
  block_size: int
  block_stride: int | None
  max_blocks: int


@pytest.mark.parametrize(
  "case",
  [XlaCase(64, None, 8), XlaCase(16, 40, 12), XlaCase(4, 4, 7), XlaCase(3, 5, 6)],
  ids=lambda c: f"block{c.block_size}-stride{c.block_stride}-table{c.max_blocks}",
)
def test_xla_matches_oracle(case):
  rng = np.random.default_rng(case.block_size * 100 + case.max_blocks)
  inputs = make_inputs(rng, 37, 300, 9, case.max_blocks, case.block_size)
  want = assert_matches_oracle(inputs, case.block_size, case.block_stride, impl="xla")
  assert_exercises_every_branch(inputs, want, case.block_size)


class KernelCase(NamedTuple):
  """One interpret-mode run: shapes, block geometry and a kernel configuration."""

  name: str
  num_tokens: int
  topk_size: int
  max_blocks: int
  block_size: int
  block_stride: int | None
  config: mosaic_gpu.TuningConfig


_PERSISTENT = dict(blocks_per_sm=1, num_sms=2)  # 2 blocks, each looping over several groups
KERNEL_CASES = [
  # K a multiple of the old 512 tile: 4 tokens per group, table in SMEM.
  KernelCase("k512-smem", 5, 512, 12, 64, None, mosaic_gpu.TuningConfig()),
  # max_blocks 6 is not a multiple of 4: the table is read in place even when staging is asked.
  KernelCase("k512-table6", 5, 512, 6, 16, 40, mosaic_gpu.TuningConfig()),
  # K off every tile (2047 = 4 * 512 - 1): groups of 4 tokens in 4 segments, masked tails, a
  # partial last group and N % 4 = 1 entry converted with scalars; persistent and pipelined.
  KernelCase(
    "k2047-persistent-3stages",
    7,
    2047,
    8,
    16,
    24,
    mosaic_gpu.TuningConfig(num_stages=3, **_PERSISTENT),
  ),
  KernelCase(
    "k100-gmem-vec2-chunk256",
    9,
    100,
    8,
    4,
    6,
    mosaic_gpu.TuningConfig(stage_table_in_smem=False, vector_size=2, chunk=256),
  ),
  # K = 3 and 1: 8 tokens per group, N % 4 != 0, several tokens per vector tile.
  KernelCase("k3-smem", 6, 3, 4, 16, None, mosaic_gpu.TuningConfig()),
  KernelCase(
    "k1-persistent-vec1", 11, 1, 8, 8, None, mosaic_gpu.TuningConfig(vector_size=1, **_PERSISTENT)
  ),
  # K a multiple of 4 but of no tile, one token per group, persistent over runs of consecutive
  # groups with GMEM lookups.
  KernelCase(
    "k260-persistent-contiguous-gmem-chunk512",
    7,
    260,
    8,
    8,
    None,
    mosaic_gpu.TuningConfig(
      stage_table_in_smem=False, chunk=512, contiguous_groups=True, **_PERSISTENT
    ),
  ),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c.name)
def test_kernel_interpret_matches_oracle(case, capsys):
  rng = np.random.default_rng(case.num_tokens * 1000 + case.topk_size)
  inputs = make_inputs(rng, case.num_tokens, case.topk_size, 3, case.max_blocks, case.block_size)
  assert_matches_oracle(
    inputs, case.block_size, case.block_stride, impl="pallas", interpret=True, config=case.config
  )
  assert RACE_MESSAGE not in capsys.readouterr().out


def test_work_plan_groups_start_on_16_byte_boundaries():
  config = mosaic_gpu.TuningConfig()
  for topk_size in [1, 2, 3, 5, 100, 127, 511, 2047, 2048, 4099, 65536]:
    for num_tokens in [1, 3, 9]:
      plan = mosaic_gpu.work_plan(num_tokens, topk_size, 8, config)
      assert plan.group_size % mosaic_gpu.BULK_COPY_ALIGN_ELEMENTS == 0
      bulk = [
        plan.segment_length(segment, last_group)
        for last_group in (False, True)
        for segment in range(plan.segments_per_group)
      ]
      assert all(length % mosaic_gpu.BULK_COPY_ALIGN_ELEMENTS == 0 for length in bulk)
      full_groups = plan.num_groups - 1
      moved = full_groups * plan.group_size + sum(bulk[plan.segments_per_group :])
      assert moved + len(plan.array_tail) == num_tokens * topk_size  # every entry, once


def out_of_contract_inputs():
  """A request id outside the table, a negative entry and one whose slots overflow int32 (a
  block-table entry of 40,000,000 with block 64), all reached by valid-looking indices."""
  block_table = np.array([[3, -1, 40_000_000, 6], [7, 8, 9, 10]], np.int32)
  req_ids = np.array([0, 2, 1], np.int32)
  topk = np.tile(np.array([5, 64 + 1, 2 * 64 + 2, 3 * 64 + 3, -1, 4 * 64], np.int32), (3, 1))
  return req_ids, block_table, topk


def test_out_of_contract_entries_are_holes_on_both_paths():
  inputs = out_of_contract_inputs()
  want_physical, want_counts = numpy_oracle(*inputs, 64, 64)
  np.testing.assert_array_equal(want_physical[0], [197, -1, -1, 387, -1, -1])
  np.testing.assert_array_equal(want_counts, [2, 0, 4])  # token 1: request 2 of 2 rows
  for impl in ("xla", "pallas"):
    # Under jit nothing is checked: the breaching entries come out as -1, not counted.
    run = jax.jit(functools.partial(convert_topk_to_physical, impl=impl, interpret=True))
    physical, counts = run(*inputs)
    np.testing.assert_array_equal(np.asarray(physical), want_physical, err_msg=impl)
    np.testing.assert_array_equal(np.asarray(counts), want_counts, err_msg=impl)


def test_out_of_contract_values_raise_eagerly_and_in_checked_mode():
  req_ids, block_table, topk = out_of_contract_inputs()
  in_range_table = np.abs(block_table) % 1000
  checked = contracts.checked_jit(functools.partial(convert_topk_to_physical, impl="xla"))
  for breach, arrays in (
    ("req_ids", (req_ids, in_range_table, topk)),
    ("block_table", (np.zeros_like(req_ids), block_table, topk)),
  ):
    with pytest.raises(ValueError, match=breach):
      convert_topk_to_physical(*arrays, impl="xla")
    with pytest.raises(ValueError, match=breach):
      checked(*arrays)
  # Indices that are negative or past the table are padding, not a breach.
  physical, _ = checked(np.zeros_like(req_ids), in_range_table, topk)
  assert (np.asarray(physical)[:, -2:] == -1).all()


class BadCall(NamedTuple):
  name: str
  kwargs: dict
  error: type
  match: str


def _bad_calls():
  req_ids, block_table, topk = make_inputs(np.random.default_rng(4), 3, 16, 2, 8, 64)
  ok = dict(req_ids=req_ids, block_table=block_table, topk=topk)
  calls = [
    BadCall("int64-topk", dict(topk=topk.astype(np.int64)), TypeError, "topk must be an int32"),
    BadCall("int64-req", dict(req_ids=req_ids.astype(np.int64)), TypeError, "req_ids"),
    BadCall("float-table", dict(block_table=block_table * 1.0), TypeError, "block_table"),
    BadCall("uint32-topk", dict(topk=topk.astype(np.uint32)), TypeError, "topk"),
    BadCall("list-req", dict(req_ids=req_ids.tolist()), TypeError, "req_ids"),
    BadCall("rank-topk", dict(topk=topk[0]), ValueError, r"topk must be .*\[T, K\]"),
    BadCall("rank-table", dict(block_table=block_table[0]), ValueError, "block_table"),
    BadCall("short-req", dict(req_ids=req_ids[:2]), ValueError, "req_ids must have shape"),
    BadCall("no-rows", dict(block_table=block_table[:0]), ValueError, "at least one row"),
    BadCall("size-0", dict(block_size=0), ValueError, "block_size"),
    BadCall("size-float", dict(block_size=64.0), TypeError, "block_size must be an int"),
    BadCall("size-bool", dict(block_size=True), TypeError, "block_size must be an int"),
    BadCall("size-str", dict(block_size="64"), TypeError, "block_size"),
    BadCall("size-huge", dict(block_size=2**31), ValueError, "block_size"),
    BadCall("stride-huge", dict(block_stride=2**70), ValueError, "block_stride"),
    BadCall("stride-float", dict(block_stride=80.5), TypeError, "block_stride"),
    BadCall("stride-overlap", dict(block_stride=32), ValueError, "one slot"),
    BadCall("impl", dict(impl="triton"), ValueError, "impl"),
    BadCall("interpret", dict(interpret=1), ValueError, "interpret"),
    BadCall("config", dict(config={"vector_size": 4}), TypeError, "config"),
  ]
  return ok, calls


_OK_ARGS, BAD_CALLS = _bad_calls()


@pytest.mark.parametrize("call", BAD_CALLS, ids=lambda c: c.name)
def test_bad_host_arguments_raise_before_compiling(call):
  kwargs = {"block_size": 64, **_OK_ARGS, **call.kwargs}
  with pytest.raises(call.error, match=call.match):
    convert_topk_to_physical(**kwargs)


@pytest.mark.parametrize(
  "fields",
  [
    dict(vector_size=3),
    dict(vector_size=True),
    dict(chunk=300),
    dict(chunk=2 * mosaic_gpu.MAX_CHUNK),
    dict(blocks_per_sm=0),
    dict(num_stages=0),
    dict(num_stages=2.0),
    dict(num_sms=-1),
    dict(stage_table_in_smem="yes"),
    dict(contiguous_groups=1),
  ],
  ids=str,
)
def test_bad_tuning_config_raises(fields):
  with pytest.raises(ValueError, match=next(iter(fields))):
    mosaic_gpu.TuningConfig(**fields)


class EmptyCase(NamedTuple):
  name: str
  num_tokens: int
  topk_size: int
  num_requests: int
  max_blocks: int


@pytest.mark.parametrize(
  "case",
  [
    EmptyCase("no-tokens", 0, 8, 2, 4),
    EmptyCase("no-tokens-no-table", 0, 8, 0, 0),
    EmptyCase("k0", 3, 0, 2, 4),
    EmptyCase("no-blocks", 3, 8, 2, 0),
  ],
  ids=lambda c: c.name,
)
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_zero_size_inputs_need_no_launch(case, impl):
  req_ids = np.zeros(case.num_tokens, np.int32) if case.num_requests else np.zeros(0, np.int32)
  block_table = np.zeros((case.num_requests, case.max_blocks), np.int32)
  topk = np.arange(case.num_tokens * case.topk_size, dtype=np.int32).reshape(
    case.num_tokens, case.topk_size
  )
  run = functools.partial(convert_topk_to_physical, block_size=4, impl=impl, interpret=True)
  physical, counts = run(req_ids, block_table, topk)
  np.testing.assert_array_equal(np.asarray(physical), np.full(topk.shape, -1))
  np.testing.assert_array_equal(np.asarray(counts), np.zeros(case.num_tokens))
  jaxpr = jax.make_jaxpr(run)(req_ids, block_table, topk).jaxpr
  assert count_calls(jaxpr, api.OP.backend_names) == 0


def test_auto_runs_the_kernel_for_any_k_in_interpret_mode():
  inputs = make_inputs(np.random.default_rng(3), 3, 7, 2, 8, 16)
  run = functools.partial(convert_topk_to_physical, block_size=16, impl="auto", interpret=True)
  jaxpr = jax.make_jaxpr(run)(*inputs).jaxpr
  assert count_calls(jaxpr, api.OP.backend_names[1]) == 1
  assert_matches_oracle(inputs, 16, None, impl="auto", interpret=True)


# ---- Property-based tests (hypothesis): small example budgets keep the CPU suite fast. ----

_BLOCK_SIZES = st.sampled_from([1, 2, 3, 16, 64])


@st.composite
def valid_inputs(draw, shapes=None, block_size=None, block_stride=None):
  """Random inputs that keep the device-value contract; shapes drawn from `shapes` (a list of
  (T, K, R, max_blocks)) when given, so that interpret-mode kernels compile once per shape."""
  if shapes is None:
    shape = (draw(st.integers(1, 6)), draw(st.integers(1, 40)), draw(st.integers(1, 4)))
    shape += (draw(st.integers(1, 6)),)
  else:
    shape = draw(st.sampled_from(shapes))
  num_tokens, topk_size, num_requests, max_blocks = shape
  block_size = draw(_BLOCK_SIZES) if block_size is None else block_size
  if block_stride is None:
    block_stride = block_size + draw(st.integers(0, 3))
  table = draw(hnp.arrays(np.int32, (num_requests, max_blocks), elements=st.integers(0, 2**16)))
  req_ids = draw(hnp.arrays(np.int32, (num_tokens,), elements=st.integers(0, num_requests - 1)))
  reach = (max_blocks + 2) * block_size
  topk = draw(hnp.arrays(np.int32, (num_tokens, topk_size), elements=st.integers(-3, reach)))
  return (req_ids, table, topk), block_size, block_stride


@settings(max_examples=15, deadline=None)
@given(valid_inputs())
def test_property_xla_matches_oracle(drawn):
  inputs, block_size, block_stride = drawn
  assert_matches_oracle(inputs, block_size, block_stride, impl="xla")


# Few (shape, configuration) pairs and a fixed block geometry: each compiles once in interpret
# mode. Shapes are (T, K, R, max_blocks): K = 5 packs 8 tokens per group with N % 4 != 0; K = 130
# (not a multiple of 4) packs 2 tokens per group into a 512-entry tile with a masked tail, on a
# persistent pipelined grid; K = 512 with T = 2 is one group of 4 with two missing tokens.
_INTERPRET_SHAPES = [(3, 5, 2, 4), (5, 130, 3, 8), (2, 512, 2, 4)]
_INTERPRET_RUNS = [
  ((3, 5, 2, 4), mosaic_gpu.TuningConfig()),
  ((5, 130, 3, 8), mosaic_gpu.TuningConfig(stage_table_in_smem=False, chunk=512, **_PERSISTENT)),
  ((2, 512, 2, 4), mosaic_gpu.TuningConfig(vector_size=2)),
]


@st.composite
def kernel_run(draw):
  shape, config = draw(st.sampled_from(_INTERPRET_RUNS))
  return draw(valid_inputs(shapes=[shape], block_size=16, block_stride=24)), config


@settings(max_examples=15, deadline=None)
@given(kernel_run())
def test_property_kernel_matches_xla_and_oracle(run):
  (inputs, block_size, block_stride), config = run
  want = numpy_oracle(*inputs, block_size, block_stride)
  xla = convert(inputs, block_size, block_stride, impl="xla")
  kernel = convert(inputs, block_size, block_stride, impl="pallas", interpret=True, config=config)
  for got in (xla, kernel):
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


# Under jit nothing is checked; jitted once here so that examples reuse the compiled programs.
_JITTED_16_24 = {
  impl: jax.jit(
    functools.partial(
      convert_topk_to_physical, block_size=16, block_stride=24, impl=impl, interpret=True
    )
  )
  for impl in ("xla", "pallas")
}


@st.composite
def out_of_contract(draw):
  """Valid inputs with breaches planted: request ids outside the table, entries that are
  negative or whose slots overflow int32."""
  (req_ids, table, topk), block_size, block_stride = draw(
    valid_inputs(shapes=_INTERPRET_SHAPES, block_size=16, block_stride=24)
  )
  num_requests = table.shape[0]
  bad_entries = st.sampled_from([-1, -(2**31), 2**31 // 24 - 1, 2**31 // 24, 2**31 - 1])
  table = table.copy()
  for _ in range(draw(st.integers(0, 3))):
    row, column = draw(st.integers(0, num_requests - 1)), draw(st.integers(0, table.shape[1] - 1))
    table[row, column] = draw(bad_entries)
  req_ids = req_ids.copy()
  for _ in range(draw(st.integers(0, 2))):
    req_ids[draw(st.integers(0, len(req_ids) - 1))] = draw(
      st.sampled_from([-1, num_requests, 2**31 - 1])
    )
  return (req_ids, table, topk), block_size, block_stride


@settings(max_examples=15, deadline=None)
@given(out_of_contract())
def test_property_out_of_contract_raises_eagerly_and_agrees_under_jit(drawn):
  inputs, block_size, block_stride = drawn
  want_physical, want_counts = numpy_oracle(*inputs, block_size, block_stride)
  bad_request, bad_entry = contract_breaches(*inputs, block_size, block_stride)
  if bad_request or bad_entry:
    with pytest.raises(ValueError, match="req_ids" if bad_request else "block_table"):
      convert_topk_to_physical(*inputs, block_size=block_size, block_stride=block_stride)
  else:  # the planted values were not reached: an eager call is fine
    assert_matches_oracle(inputs, block_size, block_stride, impl="xla")
  for impl, run in _JITTED_16_24.items():
    physical, counts = run(*inputs)
    np.testing.assert_array_equal(np.asarray(physical), want_physical, err_msg=impl)
    np.testing.assert_array_equal(np.asarray(counts), want_counts, err_msg=impl)


@settings(max_examples=25, deadline=None)
@given(
  st.sampled_from(BAD_CALLS),
  st.sampled_from(["xla", "pallas", "auto"]),
  st.booleans(),
)
def test_property_bad_host_arguments_raise_whatever_the_backend(call, impl, interpret):
  kwargs = {"block_size": 64, "impl": impl, "interpret": interpret, **_OK_ARGS, **call.kwargs}
  with pytest.raises(call.error, match=call.match):
    convert_topk_to_physical(**kwargs)


# ---- CUDA lowering (no GPU needed) and native GPU runs. ----


class LoweringCase(NamedTuple):
  name: str
  num_tokens: int
  topk_size: int
  max_blocks: int
  config: mosaic_gpu.TuningConfig


LOWERING_CASES = [
  LoweringCase("k2048-smem", 8, 2048, 260, mosaic_gpu.TuningConfig()),
  LoweringCase("k2048-gmem", 8, 2048, 260, mosaic_gpu.TuningConfig(stage_table_in_smem=False)),
  LoweringCase(
    "k2048-persistent-3stages",
    600,
    2048,
    1024,
    mosaic_gpu.TuningConfig(blocks_per_sm=4, num_stages=3),
  ),
  LoweringCase(
    "k2047-persistent-vec1",
    9,
    2047,
    12,
    mosaic_gpu.TuningConfig(blocks_per_sm=2, vector_size=1, chunk=1024),
  ),
  LoweringCase("k2047-smem", 7, 2047, 12, mosaic_gpu.TuningConfig()),
  LoweringCase(
    "k2048-persistent-contiguous-gmem",
    600,
    2048,
    1024,
    mosaic_gpu.TuningConfig(blocks_per_sm=8, contiguous_groups=True, stage_table_in_smem=False),
  ),
  LoweringCase("k100-gmem", 9, 100, 8, mosaic_gpu.TuningConfig(stage_table_in_smem=False)),
  LoweringCase("k3", 3, 3, 5, mosaic_gpu.TuningConfig()),
  LoweringCase("k512-chunk512", 5, 512, 8, mosaic_gpu.TuningConfig(chunk=512, vector_size=2)),
]


@pytest.mark.parametrize("case", LOWERING_CASES, ids=lambda c: c.name)
def test_kernel_lowers_for_cuda_on_any_host(case):
  # Interpret mode stands in for the inline Mosaic GPU lookup; lowering for CUDA (no GPU
  # needed) checks that the real one builds, with its copies, layouts, loops and scalar tail.
  shapes = [(case.num_tokens,), (16, case.max_blocks), (case.num_tokens, case.topk_size)]
  args = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in shapes]
  kernel = functools.partial(
    mosaic_gpu.convert_topk_to_physical_mosaic_gpu,
    block_size=64,
    block_stride=64,
    config=case.config,
  )
  lowered = jax.jit(kernel).trace(*args).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


GPU_CONFIGS = {
  "default": mosaic_gpu.TuningConfig(),
  "gmem": mosaic_gpu.TuningConfig(stage_table_in_smem=False),
  "persistent-4x3": mosaic_gpu.TuningConfig(blocks_per_sm=4, num_stages=3),
  "persistent-8x2-gmem-contiguous": mosaic_gpu.TuningConfig(
    blocks_per_sm=8, num_stages=2, stage_table_in_smem=False, contiguous_groups=True
  ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("config_name", list(GPU_CONFIGS))
@pytest.mark.parametrize("topk_size", [2048, 2047, 512, 128, 100, 3])
@pytest.mark.parametrize("num_tokens", [1, 1000])
def test_kernel_on_gpu_matches_oracle(num_tokens, topk_size, config_name):
  assert jax.devices()[0].platform == "gpu"
  rng = np.random.default_rng(num_tokens + topk_size)
  inputs = make_inputs(rng, num_tokens, topk_size, 97, 260, 64)
  physical, counts = convert(inputs, 64, 80, impl="pallas", config=GPU_CONFIGS[config_name])
  want_physical, want_counts = numpy_oracle_fast(*inputs, 64, 80)
  np.testing.assert_array_equal(physical, want_physical)
  np.testing.assert_array_equal(counts, want_counts)


@pytest.mark.gpu
@pytest.mark.parametrize("config_name", list(GPU_CONFIGS))
def test_out_of_contract_entries_are_holes_on_gpu(config_name):
  inputs = out_of_contract_inputs()
  run = jax.jit(
    functools.partial(convert_topk_to_physical, impl="pallas", config=GPU_CONFIGS[config_name])
  )
  physical, counts = run(*inputs)
  want_physical, want_counts = numpy_oracle(*inputs, 64, 64)
  np.testing.assert_array_equal(np.asarray(physical), want_physical)
  np.testing.assert_array_equal(np.asarray(counts), want_counts)
