"""The split model that the steps take: cheap to hash on every call, exact to merge back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.model.config import tiny
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.serving.engine import EngineConfig, Generator
from jaxspec.serving.model_graph import ModelGraph, split_model
from jaxspec.testing import count_compiles


@pytest.fixture(scope="module")
def model():
  return GlmForCausalLM(tiny(), dtype=jnp.float32, rngs=nnx.Rngs(0))


def test_merge_gives_back_the_same_model(model):
  graph, params = split_model(model)
  assert isinstance(params, list) and len(params) == graph.num_params
  assert all(isinstance(p, jax.Array) for p in params)
  ids = jnp.array([[1, 2, 3, 4]])
  np.testing.assert_array_equal(graph.merge(params)(ids), model(ids))


def test_the_graph_is_hashed_once(model, monkeypatch):
  graph, _ = split_model(model)
  first = hash(graph)
  calls = []
  graphdef_type = type(graph.graphdef)
  original = graphdef_type.__hash__
  monkeypatch.setattr(graphdef_type, "__hash__", lambda self: calls.append(1) or original(self))
  assert [hash(graph) for _ in range(3)] == [first] * 3
  assert calls == []


def test_graphs_of_one_structure_are_equal(model):
  graph, _ = split_model(model)
  again, _ = split_model(model)
  other, _ = split_model(GlmForCausalLM(tiny(num_hidden_layers=1), rngs=nnx.Rngs(0)))
  assert graph == again and hash(graph) == hash(again)
  assert graph != other
  assert graph != graph.graphdef


def test_merge_refuses_a_params_list_of_another_length(model):
  graph, params = split_model(model)
  with pytest.raises(ValueError, match=f"list of {graph.num_params} arrays"):
    graph.merge(params[:-1])


def test_engine_steps_reuse_one_compiled_program_per_shape(model):
  """A second engine on the same model hits the first one's compiled steps (equal graphs)."""
  config = EngineConfig(max_batch_size=1, max_seq_len=64)
  first = Generator(model, config).generate([[1, 2, 3]], max_new_tokens=4)
  with count_compiles() as count:
    again = Generator(model, config).generate([[1, 2, 3]], max_new_tokens=4)
  assert again.tokens == first.tokens
  assert count.compiles == 0


def test_model_graph_is_a_frozen_dataclass(model):
  graph, _ = split_model(model)
  assert isinstance(graph, ModelGraph)
  with pytest.raises(AttributeError):
    graph.graphdef = None
