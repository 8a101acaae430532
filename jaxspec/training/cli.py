"""`python -m jaxspec train`: trains the default model (or a smoke-sized one) and its MTP head.

Every option maps to a `TrainConfig` field. Options left out take the recipe's defaults
(`TrainConfig()`), or `SMOKE`'s with `--smoke`; options given are honoured in both cases. Bad
values, a non-empty `--output-dir` without `--overwrite`, a missing `--corpus` or `--tokenizer`
are one `error:` line and exit status 2, before any work.
"""

import argparse
import dataclasses
import tarfile
from pathlib import Path

import tokenizers

from jaxspec import argtypes
from jaxspec.training import resume, staging
from jaxspec.training.trainer import (
  DRAFT_TEXTS,
  KEEP_CHOICES,
  MODEL_PRESETS,
  MTP_LABELS,
  TrainConfig,
  check_initial_checkpoint,
  train,
)

# A few seconds on a CPU: tiny model, 40 training files, 30 steps, demo continuations of 32 tokens.
SMOKE = TrainConfig(
  model_preset="smoke",
  vocab_size=512,
  steps=30,
  batch_size=4,
  seq_len=64,
  learning_rate=3e-3,
  warmup_steps=5,
  eval_every=10,
  eval_batch_size=8,
  max_eval_windows=16,
  demo_new_tokens=32,
  log_every=1,
  max_train_files=40,
  repetition_rows=0,
)

# TrainConfig field -> (argparse type, help). Each becomes `--field-name`, default None (unset);
# `_CHOICES` fields take one of their values, `_FLAGS` fields are switches.
_CONFIG_OPTIONS = {
  "model_preset": (None, "model size"),
  "vocab_size": (argtypes.int_in(257), "byte-level BPE vocabulary (256 bytes + merges + EOS)"),
  "steps": (argtypes.positive_int, "training steps (an upper bound with --time-budget-s)"),
  "batch_size": (argtypes.positive_int, "windows per step"),
  "seq_len": (argtypes.positive_int, "tokens per window"),
  "learning_rate": (argtypes.float_in(0.0, low_open=True), "peak learning rate"),
  "min_lr_ratio": (argtypes.float_in(0.0, 1.0), "final learning rate / peak"),
  "warmup_steps": (argtypes.positive_int, "linear warm-up steps (fewer than --steps)"),
  "weight_decay": (argtypes.float_in(0.0), "AdamW weight decay on matrices"),
  "mtp_weight": (argtypes.float_in(0.0), "weight of the mean MTP loss"),
  "mtp_depth": (argtypes.int_in(1, 7), "MTP depths trained (the layer applied recurrently)"),
  "mtp_labels": (
    None,
    "what the MTP loss teaches: 'data' the corpus's tokens, 'target' the target's own "
    "next-token distribution at the drafted position (self-distillation)",
  ),
  "draft_head_only": (
    None,
    "train the MTP layer alone, the target frozen bit for bit (with --init-from; "
    "--repetition-rows 0)",
  ),
  "draft_text": (
    None,
    "with --draft-head-only, the text the MTP layer trains on: 'corpus' windows, or 'greedy' "
    "the frozen target's own greedy continuations of corpus prefixes, decoded each step",
  ),
  "greedy_prefix_tokens": (
    argtypes.positive_int,
    "corpus tokens before each greedy continuation (--draft-text greedy)",
  ),
  "repetition_rows": (
    argtypes.int_in(0),
    "windows per batch that repeat one span, trained against self-reinforcing repetition "
    "(DITTO, arXiv:2206.02369); 0 = off",
  ),
  "repetition_lambda": (
    argtypes.float_in(0.0, 1.0),
    "DITTO's lambda: a repeated token's probability is pulled to lambda times the previous one's",
  ),
  "definition_documents": (
    argtypes.int_in(0),
    "copies of each top-level function and class added to the stream as a document of its own "
    "(where a definition ends when nothing follows it); 0 = whole files only",
  ),
  "unlikelihood_rows": (
    argtypes.int_in(0),
    "greedy continuations per step of the model's own, trained with sequence-level "
    "unlikelihood on tokens that repeat an n-gram (arXiv:1908.04319); 0 = off",
  ),
  "unlikelihood_ngram": (argtypes.positive_int, "n-gram length (tokens) counted as a repeat"),
  "unlikelihood_weight": (argtypes.float_in(0.0), "weight of the unlikelihood loss"),
  "eval_every": (argtypes.positive_int, "steps between held-out evaluations"),
  "seed": (argtypes.seed, f"0..{argtypes.MAX_SEED}"),
  "time_budget_s": (
    argtypes.float_in(0.0, low_open=True),
    "cut the step count to what fits in this many seconds (measured during warm-up)",
  ),
  "keep": (
    None,
    "the checkpoint saved: the 'last', or of those evaluated (the start, every --eval-every "
    "steps, the end) the one whose greedy continuations of the validation prompts read best "
    "(no line more than twice and most parsing first; the saved weights run in bf16 and in "
    "float32, the worse counting): 'validation'",
  ),
  "init_from": (
    str,
    "continue from this checkpoint of `train` (its parameters and tokenizer; fresh optimizer "
    "state), e.g. a second phase with more repeated rows",
  ),
}


_CHOICES = {
  "model_preset": sorted(MODEL_PRESETS),
  "mtp_labels": list(MTP_LABELS),
  "draft_text": list(DRAFT_TEXTS),
  "keep": list(KEEP_CHOICES),
}
_FLAGS = ("draft_head_only",)


def _option(field: str) -> str:
  return "--preset" if field == "model_preset" else "--" + field.replace("_", "-")


def add_train_parser(subparsers) -> argparse.ArgumentParser:
  """Adds the `train` command to a `subparsers` object of argparse."""
  defaults = TrainConfig()
  parser = subparsers.add_parser(
    "train",
    help="train a GLM-style MoE model with its MTP head on Python sources",
    description=__doc__,
  )
  parser.set_defaults(command_parser=parser)
  parser.add_argument("--output-dir", required=True, help="checkpoint directory to write")
  parser.add_argument(
    "--overwrite", action="store_true", help="replace the checkpoint in a non-empty --output-dir"
  )
  for field, (kind, help_text) in _CONFIG_OPTIONS.items():
    default = getattr(defaults, field)
    if field in _CHOICES:
      extra = {"choices": _CHOICES[field]}
    elif field in _FLAGS:
      extra = {"action": "store_const", "const": True}
    else:
      extra = {"type": kind}
    parser.add_argument(
      _option(field), dest=field, default=None, help=f"{help_text} (default {default})", **extra
    )
  parser.add_argument(
    "--corpus",
    help="a corpus archive written by scripts/build_corpus.py (recompressed or not), or a copy of "
    "a Python standard library folder; default: the running interpreter's standard library",
  )
  parser.add_argument(
    "--tokenizer", help="reuse this tokenizer.json instead of training a byte-level BPE"
  )
  parser.add_argument(
    "--smoke",
    action="store_true",
    help="a tiny model on 40 files for 30 steps (runs on a CPU in seconds); other options "
    "given override the smoke settings",
  )
  parser.add_argument(
    "--pause-after-s",
    type=argtypes.float_in(0.0, low_open=True),
    help="stop after this many seconds of training, at a step boundary, and save the run's "
    "state beside --output-dir (OUTPUT_DIR.resume) for --resume; for runs longer than one "
    "process may last",
  )
  parser.add_argument(
    "--resume",
    action="store_true",
    help="continue the paused run of --output-dir (the same options as the call that paused "
    "it; --time-budget-s counts the first call's set-up and the training of all calls)",
  )
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")
  return parser


def config_from_args(args) -> TrainConfig:
  """The recipe's defaults (or `SMOKE`), with every option the command line gave."""
  base = SMOKE if args.smoke else TrainConfig()
  given = {f: getattr(args, f) for f in _CONFIG_OPTIONS if getattr(args, f) is not None}
  try:
    return dataclasses.replace(base, **given)
  except ValueError as error:
    args.command_parser.error(str(error))


def _check_inputs(args, config: TrainConfig) -> None:
  parser = args.command_parser
  try:
    staging.check_output_dir(args.output_dir, args.overwrite)
  except FileExistsError as error:
    parser.error(f"--output-dir: {error}")
  if args.corpus is not None:
    source = Path(args.corpus)
    if source.is_file() and not tarfile.is_tarfile(source):
      parser.error(f"--corpus {source}: not a corpus archive (build one with build_corpus.py)")
    if not source.exists():
      parser.error(f"--corpus {source}: no such file or directory")
  if args.tokenizer is not None:
    try:
      vocab = tokenizers.Tokenizer.from_file(args.tokenizer).get_vocab_size()
    except Exception as error:  # `tokenizers` raises a bare Exception for a missing/bad file
      parser.error(f"--tokenizer {args.tokenizer}: {error}")
    if args.vocab_size is not None and args.vocab_size != vocab:
      parser.error(f"--vocab-size {args.vocab_size} differs from --tokenizer's {vocab} tokens")
  if args.resume:
    try:
      resume.check(args.output_dir, dataclasses.asdict(config))
    except (FileNotFoundError, ValueError) as error:
      parser.error(f"--resume: {error}")
    return  # the paused run brings its tokenizer and parameters
  if resume.resume_dir(args.output_dir).exists():
    parser.error(
      f"--output-dir: {resume.resume_dir(args.output_dir)} holds a paused run: continue it with "
      "--resume (and the options that started it) or remove it"
    )
  if args.greedy_prefix_tokens is not None and config.draft_text != "greedy":
    parser.error(
      "--greedy-prefix-tokens sets the prefix of --draft-text greedy: add that or leave it out"
    )
  if config.init_from is not None:
    if args.tokenizer is not None:
      parser.error("--init-from brings its checkpoint's tokenizer: leave out --tokenizer")
    if not (Path(config.init_from) / "config.json").is_file():
      parser.error(f"--init-from {config.init_from}: no config.json (not a checkpoint directory)")
    try:
      check_initial_checkpoint(config)
    except (ValueError, OSError) as error:
      parser.error(f"--init-from: {error}")


def run_train(args) -> int:
  """The `train` command: trains as the arguments ask (`train`), then prints the final
  metrics as a table and a sample, or, for a paused run, how to resume it; returns the exit
  status."""
  config = config_from_args(args)
  _check_inputs(args, config)
  log = train(
    config,
    args.output_dir,
    overwrite=args.overwrite,
    corpus_source=args.corpus,
    tokenizer_path=args.tokenizer,
    progress=not args.no_progress,
    pause_after_s=args.pause_after_s,
    resume=args.resume,
  )
  if "paused" in log:
    paused = log["paused"]
    print(
      f"paused after step {paused['next_step']} of {paused['total_steps']}; state in "
      f"{paused['state']}: run the same command with --resume to continue"
    )
    return 0
  final, timing = log["final"], log["timing"]
  k = config.eval_draft_depth
  rows = [
    ("steps", f"{final['steps']}"),
    ("checkpoint kept: step", f"{final['kept_step']}"),
    ("parameters", f"{log['num_params']:,}"),
    ("train next-token CE", f"{final['train_lm_loss']:.3f}"),
    ("train MTP CE", f"{final['train_mtp_loss']:.3f}"),
    ("held-out next-token CE", f"{final['held_out_lm_loss']:.3f}"),
    ("held-out bits / byte", f"{final['held_out_lm_bits_per_byte']:.3f}"),
    ("held-out MTP CE", f"{final['held_out_mtp_loss']:.3f}"),
    ("held-out target top-1", f"{final['held_out_next_token_accuracy']:.3f}"),
    ("held-out MTP agreement (k=1, teacher-forced)", f"{final['held_out_mtp_agreement']:.3f}"),
    (
      f"held-out tokens / verify step (k={k}, teacher-forced)",
      f"{final[f'held_out_tokens_per_step_k{k}']:.2f}",
    ),
    ("demos: most repeated line (count)", f"{final['demo_max_line_repeats']}"),
    ("demos: parse as Python", f"{final['demo_parse_rate']:.2f}"),
    ("train time (s)", f"{timing['train_s']:.1f}"),
    ("tokens / s", f"{timing['tokens_per_s']:,.0f}"),
    ("checkpoint (MB)", f"{log['checkpoint_bytes'] / 1e6:.2f}"),
  ]
  print("| metric | value |\n| --- | --- |")
  for name, value in rows:
    print(f"| {name} | {value} |")
  first = log["samples"][0]
  print(f"sample: {first['prompt']}{first['continuation']}")
  return 0


def main(argv=None) -> int:
  """`python -m jaxspec.training.cli`: the `train` command alone."""
  parser = argparse.ArgumentParser(prog="python -m jaxspec.training.cli")
  add_train_parser(parser.add_subparsers(dest="command", required=True))
  return run_train(parser.parse_args(argv))


if __name__ == "__main__":
  raise SystemExit(main())
