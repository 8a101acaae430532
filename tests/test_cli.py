"""The command line's main job: `python -m jaxspec generate`."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.__main__ import DEFAULT_MODEL, _print_report, _sampling, _timed_runs, main
from jaxspec.serving.sampling import SamplingParams
from jaxspec.tokenizer import load_tokenizer
from jaxspec.training import cli as train_cli

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


# Sampled generation run twice as a module with one seed, giving the same tokens:
# tests/test_compile_cache.py (its two runs, the second from the first one's cached programs).


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
  assert result["repeats"] == 3


def test_generate_starts_the_prompt_as_a_document(monkeypatch):
  import jaxspec.__main__ as cli_main

  seen = []
  warm_engine = cli_main._warm_engine

  def recording(model, ids, *args):
    seen.append(ids)
    return warm_engine(model, ids, *args)

  monkeypatch.setattr(cli_main, "_warm_engine", recording)
  argv = ["generate", "--prompt", "def f(x):", "--max-new-tokens", "2", "--repeats", "1"]
  assert main([*argv, "--spec-tokens", "0", "--no-token-healing", "--json"]) == 0
  # The embedded tokenizer puts <|endoftext|> (id 0), the training stream's file separator, first.
  assert seen == [[0, *load_tokenizer(DEFAULT_MODEL).encode("def f(x):")]]


def test_generate_heals_the_prompt_boundary_unless_told_not_to(capsys):
  prompt = 'def is_prime(n):\n    """Return True if n is a prime number."""\n'
  # Plain and speculative engines under the same mask: tests/serving/test_token_healing.py.
  argv = ["generate", "--prompt", prompt, "--max-new-tokens", "8", "--repeats", "1"]
  argv += ["--spec-tokens", "2"]
  assert main([*argv, "--json"]) == 0
  healed = json.loads(capsys.readouterr().out)
  assert healed["token_healing"] == "\n"
  # The first new token re-covers the removed newline, which is printed once, with the prompt.
  tokenizer = load_tokenizer(DEFAULT_MODEL)
  healed_ids = tokenizer.encode_prompt(prompt)[:-1]
  assert prompt + healed["text"] == tokenizer.decode(healed_ids + healed["tokens"])
  _print_report(healed)
  out, err = capsys.readouterr()
  assert out.splitlines()[1:] == (prompt + healed["text"]).splitlines()
  assert "token healing: the prompt's last token '\\n' was removed" in err
  assert main([*argv, "--no-token-healing"]) == 0
  out, err = capsys.readouterr()
  assert out.split("\n", 1)[1].startswith(prompt) and "token healing" not in err


def test_compare_alternates_the_engines_and_reports_each_ones_median_run(monkeypatch):
  calls = []

  class FakeEngine:
    def __init__(self, name, rates):
      self.name, self.rates = name, iter(rates)

    def generate(self, prompts, **kwargs):
      calls.append(self.name)
      rate = next(self.rates)
      metrics = argparse.Namespace(as_dict=lambda: {"tokens_per_s": rate})
      return argparse.Namespace(tokens=[[rate]], metrics=metrics)

  engines = {"main": FakeEngine("main", [30, 10, 20]), "baseline": FakeEngine("plain", [5, 7, 6])}
  args = argparse.Namespace(repeats=3, max_new_tokens=4, seed=0, json=True)
  runs = _timed_runs(engines, [1, 2], None, args, SamplingParams())
  assert calls == ["main", "plain"] * 3
  assert runs["main"] == {"tokens": [20], "tokens_per_s": 20}
  assert runs["baseline"] == {"tokens": [6], "tokens_per_s": 6}


# --------------------------------------------------------------------------------------------------
# Bad arguments: one `error:` line on stderr, exit status 2, no traceback, no weights loaded.

FIXTURE_WITHOUT_TOKENIZER = ROOT / "tests" / "fixtures" / "glm4_moe_a"
GENERATE = ["generate", "--prompt", "def f(x):"]

BAD_ARGUMENTS = {
  "negative max-new-tokens": (GENERATE + ["--max-new-tokens", "-5"], "at least 1, got -5"),
  "fractional max-new-tokens": (GENERATE + ["--max-new-tokens", "2.5"], "expected an integer"),
  "huge max-new-tokens": (
    GENERATE + ["--max-new-tokens", "1000000000"],
    "exceeds the model's max_position_embeddings",
  ),
  "spec-tokens above range": (GENERATE + ["--spec-tokens", "9"], "in 0..7, got 9"),
  "negative spec-tokens": (GENERATE + ["--spec-tokens", "-1"], "in 0..7, got -1"),
  "negative top-k": (GENERATE + ["--top-k", "-1"], "at least 0"),
  "fractional top-k": (GENERATE + ["--top-k", "2.5"], "expected an integer"),
  "top-k above the vocabulary": (GENERATE + ["--top-k", "100000"], "vocabulary size"),
  "top-p zero": (GENERATE + ["--top-p", "0"], "(0, 1]"),
  "top-p above one": (GENERATE + ["--top-p", "1.5"], "(0, 1]"),
  "top-p NaN": (GENERATE + ["--top-p", "nan"], "finite"),
  "negative temperature": (GENERATE + ["--temperature", "-1"], "[0, inf)"),
  "NaN temperature": (GENERATE + ["--temperature", "nan"], "finite"),
  "infinite temperature": (GENERATE + ["--temperature", "inf"], "finite"),
  "seed too large": (GENERATE + ["--seed", str(2**70)], "in 0..4294967295"),
  "negative seed": (GENERATE + ["--seed", "-1"], "in 0..4294967295"),
  "zero page size": (GENERATE + ["--page-size", "0"], "in 1..1024"),
  "zero repeats": (GENERATE + ["--repeats", "0"], "at least 1"),
  "unknown KV cache dtype": (GENERATE + ["--kv-cache-dtype", "int8"], "invalid choice: 'int8'"),
  "KV scale without fp8 pages": (
    GENERATE + ["--kv-scale", "2"],
    "--kv-scale applies only with --kv-cache-dtype float8_e4m3fn",
  ),
  "zero KV scale": (
    GENERATE + ["--kv-cache-dtype", "float8_e4m3fn", "--kv-scale", "0"],
    "must be in (0, inf), got 0",
  ),
  "empty prompt": (["generate", "--prompt", ""], "encodes to no tokens"),
  "missing tokenizer": (
    GENERATE + ["--model", str(FIXTURE_WITHOUT_TOKENIZER)],
    "no tokenizer.json",
  ),
  "missing model": (GENERATE + ["--model", "/nonexistent/model"], "no such directory"),
  "model is a file": (GENERATE + ["--model", str(ROOT / "README.md")], "not a directory"),
  "model without config": (GENERATE + ["--model", str(ROOT / "tests")], "config.json"),
  "evaluate k zero": (["evaluate", "--spec-tokens", "0"], "in 1..7, got 0"),
  "evaluate NaN temperature": (["evaluate", "--temperatures", "0", "nan"], "finite"),
  "evaluate no prompts": (["evaluate", "--num-prompts", "0"], "at least 1"),
  "evaluate KV scale without fp8 pages": (
    ["evaluate", "--kv-scale", "0.5"],
    "--kv-scale applies only with --kv-cache-dtype float8_e4m3fn",
  ),
  "evaluate prompts beyond the held-out text": (
    ["evaluate", "--num-prompts", "5000"],
    "fewer than the 5000 x 96",
  ),
  "evaluate beyond max positions": (
    ["evaluate", "--prompt-tokens", "5000"],
    "exceeds the model's max_position_embeddings",
  ),
  "train zero steps": (["train", "--output-dir", "x", "--steps", "0"], "at least 1"),
  "train NaN learning rate": (["train", "--output-dir", "x", "--learning-rate", "nan"], "finite"),
  "train tiny vocabulary": (["train", "--output-dir", "x", "--vocab-size", "100"], "at least 257"),
  "train repetition rows filling the batch": (
    ["train", "--output-dir", "x", "--batch-size", "8", "--repetition-rows", "8"],
    "repetition_rows must be in [0, batch_size) = [0, 8), got 8",
  ),
  "train repetition lambda above one": (
    ["train", "--output-dir", "x", "--repetition-lambda", "1.5"],
    "[0, 1]",
  ),
  "train smoke warm-up beyond its steps": (
    ["train", "--output-dir", "x", "--smoke", "--warmup-steps", "40"],
    "warmup_steps (40) must be below steps (30)",
  ),
  "train init from a missing checkpoint": (
    ["train", "--output-dir", "x", "--init-from", "no_such_checkpoint"],
    "no config.json",
  ),
  "train missing corpus": (
    ["train", "--output-dir", "x", "--corpus", "/nonexistent.tar.gz"],
    "no such file",
  ),
  "train output is a file": (["train", "--output-dir", str(ROOT / "README.md")], "not a directory"),
  "train non-empty output": (["train", "--output-dir", str(ROOT / "tests")], "--overwrite"),
}


@pytest.fixture
def no_weights(monkeypatch):
  """Argument errors must be found before any weights load or any training starts."""

  def forbidden(*args, **kwargs):
    pytest.fail("an argument error was found only after starting the work")

  monkeypatch.setattr("jaxspec.__main__.load_pretrained", forbidden)
  monkeypatch.setattr("jaxspec.training.cli.train", forbidden)


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_bad_argument_is_one_error_line_and_exit_status_2(argv, message, capsys, no_weights):
  with pytest.raises(SystemExit) as exit_info:
    main(argv)
  assert exit_info.value.code == 2
  stderr = capsys.readouterr().err
  errors = [line for line in stderr.splitlines() if "error:" in line]
  assert len(errors) == 1, stderr
  assert message in errors[0], stderr
  assert "Traceback" not in stderr


def test_fp8_kv_pages_of_an_mla_model_are_an_argument_error(tmp_path, capsys, no_weights):
  # A GLM-5-family (MLA) checkpoint, its vocabulary widened to hold the embedded tokenizer.
  dsa = ROOT / "tests" / "fixtures" / "glm_moe_dsa_a"
  config = json.loads((dsa / "config.json").read_text()) | {"vocab_size": 4096}
  (tmp_path / "config.json").write_text(json.dumps(config))
  (tmp_path / "tokenizer.json").symlink_to(DEFAULT_MODEL / "tokenizer.json")
  (tmp_path / "model.safetensors").symlink_to(dsa / "model.safetensors")
  argv = [*GENERATE, "--model", str(tmp_path), "--kv-cache-dtype", "float8_e4m3fn"]
  for command in (argv, ["evaluate", *argv[3:]]):
    with pytest.raises(SystemExit) as exit_info:
      main(command)
    assert exit_info.value.code == 2
    assert "fp8 KV pages serve GQA attention; this model's MLA cache stays 16-bit" in (
      capsys.readouterr().err
    )


def test_generate_serves_the_kv_cache_dtype_and_scale_asked_for(record_instances, capsys):
  import jaxspec.__main__ as cli_main

  engines = record_instances(cli_main, "Generator")
  argv = [*GENERATE, "--max-new-tokens", "3", "--repeats", "1", "--spec-tokens", "0", "--json"]
  assert main([*argv, "--kv-cache-dtype", "float8_e4m3fn", "--kv-scale", "0.5"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert result["kv_cache_dtype"] == "float8_e4m3fn" and result["kv_scale"] == 0.5
  assert len(result["tokens"]) == 3
  (engine,) = engines
  first = engine.cache.layers[0]
  assert first.k.dtype == jnp.float8_e4m3fn and first.v.dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(np.asarray(first.k_scale), 0.5)
  _print_report(result)
  assert "-- KV pages in float8_e4m3fn, scale 0.5" in capsys.readouterr().err
  # The default keeps the weights' dtype, with no scale.
  engines.clear()
  assert main(argv) == 0
  result = json.loads(capsys.readouterr().out)
  assert result["kv_cache_dtype"] == "auto" and result["kv_scale"] is None
  assert engines[0].cache.layers[0].k.dtype == jnp.bfloat16
  _print_report(result)
  assert "KV pages" not in capsys.readouterr().err


def test_evaluate_passes_the_kv_cache_options_on(monkeypatch, capsys):
  import jaxspec.__main__ as cli_main

  configs = []

  def recording(model, tokenizer, config, progress, prompts):
    configs.append(config)
    return []

  monkeypatch.setattr(cli_main, "evaluate", recording)
  argv = ["evaluate", "--num-prompts", "2", "--spec-tokens", "1", "--temperatures", "0", "--json"]
  assert main([*argv, "--kv-cache-dtype", "float8_e4m3fn", "--kv-scale", "2"]) == 0
  assert main(argv) == 0
  assert [(c.kv_cache_dtype, c.kv_scale) for c in configs] == [
    ("float8_e4m3fn", 2.0),
    ("auto", 1.0),
  ]


def _checkpoint_with_generation_config(tmp_path, generation_config: str):
  for name in ("config.json", "tokenizer.json", "model.safetensors"):
    (tmp_path / name).symlink_to(DEFAULT_MODEL / name)
  (tmp_path / "generation_config.json").write_text(generation_config)
  return tmp_path


@pytest.mark.parametrize(
  "contents", ['{"do_sample": true, "temperature": NaN}', '{"do_sample": true, "top_k": 2.5}']
)
def test_bad_generation_config_is_an_argument_error(tmp_path, capsys, no_weights, contents):
  model = _checkpoint_with_generation_config(tmp_path, contents)
  with pytest.raises(SystemExit) as exit_info:
    main(GENERATE + ["--model", str(model)])
  assert exit_info.value.code == 2
  assert "generation_config.json has" in capsys.readouterr().err


def test_sampling_defaults_come_from_generation_config_and_options_override_them(tmp_path):
  parser = argparse.ArgumentParser()
  unset = argparse.Namespace(temperature=None, top_p=None, top_k=None)
  assert _sampling(parser, tmp_path, unset, 2048) == SamplingParams()  # no file: greedy
  model = _checkpoint_with_generation_config(
    tmp_path, '{"do_sample": true, "temperature": 0.7, "top_p": 0.95, "top_k": 0}'
  )
  assert _sampling(parser, model, unset, 2048) == SamplingParams(temperature=0.7, top_p=0.95)
  greedy = argparse.Namespace(temperature=0.0, top_p=None, top_k=None)
  assert _sampling(parser, model, greedy, 2048) == SamplingParams()
  (model / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.7}')
  assert _sampling(parser, model, unset, 2048) == SamplingParams()


def test_argv_that_is_not_utf8_is_an_argument_error():
  command = [sys.executable, "-m", "jaxspec", "generate", "--prompt", b"def \xff(x):"]
  run = subprocess.run(command, cwd=ROOT, capture_output=True)
  assert run.returncode == 2
  stderr = run.stderr.decode()
  assert "error: argument 'def \\udcff(x):' is not valid UTF-8" in stderr, stderr
  assert "Traceback" not in stderr


def test_smoke_training_honours_the_options_given():
  parser = argparse.ArgumentParser()
  train_cli.add_train_parser(parser.add_subparsers())
  args = parser.parse_args(
    ["train", "--output-dir", "x", "--smoke", "--seed", "7", "--vocab-size", "300", "--steps", "9"]
  )
  config = train_cli.config_from_args(args)
  assert (config.model_preset, config.seed, config.vocab_size, config.steps) == (
    "smoke",
    7,
    300,
    9,
  )
  assert config.batch_size == train_cli.SMOKE.batch_size  # the rest stays smoke-sized
