"""MTP speculative decoding: draft k tokens with the MTP head, verify them with the target.

One cycle per step, for a static batch of requests (DeepSeek-V3 / GLM MTP as vLLM serves it),
run as one program (`cycle_step`: one dispatch per cycle):

1. `verify_step`: the target runs `q_len = k + 1` rows per request (the last committed token and
   the k drafts) through `paged_decode_attention`; greedy acceptance or rejection sampling keeps a
   prefix of the drafts and adds one bonus token. Each request accepts its own number.
2. `draft_step`: the MTP layer runs the same q_len rows (tokens shifted by one, the bonus written
   at the last accepted row), then k - 1 single-row steps, and proposes the next k drafts.
3. The host reads the emitted tokens (the only device-to-host copy of the cycle) to apply stop
   tokens and lengths, after it has dispatched the next cycle: what a cycle hands to the next
   (`CycleState`: last token, drafts, lengths) never leaves the device. Rejected rows are rolled
   back by length: their cache slots are simply overwritten by the next cycle.

Greedy speculative decoding emits exactly the tokens of greedy plain decoding; with temperature it
samples exactly the target distribution (speculative sampling).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.serving.engine import MAX_LOOKAHEAD, EngineConfig, Generator, Prefill, Wave
from jaxspec.serving.spec_steps import CycleState, cycle_step, draft_prefill_step, retire


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """`num_speculative_tokens` = k drafts per cycle (1..7); `prune_draft_rows` switches row
  pruning in the draft's first step (off only to measure what it saves)."""

  num_speculative_tokens: int = 3
  prune_draft_rows: bool = True

  def __post_init__(self):
    k = self.num_speculative_tokens
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_LOOKAHEAD - 1:
      raise ValueError(
        f"num_speculative_tokens must be an int in 1..{MAX_LOOKAHEAD - 1}, got {k!r}"
      )
    if not isinstance(self.prune_draft_rows, bool):
      raise ValueError(f"prune_draft_rows must be a bool, got {self.prune_draft_rows!r}")

  @property
  def q_len(self) -> int:
    """Rows per request in a verify step: the last accepted token and the drafts."""
    return self.num_speculative_tokens + 1


class MtpDecoding:
  """Decoding strategy: draft k tokens with the model's MTP layer, verify them with the target."""

  needs_draft_cache = True

  def __init__(self, spec: SpeculativeConfig | None = None):
    self.spec = spec or SpeculativeConfig()
    if not isinstance(self.spec, SpeculativeConfig):
      raise TypeError(f"spec must be a SpeculativeConfig, got {type(self.spec).__name__}")

  @property
  def lookahead_tokens(self) -> int:
    """Cache slots a step may write past a request's committed tokens: `q_len`."""
    return self.spec.q_len

  @property
  def num_speculative_tokens(self) -> int:
    """Draft tokens proposed per step."""
    return self.spec.num_speculative_tokens

  def check_model(self, model: GlmForCausalLM) -> None:
    """`ValueError` when the model has no MTP layer to draft with."""
    if model.mtp is None:
      reason = getattr(model, "missing_mtp_reason", None)
      raise ValueError(
        "speculative decoding needs a model with an MTP layer (num_nextn_predict_layers >= 1)"
        + (f": {reason}" if reason else "")
      )

  def begin(self, engine: Generator, wave: Wave, prefill: Prefill) -> "_MtpWave":
    """Starts drafting and verifying a prefilled wave."""
    return _MtpWave(self.spec, engine, wave, prefill)


class _MtpWave:
  """The draft/verify cycle of one wave; its `CycleState` stays on the device between cycles."""

  def __init__(self, spec: SpeculativeConfig, engine: Generator, wave: Wave, prefill: Prefill):
    self.spec, self.engine = spec, engine
    self.statics = dict(sampling=wave.sampling, kernels=engine.config.kernels)
    self.drafting = dict(num_draft=spec.num_speculative_tokens, prune=spec.prune_draft_rows)
    drafts, draft_probs, engine.cache = draft_prefill_step(
      engine.graph,
      engine.params,
      engine.cache,
      prefill.hidden,
      jnp.asarray(wave.input_ids),
      jnp.asarray(wave.prompt_lens),
      jnp.asarray(prefill.first_tokens),
      wave.block_tables,
      wave.next_key(),
      **self.statics,
      **self.drafting,
    )
    self.state = CycleState(
      last_tokens=prefill.first_tokens,
      drafts=drafts,
      draft_probs=draft_probs,
      seq_lens=np.where(wave.done, 0, wave.prompt_lens + spec.q_len).astype(np.int32),
    )
    self.retired = wave.done.copy()

  def launch(self, wave: Wave) -> jax.Array:
    engine = self.engine
    if (wave.done & ~self.retired).any():  # only when a request has finished
      self.state, self.retired = retire(self.state, wave.done), wave.done.copy()
    emitted, self.state, engine.cache = cycle_step(
      engine.graph,
      engine.params,
      engine.cache,
      self.state,
      wave.block_tables,
      wave.next_key(),
      **self.statics,
      **self.drafting,
    )
    return emitted


class SpeculativeGenerator(Generator):
  """`Generator` with the `MtpDecoding` strategy (drafts from the model's MTP layer).

  Example:
    gen = SpeculativeGenerator(model, EngineConfig(max_seq_len=512), SpeculativeConfig(3))
    out = gen.generate(prompts, max_new_tokens=64)
    out.metrics.acceptance_rate, out.metrics.per_position_acceptance
  """

  def __init__(
    self,
    model: GlmForCausalLM,
    config: EngineConfig | None = None,
    spec: SpeculativeConfig | None = None,
  ):
    super().__init__(model, config, MtpDecoding(spec))

  @property
  def spec(self) -> SpeculativeConfig:
    """The speculative settings this generator decodes with."""
    return self.strategy.spec
