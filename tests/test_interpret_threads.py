"""GPU interpret mode with fewer cores than simulated threads: the conftest's `PJRT_NPROC`.

Each simulated warpgroup is a host thread whose barrier waits run on XLA's CPU thread pool, one
thread per core unless `PJRT_NPROC` sizes it. With one core and no such setting the case below
hung in 7 of 8 runs: the waiting consumer warpgroup held the pool's only thread.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Two consumer warpgroups sharing each K/V block, no producer warpgroup (G 12, q_len 6, D 64).
CASE = (
  "tests/kernels/test_decode_attention.py::test_kernel_matches_float64["
  "S200-4-0-65_q6_Hkv1_G12_D64_page16_bf16_num_stages=1_num_chunks=2_two_warpgroup_tiles=True"
  "-True]"
)
# The case takes 3-7 s alone on one core; a hang runs into this.
TIMEOUT_S = 240


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_two_warpgroup_interpret_case_finishes_on_one_core():
  # The child pins itself before jax starts (a preexec_fn would fork this threaded process).
  pinned_pytest = (
    "import os, sys, pytest; "
    f"os.sched_setaffinity(0, {{{min(os.sched_getaffinity(0))}}}); "
    f"sys.exit(pytest.main(['-q', '-p', 'no:xdist', '-p', 'no:cacheprovider', {CASE!r}]))"
  )
  result = subprocess.run(
    [sys.executable, "-c", pinned_pytest],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=TIMEOUT_S,
  )
  assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout[-3000:]
