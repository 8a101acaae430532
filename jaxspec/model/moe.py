"""GLM-4.5 mixture of experts: sigmoid router with group-limited top-k, routed and shared experts.

Routing follows DeepSeek-V3 (arXiv:2412.19437, section 2.1.2) as GLM-4.5 and transformers'
`Glm4MoeTopkRouter` run it:

1. `scores = sigmoid(x @ W_router^T)` in float32;
2. selection uses `scores + e_score_correction_bias` (the auxiliary-loss-free balancing bias);
   the bias never enters the combine weights;
3. group-limited routing: experts are split into `n_group` groups, each group is scored by the
   sum of its two best biased scores, and only experts of the `topk_group` best groups compete;
4. the `num_experts_per_tok` best experts are combined with weights `scores[selected]`,
   renormalised to sum to one when `norm_topk_prob`, then multiplied by `routed_scaling_factor`.

Two implementations of the routed experts compute the same function:

- `per_route`: gathers each token's k expert matrices and runs k small matmuls per token. Reads
  exactly the weights the tokens need: the right choice when there are few tokens.
- `grouped`: sorts the (token, expert) assignments by expert and runs one grouped GEMM
  (`jax.lax.ragged_dot`) per projection: each expert's weights are read once for all its tokens.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.model.config import ModelConfig
from jaxspec.model.layers import SwiGluMlp, _normal
from jaxspec.model.metadata import MOE_IMPLS, MoeChoice, MoeImpl


class Router(nnx.Module):
  def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
    self.weight = nnx.Param(
      _normal(rngs, (config.n_routed_experts, config.hidden_size), dtype, 0.02)
    )
    # Kept in float32 like transformers' `_keep_in_fp32_modules_strict`.
    self.e_score_correction_bias = nnx.Param(jnp.zeros((config.n_routed_experts,), jnp.float32))
    self.top_k = config.num_experts_per_tok
    self.n_group = config.n_group
    self.topk_group = config.topk_group
    self.norm_topk_prob = config.norm_topk_prob
    self.routed_scaling_factor = config.routed_scaling_factor

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x: [N, H] -> (weights float32 [N, k], expert ids int32 [N, k])."""
    logits = jnp.dot(x.astype(jnp.float32), self.weight[...].astype(jnp.float32).T)  # [N, E]
    scores = jax.nn.sigmoid(logits)
    biased = scores + self.e_score_correction_bias[...]
    num_tokens, num_experts = biased.shape
    if self.n_group > 1:
      grouped = biased.reshape(num_tokens, self.n_group, num_experts // self.n_group)
      group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, n_group]
      _, best_groups = jax.lax.top_k(group_scores, self.topk_group)
      group_mask = jnp.zeros((num_tokens, self.n_group), bool)
      group_mask = group_mask.at[jnp.arange(num_tokens)[:, None], best_groups].set(True)
      expert_mask = jnp.repeat(group_mask, num_experts // self.n_group, axis=1)
      biased = jnp.where(expert_mask, biased, -jnp.inf)
    _, expert_ids = jax.lax.top_k(biased, self.top_k)
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if self.norm_topk_prob:
      weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * self.routed_scaling_factor, expert_ids.astype(jnp.int32)


class RoutedExperts(nnx.Module):
  """`n_routed_experts` SwiGLU experts stored stacked: gate/up `[E, H, I]`, down `[E, I, H]`."""

  def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
    e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
    self.gate = nnx.Param(_normal(rngs, (e, h, i), dtype, 0.02))
    self.up = nnx.Param(_normal(rngs, (e, h, i), dtype, 0.02))
    self.down = nnx.Param(_normal(rngs, (e, i, h), dtype, 0.02))

  def __call__(self, x: jax.Array, weights: jax.Array, expert_ids: jax.Array, impl: MoeImpl):
    """x: [N, H]; weights float32 [N, k]; expert_ids int32 [N, k] -> [N, H] in x's dtype."""
    if impl == "per_route":
      return self._per_route(x, weights, expert_ids)
    if impl == "grouped":
      return self._grouped(x, weights, expert_ids)
    raise ValueError(f"moe impl must be one of {MOE_IMPLS}, got {impl!r}")

  def _per_route(self, x, weights, expert_ids):
    gate = self.gate[...][expert_ids]  # [N, k, H, I]
    up = self.up[...][expert_ids]
    down = self.down[...][expert_ids]  # [N, k, I, H]
    xw = x.astype(gate.dtype)
    g = jnp.einsum("nh,nkhi->nki", xw, gate, preferred_element_type=jnp.float32)
    u = jnp.einsum("nh,nkhi->nki", xw, up, preferred_element_type=jnp.float32)
    act = (jax.nn.silu(g) * u).astype(gate.dtype)
    y = jnp.einsum("nki,nkih->nkh", act, down, preferred_element_type=jnp.float32)
    return jnp.einsum("nkh,nk->nh", y, weights).astype(x.dtype)

  def _grouped(self, x, weights, expert_ids):
    num_tokens, top_k = expert_ids.shape
    num_experts = self.gate.shape[0]
    flat_experts = expert_ids.reshape(-1)  # [N * k]
    order = jnp.argsort(flat_experts, stable=True)
    token_of = order // top_k  # [N * k], token of each sorted assignment
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)
    gate = self.gate[...]
    xs = x.astype(gate.dtype)[token_of]  # [N * k, H]
    g = jax.lax.ragged_dot(xs, gate, group_sizes, preferred_element_type=jnp.float32)
    u = jax.lax.ragged_dot(xs, self.up[...], group_sizes, preferred_element_type=jnp.float32)
    act = (jax.nn.silu(g) * u).astype(gate.dtype)
    y = jax.lax.ragged_dot(act, self.down[...], group_sizes, preferred_element_type=jnp.float32)
    y = y * weights.reshape(-1)[order][:, None]
    out = jnp.zeros((num_tokens, x.shape[-1]), jnp.float32).at[token_of].add(y)
    return out.astype(x.dtype)


class MoE(nnx.Module):
  """Routed experts plus always-on shared experts (`n_shared_experts` fused into one MLP)."""

  def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
    self.gate = Router(config, dtype=dtype, rngs=rngs)
    self.experts = RoutedExperts(config, dtype=dtype, rngs=rngs)
    self.shared_experts = SwiGluMlp(
      config.hidden_size,
      config.moe_intermediate_size * config.n_shared_experts,
      dtype=dtype,
      rngs=rngs,
    )

  def __call__(self, x: jax.Array, *, moe_impl: MoeImpl) -> jax.Array:
    """x: [..., H] -> [..., H]. `moe_impl` is decided by the caller, never from x's shape here."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])  # [N, H]
    weights, expert_ids = self.gate(flat)
    routed = self.experts(flat, weights, expert_ids, moe_impl)
    return (routed + self.shared_experts(flat)).reshape(shape)


def choose_moe_impl(num_tokens: int, config: ModelConfig) -> MoeImpl:
  """Picks the routed-expert implementation from the token count of a step (a Python int).

  `per_route` streams `num_tokens * k` expert matrices, `grouped` streams the experts its tokens
  hit once each but pays for sorting and a grouped GEMM. Measured on an H200 with GLM-4.5-Air's
  MoE (128 experts, top-8, bf16; benchmarks/results/draft_pruning.md): per_route is faster at 1
  token (362 vs 463 us), grouped from 4 tokens on (585 vs 737 us at 4, 1.2 vs 2.6 ms at 16). So
  per_route is used while `num_tokens * k < n_routed_experts / 4` (below 4 tokens there).
  Callers decide once per step, from the token count *before* any row pruning, and pass the
  result down.
  """
  if num_tokens <= 0:
    raise ValueError(f"num_tokens must be positive, got {num_tokens}")
  routes = num_tokens * config.num_experts_per_tok
  return "per_route" if 4 * routes < config.n_routed_experts else "grouped"


def resolve_moe_impl(choice: MoeChoice, num_tokens: int, config: ModelConfig) -> MoeImpl:
  """`choice` itself, or for "auto" the policy's pick for `num_tokens` rows (`choose_moe_impl`)."""
  return choose_moe_impl(num_tokens, config) if choice == "auto" else choice
