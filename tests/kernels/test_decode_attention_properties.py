"""Property-based tests of paged_decode_attention (hypothesis).

* Random valid inputs (shapes, lengths with 0, 1, q_len and page/block boundaries, q_len 1..8,
  G, page size, dtypes, fp8 pages, kernel configs): XLA and the Pallas kernel in GPU interpret
  mode against the float64 oracle and each other.
* Random out-of-contract inputs (lengths past the capacity or negative, page ids out of the pool
  inside a length): the eager call refuses them; under jit both paths follow the op's rule.
* Random invalid host-side arguments: a TypeError / ValueError naming the argument, before any
  device work.

Budgets are small so the CPU suite stays fast (interpret mode compiles and interprets each
example). The ``ci`` profile (default) is derandomized, so CI runs the same examples every time;
``JAXSPEC_HYPOTHESIS_PROFILE=explore`` draws fresh ones, and ``JAXSPEC_HYPOTHESIS_SCALE=N``
multiplies every budget by N.
"""

import dataclasses
import functools
import math
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_attention_inputs import FP8, TOLERANCES, Inputs, check, make_inputs, oracle
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from races import races_found

from jaxspec.kernels import paged_decode_attention
from jaxspec.kernels.decode_attention import api
from jaxspec.kernels.decode_attention.mosaic_gpu import TuningConfig

_COMMON = {
  "deadline": None,
  "database": None,
  "print_blob": True,
  "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
settings.register_profile("ci", derandomize=True, **_COMMON)
settings.register_profile("explore", **_COMMON)
PROFILE = settings.get_profile(os.environ.get("JAXSPEC_HYPOTHESIS_PROFILE", "ci"))
SCALE = float(os.environ.get("JAXSPEC_HYPOTHESIS_SCALE", "1"))


def budget(examples: int) -> settings:
  return settings(PROFILE, max_examples=max(1, round(examples * SCALE)))


BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


@st.composite
def lengths(draw, batch, q_len, page_size, block, limit):
  """``batch`` lengths, half of them on an edge: 0, 1, q_len +- 1, page and block boundaries."""
  edges = sorted(
    {0, 1, q_len - 1, q_len, q_len + 1, page_size - 1, page_size, page_size + 1, block, block + 1}
  )
  edge = st.sampled_from([e for e in edges if 0 <= e <= limit])
  return draw(st.lists(st.one_of(edge, st.integers(0, limit)), min_size=batch, max_size=batch))


@st.composite
def problems(draw, kernel: bool):
  """(inputs, config): random valid inputs; for ``kernel``, shapes the Pallas kernel serves."""
  q_len = draw(st.integers(1, 8))
  fp8 = draw(st.booleans())
  if kernel:
    head_dim = draw(st.sampled_from([64, 128]))
    page_size = draw(st.sampled_from([16, 32, 64]))
    dtype = draw(st.sampled_from([BF16, F16]))
    group = draw(st.sampled_from([1, 2, 3, 4, 8, 12]))
    block_kv = draw(st.sampled_from([64, 128]).filter(lambda b: b % page_size == 0))
    two_warpgroups = not fp8 and q_len * group > 64 and draw(st.booleans())
    balance_waves = draw(st.sampled_from([None, 1, 2]))
    config = TuningConfig(
      block_kv=block_kv,
      num_stages=draw(st.integers(1, 3)),
      num_chunks=draw(st.sampled_from([None, 1, 2, 3])),
      two_warpgroup_tiles=two_warpgroups,
      balance_waves=balance_waves,
      num_sms=1 if balance_waves else None,  # 1 SM: tiny batches still get several chunks
      page_ids_ahead=draw(st.booleans()),
    )
    batch, limit, num_kv_heads = draw(st.integers(1, 3)), 200, 1
  else:
    head_dim = draw(st.sampled_from([16, 32, 64]))
    page_size = draw(st.sampled_from([4, 8, 16]))
    dtype = draw(st.sampled_from([F32, BF16, F16]))
    group = draw(st.integers(1, 12))
    block_kv, config = 64, None
    batch, limit, num_kv_heads = draw(st.integers(1, 4)), 120, draw(st.integers(1, 3))
  seq_lens = draw(lengths(batch, q_len, page_size, block_kv, limit))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  inputs = make_inputs(
    rng, seq_lens, q_len, num_kv_heads, group, head_dim, page_size, dtype, fp8=fp8
  )
  return inputs, config


@budget(20)
@given(problems(kernel=False))
def test_random_valid_inputs_xla_matches_float64(problem):
  inputs, _ = problem
  out = jax.jit(functools.partial(paged_decode_attention, impl="xla"))(
    *inputs.arrays, **inputs.scales
  )
  check(out, inputs)


@budget(8)
@given(problems(kernel=True))
def test_random_valid_inputs_kernel_matches_xla_and_float64(problem):
  inputs, config = problem
  out = paged_decode_attention(
    *inputs.arrays, impl="pallas", interpret=True, config=config, **inputs.scales
  )
  assert not races_found()
  check(out, inputs)
  xla = paged_decode_attention(*inputs.arrays, impl="xla", **inputs.scales)
  tol = TOLERANCES[jnp.dtype(inputs.q.dtype)]
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(xla, np.float32), atol=tol)


@st.composite
def breaches(draw, inputs: Inputs) -> Inputs:
  """The inputs with at least one request out of contract: a length past the capacity or
  negative, or a page id outside the pool inside a request's length."""
  seq_lens = np.asarray(inputs.seq_lens).copy()
  tables = np.asarray(inputs.block_tables).copy()
  batch, max_pages = tables.shape
  num_pages, page_size = inputs.k_pages.shape[1:3]
  capacity = max_pages * page_size
  past_capacity = st.one_of(st.integers(capacity + 1, capacity + 80), st.just(2**31 - 1))
  bad_id = st.one_of(st.integers(-(2**31), -1), st.integers(num_pages, 2**31 - 1))
  for b in draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=batch, unique=True)):
    kind = draw(st.sampled_from(["long", "negative", "page"]))
    if kind == "long":
      seq_lens[b] = draw(past_capacity)
    elif kind == "negative":
      seq_lens[b] = draw(st.integers(-(2**31), -1))
    else:
      seq_lens[b] = max(seq_lens[b], 1)
      live = math.ceil(min(int(seq_lens[b]), capacity) / page_size)
      for i in draw(st.lists(st.integers(0, live - 1), min_size=1, max_size=live, unique=True)):
        tables[b, i] = draw(bad_id)
  return inputs._replace(seq_lens=jnp.asarray(seq_lens), block_tables=jnp.asarray(tables))


@budget(5)
@given(st.data())
def test_random_out_of_contract_inputs_follow_the_rule_on_both_paths(data):
  inputs, config = data.draw(problems(kernel=True))
  inputs = data.draw(breaches(inputs))
  with pytest.raises(ValueError, match="seq_lens|block_tables"):
    paged_decode_attention(*inputs.arrays, impl="xla", **inputs.scales)
  expected = oracle(inputs, 1.0 / math.sqrt(inputs.q.shape[-1]))
  tol = TOLERANCES[jnp.dtype(inputs.q.dtype)]
  for impl in ("xla", "pallas"):
    call = functools.partial(
      paged_decode_attention, impl=impl, interpret=True, config=config if impl == "pallas" else None
    )
    out = jax.jit(call)(*inputs.arrays, **inputs.scales)
    assert not (impl == "pallas" and races_found())
    np.testing.assert_allclose(
      np.asarray(out, np.float64), expected, rtol=tol, atol=tol, err_msg=impl
    )


# ---------------------------------------------------------------------------------------------
# Invalid host-side arguments.

ARRAYS = ("q", "k_pages", "v_pages", "block_tables", "seq_lens")
RANKS = {"q": 4, "k_pages": 4, "v_pages": 4, "block_tables": 2, "seq_lens": 1}
WRONG_INT_DTYPES = [jnp.int8, jnp.int16, jnp.uint32, jnp.float32, jnp.bool_, np.int64]
WRONG_FLOAT_DTYPES = [jnp.int32, jnp.int8, jnp.uint8, jnp.bool_, jnp.complex64, np.float64]


def _array(make, shape, dtype, *fill):
  """``make(shape, *fill, dtype)`` (np.ones, np.zeros, np.full) as a jax.Array, copied to the
  device: ``jnp.ones`` and the like compile a program for each new shape and dtype, and the
  examples draw hundreds of them."""
  return jnp.asarray(make(shape, *fill, dtype=dtype))


@st.composite
def small_valid_arguments(draw):
  """Valid keyword arguments on small shapes (no kernel runs: the call must fail before)."""
  batch, q_len = draw(st.integers(1, 3)), draw(st.integers(1, 8))
  num_kv_heads, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
  page_size, max_pages, num_pages = draw(st.sampled_from([4, 8])), 3, 5
  dtype = draw(st.sampled_from([F32, BF16, F16]))
  fp8 = draw(st.booleans())
  kv_dtype = FP8 if fp8 else dtype
  pages_shape = (num_kv_heads, num_pages, page_size, 16)
  args = {
    "q": _array(np.ones, (batch, q_len, num_kv_heads * group, 16), dtype),
    "k_pages": _array(np.ones, pages_shape, kv_dtype),
    "v_pages": _array(np.ones, pages_shape, kv_dtype),
    "block_tables": _array(np.zeros, (batch, max_pages), jnp.int32),
    "seq_lens": _array(np.full, (batch,), jnp.int32, page_size),
  }
  if fp8 and draw(st.booleans()):
    args["k_scale"] = draw(st.floats(0.01, 10.0))
    args["v_scale"] = jnp.full((num_kv_heads,), 0.5, F32)
  return args


def _not_positive_finite(value):
  return not (math.isfinite(value) and value > 0)


@st.composite
def corruptions(draw, args):
  """(changes, names): one invalid change to ``args`` and the argument names the error may
  name (usually the changed one; for a k/v dtype clash, either page argument)."""
  kind = draw(
    st.sampled_from(
      ["rank", "zero", "mismatch", "dtype", "not_array", "sm_scale", "impl", "interpret", "other"]
    )
  )
  event(f"corrupted: {kind}")
  if kind == "rank":
    name = draw(st.sampled_from(ARRAYS))
    rank = draw(st.integers(0, 5).filter(lambda r: r != RANKS[name]))  # noqa: B023
    shape = draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank))
    return {name: _array(np.zeros, shape, args[name].dtype)}, {name}
  if kind == "zero":
    # Every zero-size dim but q's batch (B = 0 is valid when all batch dims agree).
    name, axis = draw(
      st.sampled_from(
        [("q", 1), ("q", 2), ("q", 3), ("block_tables", 0), ("block_tables", 1), ("seq_lens", 0)]
        + [(pages, axis) for pages in ("k_pages", "v_pages") for axis in range(4)]
      )
    )
    shape = list(args[name].shape)
    shape[axis] = 0
    return {name: _array(np.zeros, shape, args[name].dtype)}, {name}
  if kind == "mismatch":
    q, pages = args["q"], args["k_pages"]
    batch, q_len, num_q_heads, head_dim = q.shape
    choices = [
      ("q", (batch, draw(st.integers(9, 12)), num_q_heads, head_dim)),
      ("k_pages", (*pages.shape[:3], head_dim * 2)),
      ("v_pages", (pages.shape[0], pages.shape[1] + 1, *pages.shape[2:])),
      ("block_tables", (batch + 1, args["block_tables"].shape[1])),
      ("seq_lens", (batch + draw(st.integers(1, 2)),)),
    ]
    if pages.shape[0] > 1:  # Hq not a multiple of Hkv
      choices.append(("q", (batch, q_len, num_q_heads + 1, head_dim)))
    name, shape = draw(st.sampled_from(choices))
    return {name: _array(np.zeros, shape, args[name].dtype)}, {name}
  if kind == "dtype":
    name = draw(st.sampled_from(ARRAYS))
    wrong = WRONG_INT_DTYPES if name in ("block_tables", "seq_lens") else WRONG_FLOAT_DTYPES
    dtype = draw(st.sampled_from(wrong))
    value = np.zeros(args[name].shape, dtype)
    pages = {"k_pages", "v_pages"}
    return {name: value}, (pages if name in pages else {name})
  if kind == "not_array":
    name = draw(st.sampled_from(ARRAYS))
    value = draw(st.sampled_from([None, 1.0, "x", np.asarray(args[name]).tolist()]))
    return {name: value}, {name}
  if kind == "sm_scale":
    value = draw(
      st.one_of(
        st.floats(allow_nan=True, allow_infinity=True).filter(_not_positive_finite),
        st.text(max_size=3),
        st.booleans(),
        st.complex_numbers(),
        st.just(jnp.float32(0.1)),
      )
    )
    return {"sm_scale": value}, {"sm_scale"}
  if kind == "impl":
    value = draw(
      st.one_of(
        st.text(max_size=6).filter(lambda text: text not in ("auto", "pallas", "xla")),
        st.integers(),
        st.booleans(),
      )
    )
    return {"impl": value}, {"impl"}
  if kind == "interpret":
    value = draw(st.one_of(st.integers(0, 1), st.text(max_size=3), st.just(np.bool_(True))))
    return {"interpret": value}, {"interpret"}
  name = draw(st.sampled_from(["config", "k_scale", "v_scale"]))
  if name == "config":
    return {"config": draw(st.sampled_from([{}, "default", 4, (64, 2)]))}, {"config"}
  if args["k_pages"].dtype != FP8:  # any scale with 16/32-bit pages
    return {name: draw(st.sampled_from([1.0, 0.5, jnp.ones((1,), F32)]))}, {name}
  num_kv_heads = args["k_pages"].shape[0]
  value = draw(
    st.one_of(
      st.floats(allow_nan=True, allow_infinity=True).filter(_not_positive_finite),
      st.sampled_from(
        [
          "1",
          True,
          [1.0] * num_kv_heads,
          jnp.ones((num_kv_heads + 1,), F32),
          jnp.ones((num_kv_heads,), BF16),
          jnp.ones((num_kv_heads, 1), F32),
        ]
      ),
    )
  )
  return {name: value}, {name}


def _refuse_device_work(*_, **__):
  raise AssertionError("the call got past the host-side checks")


@budget(100)
@given(st.data())
def test_random_invalid_arguments_raise_naming_the_argument(data):
  args = data.draw(small_valid_arguments())
  changes, names = data.draw(corruptions(args))
  args |= changes
  op = dataclasses.replace(api.OP, reference=_refuse_device_work, kernel=_refuse_device_work)
  with (
    mock.patch.object(api, "_require_device_contract", _refuse_device_work),
    mock.patch.object(api, "OP", op),
    pytest.raises((TypeError, ValueError)) as error,
  ):
    paged_decode_attention(**args)
  message = str(error.value)
  assert any(name in message for name in names), f"{message!r} names none of {names}"
