"""Speculative decoding quality on held-out text: acceptance per draft position for each k.

Prompts are fixed windows of the training corpus's held-out files (`jaxspec.training.corpus.
HELD_OUT_FILES`, read from the running interpreter's standard library): `num_prompts` windows of
`prompt_tokens` tokens, spread evenly over the concatenated held-out files. For every k and
temperature, `SpeculativeGenerator` continues every prompt by `max_new_tokens` tokens (no early
stop, so every configuration verifies the same amount of text) and reports the acceptance rate,
the acceptance of each draft position, and the mean tokens per verify step (accepted drafts plus
the bonus token).
"""

import dataclasses

import numpy as np
from tqdm.auto import tqdm

from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.serving.engine import EngineConfig
from jaxspec.serving.sampling import SamplingParams
from jaxspec.serving.speculative import SpeculativeConfig, SpeculativeGenerator
from jaxspec.training import corpus


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Settings of `evaluate`: the draft-token counts and sampling temperatures to run,
  the held-out prompt windows (how many, how many tokens each), the tokens generated per prompt,
  the batch size, the sampling seed and the KV pages' dtype and fp8 scale."""

  spec_tokens: tuple[int, ...] = (1, 2, 3, 4, 5)
  temperatures: tuple[float, ...] = (0.0, 0.7)
  # 512 windows cover about half of the held-out files' 88k tokens (default tokenizer). Fewer
  # swing the mean: the embedded model's k = 3 greedy tokens per verify step was 2.87 on 16,
  # 2.99 on 128 and 2.94 on 512 (benchmarks/results/default_model_8_layers_draft_phases.md).
  num_prompts: int = 512
  prompt_tokens: int = 96
  max_new_tokens: int = 64
  batch_size: int = 8
  seed: int = 0
  # The KV pages' dtype and fp8 scale, as `EngineConfig.kv_cache_dtype` / `kv_scale`.
  kv_cache_dtype: str = "auto"
  kv_scale: float = 1.0


def held_out_prompts(tokenizer, num_prompts: int, prompt_tokens: int) -> list[list[int]]:
  """`num_prompts` windows of `prompt_tokens` tokens, evenly spaced over the held-out files."""
  _, held_out = corpus.split_corpus(max_files=0)
  if not held_out:
    raise FileNotFoundError("none of the held-out files exists in this interpreter's stdlib")
  stream = np.concatenate([np.asarray(tokenizer.encode(f.text), np.int32) for f in held_out])
  if len(stream) < num_prompts * prompt_tokens:
    raise ValueError(
      f"held-out text has {len(stream)} tokens, fewer than the "
      f"{num_prompts} x {prompt_tokens} the prompts need"
    )
  starts = np.linspace(0, len(stream) - prompt_tokens, num_prompts).astype(int)
  return [stream[s : s + prompt_tokens].tolist() for s in starts]


def evaluate(
  model: GlmForCausalLM,
  tokenizer,
  config: EvalConfig = EvalConfig(),
  progress: bool = True,
  prompts: list[list[int]] | None = None,
) -> list[dict]:
  """One row per (temperature, k): acceptance statistics over the held-out prompts.

  `prompts`: the output of `held_out_prompts` for this tokenizer and config, when the caller
  already has them.
  """
  if prompts is None:
    prompts = held_out_prompts(tokenizer, config.num_prompts, config.prompt_tokens)
  engine_config = EngineConfig(
    max_batch_size=config.batch_size,
    max_seq_len=config.prompt_tokens + config.max_new_tokens,
    min_prompt_bucket=config.prompt_tokens,
    kv_cache_dtype=config.kv_cache_dtype,
    kv_scale=config.kv_scale,
  )
  rows = []
  grid = [(t, k) for t in config.temperatures for k in config.spec_tokens]
  for temperature, k in tqdm(grid, desc="evaluating", disable=not progress):
    generator = SpeculativeGenerator(model, engine_config, SpeculativeConfig(k))
    out = generator.generate(
      prompts,
      max_new_tokens=config.max_new_tokens,
      sampling=SamplingParams(temperature=temperature),
      seed=config.seed,
      stop_token_ids=(),
    )
    metrics = out.metrics
    rows.append(
      {
        "temperature": temperature,
        "k": k,
        "acceptance_rate": metrics.acceptance_rate,
        "per_position_acceptance": metrics.per_position_acceptance,
        "tokens_per_verify_step": metrics.mean_accepted_length,
        "verify_steps": metrics.verify_steps,
      }
    )
  return rows


def format_table(rows: list[dict]) -> str:
  """Markdown table of `evaluate`'s rows."""
  lines = [
    "| temperature | k | acceptance | per position | tokens / verify step |",
    "|---|---|---|---|---|",
  ]
  for row in rows:
    per_position = " / ".join(f"{a:.2f}" for a in row["per_position_acceptance"])
    lines.append(
      f"| {row['temperature']:g} | {row['k']} | {row['acceptance_rate']:.3f} | "
      f"{per_position} | {row['tokens_per_verify_step']:.2f} |"
    )
  return "\n".join(lines)
