"""Plain (non-speculative) batched generation over the paged cache.

Requests of different prompt lengths are padded into a static batch bucket (a power of two up to
`max_batch_size`) and a prompt-length bucket; each wave runs one prefill step and then one decode
step per new token. Only the sampled token ids come back to the host each step, to check stop
tokens and lengths.
"""

import dataclasses
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxspec.model.moe import choose_moe_impl
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.serving.kv_cache import BlockAllocator
from jaxspec.serving.latent_cache import create_cache
from jaxspec.serving.sampling import GREEDY, SamplingParams
from jaxspec.serving.steps import decode_step, prefill_step

MAX_LOOKAHEAD = 8


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static sizes of the serving engine.

  `num_pages` defaults to enough pages for `max_batch_size` requests of `max_seq_len` tokens.
  `shuffle_pages_seed` hands pages out in random order (tests use it).
  """

  max_batch_size: int = 8
  max_seq_len: int = 1024
  page_size: int = 16
  num_pages: int | None = None
  min_prompt_bucket: int = 16
  attention_impl: str = "auto"
  shuffle_pages_seed: int | None = None

  def __post_init__(self):
    for name in ("max_batch_size", "max_seq_len", "page_size", "min_prompt_bucket"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

  @property
  def max_pages_per_request(self) -> int:
    # Speculative steps write up to q_len = 8 rows past the last committed token.
    return math.ceil((self.max_seq_len + MAX_LOOKAHEAD) / self.page_size)

  @property
  def total_pages(self) -> int:
    return self.num_pages or self.max_batch_size * self.max_pages_per_request


@dataclasses.dataclass
class GenerationOutput:
  """Generated token ids per request (prompt excluded, stop token included) and timings."""

  tokens: list[list[int]]
  metrics: dict


def bucket(n: int, minimum: int = 1) -> int:
  """Smallest power of two >= max(n, minimum): the static shape a dynamic size is padded to."""
  return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


class Generator:
  """Batched prefill + decode of a `GlmForCausalLM` with a paged KV cache.

  Example:
    gen = Generator(model, EngineConfig(max_seq_len=256))
    out = gen.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)
  """

  # Cache slots a step may write past a request's last committed token (speculative verify rows).
  lookahead_tokens = 0

  def __init__(self, model: GlmForCausalLM, config: EngineConfig | None = None):
    config = config or EngineConfig()
    self.model = model
    self.config = config
    self.graphdef, self.params = nnx.split(model)
    self.allocator = BlockAllocator(
      config.total_pages, config.page_size, shuffle_seed=config.shuffle_pages_seed
    )
    self.cache = create_cache(
      model.config, self.num_cache_layers, config.total_pages, config.page_size, model.dtype
    )

  @property
  def num_cache_layers(self) -> int:
    return self.model.config.num_hidden_layers

  def generate(
    self,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    progress: bool = False,
  ) -> GenerationOutput:
    """Generates up to `max_new_tokens` tokens per prompt; stops a request at a stop token.

    `stop_token_ids` defaults to the config's `eos_token_id`; pass `()` to never stop early.
    """
    prompts = [list(map(int, p)) for p in prompts]
    self._check_requests(prompts, max_new_tokens)
    stop = set(self.model.config.eos_token_ids if stop_token_ids is None else stop_token_ids)
    key = jax.random.key(seed)
    outputs, waves = [], []
    start = time.perf_counter()
    bar = tqdm(
      total=len(prompts) * max_new_tokens, desc="generating", unit="tok", disable=not progress
    )
    for wave_start in range(0, len(prompts), self.config.max_batch_size):
      wave = prompts[wave_start : wave_start + self.config.max_batch_size]
      key, wave_key = jax.random.split(key)
      tokens, stats = self._generate_wave(wave, max_new_tokens, sampling, wave_key, stop, bar)
      outputs.extend(tokens)
      waves.append(stats)
    bar.close()
    elapsed = time.perf_counter() - start
    return GenerationOutput(tokens=outputs, metrics=self._metrics(waves, outputs, elapsed))

  def _metrics(self, waves: list[dict], outputs: list[list[int]], elapsed: float) -> dict:
    """Throughput and latency: TTFT (prefill to first token), ITL (time between two tokens of a
    request), TPOT (decode time per output token after the first)."""
    generated = sum(len(t) for t in outputs)
    first_token_times = [w["ttft_s"] for w in waves]
    step_times = [t for w in waves for t in w["step_times"]]
    tokens_per_step = [n for w in waves for n in w["tokens_per_step"]]
    return {
      "num_requests": len(outputs),
      "generated_tokens": generated,
      "elapsed_s": elapsed,
      "tokens_per_s": generated / elapsed if elapsed > 0 else 0.0,
      "decode_steps": len(step_times),
      "ttft_s": float(np.mean(first_token_times)),
      "itl_s": float(np.sum(step_times) / max(np.sum(tokens_per_step), 1)),
      "tpot_s": (elapsed - float(np.sum(first_token_times))) / max(generated - len(outputs), 1),
    }

  def _check_requests(self, prompts, max_new_tokens):
    if not prompts:
      raise ValueError("prompts must hold at least one request")
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    vocab = self.model.config.vocab_size
    for i, prompt in enumerate(prompts):
      if not prompt:
        raise ValueError(f"prompt {i} is empty")
      if min(prompt) < 0 or max(prompt) >= vocab:
        raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
      if len(prompt) + max_new_tokens > self.config.max_seq_len:
        raise ValueError(
          f"prompt {i} ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
          f"max_seq_len ({self.config.max_seq_len})"
        )

  def _generate_wave(self, prompts, max_new_tokens, sampling, key, stop, bar):
    cfg = self.config
    num_requests = len(prompts)
    batch = bucket(num_requests)
    prompt_bucket = min(bucket(max(map(len, prompts)), cfg.min_prompt_bucket), cfg.max_seq_len)
    input_ids = np.zeros((batch, prompt_bucket), np.int32)
    prompt_lens = np.zeros((batch,), np.int32)
    block_tables = np.zeros((batch, cfg.max_pages_per_request), np.int32)
    owned = []
    try:
      for b, prompt in enumerate(prompts):
        input_ids[b, : len(prompt)] = prompt
        prompt_lens[b] = len(prompt)
        capacity = len(prompt) + max_new_tokens + self.lookahead_tokens
        pages = self.allocator.allocate(self.allocator.pages_for(capacity))
        owned.append(pages)
        block_tables[b, : len(pages)] = pages
      return self._run_wave(
        input_ids, prompt_lens, block_tables, num_requests, max_new_tokens, sampling, key, stop, bar
      )
    finally:
      for pages in owned:
        self.allocator.free(pages)

  def _prefill(self, input_ids, prompt_lens, block_tables, sampling, key):
    """Target prefill; returns (first tokens [B] on host, hidden [B, T, H] on device, seconds)."""
    t0 = time.perf_counter()
    next_tokens, hidden, self.cache = prefill_step(
      self.graphdef,
      self.params,
      self.cache,
      jnp.asarray(input_ids),
      jnp.asarray(prompt_lens),
      block_tables,
      key,
      sampling=sampling,
      moe_impl=choose_moe_impl(input_ids.size, self.model.config),
      attention_impl=self.config.attention_impl,
    )
    first_tokens = np.asarray(next_tokens)
    return first_tokens, hidden, time.perf_counter() - t0

  def _run_wave(
    self,
    input_ids,
    prompt_lens,
    block_tables,
    num_requests,
    max_new_tokens,
    sampling,
    key,
    stop,
    bar,
  ):
    batch = input_ids.shape[0]
    block_tables = jnp.asarray(block_tables)
    key, step_key = jax.random.split(key)
    host_tokens, _, ttft = self._prefill(input_ids, prompt_lens, block_tables, sampling, step_key)
    generated = [[] for _ in range(num_requests)]
    done = np.ones(batch, bool)
    for b in range(num_requests):
      done[b] = append_tokens(generated[b], host_tokens[b : b + 1], max_new_tokens, stop, bar)
    lengths = prompt_lens.copy()  # tokens already in the cache per request
    step_times = []
    decode_moe = choose_moe_impl(batch, self.model.config)
    while not done.all():
      t_step = time.perf_counter()
      seq_lens = np.where(done, 0, lengths + 1).astype(np.int32)
      key, step_key = jax.random.split(key)
      next_tokens, self.cache = decode_step(
        self.graphdef,
        self.params,
        self.cache,
        jnp.asarray(host_tokens[:, None]),
        jnp.asarray(seq_lens),
        block_tables,
        step_key,
        sampling=sampling,
        moe_impl=decode_moe,
        attention_impl=self.config.attention_impl,
      )
      new_tokens = np.asarray(next_tokens)
      step_times.append(time.perf_counter() - t_step)
      for b in np.flatnonzero(~done):
        lengths[b] += 1
        done[b] = append_tokens(generated[b], new_tokens[b : b + 1], max_new_tokens, stop, bar)
      host_tokens = np.where(done, host_tokens, new_tokens)
    return generated, {
      "ttft_s": ttft,
      "step_times": step_times,
      "tokens_per_step": [1] * len(step_times),
    }


def append_tokens(output: list[int], new_tokens, max_new_tokens: int, stop: set[int], bar) -> bool:
  """Appends a step's tokens to a request's output, cut at a stop token or at max_new_tokens.

  Returns True when the request is finished.
  """
  for token in map(int, new_tokens):
    output.append(token)
    bar.update(1)
    if token in stop or len(output) >= max_new_tokens:
      return True
  return False
