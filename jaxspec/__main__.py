"""Command line: `python -m jaxspec generate --prompt TEXT [options]`."""

import argparse
import json
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.model.config import tiny
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.model.weights import load_pretrained
from jaxspec.serving.engine import EngineConfig, Generator
from jaxspec.serving.sampling import SamplingParams
from jaxspec.tokenizer import ByteTokenizer, load_tokenizer

_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def _random_default_model():
  """A tiny randomly initialised GLM over raw bytes: stands in until a trained model ships."""
  config = tiny(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
  )
  return GlmForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0)), ByteTokenizer()


def _build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m jaxspec", description=__doc__)
  commands = parser.add_subparsers(dest="command", required=True)
  gen = commands.add_parser("generate", help="generate a continuation of a prompt")
  gen.add_argument("--prompt", required=True, help="text to continue")
  gen.add_argument(
    "--model",
    help="Hugging Face checkpoint directory (config.json, "
    "*.safetensors, tokenizer.json); default: a tiny random model",
  )
  gen.add_argument(
    "--spec-tokens", type=int, default=0, help="draft tokens per step (k); 0 = plain decoding"
  )
  gen.add_argument("--max-new-tokens", type=int, default=64)
  gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  gen.add_argument("--top-k", type=int, default=0, help="0 = off")
  gen.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
  gen.add_argument("--seed", type=int, default=0)
  gen.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
  gen.add_argument("--page-size", type=int, default=16)
  gen.add_argument("--json", action="store_true", help="print one JSON object")
  return parser


def generate(args) -> dict:
  if args.spec_tokens != 0:
    raise SystemExit(
      "error: --spec-tokens > 0 needs the MTP speculative engine, which this "
      "version does not include yet; use --spec-tokens 0"
    )
  if args.model:
    model = load_pretrained(args.model, dtype=_DTYPES[args.dtype])
    tokenizer = load_tokenizer(args.model)
    model_name = args.model
  else:
    model, tokenizer = _random_default_model()
    model_name = "tiny random-init GLM (no trained default model yet: the text is noise)"
  prompt_ids = tokenizer.encode(args.prompt)
  if not prompt_ids:
    raise SystemExit("error: --prompt encodes to no tokens")
  sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
  max_seq_len = len(prompt_ids) + args.max_new_tokens
  engine = Generator(
    model, EngineConfig(max_batch_size=1, max_seq_len=max_seq_len, page_size=args.page_size)
  )
  out = engine.generate(
    [prompt_ids],
    max_new_tokens=args.max_new_tokens,
    sampling=sampling,
    seed=args.seed,
    progress=not args.json,
  )
  tokens = out.tokens[0]
  return {
    "model": model_name,
    "device": jax.devices()[0].device_kind,
    "prompt": args.prompt,
    "text": tokenizer.decode(tokens),
    "tokens": tokens,
    "spec_tokens": args.spec_tokens,
    # Plain decoding accepts no drafts: one token per step.
    "acceptance_rate": None,
    "per_position_acceptance": [],
    "mean_accepted_length": 1.0,
    **{k: out.metrics[k] for k in ("tokens_per_s", "ttft_s", "itl_s", "tpot_s", "elapsed_s")},
  }


def main(argv=None) -> int:
  args = _build_parser().parse_args(argv)
  result = generate(args)
  if args.json:
    print(json.dumps(result))
  else:
    print(f"model: {result['model']}")
    print(f"{result['prompt']}{result['text']}")
    print(
      f"-- {len(result['tokens'])} tokens, {result['tokens_per_s']:.1f} tok/s, "
      f"TTFT {result['ttft_s'] * 1e3:.0f} ms, TPOT {result['tpot_s'] * 1e3:.1f} ms",
      file=sys.stderr,
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
