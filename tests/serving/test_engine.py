"""Batched generation over the paged cache equals one-request-at-a-time greedy decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.model.config import tiny
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.serving.engine import EngineConfig, Generator, bucket
from jaxspec.serving.kv_cache import OutOfPagesError


@pytest.fixture(scope="module")
def model():
  return GlmForCausalLM(tiny(), rngs=nnx.Rngs(11))


def _greedy_reference(model, prompt, steps):
  """Greedy decoding by re-running the plain forward; padded to one shape so it compiles once."""
  graphdef, params = nnx.split(model)
  forward = jax.jit(lambda params, ids: nnx.merge(graphdef, params)(ids))
  ids = np.zeros((1, 32), np.int32)
  ids[0, : len(prompt)] = prompt
  for n in range(len(prompt), len(prompt) + steps):
    ids[0, n] = int(jnp.argmax(forward(params, jnp.asarray(ids))[0, n - 1]))
  return ids[0, len(prompt) : len(prompt) + steps].tolist()


def test_batch_of_ragged_prompts_matches_single_request_greedy(model):
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 128, n).tolist() for n in (5, 1, 12)]
  engine = Generator(
    model,
    EngineConfig(
      max_batch_size=4, max_seq_len=32, page_size=4, attention_impl="xla", shuffle_pages_seed=2
    ),
  )
  out = engine.generate(prompts, max_new_tokens=8, stop_token_ids=())
  assert out.tokens == [_greedy_reference(model, p, 8) for p in prompts]
  assert engine.allocator.num_free == engine.config.total_pages  # pages returned


def test_request_stops_at_stop_token_and_others_continue(model):
  prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
  full = [_greedy_reference(model, p, 8) for p in prompts]
  stop = full[0][2]  # request 0 stops at its third token
  engine = Generator(
    model, EngineConfig(max_batch_size=2, max_seq_len=32, page_size=4, attention_impl="xla")
  )
  out = engine.generate(prompts, max_new_tokens=8, stop_token_ids=(stop,))
  assert out.tokens[0] == full[0][: full[0].index(stop) + 1]
  expected_1 = full[1][: full[1].index(stop) + 1] if stop in full[1] else full[1]
  assert out.tokens[1] == expected_1


def test_more_requests_than_batch_run_in_waves(model):
  prompts = [[i + 1, i + 2] for i in range(5)]
  engine = Generator(
    model, EngineConfig(max_batch_size=2, max_seq_len=16, page_size=4, attention_impl="xla")
  )
  out = engine.generate(prompts, max_new_tokens=3, stop_token_ids=())
  assert out.tokens == [_greedy_reference(model, p, 3) for p in prompts]


def test_bad_requests_are_rejected(model):
  engine = Generator(
    model, EngineConfig(max_batch_size=2, max_seq_len=8, page_size=4, attention_impl="xla")
  )
  with pytest.raises(ValueError, match="exceeds max_seq_len"):
    engine.generate([[1] * 6], max_new_tokens=4)
  with pytest.raises(ValueError, match="outside"):
    engine.generate([[1, 999]], max_new_tokens=1)
  with pytest.raises(ValueError, match="empty"):
    engine.generate([[]], max_new_tokens=1)


def test_out_of_pages(model):
  engine = Generator(
    model,
    EngineConfig(max_batch_size=2, max_seq_len=16, page_size=4, num_pages=3, attention_impl="xla"),
  )
  with pytest.raises(OutOfPagesError):
    engine.generate([[1, 2, 3], [4, 5, 6]], max_new_tokens=5)
  assert engine.allocator.num_free == 3  # nothing leaked


def test_bucket():
  assert [bucket(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
  assert bucket(3, minimum=16) == 16
