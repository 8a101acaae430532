#!/usr/bin/env bash
# Trains the embedded default model (jaxspec/assets/default_model) on one H200.
#
# Usage: [STDLIB_TAR=stdlib.tar.gz] [TIME_BUDGET_S=75] benchmarks/train_default_model.sh \
#          OUTPUT_DIR [extra `train` options]
#
# The step count is cut to what fits in TIME_BUDGET_S seconds (tokenizer, data and compile
# included), measured during the warm-up, and the cosine schedule is fitted to it. The run writes
# config.json, model.safetensors (bf16), tokenizer.json, training_log.json and loss.png into
# OUTPUT_DIR and prints a summary table.
#
# Some Python images strip the standard library's test suite, which is two thirds of the corpus;
# the shipped model was trained on a full CPython 3.12 stdlib: pass one as STDLIB_TAR (a tarball
# of the stdlib's .py files, paths relative to the stdlib folder), extracted for --stdlib-dir.
# The shipped run also passed --tokenizer with a BPE trained beforehand on the CPU from the same
# files (the recipe trains the same one itself when --tokenizer is left out).
set -euo pipefail
output_dir=${1:?usage: $0 OUTPUT_DIR [train options]}
shift
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
corpus_args=()
if [[ -n "${STDLIB_TAR:-}" ]]; then
  stdlib_dir=$(mktemp -d)
  tar xzf "$STDLIB_TAR" -C "$stdlib_dir"
  corpus_args=(--stdlib-dir "$stdlib_dir")
fi
PYTHONPATH=. "$PYTHON" -m jaxspec.training.cli train \
  --output-dir "$output_dir" \
  --preset default \
  --vocab-size 2048 \
  --steps 20000 \
  --batch-size 64 \
  --seq-len 512 \
  --learning-rate 3e-3 \
  --warmup-steps 100 \
  --eval-every 250 \
  --seed 0 \
  --time-budget-s "${TIME_BUDGET_S:-75}" \
  "${corpus_args[@]}" \
  "$@"
