#!/usr/bin/env bash
# Trains the embedded default model (jaxspec/assets/default_model) on one H200 in one command.
#
# Usage: [CORPUS=corpus/python_sources.tar.gz] [TIME_BUDGET_S=510] \
#          benchmarks/train_default_model.sh OUTPUT_DIR [extra `train` options]
#
# The recipe is `python -m jaxspec train`'s defaults (jaxspec/training/trainer.py, TrainConfig and
# default_model_config) on the corpus archive that scripts/build_corpus.py writes: build it once
# on any machine with the same Python and packages, and carry it (it is not committed):
#
#   python scripts/build_corpus.py corpus/python_sources.tar.gz
#
# Everything, tokenizer training, data preparation and compilation included, fits in
# TIME_BUDGET_S seconds: the step count is cut to what fits (measured during the warm-up) and the
# cosine schedule is fitted to it; Python start-up adds about ten seconds. The run writes
# config.json, generation_config.json, model.safetensors (bf16), tokenizer.json,
# training_log.json and loss.png into OUTPUT_DIR (a directory beside it holds them until the end;
# a non-empty OUTPUT_DIR is refused unless --overwrite is passed) and prints a summary table.
set -euo pipefail
output_dir=${1:?usage: $0 OUTPUT_DIR [train options]}
shift
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
corpus=${CORPUS:-corpus/python_sources.tar.gz}
if [[ ! -f "$corpus" ]]; then
  echo "error: corpus archive $corpus not found: run scripts/build_corpus.py $corpus" >&2
  exit 2
fi
PYTHONPATH=. "$PYTHON" -m jaxspec train \
  --output-dir "$output_dir" \
  --corpus "$corpus" \
  --time-budget-s "${TIME_BUDGET_S:-510}" \
  --no-progress \
  "$@"
