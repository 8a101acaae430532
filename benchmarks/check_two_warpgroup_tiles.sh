#!/usr/bin/env bash
# Issue 4, item 1 on the H200: checks the 128-row tile of two warpgroups
# (TuningConfig.two_warpgroup_tiles) and times it against the default 64-row
# tiles at G 12 (GLM-4.5), in well under 150 s:
#   1. the gpu tests of the two-warpgroup tile against the float64 reference;
#   2. B8 and B64 at L 8k, q_len 6 and 7, bf16, Hkv 8, D 128, page 16: both
#      paths on the same inputs, with a short table printed last.
# Run from the repository root; results go to $RESULTS_DIR (default benchmarks/results).
#   bash benchmarks/check_two_warpgroup_tiles.sh          # on the GPU
#   PYTHON=.venv/bin/python bash benchmarks/check_two_warpgroup_tiles.sh --smoke
# --smoke runs the same steps on the CPU (interpret-mode tests, tiny shapes) to
# catch Python errors before spending GPU time.
set -u
export PYTHONPATH=.
python=${PYTHON:-python3}
out=${RESULTS_DIR:-benchmarks/results}
mkdir -p "$out"
if [ "${1:-}" = "--smoke" ]; then
  marker="not gpu"
  smoke=--smoke
else
  marker=gpu
  smoke=
fi

timeout 65 "$python" -m pytest -q -p no:cacheprovider -m "$marker" -k two_warpgroup \
  --tb=short tests/kernels/test_decode_attention.py >"$out/two_warpgroup_tests.log" 2>&1
tests_rc=$?
tail -n 25 "$out/two_warpgroup_tests.log"

timeout 80 "$python" benchmarks/bench_decode_attention.py --two-warpgroup-check $smoke \
  --out "$out" >"$out/two_warpgroup_bench.log" 2>&1
bench_rc=$?
sed '/^# 128-row tile/,$d' "$out/two_warpgroup_bench.log" | tail -n 12
echo "tests rc=$tests_rc, benchmark rc=$bench_rc (124 = timed out)"
cat "$out/two_warpgroup_tiles.md" 2>/dev/null || echo "no table written"
