"""MoE routing and the implementation policy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.model.config import glm45_air, tiny
from jaxspec.model.moe import MoE, choose_moe_impl


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_per_route_and_grouped_agree(num_tokens):
  config = tiny(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
  moe = MoE(config, dtype=jnp.float32, rngs=nnx.Rngs(num_tokens))
  x = jax.random.normal(jax.random.key(num_tokens), (num_tokens, config.hidden_size))
  np.testing.assert_allclose(
    moe(x, moe_impl="per_route"), moe(x, moe_impl="grouped"), rtol=1e-5, atol=1e-6
  )


def test_policy_follows_the_h200_crossover_for_glm45_air():
  air = glm45_air()
  assert [choose_moe_impl(n, air) for n in (1, 3, 4, 16, 384)] == [
    "per_route",
    "per_route",
    "grouped",
    "grouped",
    "grouped",
  ]
  with pytest.raises(ValueError):
    choose_moe_impl(0, air)


def test_unknown_impl_is_rejected():
  config = tiny()
  moe = MoE(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="moe impl"):
    moe(jnp.ones((2, config.hidden_size)), moe_impl="dense")
