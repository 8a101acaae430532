#!/usr/bin/env bash
# Trains the embedded default model (jaxspec/assets/default_model) on one H200.
#
# Usage: benchmarks/train_default_model.sh OUTPUT_DIR [extra `train` options]
# The step count is cut to what fits in TIME_BUDGET_S seconds (default 170), measured during the
# warm-up; the run writes config.json, model.safetensors (bf16), tokenizer.json,
# training_log.json and loss.png into OUTPUT_DIR and prints a summary table.
set -euo pipefail
output_dir=${1:?usage: $0 OUTPUT_DIR [train options]}
shift
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PYTHONPATH=. "$PYTHON" -m jaxspec.training.cli train \
  --output-dir "$output_dir" \
  --preset default \
  --vocab-size 4096 \
  --steps 20000 \
  --batch-size 64 \
  --seq-len 512 \
  --learning-rate 3e-3 \
  --warmup-steps 200 \
  --eval-every 500 \
  --seed 0 \
  --time-budget-s "${TIME_BUDGET_S:-170}" \
  "$@"
