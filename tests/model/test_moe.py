"""MoE routing and the implementation policy."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.model.config import glm45_air, tiny
from jaxspec.model.moe import MoE, _routed_experts, choose_moe_impl


@pytest.mark.parametrize("impl", ["per_route", "dense"])
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_the_xla_paths_agree_with_grouped(num_tokens, impl):
  config = tiny(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
  moe = MoE(config, dtype=jnp.float32, rngs=nnx.Rngs(num_tokens))
  x = jax.random.normal(jax.random.key(num_tokens), (num_tokens, config.hidden_size))
  np.testing.assert_allclose(
    moe(x, moe_impl=impl), moe(x, moe_impl="grouped"), rtol=1e-5, atol=1e-6
  )


def test_dense_drops_routes_to_experts_another_shard_holds():
  """With `expert_offset` (one expert-parallel shard), routes outside the shard add nothing:
  the two halves of the experts sum to the whole, for dense as for grouped."""
  config = tiny(n_routed_experts=8, num_experts_per_tok=2, n_group=1)
  moe = MoE(config, dtype=jnp.float32, rngs=nnx.Rngs(3))
  x = jax.random.normal(jax.random.key(3), (9, config.hidden_size))
  weights, expert_ids = moe.gate(x)
  experts = [w[...] for w in (moe.experts.gate, moe.experts.up, moe.experts.down)]
  for impl in ("dense", "grouped"):
    whole = _routed_experts(x, weights, expert_ids, *experts, impl=impl, interpret=False)
    halves = sum(
      _routed_experts(
        x, weights, expert_ids, *[w[o : o + 4] for w in experts], o, impl=impl, interpret=False
      )
      for o in (0, 4)
    )
    np.testing.assert_allclose(halves, whole, rtol=1e-5, atol=1e-6, err_msg=impl)


def test_the_kernel_path_matches_the_xla_paths_inside_the_model():
  """The MoE layer with the Mosaic GPU routed-expert kernels (GPU interpret mode) against both
  XLA paths, at a kernel-friendly width (H and I multiples of 64), bf16 weights."""
  config = tiny(hidden_size=64, moe_intermediate_size=64, n_routed_experts=8, n_group=1)
  moe = MoE(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(2))
  x = jax.random.normal(jax.random.key(2), (2, 5, config.hidden_size), jnp.bfloat16)
  outputs = {
    impl: np.asarray(moe(x, moe_impl=impl, interpret=True), np.float32)
    for impl in ("pallas", "grouped", "per_route", "dense")
  }
  chex.assert_shape(list(outputs.values()), x.shape)
  # bf16 outputs: the paths differ by the rounding of the result (and of silu's fast exp).
  chex.assert_trees_all_close(outputs["pallas"], outputs["grouped"], rtol=2e-2, atol=2e-3)
  chex.assert_trees_all_close(outputs["grouped"], outputs["per_route"], rtol=2e-2, atol=2e-3)
  # dense rounds weight * activation once instead of the activation alone: same bf16 tolerance.
  chex.assert_trees_all_close(outputs["dense"], outputs["grouped"], rtol=2e-2, atol=2e-3)


def _bf16(a):
  return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32), np.float64)


def test_each_route_output_is_rounded_before_the_combine_on_every_path():
  """Two routes whose down projections nearly cancel: expert 1 is expert 0 with its down
  projection negated and one column of its up projection doubled, so the float32 sum of the
  two outputs is one term of a 64-term dot product, about the size of the bf16 rounding error
  of each output. The routes' outputs rounded to bf16 before the combine (the op's semantics,
  as transformers rounds each expert's down_proj output) give a different answer than the
  unrounded sum, and every path must give the rounded one. The gate projection is kept above
  20, where silu(g) = g in float32, so the fast exp of the kernel cannot move the activation."""
  rng = np.random.default_rng(0)
  num_tokens, hidden, inter = 8, 64, 64
  x = _bf16(rng.uniform(0.5, 1.5, (num_tokens, hidden)))
  w_gate = _bf16(rng.uniform(0.5, 1.0, (1, hidden, inter))).repeat(2, axis=0)
  w_up = _bf16(rng.standard_normal((1, hidden, inter)) / 8).repeat(2, axis=0)
  w_up[1, :, 0] *= 2
  w_down = _bf16(rng.standard_normal((1, inter, hidden)) / 8)
  w_down = np.concatenate([w_down, -w_down])
  expert_ids = np.tile(np.array([[0, 1]], np.int32), (num_tokens, 1))
  weights = np.ones((num_tokens, 2), np.float32)

  gate = x @ w_gate[0]
  assert gate.min() > 20  # silu(g) = g in float32
  act = [_bf16(gate * (x @ w_up[e])) for e in (0, 1)]
  down = [act[e] @ w_down[e] for e in (0, 1)]
  want = _bf16(_bf16(down[0]) + _bf16(down[1]))
  unrounded = _bf16(down[0] + down[1])
  # The test has teeth: most outputs differ between the two semantics.
  assert np.mean(want != unrounded) > 0.5

  args = (
    jnp.asarray(x, jnp.bfloat16),
    jnp.asarray(weights),
    jnp.asarray(expert_ids),
    *(jnp.asarray(w, jnp.bfloat16) for w in (w_gate, w_up, w_down)),
  )
  for impl in ("grouped", "per_route", "pallas"):
    out = _routed_experts(*args, impl=impl, interpret=True)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32), np.float64), want, impl)


def test_policy_picks_the_kernel_on_hopper_where_it_serves_the_weights():
  air = glm45_air()
  assert [choose_moe_impl(n, air, hopper=True) for n in (1, 16, 8192)] == ["pallas"] * 3
  # fp32 weights or widths off the kernel's tiles fall back to the XLA policy.
  assert choose_moe_impl(1, air, jnp.float32, hopper=True) == "per_route"
  assert choose_moe_impl(64, tiny(), jnp.bfloat16, hopper=True) == "grouped"


def test_policy_follows_the_h200_crossover_for_glm45_air():
  air = glm45_air()
  assert [choose_moe_impl(n, air, hopper=False) for n in (1, 3, 4, 16, 384)] == [
    "per_route",
    "per_route",
    "grouped",
    "grouped",
    "grouped",
  ]
  with pytest.raises(ValueError, match="num_tokens must be positive, got 0"):
    choose_moe_impl(0, air)


def test_unknown_impl_is_rejected():
  config = tiny()
  moe = MoE(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="moe impl"):
    moe(jnp.ones((2, config.hidden_size)), moe_impl="sparse")
