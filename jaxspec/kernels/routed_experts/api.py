"""Public entry point of the routed experts (grouped-expert SwiGLU MLPs of a MoE layer)."""

import jax
import jax.numpy as jnp

from jaxspec.contracts import require
from jaxspec.kernels.dispatch import KernelOp
from jaxspec.kernels.routed_experts import mosaic_gpu
from jaxspec.kernels.routed_experts.reference import routed_experts_reference

_FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _check_inputs(x, expert_ids, weights, w_gate, w_up, w_down) -> None:
  """Raises a ``ValueError`` naming the argument whose shape or dtype is wrong."""
  if w_gate.ndim != 3:
    raise ValueError(f"w_gate must be [E, H, I], got shape {w_gate.shape}")
  num_experts, hidden, intermediate = w_gate.shape
  if min(w_gate.shape) < 1:
    raise ValueError(f"w_gate [E, H, I] must be non-empty, got shape {w_gate.shape}")
  if w_up.shape != w_gate.shape:
    raise ValueError(f"w_up must be [E, H, I] = {list(w_gate.shape)}, got shape {w_up.shape}")
  if w_down.shape != (num_experts, intermediate, hidden):
    raise ValueError(
      f"w_down must be [E, I, H] = {[num_experts, intermediate, hidden]}, got shape {w_down.shape}"
    )
  if x.ndim != 2 or x.shape[1] != hidden:
    raise ValueError(f"x must be [T, H={hidden}], got shape {x.shape}")
  num_tokens = x.shape[0]
  if num_tokens < 1:
    raise ValueError(f"x must have at least one token, got shape {x.shape}")
  if expert_ids.ndim != 2 or expert_ids.shape[0] != num_tokens or expert_ids.shape[1] < 1:
    raise ValueError(f"expert_ids must be [T={num_tokens}, k >= 1], got shape {expert_ids.shape}")
  if expert_ids.dtype != jnp.int32:
    raise ValueError(f"expert_ids must be int32, got {expert_ids.dtype}")
  if weights.shape != expert_ids.shape:
    raise ValueError(
      f"weights must be [T, k] = {list(expert_ids.shape)}, got shape {weights.shape}"
    )
  if weights.dtype != jnp.float32:
    raise ValueError(f"weights must be float32, got {weights.dtype}")
  if jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
    raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
  if jnp.dtype(w_gate.dtype) not in _FLOAT_DTYPES:
    raise ValueError(f"w_gate must be bf16, fp16 or fp32, got {w_gate.dtype}")
  for name, array in (("w_up", w_up), ("w_down", w_down)):
    if array.dtype != w_gate.dtype:
      raise ValueError(f"{name} must have w_gate's dtype {w_gate.dtype}, got {array.dtype}")


def _default_config(x, expert_ids, weights, w_gate, *_, **__) -> mosaic_gpu.TuningConfig:
  num_tokens, top_k = expert_ids.shape
  num_experts, hidden, intermediate = w_gate.shape
  return mosaic_gpu.default_config(num_tokens, top_k, num_experts, hidden, intermediate)


OP = KernelOp(
  name="routed_experts",
  reference=routed_experts_reference,
  kernel=mosaic_gpu.routed_experts_mosaic_gpu,
  default_config=_default_config,
  unsupported_reason=mosaic_gpu.unsupported_reason,
)


def routed_experts(
  x: jax.Array,  # [T, H]
  expert_ids: jax.Array,  # int32 [T, k]
  weights: jax.Array,  # f32 [T, k]
  w_gate: jax.Array,  # [E, H, I]
  w_up: jax.Array,  # [E, H, I]
  w_down: jax.Array,  # [E, I, H]
  *,
  impl: str = "auto",
  interpret: bool = False,
  config: mosaic_gpu.TuningConfig | None = None,
  expert_offset: jax.Array | int | None = None,
) -> jax.Array:  # [T, H], x.dtype
  """The routed experts of a mixture-of-experts layer: a weighted sum of SwiGLU MLPs per token.

  ``y[t] = sum_j weights[t, j] * (silu(x[t] @ w_gate[e]) * (x[t] @ w_up[e])) @ w_down[e]``
  with ``e = expert_ids[t, j]``: ``x`` cast to the weights' dtype, float32 accumulation, the
  activation and each route's down projection rounded to the weights' dtype (as transformers'
  ``Glm4MoeNaiveMoe`` rounds them), the sum over ``j`` in float32, the result in ``x``'s dtype
  (the model's ``grouped`` MoE path; details in ``reference.py``).

  Contract on device values: every ``expert_ids`` entry lies in ``[0, E)``. A concrete array
  that breaks it raises ``ValueError``; under ``jit`` it is checked only in checked mode
  (``jaxspec.contracts``), and otherwise a route with an id outside ``[0, E)`` contributes
  nothing, on every path.

  Expert parallelism: with ``expert_offset`` the weights hold only the experts
  ``[expert_offset, expert_offset + E)`` of a larger set (one shard of them); routes to other
  experts belong to other shards and contribute nothing here, by design (no contract check).

  Args:
    x: [T, H] tokens (bf16, fp16 or fp32).
    expert_ids: int32 [T, k], the experts each token is routed to.
    weights: float32 [T, k], the combine weight of each route.
    w_gate, w_up: [E, H, I] expert weights (bf16, fp16 or fp32, one dtype for all three).
    w_down: [E, I, H].
    impl: "pallas" (Mosaic GPU kernels), "xla" (sorted routes + ``jax.lax.ragged_dot``) or
      "auto" (see ``jaxspec.kernels.dispatch``): the kernels on a Hopper GPU where they can
      serve the inputs (bf16/fp16 weights, H and I multiples of 64), xla otherwise.
    interpret: run the Pallas kernels in GPU interpret mode (any backend).
    config: kernel tuning knobs; ``None`` picks them from the shapes (``default_config``).
    expert_offset: the global id of ``w_gate[0]`` when the weights are one shard of the experts
      (an int or an int32 scalar array, e.g. from ``jax.lax.axis_index``); None: all experts.

  Returns:
    [T, H] in ``x``'s dtype.
  """
  _check_inputs(x, expert_ids, weights, w_gate, w_up, w_down)
  num_experts = w_gate.shape[0]
  if expert_offset is None:
    require(
      (expert_ids >= 0) & (expert_ids < num_experts),
      f"expert_ids must lie in [0, E={num_experts})",
    )
  else:
    # Ids of other shards' experts fall outside [0, E) and are dropped by every path.
    expert_ids = expert_ids - jnp.asarray(expert_offset, jnp.int32)
  return OP(
    x, expert_ids, weights, w_gate, w_up, w_down, impl=impl, interpret=interpret, config=config
  )
