"""The command line's main job: `python -m jaxspec generate`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxspec.__main__ import main

ROOT = Path(__file__).parents[1]


def test_generate_json_reports_text_tokens_and_metrics(capsys):
  assert main(["generate", "--prompt", "def f(x):", "--max-new-tokens", "5", "--json"]) == 0
  result = json.loads(capsys.readouterr().out)
  for field in (
    "text",
    "tokens",
    "acceptance_rate",
    "per_position_acceptance",
    "mean_accepted_length",
    "tokens_per_s",
    "ttft_s",
    "tpot_s",
  ):
    assert field in result
  assert len(result["tokens"]) == 5 and result["tokens_per_s"] > 0
  assert "default" in result["model"]


def test_generate_is_reproducible_and_runs_as_a_module():
  command = [
    sys.executable,
    "-m",
    "jaxspec",
    "generate",
    "--prompt",
    "ab",
    "--max-new-tokens",
    "4",
    "--temperature",
    "0.8",
    "--seed",
    "3",
    "--json",
  ]
  runs = [
    json.loads(subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True).stdout)
    for _ in range(2)
  ]
  assert runs[0]["tokens"] == runs[1]["tokens"]


def test_checkpoint_without_tokenizer_is_a_clear_error():
  fixture = ROOT / "tests" / "fixtures" / "glm4_moe_a"
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    main(["generate", "--prompt", "x", "--model", str(fixture), "--max-new-tokens", "2"])


def test_speculative_generate_with_compare_reports_both_paths(capsys):
  argv = [
    "generate",
    "--prompt",
    "abc",
    "--max-new-tokens",
    "6",
    "--spec-tokens",
    "2",
    "--compare",
    "--json",
  ]
  assert main(argv) == 0
  result = json.loads(capsys.readouterr().out)
  assert result["spec_tokens"] == 2 and len(result["per_position_acceptance"]) == 2
  assert 0.0 <= result["acceptance_rate"] <= 1.0
  assert result["mean_accepted_length"] >= 1.0
  # Greedy speculative decoding is lossless: the plain run produced the same tokens.
  assert result["baseline"]["same_tokens"] and result["speedup"] > 0


def test_bad_spec_tokens_is_rejected():
  with pytest.raises(SystemExit, match="--spec-tokens must be in 0..7"):
    main(["generate", "--prompt", "a", "--spec-tokens", "9"])
