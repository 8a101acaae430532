"""Plain-jnp float32 reference of the routed experts (the op's "xla" path).

Semantics (shared by every implementation of the op), for token ``t`` and its routes
``j < k`` with ``e = expert_ids[t, j]``::

    g = x[t] @ w_gate[e]            # float32 accumulation
    u = x[t] @ w_up[e]
    a = round(silu(g) * u)          # rounded to the weights' dtype
    d = round(a @ w_down[e])        # float32 accumulation, rounded to the weights' dtype
    y[t] = sum_j weights[t, j] * d  # float32, then x.dtype

``x`` is cast to the weights' dtype before the projections. This is the function of the model's
``grouped`` MoE path (transformers' ``Glm4MoeNaiveMoe`` in the weights' dtype, with float32
accumulation). Each route's down projection is rounded to the weights' dtype before the
combine, as transformers rounds the expert's ``down_proj`` output (and vLLM's fused MoE its
intermediate cache, there after the routing weight): a kernel then writes and reads the
``[T * k, H]`` intermediate at half the bytes of float32; the combine itself stays float32.

A route whose expert id lies outside ``[0, E)`` contributes nothing: the api rejects such ids on
concrete arrays, and under ``jit`` every implementation drops them (selected away with ``where``,
so nothing they touch can reach the output).

Algorithm: the routes are sorted by expert (routes to dropped ids last) and each projection is one
grouped GEMM, ``jax.lax.ragged_dot``, so each touched expert's weights are read once and nothing of
size ``[T, k, H, I]`` is formed; the largest intermediate is the ``[T * k, H]`` down projection.
"""

import jax
import jax.numpy as jnp


def sort_routes(expert_ids: jax.Array, num_experts: int):
  """Routes (flattened ``t * k + j``) sorted by expert id, out-of-range ids last.

  Returns ``(order int32 [T * k], valid bool [T * k], counts int32 [E])``: ``order[p]`` is the
  route at sorted position ``p``, ``valid[r]`` whether route ``r`` has an id in ``[0, E)``, and
  ``counts[e]`` the number of valid routes to expert ``e``.
  """
  flat = expert_ids.reshape(-1)  # [T * k]
  valid = (flat >= 0) & (flat < num_experts)
  key = jnp.where(valid, flat, num_experts)  # dropped routes sort after every expert
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  counts = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  return order, valid, counts


def combine_routes(
  y_rows: jax.Array,  # [rows, H], the down projection of each buffer row (any float dtype)
  position: jax.Array,  # int32 [T * k], the row of route t * k + j in y_rows
  valid: jax.Array,  # bool [T * k]
  weights: jax.Array,  # f32 [T, k]
) -> jax.Array:  # f32 [T, H]
  """``out[t] = sum_j weights[t, j] * y_rows[position[t * k + j]]`` over the valid routes.

  The rows of dropped routes may hold anything (a kernel never writes them): they are selected
  away, not multiplied by 0.
  """
  num_tokens, top_k = weights.shape
  y = y_rows[position].astype(jnp.float32) * weights.reshape(-1, 1)  # [T * k, H], route-major
  y = jnp.where(valid[:, None], y, 0.0)
  return jnp.sum(y.reshape(num_tokens, top_k, -1), axis=1)


@jax.jit
def routed_experts_reference(
  x: jax.Array,  # [T, H]
  expert_ids: jax.Array,  # int32 [T, k]
  weights: jax.Array,  # f32 [T, k]
  w_gate: jax.Array,  # [E, H, I]
  w_up: jax.Array,  # [E, H, I]
  w_down: jax.Array,  # [E, I, H]
) -> jax.Array:  # [T, H], x.dtype
  """Sorted routes and three ``ragged_dot`` grouped GEMMs with float32 accumulation."""
  num_experts = w_gate.shape[0]
  top_k = expert_ids.shape[1]
  order, valid, counts = sort_routes(expert_ids, num_experts)
  # Rows past sum(counts) (the dropped routes) belong to no group: ragged_dot leaves them 0.
  xs = x.astype(w_gate.dtype)[order // top_k]  # [T * k, H]
  g = jax.lax.ragged_dot(xs, w_gate, counts, preferred_element_type=jnp.float32)
  u = jax.lax.ragged_dot(xs, w_up, counts, preferred_element_type=jnp.float32)
  act = (jax.nn.silu(g) * u).astype(w_gate.dtype)  # [T * k, I]
  y = jax.lax.ragged_dot(act, w_down, counts, preferred_element_type=jnp.float32)
  y = y.astype(w_gate.dtype)  # [T * k, H]
  position = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
  return combine_routes(y, position, valid, weights).astype(x.dtype)
