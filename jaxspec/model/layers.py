"""Small building blocks shared by the GLM modules: linear, embedding, RMSNorm, RoPE, SwiGLU MLP.

Weights are stored in the layout the computation wants (`kernel` is `[in, out]`); the loader
transposes Hugging Face's `[out, in]` matrices once at load time.
"""

import jax
import jax.numpy as jnp
from flax import nnx


def _normal(rngs: nnx.Rngs, shape, dtype, std: float) -> jax.Array:
  return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
  """`y = x @ kernel (+ bias)`, accumulated in float32 and returned in the input dtype.

  `axes` names the logical axes of `[in, out]` for sharding (`jaxspec.model.sharding`); every
  module lists its parameters' axes in `param_axes`, a tuple of `(name, axes)` pairs (hashable:
  it is part of the module's static graph).
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    *,
    bias: bool,
    dtype,
    rngs: nnx.Rngs,
    init_std: float = 0.02,
    axes: tuple[str | None, str | None] = (None, None),
  ):
    self.kernel = nnx.Param(_normal(rngs, (in_features, out_features), dtype, init_std))
    self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None
    self.param_axes = (("kernel", axes),) + ((("bias", (axes[1],)),) if bias else ())

  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.kernel[...]
    y = jnp.dot(x.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)
    if self.bias is not None:
      y = y + self.bias[...].astype(jnp.float32)
    return y.astype(x.dtype)


@jax.custom_vjp
def _rows_one_hot_grad(table: jax.Array, ids: jax.Array) -> jax.Array:
  """`table[ids]` whose gradient is `one_hot(ids)^T @ g`: one matmul instead of a scatter-add."""
  return jnp.take(table, ids, axis=0)


def _rows_fwd(table, ids):
  # An empty [V, 0] array carries the table's row count and dtype to the backward pass.
  return jnp.take(table, ids, axis=0), (ids, jnp.zeros((table.shape[0], 0), table.dtype))


def _rows_bwd(residuals, g):
  ids, table_like = residuals
  flat_ids, flat_g = ids.reshape(-1), g.reshape(-1, g.shape[-1])  # [N], [N, H]
  # [N, V] zeros and ones: exact in any dtype; float32 accumulation over the N rows.
  one_hot = jax.nn.one_hot(flat_ids, table_like.shape[0], dtype=flat_g.dtype)
  grad = jnp.dot(one_hot.T, flat_g, preferred_element_type=jnp.float32)  # [V, H]
  return grad.astype(table_like.dtype), None


_rows_one_hot_grad.defvjp(_rows_fwd, _rows_bwd)


class Embedding(nnx.Module):
  """Token embedding table, `[num_embeddings, features]`."""

  def __init__(
    self, num_embeddings: int, features: int, *, dtype, rngs: nnx.Rngs, init_std: float = 0.02
  ):
    self.embedding = nnx.Param(_normal(rngs, (num_embeddings, features), dtype, init_std))
    self.param_axes = (("embedding", ("vocab", None)),)

  def __call__(self, ids: jax.Array, grad: str = "scatter") -> jax.Array:
    """ids: int [...] -> [..., features]. An id outside [0, num_embeddings) gives a NaN row, so
    a bad id shows in the output instead of silently reading another token's row (a negative id
    would wrap around, one past the end would be clamped).

    `grad` only changes how a gradient of the table is formed (`KernelChoices.embedding_grad`):
    "scatter" adds each row's gradient into the table (XLA scatter-add), "one_hot" computes
    `one_hot(ids)^T @ g` as one matmul. With the scatter-add, a default-model train step on an
    H200 took 82-95 ms on Python code and 32 ms on uniform random ids; the likely cause is the
    GPU scatter's atomics serialising on the frequent tokens of code (indentation, newlines),
    which the matmul does not have (its effect on that step is not yet measured). The matmul
    costs `2 * V * N * H` FLOPs whatever the ids, which suits small vocabularies."""
    table = self.embedding[...]
    valid = (ids >= 0) & (ids < table.shape[0])
    safe_ids = jnp.where(valid, ids, 0)
    if grad == "one_hot":
      rows = _rows_one_hot_grad(table, safe_ids)
    elif grad == "scatter":
      rows = jnp.take(table, safe_ids, axis=0)
    else:
      raise ValueError(f"Embedding grad must be 'scatter' or 'one_hot', got {grad!r}")
    return jnp.where(valid[..., None], rows, jnp.nan).astype(table.dtype)

  def attend(self, x: jax.Array) -> jax.Array:
    """Tied output projection: logits = x @ embedding^T, in float32."""
    table = self.embedding[...]
    return jnp.dot(x.astype(table.dtype), table.T, preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
  """RMSNorm as transformers' `Glm4MoeRMSNorm`: normalise in float32, cast back, then scale.

  The cast to the input dtype happens *before* the multiplication by `weight`, as in the HF code,
  so bf16 results round the same way.
  """

  def __init__(self, features: int, *, eps: float, dtype):
    self.weight = nnx.Param(jnp.ones((features,), dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)
    return (self.weight[...].astype(jnp.float32) * normed.astype(jnp.float32)).astype(x.dtype)


def rope_inverse_frequencies(rotary_dim: int, theta: float) -> jax.Array:
  """`1 / theta^(2i / rotary_dim)` for i < rotary_dim / 2, float32."""
  exponents = jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim
  return 1.0 / (theta**exponents)


def apply_partial_rope(
  x: jax.Array, positions: jax.Array, rotary_dim: int, theta: float
) -> jax.Array:
  """Rotates the first `rotary_dim` channels of every head; the rest pass through.

  Uses the "rotate half" (GPT-NeoX) pairing within the rotary slice: channel i pairs with
  channel i + rotary_dim / 2, as transformers' `glm4_moe.apply_rotary_pos_emb` does.

  x: [..., T, H, D]; positions: [..., T] int32. Angles are computed in float32 and cast to x's
  dtype before use, matching the HF cos/sin cache.
  """
  inv_freq = rope_inverse_frequencies(rotary_dim, theta)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., T, rotary_dim / 2]
  angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # [..., T, 1, rotary_dim]
  cos = jnp.cos(angles).astype(x.dtype).astype(jnp.float32)
  sin = jnp.sin(angles).astype(x.dtype).astype(jnp.float32)
  rot = x[..., :rotary_dim].astype(jnp.float32)
  half = rotary_dim // 2
  rotated_half = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
  rot = (rot * cos + rotated_half * sin).astype(x.dtype)
  return jnp.concatenate([rot, x[..., rotary_dim:]], axis=-1)


class SwiGluMlp(nnx.Module):
  """`down(silu(gate(x)) * up(x))`: GLM's dense MLP and shared experts."""

  def __init__(self, hidden_size: int, intermediate_size: int, *, dtype, rngs: nnx.Rngs):
    column, row = (None, "mlp"), ("mlp", None)  # split the intermediate dimension (tensor parallel)
    kwargs = dict(bias=False, dtype=dtype, rngs=rngs)
    self.gate_proj = Linear(hidden_size, intermediate_size, axes=column, **kwargs)
    self.up_proj = Linear(hidden_size, intermediate_size, axes=column, **kwargs)
    self.down_proj = Linear(intermediate_size, hidden_size, axes=row, **kwargs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
