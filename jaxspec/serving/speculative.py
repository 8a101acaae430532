"""MTP speculative decoding: draft k tokens with the MTP head, verify them with the target.

One cycle per step, for a static batch of requests (DeepSeek-V3 / GLM MTP as vLLM serves it):

1. `verify_step`: the target runs `q_len = k + 1` rows per request (the last committed token and
   the k drafts) through `paged_decode_attention`; greedy acceptance or rejection sampling keeps a
   prefix of the drafts and adds one bonus token. Each request accepts its own number.
2. `draft_step`: the MTP layer runs the same q_len rows (tokens shifted by one, the bonus written
   at the last accepted row), then k - 1 single-row steps, and proposes the next k drafts.
3. The host reads the emitted tokens (the only device-to-host copy of the cycle) to apply stop
   tokens and lengths. Rejected rows are rolled back by length: their cache slots are simply
   overwritten by the next cycle.

Greedy speculative decoding emits exactly the tokens of greedy plain decoding; with temperature it
samples exactly the target distribution (speculative sampling).
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.model.moe import choose_moe_impl
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.serving.engine import MAX_LOOKAHEAD, EngineConfig, Generator, append_tokens
from jaxspec.serving.spec_steps import draft_prefill_step, draft_step, verify_step


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """`num_speculative_tokens` = k drafts per cycle (1..7); `prune_draft_rows` switches row
  pruning in the draft's first step (off only to measure what it saves)."""

  num_speculative_tokens: int = 3
  prune_draft_rows: bool = True

  def __post_init__(self):
    if not 1 <= self.num_speculative_tokens <= MAX_LOOKAHEAD - 1:
      raise ValueError(
        f"num_speculative_tokens must be in 1..{MAX_LOOKAHEAD - 1}, "
        f"got {self.num_speculative_tokens}"
      )

  @property
  def q_len(self) -> int:
    return self.num_speculative_tokens + 1


class SpeculativeGenerator(Generator):
  """`Generator` whose decode loop drafts with the model's MTP layer and verifies with the target.

  Example:
    gen = SpeculativeGenerator(model, EngineConfig(max_seq_len=512), SpeculativeConfig(3))
    out = gen.generate(prompts, max_new_tokens=64)
    out.metrics["acceptance_rate"], out.metrics["per_position_acceptance"]
  """

  def __init__(
    self,
    model: GlmForCausalLM,
    config: EngineConfig | None = None,
    spec: SpeculativeConfig | None = None,
  ):
    if model.mtp is None:
      raise ValueError(
        "speculative decoding needs a model with an MTP layer (num_nextn_predict_layers >= 1)"
      )
    self.spec = spec or SpeculativeConfig()
    super().__init__(model, config)

  @property
  def num_cache_layers(self) -> int:
    return self.model.config.num_hidden_layers + 1  # the MTP layer keeps its own cache

  @property
  def lookahead_tokens(self) -> int:
    return self.spec.q_len

  def _metrics(self, waves, outputs, elapsed):
    metrics = super()._metrics(waves, outputs, elapsed)
    k = self.spec.num_speculative_tokens
    cycles = sum(w["cycles"] for w in waves)
    accepted_at = np.sum([w["accepted_at"] for w in waves], axis=0)  # [k]
    metrics.update(
      num_speculative_tokens=k,
      verify_steps=cycles,
      acceptance_rate=float(accepted_at.sum() / max(cycles * k, 1)),
      per_position_acceptance=(accepted_at / max(cycles, 1)).tolist(),
      mean_accepted_length=float((accepted_at.sum() + cycles) / max(cycles, 1)),
    )
    return metrics

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
    k, q_len = self.spec.num_speculative_tokens, self.spec.q_len
    statics = dict(sampling=sampling, attention_impl=self.config.attention_impl)
    drafting = dict(num_draft=k, prune=self.spec.prune_draft_rows, **statics)
    block_tables = jnp.asarray(block_tables)
    key, prefill_key, draft_key = jax.random.split(key, 3)
    first_tokens, hidden, ttft = self._prefill(
      input_ids, prompt_lens, block_tables, sampling, prefill_key
    )
    drafts, draft_probs, self.cache = draft_prefill_step(
      self.graphdef,
      self.params,
      self.cache,
      hidden,
      jnp.asarray(input_ids),
      jnp.asarray(prompt_lens),
      jnp.asarray(first_tokens),
      block_tables,
      draft_key,
      **drafting,
    )
    generated = [[] for _ in range(num_requests)]
    done = np.ones(batch, bool)
    for b in range(num_requests):
      done[b] = append_tokens(generated[b], first_tokens[b : b + 1], max_new_tokens, stop, bar)
    committed = prompt_lens.copy()  # target KV length per request
    last_tokens = jnp.asarray(first_tokens)
    verify_moe = choose_moe_impl(batch * q_len, self.model.config)
    stats = {
      "ttft_s": ttft,
      "step_times": [],
      "tokens_per_step": [],
      "cycles": 0,
      "accepted_at": np.zeros(k, np.int64),
    }
    while not done.all():
      t_step = time.perf_counter()
      seq_lens = np.where(done, 0, committed + q_len).astype(np.int32)
      key, verify_key, draft_key = jax.random.split(key, 3)
      num_accepted, emitted, hidden, self.cache = verify_step(
        self.graphdef,
        self.params,
        self.cache,
        jnp.concatenate([last_tokens[:, None], drafts], axis=1),
        jnp.asarray(seq_lens),
        block_tables,
        draft_probs,
        verify_key,
        moe_impl=verify_moe,
        **statics,
      )
      committed_after = jnp.where(jnp.asarray(done), 0, jnp.asarray(committed) + 1 + num_accepted)
      drafts, draft_probs, self.cache = draft_step(
        self.graphdef,
        self.params,
        self.cache,
        hidden,
        emitted,
        num_accepted,
        committed_after,
        block_tables,
        draft_key,
        **drafting,
      )
      last_tokens = jnp.take_along_axis(emitted, num_accepted[:, None], axis=1)[:, 0]
      host_accepted, host_emitted = np.asarray(num_accepted), np.asarray(emitted)
      stats["step_times"].append(time.perf_counter() - t_step)
      emitted_now = 0
      for b in np.flatnonzero(~done):
        a = int(host_accepted[b])
        stats["cycles"] += 1
        stats["accepted_at"][:a] += 1
        before = len(generated[b])
        done[b] = append_tokens(generated[b], host_emitted[b, : a + 1], max_new_tokens, stop, bar)
        emitted_now += len(generated[b]) - before
        committed[b] += a + 1
      stats["tokens_per_step"].append(emitted_now)
    return generated, stats
