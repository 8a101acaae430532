"""How much fp8 KV pages change a checkpoint's greedy output, against 16-bit pages.

  python scripts/check_fp8_kv_cache.py [MODEL_DIR] [--num-prompts N] [--kv-scale S]
      [--json-out FILE]

For MODEL_DIR (default: the embedded model), in bf16:

- greedy continuations of `--num-prompts` windows of the held-out stdlib files
  (`jaxspec.evaluation.held_out_prompts`, the prompts of `python -m jaxspec evaluate`), by plain
  decoding on 16-bit KV pages and on float8_e4m3fn pages (`EngineConfig.kv_cache_dtype`, each
  key and value stored as value / `--kv-scale`, rounded to e4m3, and read back times the scale):
  the share of continuations that are identical, the position of the first different token in
  those that are not, and the share of all new tokens generated before the first difference;
- for scale, the same comparison between float32 and bf16 weights on 16-bit pages: rounding
  that `generate` already accepts;
- k = 3 greedy speculative decoding on each kind of page (`jaxspec.evaluation.evaluate`):
  acceptance per draft position and tokens per verify step.

Greedy decoding follows the argmax, so a continuation changes from the first position where the
two caches' logits order two tokens differently; after that the two texts go their own ways
and later positions say nothing about the cache. The first difference is what this measures.
On a Hopper GPU the fp8 pages are read by the Pallas kernel, elsewhere by the XLA reference.
Prints a table and one JSON object (also written to --json-out).
"""

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec import argtypes
from jaxspec.__main__ import DEFAULT_MODEL
from jaxspec.evaluation import EvalConfig, evaluate, held_out_prompts
from jaxspec.serving.engine import EngineConfig, Generator
from jaxspec.tokenizer import load_tokenizer

FP8 = "float8_e4m3fn"


def greedy_continuations(
  model, prompts, *, max_new_tokens: int, batch_size: int, kv_cache_dtype: str, kv_scale: float
) -> list[list[int]]:
  """Plain greedy continuations of `prompts` (equal lengths), `max_new_tokens` each, no stop."""
  engine = EngineConfig(
    max_batch_size=batch_size,
    max_seq_len=len(prompts[0]) + max_new_tokens,
    min_prompt_bucket=len(prompts[0]),
    kv_cache_dtype=kv_cache_dtype,
    kv_scale=kv_scale,
  )
  out = Generator(model, engine).generate(
    prompts, max_new_tokens=max_new_tokens, stop_token_ids=(), progress=True
  )
  return out.tokens


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
  """How far `other`'s continuations follow `reference`'s, prompt by prompt."""
  first_differences = []
  matched = total = 0
  for want, got in zip(reference, other, strict=True):
    total += len(want)
    if len(got) != len(want):
      raise ValueError(f"continuations of {len(want)} and {len(got)} tokens do not compare")
    first = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)
    matched += len(want) if first is None else first
    if first is not None:
      first_differences.append(first)
  return {
    "prompts": len(reference),
    "identical": len(reference) - len(first_differences),
    "identical_share": 1 - len(first_differences) / len(reference),
    # 0-based position of the first different new token, in the continuations that differ.
    "first_difference_mean": float(np.mean(first_differences)) if first_differences else None,
    "first_difference_median": float(np.median(first_differences)) if first_differences else None,
    "tokens_before_first_difference_share": matched / total,
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("model_dir", nargs="?", type=Path, default=DEFAULT_MODEL)
  parser.add_argument("--num-prompts", type=argtypes.positive_int, default=512)
  parser.add_argument("--prompt-tokens", type=argtypes.positive_int, default=96)
  parser.add_argument("--max-new-tokens", type=argtypes.positive_int, default=64)
  parser.add_argument("--batch-size", type=argtypes.positive_int, default=32)
  parser.add_argument("--kv-scale", type=argtypes.float_in(0.0, low_open=True), default=1.0)
  parser.add_argument("--json-out", type=Path)
  args = parser.parse_args(argv)
  if not (args.model_dir / "config.json").is_file():
    parser.error(f"{args.model_dir}: no config.json")

  tokenizer = load_tokenizer(args.model_dir)
  prompts = held_out_prompts(tokenizer, args.num_prompts, args.prompt_tokens)
  bf16 = jaxspec.load_pretrained(args.model_dir, dtype=jnp.bfloat16)
  fp32 = jaxspec.load_pretrained(args.model_dir, dtype=jnp.float32)
  run = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, kv_scale=args.kv_scale)
  bf16_pages = greedy_continuations(bf16, prompts, kv_cache_dtype="auto", **run)
  fp8_pages = greedy_continuations(bf16, prompts, kv_cache_dtype=FP8, **run)
  fp32_weights = greedy_continuations(fp32, prompts, kv_cache_dtype="auto", **run)

  eval_config = dict(
    spec_tokens=(3,),
    temperatures=(0.0,),
    num_prompts=args.num_prompts,
    prompt_tokens=args.prompt_tokens,
    max_new_tokens=args.max_new_tokens,
    kv_scale=args.kv_scale,
  )
  k3 = {
    dtype: evaluate(
      bf16, tokenizer, EvalConfig(kv_cache_dtype=dtype, **eval_config), prompts=prompts
    )[0]
    for dtype in ("auto", FP8)
  }
  result = {
    "model_dir": str(args.model_dir),
    "device": jax.devices()[0].device_kind,
    "prompts": {"num": args.num_prompts, "tokens": args.prompt_tokens},
    "max_new_tokens": args.max_new_tokens,
    "kv_scale": args.kv_scale,
    "fp8_pages_vs_bf16_pages": agreement(bf16_pages, fp8_pages),
    "float32_weights_vs_bf16_weights": agreement(bf16_pages, fp32_weights),
    "k3_greedy": {"bf16_pages": k3["auto"], "fp8_pages": k3[FP8]},
  }

  print(
    "| greedy, plain decoding | identical | first difference (mean, median) | tokens before it |"
  )
  print("| --- | --- | --- | --- |")
  for name, label in (
    ("fp8_pages_vs_bf16_pages", "fp8 pages vs bf16 pages (bf16 weights)"),
    ("float32_weights_vs_bf16_weights", "float32 vs bf16 weights (16-bit pages)"),
  ):
    a = result[name]
    where = (
      "-"
      if a["first_difference_mean"] is None
      else f"{a['first_difference_mean']:.1f}, {a['first_difference_median']:.0f}"
    )
    print(
      f"| {label} | {a['identical']} of {a['prompts']} | {where} | "
      f"{a['tokens_before_first_difference_share']:.3f} |"
    )
  for name, row in result["k3_greedy"].items():
    per_position = " / ".join(f"{p:.3f}" for p in row["per_position_acceptance"])
    print(
      f"k = 3 greedy on {name.replace('_', ' ')}: {per_position}, "
      f"{row['tokens_per_verify_step']:.3f} tokens per verify step"
    )
  text = json.dumps(result, indent=1)
  print(text)
  if args.json_out:
    args.json_out.write_text(text + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
