"""One point of the small sweep behind the default model's shape, at reduced scale on a CPU.

  python scripts/sweep_default_model.py NAME --corpus ARCHIVE --tokenizer TOKENIZER_JSON \
      [--hidden 128 --layers 4 ...] [--train-bytes 1.3e6] [--out sweep.jsonl]

Trains `jaxspec.training.trainer.default_model_config` with the given overrides for a fixed
number of training BYTES (tokens = bytes / the tokenizer's bytes per token, so vocabularies are
compared on the same text), then appends one JSON line: held-out next-token CE per token and in
bits per byte, the teacher-forced MTP agreement and chain acceptances, parameters, steps. Runs are
minutes long on two cores: early training, so read them as relative comparisons only.
"""

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers

from jaxspec.training import corpus, trainer


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("name")
  parser.add_argument("--corpus", required=True, help="archive from scripts/build_corpus.py")
  parser.add_argument("--tokenizer", required=True, help="a byte-level BPE tokenizer.json")
  parser.add_argument("--stdlib-only", action="store_true", help="train on the stdlib files only")
  parser.add_argument("--hidden", type=int, default=128)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--intermediate", type=int, default=256)
  parser.add_argument("--moe-intermediate", type=int, default=48)
  parser.add_argument("--train-bytes", type=float, default=1.3e6)
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=128)
  parser.add_argument("--mtp-depth", type=int, default=2)
  parser.add_argument("--eval-windows", type=int, default=48)
  parser.add_argument("--out", default="sweep.jsonl")
  args = parser.parse_args(argv)

  bpe = tokenizers.Tokenizer.from_file(args.tokenizer)
  train_files, held_out_files = corpus.split_corpus(args.corpus)
  if args.stdlib_only:
    train_files = [f for f in train_files if f.origin == corpus.STDLIB]
  stream = trainer.encode_files(bpe, train_files)
  train_bytes_per_token = sum(len(f.text.encode()) for f in train_files) / len(stream)
  held_out = trainer.encode_files(bpe, held_out_files)
  held_out_bytes_per_token = sum(len(f.text.encode()) for f in held_out_files) / len(held_out)
  windows = trainer.eval_windows(held_out, args.seq_len, 3, None)
  chosen = np.random.default_rng(0).choice(len(windows), args.eval_windows, replace=False)
  windows = windows[np.sort(chosen)]

  tokens = args.train_bytes / train_bytes_per_token
  steps = int(tokens // (args.batch_size * args.seq_len))
  config = trainer.TrainConfig(
    vocab_size=bpe.get_vocab_size(),
    steps=steps,
    batch_size=args.batch_size,
    seq_len=args.seq_len,
    warmup_steps=40,
    mtp_depth=args.mtp_depth,
    eval_batch_size=16,
  )
  model_config = trainer.default_model_config(bpe.get_vocab_size()).replace(
    hidden_size=args.hidden,
    num_hidden_layers=args.layers,
    num_attention_heads=args.heads,
    intermediate_size=args.intermediate,
    moe_intermediate_size=args.moe_intermediate,
  )
  run = trainer.Trainer(model_config, config)
  device_stream = jax.device_put(jnp.asarray(stream))
  key = jax.random.key(config.seed)
  start = time.perf_counter()
  losses = []
  for step in range(steps):
    metrics = run.train_step(
      device_stream, jax.random.fold_in(key, step), trainer.learning_rate(step, steps, config)
    )
    losses.append(float(metrics["lm_loss"]))
  train_s = time.perf_counter() - start
  metrics = run.evaluate(windows)
  result = {
    "name": args.name,
    "args": vars(args),
    "params": run.num_params,
    "steps": steps,
    "train_s": train_s,
    "train_lm_loss_last10": float(np.mean(losses[-10:])),
    "held_out_ce": metrics["lm_loss"],
    "held_out_bits_per_byte": metrics["lm_loss"] / held_out_bytes_per_token / math.log(2),
    "held_out_bytes_per_token": held_out_bytes_per_token,
    "mtp_agreement": metrics["mtp_agreement"],
    "chain_acceptance": [metrics[f"chain_acceptance_{d}"] for d in (1, 2, 3)],
  }
  print(json.dumps(result))
  with open(args.out, "a") as f:
    f.write(json.dumps(result) + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
