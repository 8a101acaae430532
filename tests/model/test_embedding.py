"""The embedding lookup and its two ways of forming the table's gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.model.layers import Embedding
from jaxspec.model.metadata import KernelChoices


def _table_grad(embedding: Embedding, ids, weights, grad: str):
  graphdef, state = nnx.split(embedding)

  def loss(state):
    return jnp.sum(nnx.merge(graphdef, state)(ids, grad) * weights)

  return jax.jit(jax.grad(loss))(state)["embedding"][...]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_hot_and_scatter_gradients_agree_on_repeated_ids(dtype):
  """Frequent ids are the point: every row's gradient is the sum over its occurrences."""
  embedding = Embedding(64, 16, dtype=dtype, rngs=nnx.Rngs(0))
  ids = jnp.concatenate(
    [jnp.zeros((3, 40), jnp.int32), jax.random.randint(jax.random.key(1), (3, 24), 0, 64)], -1
  )  # [3, 64], id 0 forty times per row
  weights = jax.random.normal(jax.random.key(2), (3, 64, 16))
  scatter = np.asarray(_table_grad(embedding, ids, weights, "scatter"), np.float32)
  one_hot = np.asarray(_table_grad(embedding, ids, weights, "one_hot"), np.float32)
  # float32: the same sums in another order; bf16: the scatter-add also rounds every partial sum
  # to bf16 while the matmul accumulates in float32, so allow a few bf16 ulps of the largest row.
  exact = dtype == jnp.float32
  largest = np.abs(one_hot).max()
  np.testing.assert_allclose(
    one_hot, scatter, rtol=1e-5 if exact else 2e-2, atol=1e-5 if exact else 0.05 * largest
  )
  # Row 0 is the sum of the 120 weight rows at its occurrences (float32, then the table's dtype).
  row0 = np.asarray(jnp.sum(jnp.where((ids == 0)[..., None], weights, 0.0), (0, 1)), np.float32)
  np.testing.assert_allclose(
    one_hot[0], row0, rtol=1e-5 if exact else 1e-2, atol=1e-5 if exact else 1e-2 * largest
  )


def test_the_forward_is_the_same_lookup_and_bad_ids_stay_nan():
  embedding = Embedding(8, 4, dtype=jnp.float32, rngs=nnx.Rngs(0))
  ids = jnp.array([[0, 7, 8, -1]])
  scatter, one_hot = embedding(ids, "scatter"), embedding(ids, "one_hot")
  np.testing.assert_array_equal(np.asarray(scatter), np.asarray(one_hot))
  assert (
    np.isnan(np.asarray(one_hot)[0, 2:]).all() and np.isfinite(np.asarray(one_hot)[0, :2]).all()
  )


def test_unknown_gradient_forms_are_clear_errors():
  with pytest.raises(ValueError, match="KernelChoices.embedding_grad"):
    KernelChoices(embedding_grad="segment_sum")
  embedding = Embedding(8, 4, dtype=jnp.float32, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="Embedding grad"):
    embedding(jnp.zeros((1, 2), jnp.int32), "segment_sum")
