"""The held-out acceptance evaluation of the embedded default model."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.__main__ import DEFAULT_MODEL
from jaxspec.evaluation import EvalConfig, evaluate, format_table, held_out_prompts
from jaxspec.model.weights import load_pretrained
from jaxspec.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def default_model():
  return load_pretrained(DEFAULT_MODEL, dtype=jnp.bfloat16), load_tokenizer(DEFAULT_MODEL)


def test_prompts_are_fixed_windows_of_held_out_files(default_model):
  _, tokenizer = default_model
  first = held_out_prompts(tokenizer, 4, 32)
  assert first == held_out_prompts(tokenizer, 4, 32)
  assert [len(p) for p in first] == [32] * 4 and len({tuple(p) for p in first}) == 4


def test_trained_draft_head_is_accepted_on_held_out_text(default_model):
  model, tokenizer = default_model
  config = EvalConfig(
    spec_tokens=(3,),
    temperatures=(0.0,),
    num_prompts=4,
    prompt_tokens=48,
    max_new_tokens=24,
    batch_size=4,
  )
  (row,) = evaluate(model, tokenizer, config, progress=False)
  assert row["k"] == 3 and len(row["per_position_acceptance"]) == 3
  # The shipped model was trained to reach >= 0.6 first-draft acceptance on these files.
  assert row["per_position_acceptance"][0] >= 0.6
  assert row["tokens_per_verify_step"] == pytest.approx(1 + sum(row["per_position_acceptance"]))
  assert "| 0 | 3 |" in format_table([row])


def test_evaluate_runs_on_the_kv_pages_asked_for(default_model, record_instances):
  import jaxspec.evaluation as evaluation

  engines = record_instances(evaluation, "SpeculativeGenerator")
  model, tokenizer = default_model
  config = EvalConfig(
    spec_tokens=(2,),
    temperatures=(0.0,),
    num_prompts=2,
    prompt_tokens=16,
    max_new_tokens=4,
    kv_cache_dtype="float8_e4m3fn",
    kv_scale=0.25,
  )
  (row,) = evaluate(model, tokenizer, config, progress=False)
  assert row["verify_steps"] > 0
  (engine,) = engines
  for pages in (*engine.cache.layers, engine.cache.draft):
    assert pages.k.dtype == jnp.float8_e4m3fn and pages.v.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(pages.v_scale), 0.25)
