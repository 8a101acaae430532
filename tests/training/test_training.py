"""The training recipe on the CPU: a smoke run of a tiny model over a slice of the stdlib corpus."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from flax import nnx

import jaxspec
import jaxspec.__main__
from jaxspec.tokenizer import load_tokenizer
from jaxspec.training import cli, corpus, demos, repetition, resume, trainer

# A flag that differs from the smoke defaults (and leaves the losses as they were): the run
# must honour it.
SMOKE_FLAGS = ["--eval-every", "15"]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
  output_dir = tmp_path_factory.mktemp("smoke_model")
  (output_dir / "model.safetensors").write_bytes(b"an older checkpoint")
  (output_dir / "notes.txt").write_text("a file of the older checkpoint")
  argv = ["train", "--smoke", "--no-progress", "--output-dir", str(output_dir), "--overwrite"]
  assert cli.main(argv + SMOKE_FLAGS) == 0
  with open(output_dir / "training_log.json") as f:
    return output_dir, json.load(f)


def assert_same_parameters(base_dir, output_dir):
  """The two checkpoints hold the same parameters, bit for bit."""
  base = jaxspec.load_pretrained(base_dir, dtype=jnp.bfloat16)
  saved = jaxspec.load_pretrained(output_dir, dtype=jnp.bfloat16)
  for before, after in zip(
    jax.tree.leaves(nnx.state(base, nnx.Param)),
    jax.tree.leaves(nnx.state(saved, nnx.Param)),
    strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(before, np.float32), np.asarray(after, np.float32))


def test_corpus_is_sorted_and_held_out_files_stay_out_of_training():
  paths = corpus.list_sources()
  assert paths == sorted(paths)
  train_files, held_out_files = corpus.split_corpus()
  held_out = {f.relative_path for f in held_out_files}
  assert held_out == set(corpus.HELD_OUT_FILES)
  assert held_out.isdisjoint(f.relative_path for f in train_files)
  assert len(train_files) > 500


def test_definition_documents_follow_the_files_in_the_stream(smoke_run):
  output_dir, _ = smoke_run
  bpe_tokenizer = tokenizers.Tokenizer.from_file(str(output_dir / "tokenizer.json"))
  files = corpus.split_corpus(max_files=5)[0]
  whole, whole_tokens, none = trainer.training_stream(bpe_tokenizer, files, 0)
  stream, file_tokens, count = trainer.training_stream(bpe_tokenizer, files, 2)
  documents = corpus.definition_documents(files)
  definitions = trainer.encode_files(bpe_tokenizer, documents)
  assert (none, whole_tokens, file_tokens) == (0, whole.size, whole.size)
  assert count == len(documents) > 0
  # The files as before, then two copies of the definitions, each document closed by EOS (0)
  # and none opened by one (the tokenizer's document start is for prompts, not the stream).
  np.testing.assert_array_equal(stream, np.concatenate([whole, definitions, definitions]))
  assert (stream == 0).sum() == len(files) + 2 * count


def test_demo_continuations_have_a_positive_length():
  assert trainer.TrainConfig().demo_new_tokens == demos.DEMO_NEW_TOKENS == 96
  with pytest.raises(ValueError, match="demo_new_tokens must be positive, got 0"):
    dataclasses.replace(cli.SMOKE, demo_new_tokens=0)


def test_learning_rate_warms_up_then_decays_to_the_floor():
  config = trainer.TrainConfig(steps=100, warmup_steps=10, learning_rate=1e-3, min_lr_ratio=0.1)
  rates = [trainer.learning_rate(step, 100, config) for step in range(100)]
  assert rates[0] == pytest.approx(1e-4)
  assert rates[9] == pytest.approx(1e-3)
  assert all(a <= b for a, b in zip(rates[:10], rates[1:10], strict=False))
  assert all(a >= b for a, b in zip(rates[10:], rates[11:], strict=False))
  assert rates[-1] == pytest.approx(1e-4, rel=0.01)


def test_time_budget_fits_the_steps_to_the_time_left():
  config = trainer.TrainConfig(steps=10_000, warmup_steps=100, eval_every=100, time_budget_s=500)
  # 100 s spent at step 35; 0.1 s per step; 2 s per evaluation (0.02 s per step).
  left = 500 - 100 - 2 - trainer.TAIL_RESERVE_S
  expected = 35 + int(0.97 * left / 0.12)
  assert trainer.steps_within_budget(config, 35, 100.0, 0.1, 2.0) == expected
  assert trainer.steps_within_budget(config, 35, 100.0, 0.001, 2.0) == 10_000  # the cap
  assert trainer.steps_within_budget(config, 35, 600.0, 0.1, 2.0) == 101  # past the budget


def test_smoke_run_honours_its_flags_and_lowers_train_and_held_out_losses(smoke_run):
  _, log = smoke_run
  assert log["train_config"] == dataclasses.asdict(cli.SMOKE) | {"eval_every": 15}
  assert log["corpus"]["definition_documents"] == 0  # whole files only, unless asked
  assert log["corpus"]["stream_tokens"] == log["corpus"]["train_tokens"]
  history, evals = log["history"], log["evals"]
  assert len(history) == log["final"]["steps"] == 30
  assert "repetition_loss" not in history[0]  # no repeated rows in the smoke recipe
  assert [e["step"] for e in evals] == [0, 15, 30]
  first = np.mean([h["loss"] for h in history[:3]])
  last = np.mean([h["loss"] for h in history[-3:]])
  assert last < first - 1.0, (first, last)
  assert evals[-1]["lm_loss"] < evals[0]["lm_loss"] - 0.5
  assert evals[-1]["mtp_loss"] < evals[0]["mtp_loss"] - 0.5
  chain = [evals[-1][f"chain_acceptance_{d}"] for d in (1, 2, 3)]
  assert chain == sorted(chain, reverse=True)
  assert evals[-1]["tokens_per_step_k3"] == pytest.approx(1.0 + sum(chain))
  bytes_per_token = log["corpus"]["held_out_bytes_per_token"]
  assert evals[-1]["lm_bits_per_byte"] == pytest.approx(
    evals[-1]["lm_loss"] / bytes_per_token / np.log(2)
  )
  assert len(log["samples"]) == 6 and 0.0 <= log["final"]["demo_parse_rate"] <= 1.0
  repeats = log["final"]["held_out_repeats"]
  assert list(repeats) == ["span_12", "span_48"]
  for profile, (_, count) in zip(repeats.values(), repetition.DIAGNOSTIC_SPANS, strict=True):
    assert len(profile["probability"]) == len(profile["argmax"]) == count - 1
    assert all(0.0 < p < 1.0 for p in profile["probability"])
    assert all(0.0 <= p <= 1.0 for p in profile["argmax"])


def test_overwrite_replaces_the_whole_directory_and_leaves_no_temporary(smoke_run):
  output_dir, log = smoke_run
  names = {p.name for p in output_dir.iterdir()}
  written = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"}
  assert written | {"training_log.json", "loss.png"} <= names
  # The recipe's generation_config.json is the embedded model's (greedy by default).
  shipped = (jaxspec.__main__.DEFAULT_MODEL / "generation_config.json").read_text()
  written_config = (output_dir / "generation_config.json").read_text()
  assert json.loads(written_config) == json.loads(shipped)
  assert "notes.txt" not in names  # nothing of the older checkpoint is left beside the new one
  assert (output_dir / "model.safetensors").read_bytes() != b"an older checkpoint"
  temporary = f".{output_dir.name}."  # staging and previous-checkpoint directories
  assert [p.name for p in output_dir.parent.iterdir() if p.name.startswith(temporary)] == []


def test_checkpoint_round_trips_with_load_pretrained_and_its_tokenizer(smoke_run):
  output_dir, log = smoke_run
  model = jaxspec.load_pretrained(output_dir, dtype=jnp.float32)
  assert model.config.num_nextn_predict_layers == 1 and model.mtp is not None
  assert model.config.to_hf_dict() == log["model_config"]

  tokenizer = load_tokenizer(output_dir)
  text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
  assert tokenizer.decode(tokenizer.encode(text)) == text
  # A prompt starts a document, as each training file follows <|endoftext|> (id 0) in the stream.
  assert tokenizer.encode_prompt(text) == [0, *tokenizer.encode(text)]
  assert tokenizer.vocab_size == model.config.vocab_size == log["train_config"]["vocab_size"]

  # The trainer evaluates on a bf16 copy of its float32 parameters, which is exactly what the
  # bf16 checkpoint holds: the held-out metrics of the reloaded model must match the log's.
  config = trainer.TrainConfig(**log["train_config"])
  reloaded = trainer.Trainer(model.config, config)
  reloaded.params = nnx.state(model, nnx.Param)
  bpe_tokenizer = tokenizers.Tokenizer.from_file(str(output_dir / "tokenizer.json"))
  windows = trainer.eval_windows(
    trainer.encode_files(bpe_tokenizer, corpus.split_corpus()[1]),
    config.seq_len,
    config.eval_draft_depth,
    config.max_eval_windows,
  )
  metrics = reloaded.evaluate(windows)
  final = log["evals"][-1]
  for name in ("lm_loss", "mtp_loss", "mtp_agreement", "chain_acceptance_3"):
    assert metrics[name] == pytest.approx(final[name], rel=1e-5, abs=1e-6), name


def test_the_demos_run_the_weights_as_the_checkpoint_saves_and_load_pretrained_reads_them(
  smoke_run, tmp_path
):
  # Master parameters off the bf16 grid, as training leaves them; the router's correction bias
  # too (the checkpoint keeps it float32).
  model = jaxspec.load_pretrained(smoke_run[0], dtype=jnp.float32)
  params = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  noisy = [
    v * (1 + 1e-3 * jax.random.normal(k, v.shape)) for v, k in zip(leaves, keys, strict=True)
  ]
  params = jax.tree.unflatten(treedef, noisy)
  nnx.update(model, params)
  jaxspec.save_pretrained(model, tmp_path, dtype=jnp.bfloat16)
  for dtype in (jnp.bfloat16, jnp.float32):
    saved = nnx.state(jaxspec.load_pretrained(tmp_path, dtype=dtype), nnx.Param)
    ours = trainer._saved_params(params, dtype)
    flat_saved, flat_ours = jax.tree.leaves_with_path(saved), jax.tree.leaves_with_path(ours)
    assert [p for p, _ in flat_saved] == [p for p, _ in flat_ours]
    for (path, a), (_, b) in zip(flat_saved, flat_ours, strict=True):
      assert a.dtype == b.dtype and bool(jnp.all(a == b)), (dtype, jax.tree_util.keystr(path))


def test_init_from_continues_from_the_checkpoint_and_keep_validation_can_save_its_start(
  smoke_run, tmp_path, monkeypatch
):
  base_dir, base_log = smoke_run
  # `--keep validation` with the first evaluation, the loaded checkpoint's, ranked above the
  # others: the saved weights must then be the loaded ones bit for bit, though the steps after it
  # changed the parameters (whose buffers each step donates).
  monkeypatch.setattr(trainer, "_validation_key", lambda metrics: -metrics["step"])
  # Two of the prompts: each evaluation continues them by 96 tokens, which on a CPU costs more
  # than the whole phase's training.
  monkeypatch.setattr(trainer, "VALIDATION_PROMPTS", trainer.VALIDATION_PROMPTS[:2])
  output_dir = tmp_path / "second_phase"
  argv = ["train", "--smoke", "--no-progress", "--output-dir", str(output_dir)]
  phase = ["--init-from", str(base_dir), "--steps", "4", "--warmup-steps", "3", "--keep"]
  phase += ["validation"]
  assert cli.main(argv + phase + ["--repetition-rows", "2", "--unlikelihood-rows", "2"]) == 0
  with open(output_dir / "training_log.json") as f:
    log = json.load(f)
  evals, final = log["evals"], log["final"]
  assert [e["step"] for e in evals] == [0, 4]
  for e in evals:
    assert e["validation_demo_max_line_repeats"] >= 1
    assert 0.0 <= e["validation_demo_parse_rate"] <= 1.0
  assert evals[-1]["lm_loss"] != evals[0]["lm_loss"]
  assert (final["steps"], final["kept_step"]) == (4, 0)
  # The demos of the saved weights, served in bf16 and in float32: the worse of the two counts.
  by_precision = final["demo_by_precision"]
  assert set(by_precision) == {"bfloat16", "float32"}
  assert final["demo_max_line_repeats"] == max(r["max_line_repeats"] for r in by_precision.values())
  assert final["demo_parse_rate"] == min(r["parse_rate"] for r in by_precision.values())
  assert final["held_out_lm_loss"] == evals[0]["lm_loss"]
  assert final["train_lm_loss"] == log["history"][0]["lm_loss"]
  assert_same_parameters(base_dir, output_dir)
  # The second phase evaluates the loaded bf16 parameters before its first step: exactly the
  # first phase's final (bf16) evaluation, on the same held-out windows.
  start, end = log["evals"][0], base_log["evals"][-1]
  for name in ("lm_loss", "mtp_loss", "mtp_agreement", "chain_acceptance_3"):
    assert start[name] == pytest.approx(end[name], rel=1e-5, abs=1e-6), name
  assert (output_dir / "tokenizer.json").read_bytes() == (base_dir / "tokenizer.json").read_bytes()
  assert log["initial_checkpoint"]["model_sha256"] == trainer._sha256(
    base_dir / "model.safetensors"
  )
  assert log["train_config"]["init_from"] == str(base_dir)
  assert {"repetition_loss", "unlikelihood_loss", "rollout_malformed_share"} <= set(
    log["history"][0]
  )


def test_a_draft_head_phase_changes_the_mtp_layer_and_saves_the_target_bit_for_bit(
  smoke_run, tmp_path
):
  # Both draft-head options in one phase (each phase costs about 30 s on a CPU); each label kind
  # alone: tests/training/test_draft_head_training.py.
  base_dir, base_log = smoke_run
  output_dir = tmp_path / "draft_head"
  argv = ["train", "--smoke", "--no-progress", "--output-dir", str(output_dir)]
  phase = ["--init-from", str(base_dir), "--steps", "4", "--warmup-steps", "3"]
  draft_options = ["--mtp-labels", "target", "--draft-text", "greedy"]
  draft_options += ["--greedy-prefix-tokens", "16"]
  assert cli.main(argv + phase + ["--draft-head-only"] + draft_options) == 0
  base = jaxspec.load_pretrained(base_dir, dtype=jnp.bfloat16)
  tuned = jaxspec.load_pretrained(output_dir, dtype=jnp.bfloat16)
  flat = {
    name: jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    for name, model in (("base", base), ("tuned", tuned))
  }
  changed = set()
  for (path, before), (_, after) in zip(flat["base"], flat["tuned"], strict=True):
    name = jax.tree_util.keystr(path)
    if not np.array_equal(np.asarray(before, np.float32), np.asarray(after, np.float32)):
      changed.add(name)
  assert changed and all(name.startswith("['mtp']") for name in changed), changed
  # The same target: the held-out next-token loss and the demos are the first phase's.
  with open(output_dir / "training_log.json") as f:
    log = json.load(f)
  end = base_log["final"]
  assert log["final"]["held_out_lm_loss"] == pytest.approx(end["held_out_lm_loss"], rel=1e-6)
  assert [s["continuation"] for s in log["samples"]] == [
    s["continuation"] for s in base_log["samples"]
  ]


def test_a_run_paused_twice_and_resumed_saves_the_uninterrupted_checkpoint_bit_for_bit(
  smoke_run, tmp_path, capsys
):
  base_dir, base_log = smoke_run
  output_dir = tmp_path / "paused"
  argv = ["train", "--smoke", "--no-progress", "--output-dir", str(output_dir)] + SMOKE_FLAGS
  state = resume.resume_dir(output_dir)
  # Any positive pause stops after the call's first step: steps 0 and 1, then the rest.
  for call, next_step in ((argv, 1), (argv + ["--resume"], 2)):
    assert cli.main(call + ["--pause-after-s", "1e-9"]) == 0
    assert f"paused after step {next_step} of 30" in capsys.readouterr().out
    assert not output_dir.exists()
    with open(state / "state.json") as f:
      saved = json.load(f)
    assert saved["next_step"] == next_step
  # The log's total_s counts the earlier calls' wall time: mark it in the state to see it carried.
  saved["wall_s"] += 1000.0
  with open(state / "state.json", "w") as f:
    json.dump(saved, f)
  assert cli.main(argv + ["--resume"]) == 0
  assert not state.exists()  # the checkpoint replaces the paused state
  for name in ("model.safetensors", "tokenizer.json", "config.json"):
    assert (output_dir / name).read_bytes() == (base_dir / name).read_bytes(), name
  with open(output_dir / "training_log.json") as f:
    log = json.load(f)
  assert [h["loss"] for h in log["history"]] == [h["loss"] for h in base_log["history"]]
  assert [e["step"] for e in log["evals"]] == [0, 15, 30]
  assert log["evals"][-1]["lm_loss"] == base_log["evals"][-1]["lm_loss"]
  assert log["final"]["steps"] == 30
  assert log["timing"]["total_s"] > 1000.0 > log["timing"]["train_s"]


def test_resume_refuses_a_missing_or_foreign_state_and_a_fresh_run_keeps_a_paused_one(
  tmp_path, capsys
):
  output_dir = tmp_path / "model"
  argv = ["train", "--smoke", "--no-progress", "--output-dir", str(output_dir)]
  with pytest.raises(SystemExit):
    cli.main(argv + ["--resume"])
  assert "no paused run to resume" in capsys.readouterr().err
  # With a time budget the first call pauses only once the step count is fixed: after the
  # calibration's last step (the smoke warm-up's 5th, step 5).
  budget = ["--steps", "8", "--time-budget-s", "1000"]
  assert cli.main(argv + budget + ["--pause-after-s", "1e-9"]) == 0
  with open(resume.resume_dir(output_dir) / "state.json") as f:
    state = json.load(f)
  assert (state["next_step"], state["total_steps"]) == (6, 8)
  with pytest.raises(SystemExit):  # other options than the paused run's
    cli.main(argv + ["--steps", "9", "--time-budget-s", "1000", "--resume"])
  assert "steps: 8 then, 9 now" in capsys.readouterr().err
  with pytest.raises(SystemExit):  # a fresh run would write over the paused state
    cli.main(argv + ["--steps", "8"])
  assert "holds a paused run" in capsys.readouterr().err
  with pytest.raises(FileExistsError, match="holds a paused run"):
    trainer.train(dataclasses.replace(cli.SMOKE, steps=8), output_dir, progress=False)
  with pytest.raises(ValueError, match="pause_after_s must be positive"):
    trainer.train(cli.SMOKE, tmp_path / "other", pause_after_s=0.0, progress=False)
  assert (resume.resume_dir(output_dir) / "state.json").is_file()


def test_a_paused_run_keeps_its_best_evaluation_s_parameters(smoke_run, tmp_path, monkeypatch):
  # As in the init_from test, the first evaluation ranks best: after a pause right after step 0
  # and the resumed steps, the saved weights must still be the loaded ones bit for bit.
  base_dir, _ = smoke_run
  monkeypatch.setattr(trainer, "_validation_key", lambda metrics: -metrics["step"])
  monkeypatch.setattr(trainer, "VALIDATION_PROMPTS", trainer.VALIDATION_PROMPTS[:1])
  output_dir = tmp_path / "kept"
  argv = ["train", "--smoke", "--no-progress", "--output-dir", str(output_dir), "--init-from"]
  argv += [str(base_dir), "--steps", "4", "--warmup-steps", "3", "--keep", "validation"]
  assert cli.main(argv + ["--pause-after-s", "1e-9"]) == 0
  assert cli.main(argv + ["--resume"]) == 0
  with open(output_dir / "training_log.json") as f:
    log = json.load(f)
  assert [e["step"] for e in log["evals"]] == [0, 4]
  assert (log["final"]["steps"], log["final"]["kept_step"]) == (4, 0)
  assert log["evals"][-1]["lm_loss"] != log["evals"][0]["lm_loss"]  # the steps did train
  assert_same_parameters(base_dir, output_dir)


def test_init_from_refuses_a_checkpoint_of_another_shape(smoke_run, tmp_path, capsys):
  base_dir, _ = smoke_run
  argv = ["train", "--no-progress", "--output-dir", str(tmp_path / "x"), "--init-from"]
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv + [str(base_dir)])  # the default preset from a smoke checkpoint
  assert exit_info.value.code == 2
  assert "not the 'default' preset at vocab_size 2048" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main(argv + [str(base_dir), "--smoke", "--tokenizer", str(base_dir / "tokenizer.json")])
  assert "leave out --tokenizer" in capsys.readouterr().err
  with pytest.raises(ValueError, match="not both"):
    trainer.train(
      dataclasses.replace(cli.SMOKE, init_from=str(base_dir)),
      tmp_path / "y",
      tokenizer_path=base_dir / "tokenizer.json",
    )


def test_an_interrupted_run_leaves_the_old_checkpoint_untouched(tmp_path, monkeypatch):
  output_dir = tmp_path / "model"
  output_dir.mkdir()
  old = {"config.json": b'{"old": true}', "model.safetensors": b"old weights"}
  for name, data in old.items():
    (output_dir / name).write_bytes(data)

  def interrupted_step(self, stream, key, lr):
    raise KeyboardInterrupt

  monkeypatch.setattr(trainer.Trainer, "train_step", interrupted_step)
  with pytest.raises(KeyboardInterrupt):
    trainer.train(cli.SMOKE, output_dir, overwrite=True, progress=False)
  assert {p.name: p.read_bytes() for p in output_dir.iterdir()} == old
  assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary directory left
  # Without overwrite the run refuses before any work.
  with pytest.raises(FileExistsError, match="not empty"):
    trainer.train(cli.SMOKE, output_dir, progress=False)
