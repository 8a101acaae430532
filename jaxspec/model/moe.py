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

Four implementations of the routed experts compute the same function:

- `pallas`: `jaxspec.kernels.routed_experts` on a Hopper GPU, two Mosaic GPU grouped-expert
  kernels (gate and up fused with the SwiGLU, then down) and a weighted combine; every touched
  expert's weights are streamed once, untouched experts are never read, at any token count;
- `grouped` (XLA): the same op's reference, routes sorted by expert and one grouped GEMM
  (`jax.lax.ragged_dot`) per projection;
- `per_route` (XLA): gathers each token's k expert matrices and runs k small matmuls per token;
  reads exactly the weights the tokens need, the fastest XLA path for a few tokens;
- `dense` (XLA): every expert on every token, weighted by a [N, E] combine matrix that is zero
  for the experts a token did not choose: E / k times the FLOPs, but three plain matmuls and no
  sort or gather. With few, narrow experts (the embedded default model: 8 x 96) that is the
  fastest way to train (the trainer's choice); the serving policy never picks it.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxspec.kernels import routed_experts
from jaxspec.kernels.dispatch import is_hopper_gpu
from jaxspec.kernels.routed_experts import api as routed_experts_api
from jaxspec.model.config import ModelConfig
from jaxspec.model.layers import SwiGluMlp, _normal
from jaxspec.model.metadata import MOE_IMPLS, MoeChoice, MoeImpl


class Router(nnx.Module):
  """GLM-4.5's router (DeepSeek-V3's): sigmoid scores of the logits; the top-k experts
  chosen on the scores plus `e_score_correction_bias`, among the `topk_group` best of `n_group`
  expert groups (a group's score: the sum of its best two); the weights are the unbiased scores
  of those experts, normalised to sum 1 with `norm_topk_prob`, times `routed_scaling_factor`."""

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
  """`n_routed_experts` SwiGLU experts stored stacked: gate/up `[E, H, I]`, down `[E, I, H]`.

  On a mesh the experts are split over `ep` and each expert's intermediate dimension over `tp`;
  every device runs its shard under `jax.shard_map` (routes to other devices' experts contribute
  nothing there) and one `psum` over both axes adds the partial outputs, in float32.
  """

  def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs, mesh: Mesh | None = None):
    e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
    self.gate = nnx.Param(_normal(rngs, (e, h, i), dtype, 0.02))
    self.up = nnx.Param(_normal(rngs, (e, h, i), dtype, 0.02))
    self.down = nnx.Param(_normal(rngs, (e, i, h), dtype, 0.02))
    column, row = ("experts", None, "expert_mlp"), ("experts", "expert_mlp", None)
    self.param_axes = (("gate", column), ("up", column), ("down", row))
    self.mesh = mesh

  def __call__(
    self,
    x: jax.Array,  # [N, H]
    weights: jax.Array,  # float32 [N, k]
    expert_ids: jax.Array,  # int32 [N, k]
    impl: MoeImpl,
    interpret: bool = False,
  ) -> jax.Array:  # [N, H], x.dtype
    """The routed experts' weighted sum, by `impl` (see `MoE`)."""
    if impl not in MOE_IMPLS:
      raise ValueError(f"moe impl must be one of {MOE_IMPLS}, got {impl!r}")
    experts = (self.gate[...], self.up[...], self.down[...])
    run = functools.partial(_routed_experts, impl=impl, interpret=interpret)
    if self.mesh is None:
      return run(x, weights, expert_ids, *experts)
    experts_local = self.gate.shape[0] // self.mesh.shape["ep"]

    def shard(x, weights, expert_ids, gate, up, down):
      offset = jax.lax.axis_index("ep") * experts_local
      partial = run(x.astype(jnp.float32), weights, expert_ids, gate, up, down, offset)
      return jax.lax.psum(partial, ("ep", "tp")).astype(x.dtype)

    column, row = P("ep", None, "tp"), P("ep", "tp", None)
    return jax.shard_map(
      shard,
      mesh=self.mesh,
      in_specs=(P(), P(), P(), column, column, row),
      out_specs=P(),
      # Pallas kernels do not type their outputs' varying mesh axes; the psum makes the
      # result the same on every device, which is what out_specs=P() says.
      check_vma=False,
    )(x, weights, expert_ids, *experts)


def _routed_experts(x, weights, expert_ids, gate, up, down, expert_offset=None, *, impl, interpret):
  """One implementation over the experts `gate/up/down` hold (all, or one shard from
  `expert_offset` on); routes to experts they do not hold contribute nothing."""
  if impl == "per_route":
    return _per_route(x, weights, expert_ids, gate, up, down, expert_offset)
  if impl == "dense":
    return _dense(x, weights, expert_ids, gate, up, down, expert_offset)
  op_impl = "xla" if impl == "grouped" else "pallas"
  return routed_experts(
    x,
    expert_ids,
    weights,
    gate,
    up,
    down,
    impl=op_impl,
    interpret=interpret,
    expert_offset=expert_offset,
  )


def _per_route(x, weights, expert_ids, gate, up, down, expert_offset=None):
  """Gathers each route's expert matrices and runs k small matmuls per token."""
  if expert_offset is not None:
    local = expert_ids - expert_offset
    held = (local >= 0) & (local < gate.shape[0])
    expert_ids, weights = jnp.where(held, local, 0), jnp.where(held, weights, 0.0)
  gate, up, down = gate[expert_ids], up[expert_ids], down[expert_ids]  # [N, k, H, I], [N, k, I, H]
  xw = x.astype(gate.dtype)
  g = jnp.einsum("nh,nkhi->nki", xw, gate, preferred_element_type=jnp.float32)
  u = jnp.einsum("nh,nkhi->nki", xw, up, preferred_element_type=jnp.float32)
  act = (jax.nn.silu(g) * u).astype(gate.dtype)
  y = jnp.einsum("nki,nkih->nkh", act, down, preferred_element_type=jnp.float32)
  y = y.astype(gate.dtype).astype(jnp.float32)  # each route's output rounded, as the op's
  return jnp.einsum("nkh,nk->nh", y, weights).astype(x.dtype)


def _dense(x, weights, expert_ids, gate, up, down, expert_offset=None):
  """Runs every expert held on every token; the combine matrix zeroes the routes not taken.

  Numerics: as the other paths (weights' dtype into the matmuls, float32 accumulation), except
  that the routing weight multiplies the activation in float32 before it is rounded for the
  down projection, instead of the down projection's output, and the routes' down projections
  are summed in float32 inside one matmul instead of each rounded to the weights' dtype.
  """
  num_experts = gate.shape[0]
  if expert_offset is not None:
    expert_ids = expert_ids - expert_offset  # ids outside [0, E) select no held expert
  # one_hot of an id outside [0, E) is all zeros: such a route contributes nothing.
  combine = jnp.einsum(
    "nke,nk->ne", jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32), weights
  )  # [N, E]
  xw = x.astype(gate.dtype)
  g = jnp.einsum("nh,ehi->nei", xw, gate, preferred_element_type=jnp.float32)
  u = jnp.einsum("nh,ehi->nei", xw, up, preferred_element_type=jnp.float32)
  act = (jax.nn.silu(g) * u * combine[..., None]).astype(gate.dtype)  # [N, E, I]
  return jnp.einsum("nei,eih->nh", act, down, preferred_element_type=jnp.float32).astype(x.dtype)


class MoE(nnx.Module):
  """Routed experts plus always-on shared experts (`n_shared_experts` fused into one MLP)."""

  def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs, mesh: Mesh | None = None):
    self.gate = Router(config, dtype=dtype, rngs=rngs)
    self.experts = RoutedExperts(config, dtype=dtype, rngs=rngs, mesh=mesh)
    self.shared_experts = SwiGluMlp(
      config.hidden_size,
      config.moe_intermediate_size * config.n_shared_experts,
      dtype=dtype,
      rngs=rngs,
    )

  def __call__(self, x: jax.Array, *, moe_impl: MoeImpl, interpret: bool = False) -> jax.Array:
    """x: [..., H] -> [..., H]. `moe_impl` is decided by the caller, never from x's shape here;
    `interpret` runs the Pallas kernels in GPU interpret mode."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])  # [N, H]
    weights, expert_ids = self.gate(flat)
    routed = self.experts(flat, weights, expert_ids, moe_impl, interpret)
    return (routed + self.shared_experts(flat)).reshape(shape)


def kernel_serves(num_tokens: int, config: ModelConfig, dtype) -> bool:
  """Whether the Mosaic GPU routed-expert kernels serve this model's expert weights."""
  e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
  k = config.num_experts_per_tok
  shapes = (
    jax.ShapeDtypeStruct((num_tokens, h), dtype),  # x
    jax.ShapeDtypeStruct((num_tokens, k), jnp.int32),  # expert_ids
    jax.ShapeDtypeStruct((num_tokens, k), jnp.float32),  # weights
    jax.ShapeDtypeStruct((e, h, i), dtype),  # w_gate
    jax.ShapeDtypeStruct((e, h, i), dtype),  # w_up
    jax.ShapeDtypeStruct((e, i, h), dtype),  # w_down
  )
  op = routed_experts_api.OP
  return op.unsupported_reason(*shapes, config=op.default_config(*shapes)) is None


def choose_moe_impl(
  num_tokens: int, config: ModelConfig, dtype=jnp.bfloat16, *, hopper: bool | None = None
) -> MoeImpl:
  """Picks the routed-expert implementation from the token count of a step (a Python int).

  On a Hopper GPU (`hopper`, default: the current device) the Mosaic GPU kernels (`pallas`)
  serve every token count wherever they support the weights (bf16/fp16, H and I multiples of
  64): they stream each touched expert's weights once at any count. Elsewhere, between the XLA
  paths: `per_route` streams `num_tokens * k` expert matrices, `grouped` streams the experts its
  tokens hit once each but pays for sorting and a grouped GEMM. Measured on an H200 with
  GLM-4.5-Air's MoE (128 experts, top-8, bf16; benchmarks/results/draft_pruning.md): per_route
  is faster at 1 token (362 vs 463 us), grouped from 4 tokens on (585 vs 737 us at 4, 1.2 vs
  2.6 ms at 16). So per_route is used while `num_tokens * k < n_routed_experts / 4`.
  Callers decide once per step, from the token count *before* any row pruning, and pass the
  result down.
  """
  if num_tokens <= 0:
    raise ValueError(f"num_tokens must be positive, got {num_tokens}")
  hopper = is_hopper_gpu() if hopper is None else hopper
  if hopper and kernel_serves(num_tokens, config, dtype):
    return "pallas"
  routes = num_tokens * config.num_experts_per_tok
  return "per_route" if 4 * routes < config.n_routed_experts else "grouped"


def resolve_moe_impl(choice: MoeChoice, num_tokens: int, config: ModelConfig, dtype) -> MoeImpl:
  """`choice` itself, or the policy's pick for `num_tokens` rows (`choose_moe_impl`) for "auto",
  and for "xla" its pick between the XLA paths."""
  if choice in ("auto", "xla"):
    return choose_moe_impl(num_tokens, config, dtype, hopper=False if choice == "xla" else None)
  return choice
