"""Command line: `python -m jaxspec generate --prompt TEXT [options]`, `evaluate`, `train`.

Every bad argument is one `error:` line on stderr and exit status 2, as argparse reports them:
ranges are argparse types (`jaxspec.argtypes`), and the checkpoint directory, its `config.json`
and `tokenizer.json` and the prompt's length are checked before any weight is loaded.
"""

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxspec import argtypes
from jaxspec.compile_cache import enable_compile_cache
from jaxspec.evaluation import EvalConfig, evaluate, format_table, held_out_prompts
from jaxspec.model.weights import load_pretrained, read_config
from jaxspec.serving.engine import KV_CACHE_DTYPES, MAX_LOOKAHEAD, EngineConfig, Generator
from jaxspec.serving.sampling import SamplingParams
from jaxspec.serving.speculative import SpeculativeConfig, SpeculativeGenerator
from jaxspec.serving.token_healing import continuation_text, heal_prompt
from jaxspec.tokenizer import HfTokenizer
from jaxspec.training.cli import add_train_parser, run_train

# A GLM-4.5-style MoE with its MTP layer, trained on Python sources (`python -m jaxspec train`);
# shipped inside the package.
DEFAULT_MODEL = Path(__file__).parent / "assets" / "default_model"
DEFAULT_MODEL_NAME = "jaxspec default (GLM-4.5-style MoE + MTP, trained on Python sources)"

_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
_EVAL = EvalConfig()  # the `evaluate` options' defaults
MAX_SPEC_TOKENS = MAX_LOOKAHEAD - 1  # k draft tokens + 1 verified row fit the lookahead
MAX_PAGE_SIZE = 1024


def _add_kv_cache_options(command: argparse.ArgumentParser) -> None:
  command.add_argument(
    "--kv-cache-dtype",
    choices=KV_CACHE_DTYPES,
    default="auto",
    help="KV pages' dtype: auto = the weights' dtype; float8_e4m3fn halves the bytes each "
    "attention step reads (GQA models), quantised on write as value / --kv-scale",
  )
  command.add_argument(
    "--kv-scale",
    type=argtypes.float_in(0.0, low_open=True),
    help="fp8 pages store value / scale (default 1.0); only with --kv-cache-dtype float8_e4m3fn",
  )


def _build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m jaxspec", description=__doc__)
  commands = parser.add_subparsers(dest="command", required=True)
  gen = commands.add_parser("generate", help="generate a continuation of a prompt")
  gen.set_defaults(command_parser=gen)
  gen.add_argument("--prompt", required=True, help="text to continue")
  gen.add_argument(
    "--model",
    help="Hugging Face checkpoint directory (config.json, "
    "*.safetensors, tokenizer.json); default: the embedded model",
  )
  gen.add_argument(
    "--spec-tokens",
    type=argtypes.int_in(0, MAX_SPEC_TOKENS),
    default=3,
    help=f"draft tokens per step (k, 0..{MAX_SPEC_TOKENS}); 0 = plain decoding",
  )
  gen.add_argument(
    "--max-new-tokens",
    type=argtypes.positive_int,
    default=64,
    help="tokens to generate (prompt + new tokens <= the model's max_position_embeddings)",
  )
  gen.add_argument(
    "--temperature",
    type=argtypes.float_in(0.0),
    help="0 = greedy (lossless); default: the checkpoint's generation_config.json, else 0",
  )
  gen.add_argument(
    "--top-k", type=argtypes.int_in(0), help="0 = off; default: generation_config.json, else 0"
  )
  gen.add_argument(
    "--top-p",
    type=argtypes.float_in(0.0, 1.0, low_open=True),
    help="1.0 = off; default: generation_config.json, else 1.0",
  )
  gen.add_argument("--seed", type=argtypes.seed, default=0, help=f"0..{argtypes.MAX_SEED}")
  gen.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
  gen.add_argument("--page-size", type=argtypes.int_in(1, MAX_PAGE_SIZE), default=16)
  _add_kv_cache_options(gen)
  gen.add_argument(
    "--compare",
    action="store_true",
    help="also run plain decoding on the same prompt and report both throughputs",
  )
  gen.add_argument(
    "--repeats",
    type=argtypes.positive_int,
    default=3,
    help="timed runs after the compiling warm-up (alternating with --compare); the report is "
    "the median run's",
  )
  gen.add_argument(
    "--no-token-healing",
    dest="token_healing",
    action="store_false",
    help="keep the prompt's last token; by default it is removed and the first new token must "
    "start with its text (token healing: a prompt ending in a newline may go on indented)",
  )
  gen.add_argument("--json", action="store_true", help="print one JSON object")
  add_train_parser(commands)
  ev = commands.add_parser(
    "evaluate", help="acceptance per draft position on held-out stdlib files, for each k"
  )
  ev.set_defaults(command_parser=ev)
  ev.add_argument("--model", help="checkpoint directory; default: the embedded model")
  ev.add_argument(
    "--spec-tokens",
    type=argtypes.int_in(1, MAX_SPEC_TOKENS),
    nargs="+",
    default=list(_EVAL.spec_tokens),
  )
  ev.add_argument(
    "--temperatures", type=argtypes.float_in(0.0), nargs="+", default=list(_EVAL.temperatures)
  )
  ev.add_argument(
    "--num-prompts",
    type=argtypes.positive_int,
    default=_EVAL.num_prompts,
    help="windows of the held-out files continued (default %(default)s)",
  )
  ev.add_argument("--prompt-tokens", type=argtypes.positive_int, default=_EVAL.prompt_tokens)
  ev.add_argument("--max-new-tokens", type=argtypes.positive_int, default=_EVAL.max_new_tokens)
  ev.add_argument("--seed", type=argtypes.seed, default=0)
  ev.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
  _add_kv_cache_options(ev)
  ev.add_argument("--json", action="store_true", help="print the rows as JSON")
  return parser


def _checked_model_dir(parser: argparse.ArgumentParser, model: str | None):
  """(directory, config, tokenizer) of `--model`; a parser error for anything unusable.

  Reads only `config.json` and `tokenizer.json`: a broken checkpoint is reported before its
  weights are read.
  """
  directory = Path(model) if model is not None else DEFAULT_MODEL
  if not directory.exists():
    parser.error(f"--model {directory}: no such directory")
  if not directory.is_dir():
    parser.error(f"--model {directory}: not a directory")
  if not os.access(directory, os.R_OK | os.X_OK):
    parser.error(f"--model {directory}: directory not readable")
  try:
    config = read_config(directory / "config.json")
  except (OSError, ValueError, TypeError, KeyError) as error:
    parser.error(f"--model {directory}: cannot read config.json: {error}")
  tokenizer_path = directory / "tokenizer.json"
  if not tokenizer_path.is_file():
    parser.error(f"--model {directory}: no tokenizer.json (a checkpoint needs one to read text)")
  try:
    tokenizer = HfTokenizer(tokenizer_path)
  except Exception as error:  # `tokenizers` raises a bare Exception for a malformed file
    parser.error(f"--model {directory}: cannot read tokenizer.json: {error}")
  if tokenizer.vocab_size > config.vocab_size:
    parser.error(
      f"--model {directory}: tokenizer.json has {tokenizer.vocab_size} tokens, more than the "
      f"model's vocab_size {config.vocab_size}"
    )
  if not any(directory.glob("*.safetensors")):
    parser.error(f"--model {directory}: no *.safetensors weights")
  return directory, config, tokenizer


def _kv_cache(parser: argparse.ArgumentParser, args, config) -> dict:
  """`EngineConfig`'s KV-cache fields from `--kv-cache-dtype` / `--kv-scale`, checked against the
  model's attention before any weight loads."""
  if args.kv_cache_dtype == "auto":
    if args.kv_scale is not None:
      parser.error("--kv-scale applies only with --kv-cache-dtype float8_e4m3fn")
    return {}
  if config.attention_kind != "gqa":
    parser.error(
      f"--kv-cache-dtype {args.kv_cache_dtype}: fp8 KV pages serve GQA attention; this model's "
      f"{config.attention_kind.upper()} cache stays 16-bit"
    )
  scale = 1.0 if args.kv_scale is None else args.kv_scale
  return {"kv_cache_dtype": args.kv_cache_dtype, "kv_scale": scale}


def _sampling(
  parser: argparse.ArgumentParser, directory: Path, args, vocab_size: int
) -> SamplingParams:
  """Sampling settings: the options given, else the checkpoint's `generation_config.json`.

  Hugging Face's convention: `do_sample` false (or no file) is greedy; otherwise `temperature`,
  `top_p` and `top_k` apply (transformers' defaults 1.0, 1.0 and 50 where a field is missing).
  """
  recommended = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
  path = directory / "generation_config.json"
  if path.is_file():
    try:
      raw = json.loads(path.read_text())
    except (OSError, ValueError) as error:
      parser.error(f"--model {directory}: cannot read generation_config.json: {error}")
    if raw.get("do_sample"):
      recommended = {
        "temperature": raw.get("temperature", 1.0),
        "top_p": raw.get("top_p", 1.0),
        "top_k": raw.get("top_k", 50),
      }
    for name, value in recommended.items():
      kind = int if name == "top_k" else (int, float)
      if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value):
        parser.error(f"--model {directory}: generation_config.json has {name} {value!r}")
  given = {name: getattr(args, name) for name in recommended if getattr(args, name) is not None}
  if given.get("top_k", 0) > vocab_size:
    parser.error(f"--top-k must be at most the vocabulary size ({vocab_size})")
  try:
    sampling = SamplingParams(**(recommended | given))
  except (TypeError, ValueError) as error:
    parser.error(f"--model {directory}: generation_config.json: {error}")
  return SamplingParams() if sampling.greedy else sampling  # greedy ignores top-k / top-p


def _load_weights(parser, directory: Path, dtype: str):
  try:
    return load_pretrained(directory, dtype=_DTYPES[dtype])
  except (OSError, ValueError) as error:
    parser.error(f"--model {directory}: {error}")


def _warm_engine(
  model, prompt_ids, first_token_mask, args, sampling: SamplingParams, spec_tokens: int, kv_cache
):
  """A plain (spec_tokens 0) or MTP-speculative engine for the prompt, its steps compiled by a
  two-token run on the same shapes and first-token mask, so that timed runs exclude compilation."""
  engine_config = EngineConfig(
    max_batch_size=1,
    max_seq_len=len(prompt_ids) + args.max_new_tokens,
    page_size=args.page_size,
    **kv_cache,
  )
  if spec_tokens:
    engine = SpeculativeGenerator(model, engine_config, SpeculativeConfig(spec_tokens))
  else:
    engine = Generator(model, engine_config)
  engine.generate(
    [prompt_ids],
    max_new_tokens=min(2, args.max_new_tokens),
    sampling=sampling,
    first_token_masks=[first_token_mask],
  )
  return engine


def _timed_runs(
  engines: dict, prompt_ids, first_token_mask, args, sampling: SamplingParams
) -> dict[str, dict]:
  """`args.repeats` runs of every engine, alternating between them (a drift of the machine's
  speed hits each alike); per engine, the run of median throughput (tokens and metrics)."""
  runs = {name: [] for name in engines}
  for repeat in range(args.repeats):
    for name, engine in engines.items():
      out = engine.generate(
        [prompt_ids],
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        seed=args.seed,
        first_token_masks=[first_token_mask],
        progress=not args.json and repeat == 0,
      )
      runs[name].append({"tokens": out.tokens[0], **out.metrics.as_dict()})
  return {
    name: sorted(rows, key=lambda row: row["tokens_per_s"])[len(rows) // 2]
    for name, rows in runs.items()
  }


def generate(args) -> dict:
  """The `generate` command: loads the model (by default the embedded one), generates from
  `--prompt` as the arguments ask (speculative or plain, sampling, token healing, fp8 KV pages)
  and returns the text, tokens and timings as a dict (with `--compare`, also plain decoding's
  timings and the speed-up). Bad arguments exit through `parser.error`."""
  parser = args.command_parser
  directory, config, tokenizer = _checked_model_dir(parser, args.model)
  sampling = _sampling(parser, directory, args, config.vocab_size)
  if not tokenizer.encode(args.prompt):
    parser.error("--prompt encodes to no tokens")
  # With the special tokens the checkpoint's tokenizer adds (the default model: a document start).
  prompt_ids = tokenizer.encode_prompt(args.prompt)
  if len(prompt_ids) + args.max_new_tokens > config.max_position_embeddings:
    parser.error(
      f"--max-new-tokens {args.max_new_tokens} with a {len(prompt_ids)}-token prompt exceeds the "
      f"model's max_position_embeddings ({config.max_position_embeddings})"
    )
  kv_cache = _kv_cache(parser, args, config)
  model_name = args.model or DEFAULT_MODEL_NAME
  if args.spec_tokens and not config.num_nextn_predict_layers:
    parser.error(f"{model_name} has no MTP layer; use --spec-tokens 0")
  model = _load_weights(parser, directory, args.dtype)
  if args.spec_tokens and model.mtp is None:
    parser.error(f"{model_name} has no MTP weights; use --spec-tokens 0")
  # Both engines run the same (healed) prompt and first-token mask.
  ids, mask = prompt_ids, None
  if args.token_healing:
    ids, mask = heal_prompt(tokenizer, prompt_ids, config.vocab_size)
  engines = {"main": _warm_engine(model, ids, mask, args, sampling, args.spec_tokens, kv_cache)}
  if args.compare:
    engines["baseline"] = _warm_engine(model, ids, mask, args, sampling, 0, kv_cache)
  runs = _timed_runs(engines, ids, mask, args, sampling)
  run = runs["main"]
  result = {
    "model": model_name,
    "device": jax.devices()[0].device_kind,
    "prompt": args.prompt,
    "seed": args.seed,
    "repeats": args.repeats,
    "text": continuation_text(tokenizer, prompt_ids, ids, run["tokens"]),
    # The text of the prompt's last token, removed and re-covered by the first new token.
    "token_healing": None if mask is None else tokenizer.decode(prompt_ids[len(ids) :]),
    "spec_tokens": args.spec_tokens,
    "sampling": dataclasses.asdict(sampling),
    "kv_cache_dtype": args.kv_cache_dtype,
    "kv_scale": kv_cache.get("kv_scale"),  # None: 16-bit pages, no scale
    **run,
  }
  if args.compare:
    baseline = runs["baseline"]
    result["baseline"] = {k: baseline[k] for k in ("tokens_per_s", "tpot_s", "itl_s", "ttft_s")}
    result["baseline"]["same_tokens"] = baseline["tokens"] == run["tokens"]
    result["speedup"] = run["tokens_per_s"] / baseline["tokens_per_s"]
  return result


def _print_report(result) -> None:
  print(f"model: {result['model']}")
  text = f"{result['prompt']}{result['text']}"
  print(text, end="" if text.endswith("\n") else "\n")  # a text ending its line: no blank line
  sampling = result["sampling"]
  if sampling["temperature"] == 0:
    decoding = "greedy"
  else:
    decoding = (
      f"sampled at temperature {sampling['temperature']:g}, top-p {sampling['top_p']:g}, "
      f"top-k {sampling['top_k'] or 'off'}, seed {result['seed']} (--temperature 0: greedy)"
    )
  lines = [
    f"-- {decoding}",
    f"-- {len(result['tokens'])} tokens, {result['tokens_per_s']:.1f} tok/s, "
    f"TTFT {result['ttft_s'] * 1e3:.0f} ms, TPOT {result['tpot_s'] * 1e3:.1f} ms",
  ]
  if result["kv_cache_dtype"] != "auto":
    lines.append(f"-- KV pages in {result['kv_cache_dtype']}, scale {result['kv_scale']:g}")
  if result["token_healing"] is not None:
    lines.append(
      f"-- token healing: the prompt's last token {result['token_healing']!r} was removed; the "
      f"first new token starts with its text (--no-token-healing: off)"
    )
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
  """The `evaluate` command: MTP acceptance and speed on held-out prompt windows
  (`jaxspec.evaluation.evaluate`), printed as a table or JSON; returns the exit status."""
  parser = args.command_parser
  directory, config, tokenizer = _checked_model_dir(parser, args.model)
  if args.prompt_tokens + args.max_new_tokens > config.max_position_embeddings:
    parser.error(
      f"--prompt-tokens {args.prompt_tokens} + --max-new-tokens {args.max_new_tokens} exceeds "
      f"the model's max_position_embeddings ({config.max_position_embeddings})"
    )
  if not config.num_nextn_predict_layers:
    parser.error(f"{directory} has no MTP layer to evaluate")
  kv_cache = _kv_cache(parser, args, config)
  try:  # the prompts exist before the weights load
    prompts = held_out_prompts(tokenizer, args.num_prompts, args.prompt_tokens)
  except (OSError, ValueError) as error:
    parser.error(str(error))
  model = _load_weights(parser, directory, args.dtype)
  eval_config = EvalConfig(
    spec_tokens=tuple(args.spec_tokens),
    temperatures=tuple(args.temperatures),
    num_prompts=args.num_prompts,
    prompt_tokens=args.prompt_tokens,
    max_new_tokens=args.max_new_tokens,
    seed=args.seed,
    **kv_cache,
  )
  rows = evaluate(model, tokenizer, eval_config, progress=not args.json, prompts=prompts)
  print(json.dumps(rows) if args.json else format_table(rows))
  return 0


def main(argv=None) -> int:
  """`python -m jaxspec`: parses `argv` (default `sys.argv[1:]`), runs `generate`, `evaluate`
  or `train` and returns the exit status."""
  parser = _build_parser()
  argv = sys.argv[1:] if argv is None else list(argv)
  bad = argtypes.first_non_utf8(argv)
  if bad is not None:
    parser.error(f"argument {bad} is not valid UTF-8")
  args = parser.parse_args(argv)
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
  enable_compile_cache()  # the command line only: a second run reuses the compiled steps
  sys.exit(main())
