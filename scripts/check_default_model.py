"""Checks a checkpoint against issue 16's bar for the embedded default model, on any backend.

  python scripts/check_default_model.py [MODEL_DIR] [--json-out FILE] [--sample-temperature T]
      [--validation-prompts]

Measures, for MODEL_DIR (default: the embedded model):

- held-out next-token cross-entropy (and bits per byte) on the held-out stdlib files, in
  non-overlapping windows of the training sequence length, as the trainer's evaluation computes
  it (bf16 forward, float32 losses): target <= 2.3;
- k = 3 greedy speculative decoding on held-out prompts (`jaxspec.evaluation.evaluate`, the
  machinery of `python -m jaxspec evaluate`): first-position acceptance >= 0.7 and tokens per
  verify step >= 3.0;
- how strongly the model reinforces a repetition (`repetition.repetition_profile`: the mean
  probability of a repeated held-out span's tokens at each occurrence after 256 tokens of
  held-out text, and the share of them that are the model's argmax, for spans of 12 tokens (a
  line) and 48 (a short function); reported, no target);
- greedy continuations of the six demo prompts (`jaxspec.training.demos.DEMO_PROMPTS`), 96 new
  tokens at most, the prompt encoded and healed as `generate` does (a continuation that ends at
  the model's end-of-text token stops there and counts as ended), the weights in bf16 and in
  float32 (`generate --dtype float32`), the worse of the two counting: no line more than twice,
  and more than half parse with `ast.parse` when cut at the last complete line (whole when
  ended).
  With `--sample-temperature T` the same prompts are also sampled (top-p 0.95, fixed seed) and
  reported the same way, to compare with greedy. `--validation-prompts` continues twelve other
  prompts of the same kinds instead (`VALIDATION_PROMPTS`), to choose between candidate
  checkpoints while the demo prompts stay an unseen test of the chosen one.

Prints the continuations, a table with each target and PASS / FAIL, and one JSON object (also
written to --json-out).
"""

import argparse
import json
import math
import sys
from pathlib import Path

import jax.numpy as jnp
import tokenizers
from flax import nnx

import jaxspec
from jaxspec.__main__ import DEFAULT_MODEL
from jaxspec.evaluation import EvalConfig, evaluate
from jaxspec.model.metadata import KernelChoices
from jaxspec.serving.engine import EngineConfig, Generator
from jaxspec.serving.sampling import SamplingParams
from jaxspec.tokenizer import load_tokenizer
from jaxspec.training import corpus, repetition, trainer
from jaxspec.training.demos import (
  DEMO_NEW_TOKENS,
  DEMO_PROMPTS,
  MAX_LINE_REPEATS,
  MIN_PARSE_RATE,
  VALIDATION_PROMPTS,
  healed_demo_quality,
  worst_of,
)

SAMPLE_TOP_P = 0.95
TARGETS = {  # name: (threshold, "max" | "min")
  "held_out_ce": (2.3, "max"),
  "first_position_acceptance_k3": (0.7, "min"),
  "tokens_per_verify_step_k3": (3.0, "min"),
  "demo_max_line_repeats": (MAX_LINE_REPEATS, "max"),
}


def held_out_stream(model_dir: Path):
  """(the held-out stdlib files, their tokens as the trainer streams them, int32 [N])."""
  bpe = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
  _, held_out_files = corpus.split_corpus(max_files=0)
  return held_out_files, trainer.encode_files(bpe, held_out_files)


def held_out_cross_entropy(model, held_out_files, stream, seq_len: int) -> dict:
  """The trainer's held-out evaluation of a loaded checkpoint (bf16 forward, like training)."""
  windows = trainer.eval_windows(stream, seq_len, 3, None)
  config = trainer.TrainConfig(
    vocab_size=model.config.vocab_size, seq_len=seq_len, eval_draft_depth=3, eval_batch_size=8
  )
  evaluator = trainer.Trainer(model.config, config)
  evaluator.params = nnx.state(model, nnx.Param)
  metrics = evaluator.evaluate(windows)
  held_out_bytes = sum(len(f.text.encode("utf-8")) for f in held_out_files)
  return {
    "seq_len": seq_len,
    "windows": len(windows),
    "ce": metrics["lm_loss"],
    "bits_per_byte": metrics["lm_loss"] * len(stream) / held_out_bytes / math.log(2),
    "bytes_per_token": held_out_bytes / len(stream),
    "teacher_forced_tokens_per_step_k3": metrics["tokens_per_step_k3"],
  }


def demo_continuations(
  model, tokenizer, sampling: SamplingParams, seed: int = 0, prompt_texts=DEMO_PROMPTS
) -> dict:
  """The demo prompts (or `prompt_texts`) continued as `python -m jaxspec generate` continues
  them (token healing on), scored by `demo_quality`."""

  def continue_prompts(ids, first_token_masks):
    max_seq_len = max(map(len, ids)) + DEMO_NEW_TOKENS
    engine = Generator(model, EngineConfig(max_batch_size=len(ids), max_seq_len=max_seq_len))
    out = engine.generate(
      ids,
      max_new_tokens=DEMO_NEW_TOKENS,
      sampling=sampling,
      seed=seed,
      first_token_masks=first_token_masks,
    )
    return out.tokens

  return healed_demo_quality(
    tokenizer,
    model.config.vocab_size,
    continue_prompts,
    prompt_texts,
    stop_token_ids=model.config.eos_token_ids,
  )


def _print_samples(title: str, report: dict) -> None:
  print(f"\n==== {title}")
  for sample in report["samples"]:
    verdict = "parses" if sample["parses"] else "does not parse"
    print(f"---- {verdict}; most repeated line x{sample['max_line_repeats']}")
    print(sample["prompt"] + sample["continuation"])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("model_dir", nargs="?", type=Path, default=DEFAULT_MODEL)
  parser.add_argument("--json-out", type=Path, help="also write the JSON result here")
  parser.add_argument(
    "--sample-temperature", type=float, help="also sample the demos at this temperature"
  )
  parser.add_argument(
    "--validation-prompts",
    action="store_true",
    help="continue jaxspec.training.demos.VALIDATION_PROMPTS instead of the demo prompts (to "
    "choose between candidates without looking at the demos)",
  )
  args = parser.parse_args(argv)
  prompt_texts = VALIDATION_PROMPTS if args.validation_prompts else DEMO_PROMPTS
  model_dir = args.model_dir
  model = jaxspec.load_pretrained(model_dir, dtype=jnp.float32)
  tokenizer = load_tokenizer(model_dir)
  log_path = model_dir / "training_log.json"
  seq_len = 512
  if log_path.exists():
    seq_len = json.loads(log_path.read_text())["train_config"]["seq_len"]

  held_out_files, stream = held_out_stream(model_dir)
  held_out = held_out_cross_entropy(model, held_out_files, stream, seq_len)
  bf16_model = jaxspec.load_pretrained(model_dir, dtype=jnp.bfloat16)  # as `generate` serves it
  (row,) = evaluate(
    bf16_model,
    tokenizer,
    EvalConfig(spec_tokens=(3,), temperatures=(0.0,)),
    progress=False,
  )
  repeats = repetition.repetition_profiles(model, stream, KernelChoices())
  # Greedy text can flip with the weights' precision: `generate` serves bf16 by default and
  # float32 with `--dtype float32`; the worse of the two counts, as the trainer scores its demos.
  by_precision = {
    name: demo_continuations(m, tokenizer, SamplingParams(), prompt_texts=prompt_texts)
    for name, m in (("bfloat16", bf16_model), ("float32", model))
  }
  for name, report in by_precision.items():
    _print_samples(f"greedy demos (96 new tokens, {name})", report)
  greedy = worst_of(by_precision, samples_from="bfloat16")
  result = {
    "model_dir": str(model_dir),
    "prompts": "validation" if args.validation_prompts else "demo",
    "held_out": held_out,
    "k3_greedy": row,
    "greedy_demos": greedy,
    "greedy_demos_float32": by_precision["float32"],
    "repeated_span_by_occurrence": repeats,
    "measured": {
      "held_out_ce": held_out["ce"],
      "first_position_acceptance_k3": row["per_position_acceptance"][0],
      "tokens_per_verify_step_k3": row["tokens_per_verify_step"],
      "demo_max_line_repeats": greedy["max_line_repeats"],
      "demo_parse_rate": greedy["parse_rate"],
    },
  }
  if args.sample_temperature is not None:
    sampling = SamplingParams(temperature=args.sample_temperature, top_p=SAMPLE_TOP_P)
    sampled = demo_continuations(bf16_model, tokenizer, sampling, prompt_texts=prompt_texts)
    _print_samples(f"sampled demos (T={args.sample_temperature}, top-p {SAMPLE_TOP_P})", sampled)
    result["sampled_demos"] = sampled | {"temperature": args.sample_temperature}

  measured = result["measured"]
  lines = ["", "| target | measured | bar | |", "| --- | --- | --- | --- |"]
  for name, (bar, kind) in TARGETS.items():
    value = measured[name]
    ok = value <= bar if kind == "max" else value >= bar
    shown = f"{value}" if isinstance(value, int) else f"{value:.3f}"
    lines.append(f"| {name} | {shown} | {'<=' if kind == 'max' else '>='} {bar} | {ok} |")
  parse_ok = measured["demo_parse_rate"] > MIN_PARSE_RATE
  lines.append(
    f"| demo_parse_rate | {measured['demo_parse_rate']:.2f} | > {MIN_PARSE_RATE} | {parse_ok} |"
  )
  lines.append(
    "(demos by precision: "
    + "; ".join(
      f"{name} line x{r['max_line_repeats']}, parse rate {r['parse_rate']:.2f}"
      for name, r in greedy["by_name"].items()
    )
    + ")"
  )
  lines.append(
    f"(held-out: {held_out['windows']} windows of {seq_len} tokens, "
    f"{held_out['bits_per_byte']:.3f} bits/byte, {held_out['bytes_per_token']:.2f} bytes/token; "
    f"k=3 per position {' / '.join(f'{a:.2f}' for a in row['per_position_acceptance'])})"
  )
  for (span, count), profile in zip(repetition.DIAGNOSTIC_SPANS, repeats.values(), strict=True):
    lines.append(
      f"(a held-out {span}-token span repeated after 256 tokens of its text, occurrences "
      f"2..{count}: mean probability of its tokens "
      + " / ".join(f"{p:.2f}" for p in profile["probability"])
      + ", share that is the argmax "
      + " / ".join(f"{p:.2f}" for p in profile["argmax"])
      + "; greedy decoding repeats what is the argmax)"
    )
  if "sampled_demos" in result:
    sampled = result["sampled_demos"]
    lines.append(
      f"(sampled demos: most repeated line x{sampled['max_line_repeats']}, "
      f"parse rate {sampled['parse_rate']:.2f})"
    )
  print("\n".join(lines))
  text = json.dumps(result, indent=1)
  print(text)
  if args.json_out is not None:
    args.json_out.write_text(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
