"""Batched generation over the paged cache: one generation loop, a decoding strategy plugged in.

`Generator` owns the loop: it checks all requests up front, cuts them into waves of a static
batch bucket (a power of two up to `max_batch_size`) and a prompt-length bucket, hands out pages,
runs the target prefill, then asks its `DecodingStrategy` for one decode step at a time until
every request has hit a stop token or `max_new_tokens`; it applies stop tokens and lengths, times
the steps and reports progress. Only the emitted token ids come back to the host each step, and
the loop runs one step ahead: step i + 1 is dispatched before step i's tokens are read, its inputs
being step i's outputs on the device, so the device never waits for the host's bookkeeping and
the host's dispatch overlaps the device's work (vLLM's asynchronous scheduling). A request that
finishes in step i has also been given step i + 1; those rows are dropped, and the rows it writes
past the request's pages go to the spill page.

Strategies: `PlainDecoding` (one token per target step) here, `MtpDecoding` (draft k tokens with
the MTP layer, verify them with the target) in `jaxspec.serving.speculative`.
"""

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxspec.checks import is_int
from jaxspec.kernels.dispatch import IMPLS
from jaxspec.model.cache import ModelCache
from jaxspec.model.metadata import KernelChoices
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.serving.kv_cache import BlockAllocator, OutOfPagesError
from jaxspec.serving.model_graph import split_model
from jaxspec.serving.sampling import GREEDY, SamplingParams
from jaxspec.serving.steps import decode_step, prefill_step

MAX_LOOKAHEAD = 8
KEYS_PER_SPLIT = 64  # step keys made per device split (Wave.next_key)
KV_CACHE_DTYPES = ("auto", "float8_e4m3fn")  # "auto": the model's dtype


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static sizes and kernel choices of the serving engine.

  `num_pages` defaults to enough pages for `max_batch_size` requests of `max_seq_len` tokens; the
  cache holds one page more, the spill page (`spill_page`).
  `attention_impl` picks `paged_decode_attention`'s implementation and `index_conversion_impl`
  (default: the same) `convert_topk_to_physical`'s, for GLM-5 models. `kv_cache_dtype`
  "float8_e4m3fn" keeps the KV pages in fp8 (half the bytes to read; GQA models), quantised on
  write as value / `kv_scale`, saturating at +-448. `shuffle_pages_seed` hands pages out in
  random order (tests).
  """

  max_batch_size: int = 8
  max_seq_len: int = 1024
  page_size: int = 16
  num_pages: int | None = None
  min_prompt_bucket: int = 16
  attention_impl: str = "auto"
  index_conversion_impl: str | None = None
  kv_cache_dtype: str = "auto"
  kv_scale: float = 1.0
  shuffle_pages_seed: int | None = None

  def __post_init__(self):
    for name in ("max_batch_size", "max_seq_len", "page_size", "min_prompt_bucket"):
      value = getattr(self, name)
      if not is_int(value) or value <= 0:
        raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
    if self.num_pages is not None and (not is_int(self.num_pages) or self.num_pages <= 0):
      raise ValueError(
        f"EngineConfig.num_pages must be a positive int or None (enough for every request at "
        f"max_seq_len), got {self.num_pages!r}"
      )
    if self.shuffle_pages_seed is not None and not is_int(self.shuffle_pages_seed):
      raise ValueError(
        f"EngineConfig.shuffle_pages_seed must be an int or None, got {self.shuffle_pages_seed!r}"
      )
    if self.kv_cache_dtype not in KV_CACHE_DTYPES:
      raise ValueError(
        f"EngineConfig.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
      )
    if (
      isinstance(self.kv_scale, bool)
      or not isinstance(self.kv_scale, (int, float))
      or not (0 < self.kv_scale < float("inf"))
    ):
      raise ValueError(f"EngineConfig.kv_scale must be a positive number, got {self.kv_scale!r}")
    for name in ("attention_impl", "index_conversion_impl"):
      value = getattr(self, name)
      if value not in IMPLS and not (value is None and name == "index_conversion_impl"):
        raise ValueError(f"EngineConfig.{name} must be one of {IMPLS}, got {value!r}")

  @property
  def max_pages_per_request(self) -> int:
    """Pages one request may hold: `max_seq_len` tokens plus the `MAX_LOOKAHEAD` rows a
    speculative step writes past the last committed token."""
    return math.ceil((self.max_seq_len + MAX_LOOKAHEAD) / self.page_size)

  @property
  def total_pages(self) -> int:
    """Pages in the cache's pool: `num_pages`, or enough for `max_batch_size` requests of
    `max_pages_per_request` each."""
    return self.num_pages or self.max_batch_size * self.max_pages_per_request

  @property
  def spill_page(self) -> int:
    """The cache's extra last page, never handed out: block-table entries past a request's own
    pages point at it, so rows written past a request's allocation (the drafts of its last
    cycle, a step dispatched before the host saw it finish) land there, not in another
    request's page."""
    return self.total_pages

  @property
  def kernels(self) -> KernelChoices:
    """The steps' kernel choices; the MoE implementation is decided per step ("auto")."""
    conversion = self.index_conversion_impl or self.attention_impl
    return KernelChoices(attention=self.attention_impl, index_conversion=conversion)


@dataclasses.dataclass(frozen=True)
class GenerationMetrics:
  """Throughput, latency and (with speculation) acceptance of one `generate` call.

  TTFT is prefill to first token, ITL the time between two tokens of a request, TPOT the decode
  time per output token after the first. With k draft tokens per verify step:
  `per_position_acceptance[j]` is the share of verify steps that accepted draft j + 1,
  `acceptance_rate` their mean, and `mean_accepted_length` the tokens per verify step (accepted
  drafts plus the bonus token). Plain decoding reports k = 0 and one token per step. Fields can
  also be read as `metrics["name"]`.
  """

  num_requests: int
  generated_tokens: int
  elapsed_s: float
  tokens_per_s: float
  decode_steps: int
  ttft_s: float
  itl_s: float
  tpot_s: float
  num_speculative_tokens: int = 0
  verify_steps: int | None = None
  acceptance_rate: float | None = None
  per_position_acceptance: list[float] = dataclasses.field(default_factory=list)
  mean_accepted_length: float = 1.0

  def __getitem__(self, name: str):
    if name not in self.as_dict():
      raise KeyError(name)
    return getattr(self, name)

  def as_dict(self) -> dict[str, Any]:
    """The metrics as a plain dict."""
    return dataclasses.asdict(self)


@dataclasses.dataclass
class GenerationOutput:
  """Generated token ids per request (prompt excluded, stop token included) and the metrics."""

  tokens: list[list[int]]
  metrics: GenerationMetrics


@dataclasses.dataclass
class WaveStats:
  """Timing of one wave, and the tokens each decode step emitted per active request."""

  ttft_s: float
  step_times: list[float] = dataclasses.field(default_factory=list)
  tokens_per_step: list[int] = dataclasses.field(default_factory=list)
  # Per decode step and active request: tokens the step produced for it (accepted drafts + 1).
  produced: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Wave:
  """One static batch of requests being generated (host-side state)."""

  input_ids: np.ndarray  # int32 [B, T] prompts, zero padded
  prompt_lens: np.ndarray  # int32 [B], 0 = padding slot
  block_tables: jax.Array  # int32 [B, max_pages], padded with the spill page
  done: np.ndarray  # bool [B]; padding slots start done
  sampling: SamplingParams
  key: jax.Array  # the wave's PRNG key
  # bool [B, V] allowed first tokens (token healing), all True in unconstrained rows; None when
  # no request of the wave constrains its first token (the prefill compiled without a mask).
  first_token_mask: np.ndarray | None = None
  # Key data of the next steps, kept on the host (`steps.step_key`: a step's key costs no device
  # work): rows of one split of `KEYS_PER_SPLIT`, the last row being the parent of the next split.
  keys: np.ndarray | None = None
  keys_used: int = 0

  def next_key(self) -> np.ndarray:
    """The next step's key, as host key data."""
    if self.keys is None or self.keys_used == KEYS_PER_SPLIT - 1:
      parent = self.key if self.keys is None else jax.random.wrap_key_data(self.keys[-1])
      # One split shape for every wave: compiled once.
      self.keys = np.asarray(jax.random.key_data(jax.random.split(parent, KEYS_PER_SPLIT)))
      self.keys_used = 0
    self.keys_used += 1
    return self.keys[self.keys_used - 1]


@dataclasses.dataclass
class Prefill:
  """What the target prefill hands to a decoding strategy."""

  first_tokens: np.ndarray  # int32 [B] (host)
  hidden: jax.Array  # [B, T, H] after the final norm


class WaveDecoder(Protocol):
  """A strategy's decoding state for one wave; it stays on the device between steps."""

  def launch(self, wave: Wave) -> jax.Array:
    """Dispatches one decode step for every request not done and returns its emitted tokens
    without waiting for them: int32 [B] (plain decoding) or [B, n] (k + 1 with k drafts), -1
    after each request's last. The step must not depend on the tokens of the step before it
    reaching the host: the engine reads those only after this call."""
    ...


class DecodingStrategy(Protocol):
  """How a wave is decoded after the prefill (plain, speculative, ...)."""

  # Cache slots a step may write past a request's last committed token.
  lookahead_tokens: int
  # Draft tokens proposed per step (0 for plain decoding).
  num_speculative_tokens: int
  # Whether the model's cache must hold the MTP layer's pages.
  needs_draft_cache: bool

  def check_model(self, model: GlmForCausalLM) -> None:
    """`ValueError` when the model cannot be decoded this way."""
    ...

  def begin(self, engine: "Generator", wave: Wave, prefill: Prefill) -> WaveDecoder:
    """Starts decoding a prefilled wave: the `WaveDecoder` that steps it."""
    ...


class PlainDecoding:
  """One target step per token: `decode_step` with the last sampled token."""

  lookahead_tokens = 0
  num_speculative_tokens = 0
  needs_draft_cache = False

  def check_model(self, model: GlmForCausalLM) -> None:
    """Every model decodes plainly: nothing to check."""
    del model  # every model decodes plainly

  def begin(self, engine: "Generator", wave: Wave, prefill: Prefill) -> WaveDecoder:
    """A decoder that writes one token per request a step."""
    return _PlainWave(engine, wave, prefill.first_tokens)


class _PlainWave:
  """Each step writes one token per request, so the host knows every length in advance; the
  tokens go from one step to the next on the device."""

  def __init__(self, engine: "Generator", wave: Wave, first_tokens: np.ndarray):
    self.engine = engine
    self.tokens = first_tokens  # int32 [B]: the host's array at first, then the device's
    self.lens = wave.prompt_lens.copy()  # int32 [B]: cached tokens before the next step

  def launch(self, wave: Wave) -> jax.Array:
    engine = self.engine
    self.lens += 1
    # Host arrays go in with the call: no eager device op per step.
    seq_lens = np.where(wave.done, 0, self.lens).astype(np.int32)
    self.tokens, engine.cache = decode_step(
      engine.graph,
      engine.params,
      engine.cache,
      self.tokens,
      seq_lens,
      wave.block_tables,
      wave.next_key(),
      sampling=wave.sampling,
      kernels=engine.config.kernels,
    )
    return self.tokens


def bucket(n: int, minimum: int = 1) -> int:
  """Smallest power of two >= max(n, minimum): the static shape a dynamic size is padded to."""
  return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


class Generator:
  """Batched prefill + decode of a `GlmForCausalLM` over its paged cache.

  Example:
    gen = Generator(model, EngineConfig(max_seq_len=256))
    out = gen.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)
    out.tokens, out.metrics.tokens_per_s
  """

  def __init__(
    self,
    model: GlmForCausalLM,
    config: EngineConfig | None = None,
    strategy: DecodingStrategy | None = None,
  ):
    if not isinstance(model, GlmForCausalLM):
      raise TypeError(f"model must be a jaxspec GlmForCausalLM, got {type(model).__name__}")
    config = config or EngineConfig()
    if not isinstance(config, EngineConfig):
      raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
    self.strategy = strategy or PlainDecoding()
    self.strategy.check_model(model)
    self.model = model
    self.config = config
    self.graph, self.params = split_model(model)
    self.allocator = BlockAllocator(
      config.total_pages, config.page_size, shuffle_seed=config.shuffle_pages_seed
    )
    self.cache = self._new_cache()

  def _new_cache(self) -> ModelCache:
    cfg = self.config
    return self.model.init_cache(
      cfg.total_pages + 1,  # + the spill page
      cfg.page_size,
      dtype=None if cfg.kv_cache_dtype == "auto" else jnp.dtype(cfg.kv_cache_dtype),
      draft=self.strategy.needs_draft_cache,
      kv_scale=cfg.kv_scale,
    )

  def generate(
    self,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    first_token_masks: Sequence[np.ndarray | None] | None = None,
    progress: bool = False,
  ) -> GenerationOutput:
    """Generates up to `max_new_tokens` tokens per prompt; stops a request at a stop token.

    `stop_token_ids` defaults to the config's `eos_token_id`; pass `()` to never stop early.
    `first_token_masks`, one entry per prompt (a bool [vocab_size] array or None), restricts a
    request's first new token to the True ids (token healing, `jaxspec.serving.token_healing`).
    Every request is checked before the first wave runs. After an exception (a
    KeyboardInterrupt included) the engine stays usable: its pages are returned and a cache
    whose buffers were donated to the interrupted step is rebuilt.
    """
    prompts, masks = self._check_requests(
      prompts, max_new_tokens, sampling, seed, stop_token_ids, first_token_masks
    )
    stop = set(self.model.config.eos_token_ids if stop_token_ids is None else stop_token_ids)
    key = jax.random.key(seed)
    outputs, waves = [], []
    start = time.perf_counter()
    bar = tqdm(
      total=len(prompts) * max_new_tokens, desc="generating", unit="tok", disable=not progress
    )
    try:
      for wave_start in range(0, len(prompts), self.config.max_batch_size):
        wave_end = wave_start + self.config.max_batch_size
        key, wave_key = jax.random.split(key)
        tokens, stats = self._generate_wave(
          prompts[wave_start:wave_end],
          masks[wave_start:wave_end],
          max_new_tokens,
          sampling,
          wave_key,
          stop,
          bar,
        )
        outputs.extend(tokens)
        waves.append(stats)
    except BaseException:
      self._recover()
      raise
    finally:
      bar.close()
    elapsed = time.perf_counter() - start
    return GenerationOutput(tokens=outputs, metrics=self._metrics(waves, outputs, elapsed))

  def _recover(self) -> None:
    """After an interrupted step: a cache donated to it is gone; build a fresh one."""
    if any(leaf.is_deleted() for leaf in jax.tree.leaves(self.cache)):
      self.cache = self._new_cache()

  # ------------------------------------------------------------------------------------------------
  # Requests.

  def _check_requests(
    self, prompts, max_new_tokens, sampling, seed, stop_token_ids, first_token_masks
  ):
    """Checks every request before any device work; returns the prompts as lists of ints and
    the first-token masks as bool numpy arrays or None, one per prompt."""
    cfg, model_config = self.config, self.model.config
    if not is_int(max_new_tokens) or max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not isinstance(sampling, SamplingParams):
      raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if not is_int(seed) or not -(2**63) <= seed < 2**64:
      raise ValueError(f"seed must be an int that fits in 64 bits, got {seed!r}")
    if stop_token_ids is not None and not all(is_int(t) for t in stop_token_ids):
      raise ValueError(f"stop_token_ids must be ints, got {stop_token_ids!r}")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
      raise ValueError("prompts must be a non-empty sequence of token-id sequences")
    vocab = model_config.vocab_size
    lookahead = self.strategy.lookahead_tokens
    checked = []
    for i, prompt in enumerate(prompts):
      if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (Sequence, np.ndarray)):
        raise ValueError(f"prompt {i} must be a sequence of token ids, got {type(prompt).__name__}")
      if len(prompt) == 0:
        raise ValueError(f"prompt {i} is empty")
      if not all(is_int(t) for t in prompt):
        raise ValueError(f"prompt {i} holds non-integer token ids")
      prompt = [int(t) for t in prompt]
      if min(prompt) < 0 or max(prompt) >= vocab:
        raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
      total = len(prompt) + max_new_tokens
      if total > cfg.max_seq_len:
        raise ValueError(
          f"prompt {i} ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
          f"max_seq_len ({cfg.max_seq_len})"
        )
      if total + lookahead > model_config.max_position_embeddings:
        raise ValueError(
          f"prompt {i} ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
          f"model's max_position_embeddings ({model_config.max_position_embeddings})"
        )
      checked.append(prompt)
    masks = self._check_first_token_masks(first_token_masks, len(checked))
    for wave_start in range(0, len(checked), cfg.max_batch_size):
      wave = checked[wave_start : wave_start + cfg.max_batch_size]
      needed = sum(self._pages_for(p, max_new_tokens) for p in wave)
      if needed > self.allocator.num_pages:
        raise OutOfPagesError(
          f"requests {wave_start}..{wave_start + len(wave) - 1} run together and need {needed} "
          f"pages, but the cache has {self.allocator.num_pages} (EngineConfig.num_pages)"
        )
    return checked, masks

  def _check_first_token_masks(self, first_token_masks, num_prompts: int) -> list:
    """`first_token_masks` as a list of bool [vocab_size] numpy arrays or None per prompt."""
    if first_token_masks is None:
      return [None] * num_prompts
    if isinstance(first_token_masks, (str, bytes)) or not isinstance(
      first_token_masks, (Sequence, np.ndarray)
    ):
      raise ValueError(
        f"first_token_masks must be a sequence of bool arrays or None, one per prompt, got "
        f"{type(first_token_masks).__name__}"
      )
    if len(first_token_masks) != num_prompts:
      raise ValueError(
        f"first_token_masks must have one entry per prompt ({num_prompts}), got "
        f"{len(first_token_masks)}"
      )
    vocab = self.model.config.vocab_size
    checked = []
    for i, mask in enumerate(first_token_masks):
      if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_ or mask.shape != (vocab,):
          raise ValueError(
            f"first_token_masks[{i}] must be a bool array of shape ({vocab},) (the vocabulary) "
            f"or None, got {mask.dtype} {mask.shape}"
          )
        if not mask.any():
          raise ValueError(f"first_token_masks[{i}] allows no token")
      checked.append(mask)
    return checked

  def _pages_for(self, prompt, max_new_tokens: int) -> int:
    return self.allocator.pages_for(len(prompt) + max_new_tokens + self.strategy.lookahead_tokens)

  # ------------------------------------------------------------------------------------------------
  # The loop.

  def _generate_wave(self, prompts, masks, max_new_tokens, sampling, key, stop, bar):
    cfg = self.config
    batch = bucket(len(prompts))
    first_token_mask = None
    if any(mask is not None for mask in masks):
      # Padding slots and unconstrained requests allow every token.
      first_token_mask = np.ones((batch, self.model.config.vocab_size), bool)  # [B, V]
      for b, mask in enumerate(masks):
        if mask is not None:
          first_token_mask[b] = mask
    prompt_bucket = min(bucket(max(map(len, prompts)), cfg.min_prompt_bucket), cfg.max_seq_len)
    input_ids = np.zeros((batch, prompt_bucket), np.int32)
    prompt_lens = np.zeros((batch,), np.int32)
    block_tables = np.full((batch, cfg.max_pages_per_request), cfg.spill_page, np.int32)
    owned = []
    try:
      for b, prompt in enumerate(prompts):
        input_ids[b, : len(prompt)] = prompt
        prompt_lens[b] = len(prompt)
        pages = self.allocator.allocate(self._pages_for(prompt, max_new_tokens))
        owned.append(pages)
        block_tables[b, : len(pages)] = pages
      wave = Wave(
        input_ids=input_ids,
        prompt_lens=prompt_lens,
        block_tables=jnp.asarray(block_tables),
        done=np.arange(batch) >= len(prompts),
        sampling=sampling,
        key=key,
        first_token_mask=first_token_mask,
      )
      return self._run_wave(wave, len(prompts), max_new_tokens, stop, bar)
    finally:
      for pages in owned:
        self.allocator.free(pages)

  def _prefill(self, wave: Wave) -> tuple[Prefill, float]:
    t0 = time.perf_counter()
    next_tokens, hidden, self.cache = prefill_step(
      self.graph,
      self.params,
      self.cache,
      jnp.asarray(wave.input_ids),
      jnp.asarray(wave.prompt_lens),
      wave.block_tables,
      wave.next_key(),
      wave.first_token_mask,  # a host array goes in with the call; None: the unmasked program
      sampling=wave.sampling,
      kernels=self.config.kernels,
    )
    first_tokens = np.asarray(next_tokens)
    return Prefill(first_tokens, hidden), time.perf_counter() - t0

  def _run_wave(self, wave: Wave, num_requests, max_new_tokens, stop, bar):
    prefill, ttft = self._prefill(wave)
    decoder = self.strategy.begin(self, wave, prefill)
    stats = WaveStats(ttft_s=ttft)
    generated = [[] for _ in range(num_requests)]
    for b in range(num_requests):
      wave.done[b] = append_tokens(
        generated[b], prefill.first_tokens[b : b + 1], max_new_tokens, stop, bar
      )
    pending = None if wave.done.all() else decoder.launch(wave)
    while pending is not None:
      t_step = time.perf_counter()
      active = np.flatnonzero(~wave.done)
      # Every step emits at least one token per request: when the pending step brings each
      # request to max_new_tokens, no step follows it.
      last = all(len(generated[b]) + 1 >= max_new_tokens for b in active)
      following = None if last else decoder.launch(wave)
      emitted = np.asarray(pending).reshape(len(wave.done), -1)  # [B, n], -1 padded
      emitted_now = 0
      for b in active:
        row = emitted[b][emitted[b] >= 0]
        stats.produced.append(len(row))
        before = len(generated[b])
        wave.done[b] = append_tokens(generated[b], row, max_new_tokens, stop, bar)
        emitted_now += len(generated[b]) - before
      stats.tokens_per_step.append(emitted_now)
      stats.step_times.append(time.perf_counter() - t_step)
      # A step launched for requests that have all finished since is dropped unread.
      pending = None if wave.done.all() else following
    return generated, stats

  def _metrics(self, waves: list[WaveStats], outputs, elapsed: float) -> GenerationMetrics:
    generated = sum(len(t) for t in outputs)
    first_token_times = [w.ttft_s for w in waves]
    step_times = [t for w in waves for t in w.step_times]
    tokens_per_step = [n for w in waves for n in w.tokens_per_step]
    common = dict(
      num_requests=len(outputs),
      generated_tokens=generated,
      elapsed_s=elapsed,
      tokens_per_s=generated / elapsed if elapsed > 0 else 0.0,
      decode_steps=len(step_times),
      ttft_s=float(np.mean(first_token_times)),
      itl_s=float(np.sum(step_times) / max(np.sum(tokens_per_step), 1)),
      tpot_s=(elapsed - float(np.sum(first_token_times))) / max(generated - len(outputs), 1),
    )
    k = self.strategy.num_speculative_tokens
    if not k:
      return GenerationMetrics(**common)
    produced = np.array([n for w in waves for n in w.produced], np.int64)  # accepted + 1 each
    cycles = len(produced)
    accepted_at = np.array([np.sum(produced - 1 > j) for j in range(k)], np.float64)  # [k]
    return GenerationMetrics(
      **common,
      num_speculative_tokens=k,
      verify_steps=cycles,
      acceptance_rate=float(accepted_at.sum() / max(cycles * k, 1)),
      per_position_acceptance=(accepted_at / max(cycles, 1)).tolist(),
      mean_accepted_length=float((accepted_at.sum() + cycles) / max(cycles, 1)),
    )


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
