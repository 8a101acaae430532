"""routed_experts: XLA path and Mosaic GPU kernels against a float64 NumPy oracle."""

import dataclasses
import fractions
import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from races import races_found

from jaxspec.contracts import checked_jit
from jaxspec.kernels import routed_experts
from jaxspec.kernels.routed_experts import mosaic_gpu
from jaxspec.kernels.routed_experts.mosaic_gpu import TuningConfig

# bf16 keeps 8 significant bits. The oracle reads the same rounded inputs and rounds the
# activation and each route's down projection to bf16 like every path, so the error is the
# output's rounding (2^-9 relative), the accumulation order, and, rarely, an activation or a
# route's output rounded the other way: 2^-8 of the output scale bounds them.
RTOL = 2.0**-8


def make_inputs(rng, num_tokens, top_k, num_experts, hidden, intermediate, expert_ids=None):
  """bf16 tokens and weights scaled to keep every stage O(1); distinct experts per token unless
  ``expert_ids`` is given; routing weights in (0, 1)."""
  if expert_ids is None:
    expert_ids = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(num_tokens)])
  x = rng.standard_normal((num_tokens, hidden))
  w_gate = rng.standard_normal((num_experts, hidden, intermediate)) / np.sqrt(hidden)
  w_up = rng.standard_normal((num_experts, hidden, intermediate)) / np.sqrt(hidden)
  w_down = rng.standard_normal((num_experts, intermediate, hidden)) / np.sqrt(intermediate)
  weights = rng.uniform(0.05, 1.0, (num_tokens, top_k))
  return (
    jnp.asarray(x, jnp.bfloat16),
    jnp.asarray(expert_ids, jnp.int32),
    jnp.asarray(weights, jnp.float32),
    jnp.asarray(w_gate, jnp.bfloat16),
    jnp.asarray(w_up, jnp.bfloat16),
    jnp.asarray(w_down, jnp.bfloat16),
  )


def numpy_oracle(x, expert_ids, weights, w_gate, w_up, w_down):
  """float64, route by route; the activation and each route's down projection rounded to the
  weights' dtype; ids outside [0, E) contribute nothing."""
  dtype = np.asarray(w_gate).dtype
  x = np.asarray(x).astype(dtype).astype(np.float64)
  w_gate, w_up, w_down = (np.asarray(w, np.float64) for w in (w_gate, w_up, w_down))
  expert_ids, weights = np.asarray(expert_ids), np.asarray(weights, np.float64)
  out = np.zeros(x.shape)
  for t, j in np.ndindex(*expert_ids.shape):
    e = expert_ids[t, j]
    if not 0 <= e < w_gate.shape[0]:
      continue
    g, u = x[t] @ w_gate[e], x[t] @ w_up[e]
    act = (g / (1.0 + np.exp(-g)) * u).astype(dtype).astype(np.float64)
    out[t] += weights[t, j] * (act @ w_down[e]).astype(dtype).astype(np.float64)
  return out


def assert_close(out, want):
  out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
  assert out.shape == want.shape
  assert np.isfinite(out).all()
  np.testing.assert_allclose(out, want, rtol=RTOL, atol=RTOL * np.abs(want).max())


def _skewed_ids(rng, num_tokens, top_k, num_experts):
  """Expert 0 gets more routes than one 64-row tile holds, the last expert none."""
  first = np.zeros((num_tokens, 1), np.int64)
  rest = [1 + rng.permutation(num_experts - 2)[: top_k - 1] for _ in range(num_tokens)]
  return np.concatenate([first, np.stack(rest)], axis=1)


# name: (T, k, E, H, I, expert_ids maker or None, config). H and I stay small: interpret mode
# runs each work item's pipeline step by step.
SMALL = TuningConfig(block_n_gate_up=64, block_n_down=64, num_sms=4)
SMALL_SPLIT_M = TuningConfig(
  warpgroups=2,
  warpgroup_split="m",
  block_m=128,
  block_n_gate_up=64,
  block_n_down=64,
  num_stages=2,
  num_sms=2,
)
CASES = {
  "one_token_k8_e8": (1, 8, 8, 128, 128, None, SMALL),
  "all_to_one_expert_k1": (70, 1, 8, 64, 64, lambda rng, t, k, e: np.full((t, k), 3), SMALL),
  "sparse_e128_k8": (6, 8, 128, 64, 64, None, SMALL),
  "sparse_e160_k8": (3, 8, 160, 64, 64, None, dataclasses.replace(SMALL, num_sms=3)),
  "skewed_multi_tile": (70, 2, 8, 64, 64, _skewed_ids, SMALL),
  "block_m128_block_k128": (
    75,
    2,
    8,
    128,
    128,
    _skewed_ids,
    TuningConfig(block_m=128, block_n_gate_up=64, block_n_down=128, block_k=128, num_sms=2),
  ),
  # A producer warpgroup and two consumer warpgroups, splitting N blocks or M tiles.
  "two_warpgroups_split_n": (
    30,
    2,
    8,
    128,
    128,
    _skewed_ids,
    TuningConfig(warpgroups=2, block_n_gate_up=128, block_n_down=128, num_sms=3),
  ),
  "two_warpgroups_split_m": (75, 2, 8, 64, 128, _skewed_ids, SMALL_SPLIT_M),
  # Each warpgroup's output tile staged in 64-column pieces: two for gate/up, four for down.
  "two_warpgroups_epilogue_pieces": (
    75,
    2,
    8,
    256,
    128,
    _skewed_ids,
    dataclasses.replace(SMALL_SPLIT_M, block_n_gate_up=128, block_n_down=256, epilogue_n=64),
  ),
  # Tiles of 24 rows (not a power of two) as the wgmma N dimension, the weight columns split
  # over two consumer warpgroups; the skewed expert fills several tiles. Then 40-row tiles with
  # each warpgroup's output staged in 64-column pieces.
  "transposed_tiles_24_rows": (
    75,
    2,
    8,
    128,
    128,
    _skewed_ids,
    TuningConfig(
      block_m=24,
      block_n_gate_up=128,
      block_n_down=128,
      num_stages=2,
      warpgroups=2,
      transposed_tiles=True,
      num_sms=2,
    ),
  ),
  "transposed_tiles_epilogue_pieces": (
    75,
    2,
    8,
    256,
    128,
    _skewed_ids,
    TuningConfig(
      block_m=40,
      block_n_gate_up=128,
      block_n_down=256,
      num_stages=2,
      warpgroups=2,
      transposed_tiles=True,
      epilogue_n=64,
      num_sms=3,
    ),
  ),
  # The buffer's 208 rows in four parts of 56 (1, 3, 3 and 1 tiles; the first tile's 64 rows
  # reach into the second part's) and the down kernel and the combine over four 64-column
  # ranges of H.
  "memory_parts_4": (75, 2, 8, 256, 128, _skewed_ids, dataclasses.replace(SMALL, memory_parts=4)),
  # 66 routes to expert 3 (every twelfth token's route dropped) in a buffer of 128 rows cut into
  # four parts of 32: its tiles start in the first and the third part, the others run none.
  "memory_parts_4_empty_parts": (
    72,
    1,
    8,
    256,
    64,
    lambda rng, t, k, e: np.where(np.arange(t)[:, None] % 12 == 11, e, 3),
    dataclasses.replace(SMALL, memory_parts=4),
  ),
  "two_warpgroups_memory_parts_2": (
    75,
    2,
    8,
    256,
    128,
    _skewed_ids,
    dataclasses.replace(SMALL_SPLIT_M, memory_parts=2),
  ),
}


def case_inputs(name):
  num_tokens, top_k, num_experts, hidden, intermediate, make_ids, config = CASES[name]
  rng = np.random.default_rng(zlib.crc32(name.encode()))
  ids = None if make_ids is None else make_ids(rng, num_tokens, top_k, num_experts)
  return make_inputs(rng, num_tokens, top_k, num_experts, hidden, intermediate, ids), config


# The cases with the tile table in parts: checked against float64 by the memory-parts test, whose
# run in parts is this test's run.
MEMORY_PARTS_CASES = [
  "memory_parts_4",
  "memory_parts_4_empty_parts",
  "two_warpgroups_memory_parts_2",
]


@pytest.mark.parametrize("name", [name for name in CASES if name not in MEMORY_PARTS_CASES])
def test_kernel_interpret_matches_float64_with_nan_padding(name):
  # Every buffer row that belongs to no route (span padding, the tail the last tiles read) is NaN,
  # and interpret mode fills the rows the kernels never write with NaN: none may reach the output.
  args, config = case_inputs(name)
  out = mosaic_gpu.routed_experts_mosaic_gpu(
    *args, config=config, interpret=True, padding_value=float("nan")
  )
  assert_close(out, numpy_oracle(*args))
  assert not races_found()


@pytest.mark.parametrize("name", MEMORY_PARTS_CASES)
def test_memory_parts_match_float64_and_the_one_pass_result_bit_for_bit(name):
  # The run in parts is checked as every case above is (NaN padding, the float64 oracle). Each
  # tile multiplies the same rows and weights in the same order, and each output column is the
  # same sum, whether the kernels run once or in parts.
  args, config = case_inputs(name)
  in_parts, one_pass = (
    mosaic_gpu.routed_experts_mosaic_gpu(
      *args,
      config=dataclasses.replace(config, memory_parts=parts),
      interpret=True,
      padding_value=float("nan"),
    )
    for parts in (config.memory_parts, 1)
  )
  assert_close(in_parts, numpy_oracle(*args))
  np.testing.assert_array_equal(np.asarray(in_parts, np.float32), np.asarray(one_pass, np.float32))
  assert not races_found()


@pytest.mark.parametrize("name", ["one_token_k8_e8", "sparse_e160_k8", "skewed_multi_tile"])
def test_xla_matches_float64(name):
  args, _ = case_inputs(name)
  out = routed_experts(*args, impl="xla")
  assert out.dtype == jnp.bfloat16
  assert_close(out, numpy_oracle(*args))


def test_api_runs_the_kernel_on_float32_tokens_like_xla():
  # x is cast to the weights' dtype on every path; the result keeps x's dtype.
  args, config = case_inputs("all_to_one_expert_k1")
  x = args[0].astype(jnp.float32)
  kernel = routed_experts(x, *args[1:], impl="pallas", interpret=True, config=config)
  xla = routed_experts(x, *args[1:], impl="xla")
  assert kernel.dtype == xla.dtype == jnp.float32
  want = numpy_oracle(x, *args[1:])
  assert_close(kernel, want)
  assert_close(xla, want)


def _out_of_range_inputs():
  rng = np.random.default_rng(11)
  ids = np.array([[0, 8], [-1, 3], [5, 100], [-7, 9], [2, 2]])
  return make_inputs(rng, 5, 2, 8, 64, 64, ids)


def test_out_of_range_ids_raise_on_concrete_arrays():
  args = _out_of_range_inputs()
  for impl in ("xla", "pallas"):
    with pytest.raises(ValueError, match=r"expert_ids must lie in \[0, E=8\)"):
      routed_experts(*args, impl=impl, interpret=True, config=SMALL)


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
def test_out_of_range_ids_under_jit_contribute_nothing_on_every_path(interpret):
  args = _out_of_range_inputs()
  config = SMALL if interpret else dataclasses.replace(SMALL, num_sms=None)
  outs = {
    impl: jax.jit(
      lambda *a, impl=impl: routed_experts(*a, impl=impl, interpret=interpret, config=config)
    )(*args)
    for impl in ("xla", "pallas")
  }
  want = numpy_oracle(*args)
  assert np.all(want[3] == 0)  # token 3 has no valid route
  for out in outs.values():
    assert_close(out, want)
  if interpret:  # the interpreter runs the kernels' float32 arithmetic as XLA does: bit-equal
    np.testing.assert_array_equal(np.asarray(outs["xla"]), np.asarray(outs["pallas"]))


def test_checked_mode_reports_out_of_range_ids():
  args = _out_of_range_inputs()
  checked = checked_jit(lambda *a: routed_experts(*a, impl="xla"))
  with pytest.raises(ValueError, match="expert_ids must lie in"):
    checked(*args)


def test_bad_inputs_raise_before_compiling():
  x, ids, weights, w_gate, w_up, w_down = make_inputs(np.random.default_rng(2), 3, 2, 8, 64, 128)
  cases = [
    ((x[0], ids, weights, w_gate, w_up, w_down), "x must be"),
    ((x, ids[:2], weights, w_gate, w_up, w_down), "expert_ids must be"),
    ((x, ids.astype(jnp.int16), weights, w_gate, w_up, w_down), "expert_ids must be int32"),
    ((x, ids, weights[:, :1], w_gate, w_up, w_down), "weights must be"),
    ((x, ids, weights.astype(jnp.bfloat16), w_gate, w_up, w_down), "weights must be float32"),
    ((x, ids, weights, w_gate[0], w_up, w_down), "w_gate must be"),
    ((x, ids, weights, w_gate, w_up[:, :32], w_down), "w_up must be"),
    ((x, ids, weights, w_gate, w_up, w_gate), "w_down must be"),
    ((x, ids, weights, w_gate, w_up.astype(jnp.float16), w_down), "w_up must have"),
    ((x.astype(jnp.int32), ids, weights, w_gate, w_up, w_down), "x must be bf16"),
  ]
  for args, message in cases:
    with pytest.raises(ValueError, match=message):
      routed_experts(*args)
  with pytest.raises(ValueError, match="impl must be"):
    routed_experts(x, ids, weights, w_gate, w_up, w_down, impl="triton")


def test_tuning_config_is_validated():
  for changes, message in [
    ({"block_m": 96}, "block_m must be 64 or 128"),
    ({"block_n_down": 96}, "block_n_down must be a multiple of 64"),
    ({"num_stages": 1}, "num_stages must be at least 2"),
    ({"num_sms": 0}, "num_sms must be a positive int"),
    ({"warpgroups": 3}, "warpgroups must be 1 or 2"),
    ({"warpgroups": 2, "warpgroup_split": "m"}, "needs block_m=128"),
    ({"warpgroups": 2, "block_n_down": 64}, "block_n_down to be a multiple of 128"),
    ({"epilogue_n": 64}, "epilogue_n needs warpgroups=2"),
    ({"warpgroups": 2, "block_n_gate_up": 128, "epilogue_n": 0}, "epilogue_n must be a positive"),
    ({"warpgroups": 2, "block_n_gate_up": 128, "epilogue_n": -64}, "epilogue_n must be a positive"),
    # split "n": each warpgroup has 64 of the 128 columns, which 128 does not divide
    ({"warpgroups": 2, "block_n_gate_up": 128, "epilogue_n": 128}, "dividing each warpgroup's 64"),
    ({"warpgroups": 2, "block_n_down": 256, "epilogue_n": 96}, "epilogue_n must be a multiple"),
    ({"memory_parts": 0}, "memory_parts must be a positive int"),
    ({"transposed_tiles": True}, "transposed_tiles needs warpgroups=2"),
    (
      {"transposed_tiles": True, "warpgroups": 2, "warpgroup_split": "m", "block_m": 128},
      "warpgroup_split='n'",
    ),
    (
      {"transposed_tiles": True, "warpgroups": 2, "block_n_down": 256, "block_m": 100},
      "block_m must be a multiple of 8 up to 256",
    ),
    (
      {"transposed_tiles": True, "warpgroups": 2, "block_n_down": 256, "block_m": 264},
      "block_m must be a multiple of 8 up to 256",
    ),
    ({"gather_in_kernel": True}, "gather_in_kernel needs warpgroups=2"),
    (
      {"gather_in_kernel": True, "warpgroups": 2, "block_n_down": 256, "block_k": 128},
      "gather_in_kernel needs block_k=64",
    ),
    ({"gather_rows_signal": "early"}, "gather_rows_signal must be 'late' or 'copies'"),
  ]:
    with pytest.raises(ValueError, match=message):
      TuningConfig(**changes)


def operand_shapes(num_tokens, num_experts, hidden, intermediate):
  """The op's operands at top-8 as shapes and dtypes (bf16), for ``unsupported_reason``: no
  memory needed at GLM shapes."""
  shapes = [
    ((num_tokens, hidden), jnp.bfloat16),
    ((num_tokens, 8), jnp.int32),
    ((num_tokens, 8), jnp.float32),
    ((num_experts, hidden, intermediate), jnp.bfloat16),
    ((num_experts, hidden, intermediate), jnp.bfloat16),
    ((num_experts, intermediate, hidden), jnp.bfloat16),
  ]
  return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]


@pytest.mark.parametrize(
  ("num_tokens", "num_experts", "hidden", "intermediate", "two_warpgroup_tiles"),
  [
    (384, 128, 4096, 1408, False),  # 24 routes per expert: decode/verify tiles
    (895, 128, 4096, 1408, False),  # just under 56 routes per expert
    (896, 128, 4096, 1408, True),
    (1119, 160, 5120, 1536, False),  # GLM-4.5, just under 56 routes per expert
    (1120, 160, 5120, 1536, True),
    (8192, 8, 256, 192, False),  # I = 192 is no multiple of the 128-wide N block
    (8192, 8, 384, 256, True),  # H = 384 is no multiple of 256: down N blocks of 128
  ],
)
def test_default_config_takes_128_row_tiles_from_56_routes_per_expert(
  num_tokens, num_experts, hidden, intermediate, two_warpgroup_tiles
):
  config = mosaic_gpu.default_config(num_tokens, 8, num_experts, hidden, intermediate)
  assert (config.block_m, config.warpgroups) == ((128, 2) if two_warpgroup_tiles else (64, 1))
  if two_warpgroup_tiles:
    assert config.warpgroup_split == "m"
    assert config.block_n_down == (256 if hidden % 256 == 0 else 128)
  args = operand_shapes(num_tokens, num_experts, hidden, intermediate)
  assert mosaic_gpu.unsupported_reason(*args, config=config) is None


@pytest.mark.parametrize(
  ("num_tokens", "num_experts", "hidden", "intermediate", "tile_rows"),
  [
    (1024, 128, 4096, 1408, 128),  # 64 routes per expert: one 128-row tile each
    (2048, 128, 4096, 1408, 144),  # 128 +- 11 routes: one tile of 144 for nearly every expert
    (8192, 128, 4096, 1408, 136),  # 512 +- 22: four tiles of 136
    (2048, 160, 5120, 1536, 128),  # GLM-4.5, 102 +- 10
    (8192, 160, 5120, 1536, 144),  # GLM-4.5, 410 +- 20: three tiles of 144
    (8192, 8, 384, 256, 128),  # every expert takes every token: 64 full tiles each
    (2048, 16, 384, 256, 176),  # 1024 +- 23 routes: six tiles of 176; down N blocks of 128
  ],
)
def test_default_config_sizes_prefill_tiles_to_the_expected_routes(
  num_tokens, num_experts, hidden, intermediate, tile_rows
):
  config = mosaic_gpu.default_config(num_tokens, 8, num_experts, hidden, intermediate)
  assert config.block_m == tile_rows
  assert config.transposed_tiles == (tile_rows != 128)
  assert config.warpgroup_split == ("m" if tile_rows == 128 else "n")
  shapes = [
    jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    for shape in [
      (num_tokens, hidden),
      (num_experts, hidden, intermediate),
      (num_experts, hidden, intermediate),
      (num_experts, intermediate, hidden),
    ]
  ]
  x, w_gate, w_up, w_down = shapes
  ids = jax.ShapeDtypeStruct((num_tokens, 8), jnp.int32)
  weights = jax.ShapeDtypeStruct((num_tokens, 8), jnp.float32)
  assert mosaic_gpu.unsupported_reason(x, ids, weights, w_gate, w_up, w_down, config=config) is None
  # No other multiple of 8 from 128 to the register budget pads fewer rows.
  chosen = mosaic_gpu.expected_tile_rows(num_tokens, 8, num_experts, tile_rows)
  for rows in range(128, mosaic_gpu.MAX_TRANSPOSED_ROWS + 1, 8):
    assert chosen <= mosaic_gpu.expected_tile_rows(num_tokens, 8, num_experts, rows)


@pytest.mark.parametrize(
  ("hidden", "intermediate", "want"),
  [
    (4096, 1408, mosaic_gpu.PREFILL_CONFIG),
    (384, 256, mosaic_gpu.PREFILL_CONFIG_N128),  # H no multiple of 256: down N blocks of 128
    (256, 192, None),  # I no multiple of the 128-wide gate/up N block
  ],
)
def test_prefill_config_takes_n_blocks_that_divide_the_shapes(hidden, intermediate, want):
  assert mosaic_gpu.prefill_config(hidden, intermediate) == want


@pytest.mark.parametrize("rows", [64, 88, 184])
@pytest.mark.parametrize(("hidden", "intermediate"), [(4096, 1408), (384, 256)])
def test_with_transposed_tiles_keeps_the_n_blocks_and_serves_the_shapes(hidden, intermediate, rows):
  base = mosaic_gpu.prefill_config(hidden, intermediate)
  config = mosaic_gpu.with_transposed_tiles(base, rows)
  assert (config.block_m, config.transposed_tiles, config.warpgroup_split) == (rows, True, "n")
  assert (config.block_n_gate_up, config.block_n_down, config.block_k, config.memory_parts) == (
    base.block_n_gate_up,
    base.block_n_down,
    base.block_k,
    base.memory_parts,
  )
  shapes = [
    ((1024, hidden), jnp.bfloat16),
    ((1024, 8), jnp.int32),
    ((1024, 8), jnp.float32),
    ((128, hidden, intermediate), jnp.bfloat16),
    ((128, hidden, intermediate), jnp.bfloat16),
    ((128, intermediate, hidden), jnp.bfloat16),
  ]
  args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
  assert mosaic_gpu.unsupported_reason(*args, config=config) is None


@pytest.mark.parametrize(
  ("num_tokens", "top_k", "num_experts", "block_m"),
  [(50, 8, 128, 8), (300, 8, 128, 24), (2048, 8, 128, 144), (2048, 8, 160, 128), (7, 2, 2, 8)],
)
def test_expected_tile_rows_is_the_binomial_expectation(num_tokens, top_k, num_experts, block_m):
  # The exact sum over every count, in integers and fractions, against the truncated float sum.
  p = fractions.Fraction(top_k, num_experts)
  want = sum(
    math.comb(num_tokens, c) * p**c * (1 - p) ** (num_tokens - c) * (-(-c // block_m) * block_m)
    for c in range(num_tokens + 1)
  )
  got = mosaic_gpu.expected_tile_rows(num_tokens, top_k, num_experts, block_m)
  assert got == pytest.approx(float(want), rel=1e-9)


@pytest.mark.parametrize(
  ("num_tokens", "num_experts", "hidden", "intermediate", "parts"),
  [
    (2048, 128, 4096, 1408, 1),  # 16384 routes: one part
    (2049, 128, 4096, 1408, 2),
    (8192, 128, 4096, 1408, 4),  # GLM-4.5-Air: 4 parts of 16384 routes
    (8192, 160, 5120, 1536, 4),  # GLM-4.5: 20 down blocks of 256 in 4 ranges
    (6144, 160, 5120, 1536, 4),  # 3 parts would not divide the 20 down blocks
    (8192, 8, 384, 256, 3),  # 3 down blocks of 128: 3 parts, not 4
    (65536, 8, 384, 256, 3),  # never more parts than down blocks
  ],
)
def test_default_config_bounds_routes_per_memory_part(
  num_tokens, num_experts, hidden, intermediate, parts
):
  config = mosaic_gpu.default_config(num_tokens, 8, num_experts, hidden, intermediate)
  assert config.memory_parts == parts
  assert hidden % (parts * config.block_n_down) == 0


@pytest.mark.parametrize(
  ("num_tokens", "num_experts", "hidden", "intermediate", "gathers"),
  [
    (384, 128, 4096, 1408, False),  # decode tiles: one warpgroup
    (896, 128, 4096, 1408, True),  # the first prefill size, 128-row tiles
    (2048, 128, 4096, 1408, True),  # transposed tiles of 144 rows
    (2048, 160, 5120, 1536, True),
    (2049, 128, 4096, 1408, False),  # two memory parts: x no longer copied in the kernel
    (8192, 160, 5120, 1536, False),
    (2048, 8, 384, 256, True),  # PREFILL_CONFIG_N128: a 4-deep ring, still within shared memory
  ],
)
def test_default_config_gathers_in_the_kernel_up_to_one_memory_part(
  num_tokens, num_experts, hidden, intermediate, gathers
):
  config = mosaic_gpu.default_config(num_tokens, 8, num_experts, hidden, intermediate)
  assert config.gather_in_kernel == gathers
  assert gathers == (config.warpgroups == 2 and config.memory_parts == 1)
  args = operand_shapes(num_tokens, num_experts, hidden, intermediate)
  assert mosaic_gpu.unsupported_reason(*args, config=config) is None


def test_kernel_refuses_what_it_cannot_serve_and_auto_falls_back():
  x, ids, weights, w_gate, w_up, w_down = make_inputs(np.random.default_rng(3), 2, 2, 8, 64, 96)
  # I = 96 is no multiple of the 64-wide blocks.
  with pytest.raises(ValueError, match="impl='pallas' cannot serve"):
    routed_experts(x, ids, weights, w_gate, w_up, w_down, impl="pallas", interpret=True)
  out = routed_experts(x, ids, weights, w_gate, w_up, w_down, impl="auto", interpret=True)
  assert_close(out, numpy_oracle(x, ids, weights, w_gate, w_up, w_down))
  f32 = [w.astype(jnp.float32) for w in (w_gate, w_up, w_down)]
  with pytest.raises(ValueError, match="bf16 or fp16 expert weights"):
    routed_experts(x, ids, weights, *f32, impl="pallas", interpret=True)
  args = make_inputs(np.random.default_rng(4), 2, 2, 8, 128, 128)
  too_big = TuningConfig(block_m=128, block_n_gate_up=128)  # 2 x 128 x 128 accumulators
  with pytest.raises(ValueError, match="accumulators"):
    routed_experts(*args, impl="pallas", interpret=True, config=too_big)
  # 3 stages of a 64 x 128 token block and two 128 x 128 weight blocks (bf16): a 240 KiB ring,
  # 256 KiB with the output tile.
  in_parts = TuningConfig(memory_parts=4)  # 4 column ranges of the 128 columns of H
  with pytest.raises(ValueError, match="multiple of memory_parts \\* block_n_down = 4 \\* 128"):
    routed_experts(*args, impl="pallas", interpret=True, config=in_parts)
  too_deep = TuningConfig(block_k=128, num_stages=3)
  with pytest.raises(ValueError, match="bytes of shared memory, more than 232448"):
    routed_experts(*args, impl="pallas", interpret=True, config=too_deep)


@pytest.mark.parametrize("planner", ["compare", "count"])
def test_route_plan_covers_every_route_once(planner, monkeypatch):
  rng = np.random.default_rng(5)
  num_experts, block_m = 16, 64
  ids = _skewed_ids(rng, 90, 3, num_experts)
  ids[4, 1] = -1  # dropped
  ids[7, 2] = num_experts  # dropped
  threshold = ids.size if planner == "compare" else ids.size - 1
  monkeypatch.setattr(mosaic_gpu, "COMPARE_PLAN_MAX_ROUTES", threshold)
  monkeypatch.setattr(mosaic_gpu, "COUNT_BLOCK_ROUTES", 32)  # 9 blocks, the last partial
  rows = mosaic_gpu.route_rows(ids.size, num_experts)
  plan = mosaic_gpu.plan_routes(jnp.asarray(ids, jnp.int32), num_experts, block_m, rows)
  route_of_row, position = np.asarray(plan.route_of_row), np.asarray(plan.position)
  valid = np.asarray(plan.valid)
  assert valid.sum() == ids.size - 2 and not valid[4 * 3 + 1] and not valid[7 * 3 + 2]
  np.testing.assert_array_equal(route_of_row[position[valid]], np.flatnonzero(valid))
  assert (route_of_row >= 0).sum() == valid.sum()
  num_tiles = int(plan.num_tiles[0])
  expert, row_start, tile_rows = np.asarray(plan.table)
  assert num_tiles <= mosaic_gpu.max_tiles(ids.size, num_experts, block_m)
  assert (tile_rows[:num_tiles] > 0).all() and (tile_rows[num_tiles:] == 0).all()
  assert (row_start % 8 == 0).all() and (tile_rows % 8 == 0).all()
  covered = np.full(rows, -1)
  for e, start, count in zip(
    expert[:num_tiles], row_start[:num_tiles], tile_rows[:num_tiles], strict=True
  ):
    assert (covered[start : start + count] == -1).all()  # tiles never overlap
    covered[start : start + count] = e
  routed = route_of_row >= 0
  np.testing.assert_array_equal(covered[routed], ids.reshape(-1)[route_of_row[routed]])
  in_range = (ids >= 0) & (ids < num_experts)
  assert set(expert[:num_tiles]) == set(ids[in_range].reshape(-1))  # empty experts: no tile


def _oracle_positions(ids: np.ndarray, num_experts: int) -> np.ndarray:
  """Each route's buffer row, route by route: its expert's 8-aligned span start plus the number
  of earlier routes of that expert (0 for dropped routes); the plan of a stable sort."""
  flat = ids.reshape(-1)
  valid = (flat >= 0) & (flat < num_experts)
  counts = np.bincount(flat[valid], minlength=num_experts)
  spans = -(-counts // 8) * 8
  span_start = np.concatenate([[0], np.cumsum(spans)[:-1]])
  seen = np.zeros(num_experts, np.int64)
  position = np.zeros(flat.size, np.int64)
  for route, expert in enumerate(flat):
    if 0 <= expert < num_experts:
      position[route] = span_start[expert] + seen[expert]
      seen[expert] += 1
  return position


@pytest.mark.parametrize("count_block", [32, 256])
def test_route_plans_by_comparing_and_by_counting_agree_with_a_stable_sort(
  count_block, monkeypatch
):
  # Random routings with ids out of range on both sides, several expert counts and tile sizes;
  # blocks of 32 routes leave a partial last block at 10, 37 and 300 routes.
  monkeypatch.setattr(mosaic_gpu, "COUNT_BLOCK_ROUTES", count_block)
  rng = np.random.default_rng(11)
  for num_tokens, top_k, num_experts in [
    (1, 8, 128),
    (5, 2, 8),
    (64, 8, 160),
    (37, 1, 16),
    (150, 2, 4),
  ]:
    ids = np.argsort(rng.random((num_tokens, num_experts)), axis=1)[:, :top_k]
    ids[rng.random(ids.shape) < 0.1] = -2
    ids[rng.random(ids.shape) < 0.1] = num_experts + 1
    expected = _oracle_positions(ids, num_experts)
    ids = jnp.asarray(ids, jnp.int32)
    rows = mosaic_gpu.route_rows(ids.size, num_experts)
    for block_m in (64, 128):
      plans = []
      for threshold in (ids.size, ids.size - 1):  # compare, then count
        monkeypatch.setattr(mosaic_gpu, "COMPARE_PLAN_MAX_ROUTES", threshold)
        plans.append(mosaic_gpu.plan_routes(ids, num_experts, block_m, rows))
      for plan in plans:
        np.testing.assert_array_equal(np.asarray(plan.position), expected)
      for field in dataclasses.fields(mosaic_gpu.RoutePlan):
        compared, counted = (np.asarray(getattr(plan, field.name)) for plan in plans)
        np.testing.assert_array_equal(compared, counted, err_msg=field.name)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("padding", [0.0, float("nan")])
def test_gather_rows_moves_rows_bit_for_bit(dtype, padding):
  rng = np.random.default_rng(12)
  num_tokens, top_k, hidden = 6, 3, 64
  x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), dtype)
  route_of_row = rng.integers(-1, num_tokens * top_k, 40).astype(np.int32)
  route_of_row[:3] = [-1, 0, num_tokens * top_k - 1]
  xs = mosaic_gpu._gather_rows(x, jnp.asarray(route_of_row), top_k, padding)
  assert xs.shape == (40, hidden) and xs.dtype == x.dtype
  want = np.asarray(x)[np.maximum(route_of_row, 0) // top_k]
  want[route_of_row < 0] = padding
  np.testing.assert_array_equal(np.asarray(xs).view(np.uint16), want.view(np.uint16))


# Two-warpgroup cases whose gate/up kernel also runs with the rows of x copied in the kernel:
# split by rows, transposed tiles of 24 rows, and the down kernel in column ranges.
GATHER_CASES = [
  "two_warpgroups_split_m",
  "transposed_tiles_24_rows",
  "two_warpgroups_memory_parts_2",
]


def _gathering_matches_float64_and_the_xs_kernel_bit_for_bit(name, padding, interpret, signal):
  # The same rows in the same order reach the same wgmmas: bit for bit the result of the kernel
  # that reads a gathered xs. NaN padding rows come from an extra row of x, zero ones from
  # zero-filled copies (the interpreter takes the same rows).
  args, config = case_inputs(name)
  config = dataclasses.replace(config, gather_rows_signal=signal)
  if not interpret:
    config = dataclasses.replace(config, num_sms=None)
  gathering, from_xs = (
    mosaic_gpu.routed_experts_mosaic_gpu(
      *args,
      config=dataclasses.replace(config, gather_in_kernel=gather),
      interpret=interpret,
      padding_value=padding,
    )
    for gather in (True, False)
  )
  assert_close(gathering, numpy_oracle(*args))
  np.testing.assert_array_equal(np.asarray(gathering, np.float32), np.asarray(from_xs, np.float32))


@pytest.mark.parametrize(
  ("name", "signal"),
  [(name, "late") for name in GATHER_CASES] + [("transposed_tiles_24_rows", "copies")],
)
def test_gather_in_kernel_interpret_matches_float64_and_the_xs_kernel(name, signal):
  _gathering_matches_float64_and_the_xs_kernel_bit_for_bit(
    name, float("nan"), interpret=True, signal=signal
  )
  assert not races_found()


GLM_SHAPES = {"glm45_air": (128, 4096, 1408), "glm45": (160, 5120, 1536)}
TWO_WARPGROUPS_N = TuningConfig(warpgroups=2, block_n_gate_up=128, block_n_down=256)
TWO_WARPGROUPS_M = TuningConfig(
  warpgroups=2, warpgroup_split="m", block_m=128, block_n_gate_up=128, block_n_down=128
)


@pytest.mark.parametrize(
  ("shape", "num_tokens", "config"),
  [
    ("glm45_air", 1, None),
    ("glm45_air", 64, None),
    ("glm45_air", 2048, None),
    ("glm45", 2048, None),
    ("glm45_air", 64, TWO_WARPGROUPS_N),
    ("glm45_air", 2048, TWO_WARPGROUPS_M),
    ("glm45_air", 8192, None),  # in 4 memory parts, transposed tiles of 136 rows
    ("glm45", 8192, None),  # transposed tiles of 144 rows
    (
      "glm45_air",
      8192,
      dataclasses.replace(
        mosaic_gpu.default_config(8192, 8, *GLM_SHAPES["glm45_air"]),
        gather_in_kernel=True,
        gather_rows_signal="copies",
      ),
    ),
  ],
)
def test_kernel_lowers_for_cuda_at_glm_shapes(shape, num_tokens, config):
  # Interpret mode is more permissive than the real lowering: lowering for CUDA (no GPU needed)
  # builds both kernels with their TMA copies, layouts and shared-memory budget.
  top_k = 8
  num_experts, hidden, intermediate = GLM_SHAPES[shape]
  shapes = [
    ((num_tokens, hidden), jnp.bfloat16),
    ((num_tokens, top_k), jnp.int32),
    ((num_tokens, top_k), jnp.float32),
    ((num_experts, hidden, intermediate), jnp.bfloat16),
    ((num_experts, hidden, intermediate), jnp.bfloat16),
    ((num_experts, intermediate, hidden), jnp.bfloat16),
  ]
  args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
  if config is None:
    config = mosaic_gpu.default_config(num_tokens, top_k, num_experts, hidden, intermediate)
  assert mosaic_gpu.unsupported_reason(*args, config=config) is None
  lowered = (
    jax.jit(lambda *a: mosaic_gpu.routed_experts_mosaic_gpu(*a, config=config))
    .trace(*args)
    .lower(lowering_platforms=("cuda",))
  )
  text = lowered.as_text()
  assert text.count("mosaic_gpu") >= 2  # the gate/up and the down kernels
  # The gate/up parts after the first store into the first's array, in place; a gathering
  # gate/up kernel runs once over the whole table.
  gate_up_parts = 1 if config.gather_in_kernel else config.memory_parts
  assert text.count("output_operand_alias<") == gate_up_parts - 1


# On the H200 --------------------------------------------------------------------------------


# The two-warpgroup cases run last (test_two_warpgroup_cases_on_gpu_match_float64): should a
# pipeline hang on the GPU, every other check has reported by then.
ONE_WARPGROUP_CASES = [name for name, case in CASES.items() if case[-1].warpgroups == 1]
TWO_WARPGROUP_CASES = [name for name, case in CASES.items() if case[-1].warpgroups == 2]


def _gpu_matches_float64_with_nan_padding(name):
  args, config = case_inputs(name)
  config = dataclasses.replace(config, num_sms=None)
  out = mosaic_gpu.routed_experts_mosaic_gpu(*args, config=config, padding_value=float("nan"))
  assert_close(out, numpy_oracle(*args))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ONE_WARPGROUP_CASES)
def test_kernel_on_gpu_matches_float64_with_nan_padding(name):
  _gpu_matches_float64_with_nan_padding(name)


def _relative_rms(out, want):
  out, want = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (out, want))
  return np.sqrt(np.mean((out - want) ** 2) / np.mean(want**2))


def _xla_by_token_chunks(x, expert_ids, weights, *experts, chunk=512):
  """The XLA path, ``chunk`` tokens at a time (each token's output depends on its own row
  alone): XLA's grouped matmuls take 17-27 GB of temporaries at 2048 tokens, too much beside the
  other test processes that share the GPU."""
  pieces = [
    routed_experts(
      x[i : i + chunk], expert_ids[i : i + chunk], weights[i : i + chunk], *experts, impl="xla"
    )
    for i in range(0, x.shape[0], chunk)
  ]
  return jnp.concatenate(pieces)


@functools.cache
def glm_weights(shape):
  """Expert weights at a GLM shape, drawn on the device (NumPy would take minutes), kept for
  the module's tests."""
  num_experts, hidden, intermediate = GLM_SHAPES[shape]
  keys = jax.random.split(jax.random.key(zlib.crc32(shape.encode())), 3)
  scales = (hidden**-0.5, hidden**-0.5, intermediate**-0.5)
  shapes = [(num_experts, hidden, intermediate)] * 2 + [(num_experts, intermediate, hidden)]
  return tuple(
    jax.random.normal(key, size, jnp.bfloat16) * jnp.bfloat16(scale)
    for key, size, scale in zip(keys, shapes, scales, strict=True)
  )


def glm_inputs(shape, num_tokens, skewed=False):
  """Fresh tokens, top-8 routing (uniform, or every token to expert 0) and routing weights."""
  num_experts, hidden, _ = GLM_SHAPES[shape]
  rng = np.random.default_rng(num_tokens + 7 * skewed)
  if skewed:
    ids = _skewed_ids(rng, num_tokens, 8, num_experts)
  else:
    ids = np.argsort(rng.random((num_tokens, num_experts)), axis=1)[:, :8]
  x = jax.random.normal(jax.random.key(int(rng.integers(1 << 31))), (num_tokens, hidden))
  weights = rng.uniform(0.05, 1.0, (num_tokens, 8))
  return (
    x.astype(jnp.bfloat16),
    jnp.asarray(ids, jnp.int32),
    jnp.asarray(weights, jnp.float32),
    *glm_weights(shape),
  )


@pytest.mark.gpu
@pytest.mark.parametrize(
  ("shape", "num_tokens", "skewed"),
  [
    ("glm45_air", 1, False),
    ("glm45_air", 16, False),
    ("glm45_air", 64, False),
    ("glm45_air", 384, False),
    ("glm45_air", 896, False),  # 56 routes per expert: the prefill config's first size
    ("glm45_air", 2048, True),
    ("glm45", 1, False),
    ("glm45", 64, False),
    ("glm45", 2048, True),
    ("glm45_air", 8192, False),  # default_config: 4 memory parts
    ("glm45", 8192, False),
  ],
)
def test_kernel_on_gpu_matches_xla_at_glm_shapes(shape, num_tokens, skewed):
  # Skewed: expert 0 takes all 2048 tokens (32 full tiles), the last expert none.
  args = glm_inputs(shape, num_tokens, skewed)
  out = routed_experts(*args, impl="pallas")
  want = _xla_by_token_chunks(*args)
  assert np.isfinite(np.asarray(out, np.float32)).all()
  # Both round the same float32 sums to bf16 (activation and output): rms of 2^-8 is generous.
  assert _relative_rms(out, want) < RTOL


@pytest.mark.gpu
def test_memory_parts_on_gpu_give_the_one_pass_result_bit_for_bit():
  args = glm_inputs("glm45_air", 8192)
  config = mosaic_gpu.default_config(8192, 8, *GLM_SHAPES["glm45_air"])
  assert config.memory_parts == 4
  in_parts = routed_experts(*args, impl="pallas", config=config)
  one_pass = routed_experts(
    *args, impl="pallas", config=dataclasses.replace(config, memory_parts=1)
  )
  np.testing.assert_array_equal(np.asarray(in_parts, np.float32), np.asarray(one_pass, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize(
  "config",
  [
    TuningConfig(block_m=128, block_n_gate_up=64, block_n_down=128),
    TuningConfig(block_k=128, num_stages=2),  # three stages need 256 KiB of shared memory
    TuningConfig(block_n_gate_up=64, block_n_down=256, num_stages=2),
    TWO_WARPGROUPS_N,
    TWO_WARPGROUPS_M,
    dataclasses.replace(TWO_WARPGROUPS_M, num_stages=3),
    mosaic_gpu.PREFILL_CONFIG,  # at 300 tokens default_config takes decode tiles
    # Split by columns, each warpgroup's 128 down columns staged in two pieces.
    dataclasses.replace(
      TWO_WARPGROUPS_M, warpgroup_split="n", block_n_down=256, num_stages=3, epilogue_n=64
    ),
    # Transposed tiles as default_config makes them, and of the register budget's 184 rows.
    mosaic_gpu.prefill_tile_rows(mosaic_gpu.PREFILL_CONFIG, 2048, 8, 16),  # 176 rows
    mosaic_gpu.prefill_tile_rows(mosaic_gpu.PREFILL_CONFIG, 8192, 8, 128),  # 136 rows
    dataclasses.replace(
      mosaic_gpu.prefill_tile_rows(mosaic_gpu.PREFILL_CONFIG, 8192, 8, 128), block_m=184
    ),
  ],
)
def test_tuning_configs_on_gpu_match_xla(config):
  args = glm_inputs("glm45_air", 300)
  out = routed_experts(*args, impl="pallas", config=config)
  want = routed_experts(*args, impl="xla")
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert _relative_rms(out, want) < RTOL


@pytest.mark.gpu
@pytest.mark.parametrize("name", TWO_WARPGROUP_CASES)
def test_two_warpgroup_cases_on_gpu_match_float64(name):
  _gpu_matches_float64_with_nan_padding(name)


@pytest.mark.gpu
@pytest.mark.parametrize("signal", ["late", "copies"])
@pytest.mark.parametrize("padding", [float("nan"), 0.0])
@pytest.mark.parametrize("name", GATHER_CASES)
def test_gather_in_kernel_on_gpu_matches_float64_and_the_xs_kernel(name, padding, signal):
  _gathering_matches_float64_and_the_xs_kernel_bit_for_bit(
    name, padding, interpret=False, signal=signal
  )


@pytest.mark.gpu
@pytest.mark.parametrize("signal", ["late", "copies"])
@pytest.mark.parametrize(
  ("shape", "num_tokens"),
  [
    ("glm45_air", 896),
    ("glm45_air", 2048),
    ("glm45_air", 8192),  # one pass, no memory parts
    ("glm45", 8192),
  ],
)
def test_gather_in_kernel_on_gpu_gives_the_xs_result_bit_for_bit(shape, num_tokens, signal):
  args = glm_inputs(shape, num_tokens)
  config = mosaic_gpu.default_config(num_tokens, 8, *GLM_SHAPES[shape])
  config = dataclasses.replace(config, gather_rows_signal=signal)
  gathering, from_xs = (
    routed_experts(
      *args, impl="pallas", config=dataclasses.replace(config, gather_in_kernel=gather)
    )
    for gather in (True, False)
  )
  np.testing.assert_array_equal(np.asarray(gathering, np.float32), np.asarray(from_xs, np.float32))
