"""Token healing: the healed prompt and first-token mask, and the engines' masked first token."""

import numpy as np
import pytest
from flax import nnx

from jaxspec.__main__ import DEFAULT_MODEL
from jaxspec.model.config import tiny
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.serving import engine as engine_module
from jaxspec.serving.engine import EngineConfig, Generator
from jaxspec.serving.sampling import SamplingParams
from jaxspec.serving.speculative import SpeculativeConfig, SpeculativeGenerator
from jaxspec.serving.token_healing import continuation_text, heal_prompt
from jaxspec.testing import count_compiles
from jaxspec.tokenizer import load_tokenizer
from jaxspec.training.trainer import greedy_continuations

DOCSTRING_PROMPT = 'def is_prime(n):\n    """Return True if n is a prime number."""\n'


@pytest.fixture(scope="module")
def tokenizer():
  return load_tokenizer(DEFAULT_MODEL)


def _brute_force_allowed(tokenizer, last: int) -> np.ndarray:
  """Tokens whose decoded text starts with the last token's text, decoding each id alone."""
  prefix = tokenizer.decode([last])
  return np.array([tokenizer.decode([i]).startswith(prefix) for i in range(tokenizer.vocab_size)])


def test_a_prompt_ending_in_a_newline_may_go_on_indented(tokenizer):
  prompt_ids = tokenizer.encode(DOCSTRING_PROMPT)
  assert tokenizer.decode(prompt_ids[-1:]) == "\n"
  (indent,) = tokenizer.encode("\n    ")  # one token: the newline merged with the indentation
  ids, allowed = heal_prompt(tokenizer, prompt_ids, tokenizer.vocab_size)
  assert ids == prompt_ids[:-1]
  assert allowed[prompt_ids[-1]] and allowed[indent] and allowed.sum() > 2
  # The healed first token re-covers the newline: it is printed once, after the prompt.
  assert continuation_text(tokenizer, prompt_ids, ids, [indent]) == "    "
  assert continuation_text(tokenizer, prompt_ids, prompt_ids, [indent]) == "\n    "


@pytest.mark.parametrize("text", [DOCSTRING_PROMPT, "x = 1\n\n", "def f(x):\n    return x ", "(a,"])
def test_allowed_tokens_match_a_brute_force_scan_of_the_vocabulary(tokenizer, text):
  prompt_ids = tokenizer.encode(text)
  _, allowed = heal_prompt(tokenizer, prompt_ids, tokenizer.vocab_size + 5)
  if allowed is None:
    assert _brute_force_allowed(tokenizer, prompt_ids[-1]).sum() == 1
    return
  assert allowed.shape == (tokenizer.vocab_size + 5,) and not allowed[tokenizer.vocab_size :].any()
  np.testing.assert_array_equal(
    allowed[: tokenizer.vocab_size], _brute_force_allowed(tokenizer, prompt_ids[-1])
  )


def test_partial_utf8_tokens_are_compared_as_bytes(tokenizer):
  pieces = tokenizer.token_bytes()
  assert [p.decode("utf-8", "replace") for p in pieces] == [
    tokenizer.decode([i]) for i in range(tokenizer.vocab_size)
  ]
  # Byte-level BPE: tokens holding part of a UTF-8 character all decode to U+FFFD alone, so as
  # text any of them would extend any other; as bytes a lead byte heals to the tokens it starts.
  partial = [i for i in range(tokenizer.vocab_size) if "\ufffd" in tokenizer.decode([i])]
  last = max(partial, key=lambda i: sum(p.startswith(pieces[i]) for p in pieces))
  _, allowed = heal_prompt(tokenizer, [1, last], tokenizer.vocab_size)
  np.testing.assert_array_equal(allowed, [p.startswith(pieces[last]) for p in pieces])
  assert 2 <= allowed.sum() < len(partial)


def test_nothing_is_healed_without_a_longer_token_or_text(tokenizer):
  pieces = tokenizer.token_bytes()
  longest = max(range(len(pieces)), key=lambda i: len(pieces[i]))  # no token extends it
  newline = tokenizer.encode("\n")
  end_of_text = 0  # special: decodes to no text
  for ids in ([5, longest], newline, [5, end_of_text]):
    assert heal_prompt(tokenizer, ids, tokenizer.vocab_size) == (ids, None)
  with pytest.raises(ValueError, match="vocab_size"):
    heal_prompt(tokenizer, [5, 6], tokenizer.vocab_size - 1)


# --------------------------------------------------------------------------------------------------
# The engines' masked first token.

ENGINE = EngineConfig(max_batch_size=4, max_seq_len=64, page_size=4, attention_impl="xla")


@pytest.fixture(scope="module")
def model():
  return GlmForCausalLM(tiny(), rngs=nnx.Rngs(3))


def _masks_without(tokens, vocab_size, rng):
  """A random half of the vocabulary per request, never the token it would start with."""
  masks = [rng.random(vocab_size) < 0.5 for _ in tokens]
  for mask, token in zip(masks, tokens, strict=True):
    mask[token] = False
  return masks


def test_greedy_first_token_is_the_argmax_over_the_allowed_tokens(model):
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 128, n).tolist() for n in (5, 1, 9)]
  plain = Generator(model, ENGINE).generate(prompts, max_new_tokens=6, stop_token_ids=())
  masks = _masks_without([tokens[0] for tokens in plain.tokens], 128, rng)
  masks[1] = None  # an unconstrained request next to constrained ones
  out = Generator(model, ENGINE).generate(
    prompts, max_new_tokens=6, stop_token_ids=(), first_token_masks=masks
  )
  # The trainer's cache-free greedy loop, masked the same way (only the first token is masked).
  assert out.tokens == greedy_continuations(model, prompts, masks, 6)
  assert out.tokens[1] == plain.tokens[1]
  assert out.tokens[0][0] != plain.tokens[0][0] and out.tokens[2][0] != plain.tokens[2][0]


@pytest.fixture(scope="module")
def bigram_model(mostly_bigram):
  config = tiny(vocab_size=32, first_k_dense_replace=1, num_nextn_predict_layers=1)
  return mostly_bigram(GlmForCausalLM(config, rngs=nnx.Rngs(0)), scale=0.05)


def test_plain_and_speculative_engines_heal_alike(bigram_model):
  prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 3, 11, 12, 13, 14]]
  plain = Generator(bigram_model, ENGINE)
  unmasked = plain.generate(prompts, max_new_tokens=1)
  masks = _masks_without([tokens[0] for tokens in unmasked.tokens], 32, np.random.default_rng(1))
  spec = SpeculativeGenerator(bigram_model, ENGINE, SpeculativeConfig(3))
  out = [e.generate(prompts, max_new_tokens=16, first_token_masks=masks) for e in (plain, spec)]
  assert out[0].tokens == out[1].tokens
  assert out[1].metrics.acceptance_rate > 0.3  # the drafts after a healed first token hold
  for seed in range(4):  # sampled: the first token too comes from the allowed tokens
    sampled = plain.generate(
      prompts,
      max_new_tokens=1,
      sampling=SamplingParams(temperature=1.0),
      seed=seed,
      first_token_masks=masks,
    )
    assert all(m[t] for m, (t,) in zip(masks, sampled.tokens, strict=True))


def test_a_wave_without_masks_keeps_its_compiled_prefill(model):
  engine = Generator(model, ENGINE)
  prompts = [[1, 2, 3], [4, 5]]
  masks = [np.arange(128) % 2 == 0, None]
  engine.generate(prompts, max_new_tokens=3)  # warm-up without masks
  with count_compiles() as unmasked:
    engine.generate(prompts, max_new_tokens=3)
  with count_compiles() as first_masked:
    engine.generate(prompts, max_new_tokens=3, first_token_masks=masks)
  with count_compiles() as again:
    engine.generate(prompts, max_new_tokens=3, first_token_masks=masks[::-1])
    engine.generate(prompts, max_new_tokens=3)
  assert (unmasked.compiles, again.compiles) == (0, 0)
  assert first_masked.compiles >= 1  # the masked prefill, once


@pytest.mark.parametrize(
  "masks, message",
  [
    ([None], r"one entry per prompt \(2\), got 1"),
    (np.ones(128, bool), r"one entry per prompt \(2\), got 128"),
    ("mask", "must be a sequence"),
    ([np.ones(64, bool), None], r"first_token_masks\[0\] must be a bool array of shape \(128,\)"),
    ([None, np.ones(128, np.int32)], r"first_token_masks\[1\] must be a bool array"),
    ([None, np.zeros(128, bool)], r"first_token_masks\[1\] allows no token"),
  ],
)
def test_bad_first_token_masks_are_named_before_any_prefill(model, monkeypatch, masks, message):
  engine = Generator(model, ENGINE)
  monkeypatch.setattr(engine_module, "prefill_step", lambda *a, **k: pytest.fail("prefill ran"))
  with pytest.raises(ValueError, match=message) as error:
    engine.generate([[1, 2], [3]], max_new_tokens=2, first_token_masks=masks)
  assert "first_token_masks" in str(error.value)


def test_greedy_continuations_stop_after_a_stop_token_as_the_engine_does(model):
  rng = np.random.default_rng(1)
  prompts = [rng.integers(1, 128, n).tolist() for n in (5, 9)]
  free = Generator(model, ENGINE).generate(prompts, max_new_tokens=6, stop_token_ids=())
  stop = free.tokens[0][2]  # request 0 stops at its third token at the latest
  out = Generator(model, ENGINE).generate(prompts, max_new_tokens=6, stop_token_ids=(stop,))
  for tokens, unstopped in zip(out.tokens, free.tokens, strict=True):
    end = unstopped.index(stop) + 1 if stop in unstopped else len(unstopped)
    assert tokens == unstopped[:end]
  assert len(out.tokens[0]) <= 3
  assert out.tokens == greedy_continuations(model, prompts, [None, None], 6, (stop,))
