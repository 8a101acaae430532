"""Token sampling: greedy, temperature, top-k and top-p (nucleus), on device with static shapes.

`SamplingParams` is static configuration (a frozen dataclass, hashed into the jit cache key);
the logits and the PRNG key are arrays. `sampling_probs` gives the distribution that `sample`
draws from, which rejection sampling needs for both target and draft.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxspec.checks import is_int, is_number


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters."""

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not is_number(self.temperature) or not math.isfinite(self.temperature):
      raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not is_int(self.top_k):
      raise ValueError(f"top_k must be an int (0 = off), got {self.top_k!r}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if not is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
    # Plain Python numbers: the params are a static jit argument, hashed into the cache key.
    object.__setattr__(self, "temperature", float(self.temperature))
    object.__setattr__(self, "top_k", int(self.top_k))
    object.__setattr__(self, "top_p", float(self.top_p))

  @property
  def greedy(self) -> bool:
    """Whether sampling is greedy (temperature 0: the argmax)."""
    return self.temperature == 0.0


GREEDY = SamplingParams()


def filtered_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Temperature-scaled float32 logits with everything outside top-k / top-p set to -inf.

  logits: [..., V]. Top-p keeps the smallest set of most likely tokens whose probability reaches
  `top_p` (the token that crosses the threshold is kept), as in Holtzman et al., 2019.
  """
  scaled = logits.astype(jnp.float32) / max(params.temperature, 1e-6)
  vocab = scaled.shape[-1]
  if 0 < params.top_k < vocab:
    kth = jax.lax.top_k(scaled, params.top_k)[0][..., -1:]
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
  if params.top_p < 1.0:
    sorted_desc = jnp.flip(jnp.sort(scaled, axis=-1), axis=-1)
    cumulative = jnp.cumsum(jax.nn.softmax(sorted_desc, axis=-1), axis=-1)
    # Probability mass strictly before each sorted token; keep tokens that start below top_p.
    mass_before = cumulative - jax.nn.softmax(sorted_desc, axis=-1)
    keep_sorted = mass_before < params.top_p
    threshold = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    scaled = jnp.where(scaled < threshold, -jnp.inf, scaled)
  return scaled


def sampling_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """The distribution `sample` draws from: [..., V] float32 (one-hot argmax when greedy)."""
  if params.greedy:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(filtered_logits(logits, params), axis=-1)


def sample(logits: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
  """logits: [..., V] -> int32 token ids [...]."""
  if params.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, filtered_logits(logits, params), axis=-1).astype(jnp.int32)
