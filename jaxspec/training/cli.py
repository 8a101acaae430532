"""`python -m jaxspec train`: trains the default model (or a smoke-sized one) and its MTP head."""

import argparse
import dataclasses

from jaxspec.training.trainer import MODEL_PRESETS, TrainConfig, train

# A few seconds on a CPU: tiny model, 40 training files, 30 steps.
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
  log_every=1,
  max_train_files=40,
)


def add_train_parser(subparsers) -> argparse.ArgumentParser:
  """Adds the `train` command to a `subparsers` object of argparse."""
  defaults = TrainConfig()
  parser = subparsers.add_parser(
    "train",
    help="train a GLM-style MoE model with its MTP head on the Python standard library",
    description=__doc__,
  )
  parser.add_argument("--output-dir", required=True, help="checkpoint directory to write")
  parser.add_argument("--preset", choices=sorted(MODEL_PRESETS), default=defaults.model_preset)
  parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
  parser.add_argument("--steps", type=int, default=defaults.steps)
  parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
  parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
  parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
  parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
  parser.add_argument("--mtp-weight", type=float, default=defaults.mtp_weight)
  parser.add_argument("--eval-every", type=int, default=defaults.eval_every)
  parser.add_argument("--seed", type=int, default=defaults.seed)
  parser.add_argument(
    "--time-budget-s",
    type=float,
    default=None,
    help="cut the step count to what fits in this many seconds (measured during warm-up)",
  )
  parser.add_argument(
    "--tokenizer", help="reuse this tokenizer.json instead of training a byte-level BPE"
  )
  parser.add_argument(
    "--stdlib-dir",
    help="read the corpus from this copy of a Python standard library folder instead of the "
    "running interpreter's (same files, same held-out list)",
  )
  parser.add_argument(
    "--smoke", action="store_true", help="a few steps of a tiny model: runs on a CPU in seconds"
  )
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")
  return parser


def config_from_args(args) -> TrainConfig:
  if args.smoke:
    return dataclasses.replace(SMOKE, seed=args.seed)
  return TrainConfig(
    model_preset=args.preset,
    vocab_size=args.vocab_size,
    steps=args.steps,
    batch_size=args.batch_size,
    seq_len=args.seq_len,
    learning_rate=args.learning_rate,
    warmup_steps=args.warmup_steps,
    mtp_weight=args.mtp_weight,
    eval_every=args.eval_every,
    seed=args.seed,
    time_budget_s=args.time_budget_s,
  )


def run_train(args) -> int:
  config = config_from_args(args)
  log = train(
    config,
    args.output_dir,
    tokenizer_path=args.tokenizer,
    stdlib_dir=args.stdlib_dir,
    progress=not args.no_progress,
  )
  final, timing = log["final"], log["timing"]
  k = config.eval_draft_depth
  rows = [
    ("steps", f"{final['steps']}"),
    ("parameters", f"{log['num_params']:,}"),
    ("train next-token CE", f"{final['train_lm_loss']:.3f}"),
    ("train MTP CE", f"{final['train_mtp_loss']:.3f}"),
    ("held-out next-token CE", f"{final['held_out_lm_loss']:.3f}"),
    ("held-out MTP CE", f"{final['held_out_mtp_loss']:.3f}"),
    ("held-out target top-1", f"{final['held_out_next_token_accuracy']:.3f}"),
    ("held-out MTP agreement (k=1, teacher-forced)", f"{final['held_out_mtp_agreement']:.3f}"),
    (
      f"held-out tokens / verify step (k={k}, teacher-forced)",
      f"{final[f'held_out_tokens_per_step_k{k}']:.2f}",
    ),
    ("train time (s)", f"{timing['train_s']:.1f}"),
    ("tokens / s", f"{timing['tokens_per_s']:,.0f}"),
    ("checkpoint (MB)", f"{log['checkpoint_bytes'] / 1e6:.2f}"),
  ]
  print("| metric | value |\n| --- | --- |")
  for name, value in rows:
    print(f"| {name} | {value} |")
  print(f"sample: {log['sample']['prompt']}{log['sample']['greedy_continuation']}")
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxspec.training.cli")
  add_train_parser(parser.add_subparsers(dest="command", required=True))
  return run_train(parser.parse_args(argv))


if __name__ == "__main__":
  raise SystemExit(main())
