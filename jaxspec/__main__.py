"""Command line: `python -m jaxspec generate --prompt TEXT [options]`."""

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxspec.evaluation import EvalConfig, evaluate, format_table
from jaxspec.model.weights import load_pretrained
from jaxspec.serving.engine import EngineConfig, Generator
from jaxspec.serving.sampling import SamplingParams
from jaxspec.serving.speculative import SpeculativeConfig, SpeculativeGenerator
from jaxspec.tokenizer import load_tokenizer
from jaxspec.training.cli import add_train_parser, run_train

# A 5M-parameter GLM-4.5-style MoE with its MTP layer, trained on the Python standard library
# (`python -m jaxspec train`); shipped inside the package.
DEFAULT_MODEL = Path(__file__).parent / "assets" / "default_model"

_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def _build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m jaxspec", description=__doc__)
  commands = parser.add_subparsers(dest="command", required=True)
  gen = commands.add_parser("generate", help="generate a continuation of a prompt")
  gen.add_argument("--prompt", required=True, help="text to continue")
  gen.add_argument(
    "--model",
    help="Hugging Face checkpoint directory (config.json, "
    "*.safetensors, tokenizer.json); default: the embedded model",
  )
  gen.add_argument(
    "--spec-tokens", type=int, default=3, help="draft tokens per step (k); 0 = plain decoding"
  )
  gen.add_argument("--max-new-tokens", type=int, default=64)
  gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  gen.add_argument("--top-k", type=int, default=0, help="0 = off")
  gen.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
  gen.add_argument("--seed", type=int, default=0)
  gen.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
  gen.add_argument("--page-size", type=int, default=16)
  gen.add_argument(
    "--compare",
    action="store_true",
    help="also run plain decoding on the same prompt and report both throughputs",
  )
  gen.add_argument("--json", action="store_true", help="print one JSON object")
  add_train_parser(commands)
  ev = commands.add_parser(
    "evaluate", help="acceptance per draft position on held-out stdlib files, for each k"
  )
  ev.add_argument("--model", help="checkpoint directory; default: the embedded model")
  ev.add_argument("--spec-tokens", type=int, nargs="+", default=[1, 2, 3, 4, 5])
  ev.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
  ev.add_argument("--num-prompts", type=int, default=16)
  ev.add_argument("--prompt-tokens", type=int, default=96)
  ev.add_argument("--max-new-tokens", type=int, default=64)
  ev.add_argument("--seed", type=int, default=0)
  ev.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
  ev.add_argument("--json", action="store_true", help="print the rows as JSON")
  return parser


def _run(model, prompt_ids, args, spec_tokens: int) -> dict:
  """Generates with plain decoding (spec_tokens 0) or MTP speculation; returns the metrics.

  A two-token warm-up run on the same shapes compiles every step first, so the reported
  throughput and latencies exclude compilation.
  """
  sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
  engine_config = EngineConfig(
    max_batch_size=1, max_seq_len=len(prompt_ids) + args.max_new_tokens, page_size=args.page_size
  )
  if spec_tokens:
    engine = SpeculativeGenerator(model, engine_config, SpeculativeConfig(spec_tokens))
  else:
    engine = Generator(model, engine_config)
  engine.generate([prompt_ids], max_new_tokens=min(2, args.max_new_tokens), sampling=sampling)
  out = engine.generate(
    [prompt_ids],
    max_new_tokens=args.max_new_tokens,
    sampling=sampling,
    seed=args.seed,
    progress=not args.json,
  )
  return {"tokens": out.tokens[0], **out.metrics.as_dict()}


def generate(args) -> dict:
  if not 0 <= args.spec_tokens <= 7:
    raise SystemExit(f"error: --spec-tokens must be in 0..7, got {args.spec_tokens}")
  model_dir = args.model or DEFAULT_MODEL
  model = load_pretrained(model_dir, dtype=_DTYPES[args.dtype])
  tokenizer = load_tokenizer(model_dir)
  model_name = args.model or "jaxspec default (5M GLM-4.5-style MoE + MTP, Python stdlib)"
  if args.spec_tokens and model.mtp is None:
    raise SystemExit(f"error: {model_name} has no MTP layer; use --spec-tokens 0")
  prompt_ids = tokenizer.encode(args.prompt)
  if not prompt_ids:
    raise SystemExit("error: --prompt encodes to no tokens")
  run = _run(model, prompt_ids, args, args.spec_tokens)
  result = {
    "model": model_name,
    "device": jax.devices()[0].device_kind,
    "prompt": args.prompt,
    "text": tokenizer.decode(run["tokens"]),
    "spec_tokens": args.spec_tokens,
    **run,
  }
  if args.compare:
    baseline = _run(model, prompt_ids, args, 0)
    result["baseline"] = {k: baseline[k] for k in ("tokens_per_s", "tpot_s", "itl_s", "ttft_s")}
    result["baseline"]["same_tokens"] = baseline["tokens"] == run["tokens"]
    result["speedup"] = run["tokens_per_s"] / baseline["tokens_per_s"]
  return result


def _print_report(result) -> None:
  print(f"model: {result['model']}")
  print(f"{result['prompt']}{result['text']}")
  lines = [
    f"-- {len(result['tokens'])} tokens, {result['tokens_per_s']:.1f} tok/s, "
    f"TTFT {result['ttft_s'] * 1e3:.0f} ms, TPOT {result['tpot_s'] * 1e3:.1f} ms"
  ]
  if result["spec_tokens"]:
    per_position = ", ".join(f"{a:.2f}" for a in result["per_position_acceptance"])
    lines.append(
      f"-- k={result['spec_tokens']}: acceptance {result['acceptance_rate']:.2f} "
      f"(per position {per_position}), {result['mean_accepted_length']:.2f} tokens "
      f"per verify step"
    )
  if "baseline" in result:
    lines.append(
      f"-- plain decoding: {result['baseline']['tokens_per_s']:.1f} tok/s; "
      f"speculative / plain = {result['speedup']:.2f}x"
    )
  print("\n".join(lines), file=sys.stderr)


def run_evaluate(args) -> int:
  if any(not 1 <= k <= 7 for k in args.spec_tokens):
    raise SystemExit(f"error: --spec-tokens values must be in 1..7, got {args.spec_tokens}")
  model_dir = args.model or DEFAULT_MODEL
  model = load_pretrained(model_dir, dtype=_DTYPES[args.dtype])
  config = EvalConfig(
    spec_tokens=tuple(args.spec_tokens),
    temperatures=tuple(args.temperatures),
    num_prompts=args.num_prompts,
    prompt_tokens=args.prompt_tokens,
    max_new_tokens=args.max_new_tokens,
    seed=args.seed,
  )
  rows = evaluate(model, load_tokenizer(model_dir), config, progress=not args.json)
  print(json.dumps(rows) if args.json else format_table(rows))
  return 0


def main(argv=None) -> int:
  args = _build_parser().parse_args(argv)
  if args.command == "train":
    return run_train(args)
  if args.command == "evaluate":
    return run_evaluate(args)
  result = generate(args)
  if args.json:
    print(json.dumps(result))
  else:
    _print_report(result)
  return 0


if __name__ == "__main__":
  sys.exit(main())
