"""Batched generation over the paged cache equals one-request-at-a-time greedy decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.model.config import tiny
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.serving import engine as engine_module
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


def test_engine_survives_an_interrupt_inside_a_donating_step(model, monkeypatch):
  """A KeyboardInterrupt after a step consumed (donated) the cache but before the engine got the
  new one back used to leave every later call failing with 'Array has been deleted'."""
  config = EngineConfig(max_batch_size=2, max_seq_len=32, page_size=4, attention_impl="xla")
  prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
  expected = Generator(model, config).generate(prompts, max_new_tokens=6, stop_token_ids=())
  engine = Generator(model, config)
  real_step = engine_module.decode_step
  calls = []

  def interrupted_step(*args, **kwargs):
    calls.append(1)
    result = real_step(*args, **kwargs)  # consumes the donated cache...
    if len(calls) == 2:
      raise KeyboardInterrupt  # ...and is interrupted before the engine stores the new one
    return result

  monkeypatch.setattr(engine_module, "decode_step", interrupted_step)
  with pytest.raises(KeyboardInterrupt):
    engine.generate(prompts, max_new_tokens=6, stop_token_ids=())
  monkeypatch.setattr(engine_module, "decode_step", real_step)
  assert engine.allocator.num_free == engine.config.total_pages  # no page leaked
  again = engine.generate(prompts, max_new_tokens=6, stop_token_ids=())
  assert again.tokens == expected.tokens  # nothing of the interrupted run leaks into this one


def test_requests_are_checked_as_a_whole_before_the_first_wave(model, monkeypatch):
  """A bad request in a later wave used to be found only after the earlier waves ran."""
  engine = Generator(
    model,
    EngineConfig(max_batch_size=1, max_seq_len=16, page_size=4, num_pages=3, attention_impl="xla"),
  )
  prefills = []
  monkeypatch.setattr(engine_module, "prefill_step", lambda *a, **k: prefills.append(1))
  good = [1, 2, 3]
  with pytest.raises(OutOfPagesError, match="requests 2..2"):
    engine.generate([good, good, [1] * 10], max_new_tokens=5)
  with pytest.raises(ValueError, match="prompt 1 has token ids outside"):
    engine.generate([good, [1, 128]], max_new_tokens=2)
  with pytest.raises(ValueError, match="prompt 1 holds non-integer"):
    engine.generate([good, [1.0, 2.0]], max_new_tokens=2)
  assert prefills == []


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(max_new_tokens=-5), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(max_new_tokens=4, seed=2**70), "seed"),
    (dict(max_new_tokens=4, stop_token_ids=[1.5]), "stop_token_ids"),
    (dict(max_new_tokens=100_000), "max_seq_len"),
  ],
)
def test_bad_generate_arguments_are_named(model, kwargs, message):
  engine = Generator(model, EngineConfig(max_batch_size=1, max_seq_len=32, attention_impl="xla"))
  with pytest.raises(ValueError, match=message):
    engine.generate([[1, 2]], **kwargs)


def test_max_position_embeddings_bounds_a_request(model):
  small = GlmForCausalLM(tiny(max_position_embeddings=16), rngs=nnx.Rngs(0))
  engine = Generator(small, EngineConfig(max_batch_size=1, max_seq_len=64, attention_impl="xla"))
  with pytest.raises(ValueError, match="max_position_embeddings"):
    engine.generate([[1, 2]], max_new_tokens=20)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(num_pages=0), "num_pages"),
    (dict(max_batch_size=2.5), "max_batch_size"),
    (dict(page_size=True), "page_size"),
    (dict(attention_impl="triton"), "attention_impl"),
  ],
)
def test_bad_engine_config_is_named(kwargs, message):
  with pytest.raises(ValueError, match=message):
    EngineConfig(**kwargs)


def test_out_of_range_token_ids_are_an_error_or_nan_never_another_token(model):
  with pytest.raises(ValueError, match="input_ids must be token ids"):
    model(jnp.asarray([[1, 128]]))
  with pytest.raises(ValueError, match="input_ids must be token ids"):
    model(jnp.asarray([[-1, 2]]))
  # Under jit the ids are not concrete: the bad request's logits turn NaN (not another token's
  # logits), and the other requests of the batch are untouched.
  forward = jax.jit(lambda ids: model(ids))
  logits = forward(jnp.asarray([[5, 7, 9], [5, 7, 128]]))
  assert np.isnan(logits[1, 2]).all()
  np.testing.assert_array_equal(logits[0], forward(jnp.asarray([[5, 7, 9], [5, 7, 1]]))[0])


@pytest.mark.parametrize("speculative", [False, True])
def test_decoding_makes_no_eager_device_op_per_step(model, monkeypatch, speculative):
  """Per step the host only dispatches the jitted step and reads its tokens: keys come from one
  split per 64 steps and host arrays go in with the call (an eager op costs ~0.1-0.2 ms of host
  time on a GPU, the order of a small model's whole step)."""
  from jaxspec.serving.speculative import SpeculativeConfig, SpeculativeGenerator

  config = EngineConfig(max_batch_size=2, max_seq_len=256)
  if speculative:
    with_mtp = GlmForCausalLM(tiny(num_nextn_predict_layers=1), rngs=nnx.Rngs(11))
    engine = SpeculativeGenerator(with_mtp, config, SpeculativeConfig(3))
  else:
    engine = Generator(model, config)
  prompts = [[1, 2, 3], [4, 5]]
  engine.generate(prompts, max_new_tokens=4)  # compiles
  calls = {"split": 0, "asarray": 0}

  def counted(name, function):
    def wrapper(*args, **kwargs):
      calls[name] += 1
      return function(*args, **kwargs)

    return wrapper

  monkeypatch.setattr(jax.random, "split", counted("split", jax.random.split))
  monkeypatch.setattr(jnp, "asarray", counted("asarray", jnp.asarray))
  out = engine.generate(prompts, max_new_tokens=150, stop_token_ids=())
  assert out.metrics.decode_steps >= 40
  # One wave: the wave key, and one split per 63 step keys; asarray only for the wave's inputs.
  assert calls["split"] <= 2 + -(-out.metrics.decode_steps // 63), calls
  assert calls["asarray"] <= 8, calls


class _Recorded:
  """A step's tokens that log when the engine reads them."""

  def __init__(self, log, step, tokens):
    self.log, self.step, self.tokens = log, step, tokens

  def __array__(self, dtype=None, copy=None):
    self.log.append(("read", self.step))
    return self.tokens


class _CountingDecoding:
  """A strategy whose step i emits token i for every request, logging launches and reads."""

  lookahead_tokens = 0
  num_speculative_tokens = 0
  needs_draft_cache = False

  def __init__(self):
    self.log = []

  def check_model(self, model):
    del model

  def begin(self, engine, wave, prefill):
    del engine, prefill
    log, steps = self.log, iter(range(1, 1000))

    class Decoder:
      def launch(self, wave):
        step = next(steps)
        log.append(("launch", step))
        return _Recorded(log, step, np.full(len(wave.done), step, np.int32))

    return Decoder()


@pytest.mark.parametrize("stop_at", [None, 3])
def test_the_loop_dispatches_each_step_before_reading_the_one_before(model, stop_at):
  """Step i + 1 is launched before step i's tokens are read. After the step that brings every
  request to max_new_tokens nothing is launched; after a stop token, the one step already
  launched is dropped unread."""
  strategy = _CountingDecoding()
  engine = Generator(model, EngineConfig(max_batch_size=2, max_seq_len=32), strategy)
  out = engine.generate(
    [[1, 2], [3]], max_new_tokens=6, stop_token_ids=() if stop_at is None else (stop_at,)
  )
  last = 5 if stop_at is None else stop_at  # the prefill's token, then steps 1..last
  expected = [("launch", 1)]
  for step in range(1, last + 1):
    if step < 5:  # after step 5 every request has its 6 tokens
      expected.append(("launch", step + 1))
    expected.append(("read", step))
  assert strategy.log == expected
  assert [tokens[1:] for tokens in out.tokens] == [list(range(1, last + 1))] * 2
  assert out.metrics.decode_steps == last
