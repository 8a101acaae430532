"""`scripts/check_fp8_kv_cache.py`: greedy output on fp8 KV pages against 16-bit pages."""

import json

import pytest

from jaxspec.__main__ import DEFAULT_MODEL


@pytest.fixture(scope="module")
def script(load_script):
  return load_script("check_fp8_kv_cache")


def test_agreement_counts_identical_continuations_and_the_first_difference(script):
  reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
  other = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]
  got = script.agreement(reference, other)
  assert got["prompts"] == 3 and got["identical"] == 1
  assert got["identical_share"] == pytest.approx(1 / 3)
  # The second differs at position 2 (a later match does not count), the third at 0.
  assert got["first_difference_mean"] == 1.0 and got["first_difference_median"] == 1.0
  assert got["tokens_before_first_difference_share"] == (4 + 2 + 0) / 12
  same = script.agreement(reference, reference)
  assert same["identical"] == 3 and same["first_difference_mean"] is None
  assert same["tokens_before_first_difference_share"] == 1.0
  with pytest.raises(ValueError):
    script.agreement(reference, other[:2])  # a prompt without its continuation


def test_the_check_runs_end_to_end_on_the_embedded_model(script, tmp_path, capsys):
  out = tmp_path / "fp8.json"
  argv = [str(DEFAULT_MODEL), "--num-prompts", "3", "--prompt-tokens", "16"]
  assert script.main([*argv, "--max-new-tokens", "6", "--json-out", str(out)]) == 0
  result = json.loads(out.read_text())
  for name in ("fp8_pages_vs_bf16_pages", "float32_weights_vs_bf16_weights"):
    assert result[name]["prompts"] == 3
    assert 0.0 <= result[name]["tokens_before_first_difference_share"] <= 1.0
  for row in result["k3_greedy"].values():
    assert len(row["per_position_acceptance"]) == 3 and row["verify_steps"] > 0
  printed = capsys.readouterr().out
  assert "| fp8 pages vs bf16 pages (bf16 weights) |" in printed


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--num-prompts", "0"], "argument --num-prompts: must be at least 1, got 0"),
    (["--kv-scale", "0"], "argument --kv-scale: must be in (0, inf), got 0"),
    (["--kv-scale", "nan"], "argument --kv-scale: expected a finite number"),
    (["/nonexistent"], "no config.json"),
  ],
)
def test_bad_arguments_are_argument_errors(script, argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    script.main(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err
