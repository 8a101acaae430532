"""The routed-experts profiling script: its kernel count, its options, and a run in interpret
mode."""

import pathlib
import subprocess
import sys

import pytest

from benchmarks import profile_routed_experts as profile

SCRIPT = pathlib.Path(profile.__file__)


def test_kernel_count_matches_the_documented_ncu_command():
  # The module docstring's command skips and profiles 8 kernels: four memory parts at 8192
  # tokens. One part at 2048 tokens.
  assert "--launch-skip 8 --launch-count 8" in profile.__doc__
  assert profile.kernels_per_call("GLM-4.5-Air", 8192) == 8
  assert profile.kernels_per_call("GLM-4.5-Air", 2048) == 2


def test_options_are_checked(capsys):
  args = profile.parse_args(["--tokens", "2048", "--shape", "GLM-4.5"])
  assert (args.tokens, args.shape, args.kernels, args.smoke) == (2048, "GLM-4.5", False, False)
  for bad, message in (
    (["--tokens", "0"], "--tokens must be positive"),
    (["--rows", "3"], "unrecognized arguments: --rows 3"),
  ):
    with pytest.raises(SystemExit) as exit_info:
      profile.parse_args(bad)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_smoke_run_profiles_one_call_after_a_warm_up():
  result = subprocess.run(
    [sys.executable, str(SCRIPT), "--smoke", "--tokens", "5"],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "profiled: smoke, 5 tokens, 2 Pallas kernels, out (5, 128)" in result.stdout
