"""The checks behind issue 16's demo bar: repeated lines and `ast.parse` of the cut text."""

import pytest

from jaxspec.training.demos import demo_quality, max_line_repeats, parses_as_python, worst_of


def test_max_line_repeats_finds_a_greedy_loop_and_ignores_blank_lines():
  loop = "def f():\n    x = g(x)\n    x = g(x)  \n\n\n    x = g(x)\n"
  assert max_line_repeats(loop) == (3, "    x = g(x)")
  assert max_line_repeats("a\n\n\nb\n") == (1, "a")
  assert max_line_repeats("\n \n") == (0, "")


def test_parse_cuts_at_the_last_complete_line():
  prompt = "def fibonacci(n):"
  assert parses_as_python(prompt, "\n    return n\n    if n <")  # the unfinished line is cut
  assert not parses_as_python(prompt, "\n    if n < 2:\n        ")  # an empty block
  assert not parses_as_python(prompt, '\n    """Doc\n    more')  # an open docstring
  # No complete line of its own: the prompt alone is not the model's credit.
  assert not parses_as_python("x = 1\n", "y = ")
  assert not parses_as_python(prompt, "     ")


def test_a_continuation_that_ended_at_end_of_text_is_parsed_whole():
  prompt = "def fibonacci(n):"
  # The model's end-of-text completes the last line: nothing is cut.
  assert parses_as_python(prompt, "\n    return n", ended=True)
  assert not parses_as_python(prompt, "\n    return n")  # cut to the prompt alone
  assert not parses_as_python(prompt, "\n    if n:", ended=True)


def test_demo_quality_sums_up_the_samples():
  samples = [("def f():", "\n    return 1\n", False), ("def g():", "\n    if x:\n", False)]
  samples.append(("def h():", "\n    return 2", True))
  report = demo_quality(samples)
  assert report["parse_rate"] == 2 / 3 and report["max_line_repeats"] == 1
  assert [s["parses"] for s in report["samples"]] == [True, False, True]
  assert [s["ended"] for s in report["samples"]] == [False, False, True] and report["ended"] == 1


def test_healed_demos_continue_the_healed_prompts_and_score_the_text_after_the_prompt():
  from jaxspec.__main__ import DEFAULT_MODEL
  from jaxspec.tokenizer import load_tokenizer
  from jaxspec.training.demos import DEMO_PROMPTS, healed_demo_quality

  tokenizer = load_tokenizer(DEFAULT_MODEL)
  (indent,) = tokenizer.encode("\n    ")
  end_of_text = 0
  seen = {}

  def continue_prompts(ids, masks):
    seen.update(ids=ids, masks=masks)
    # A prompt healed from its newline goes on with the newline-and-indent token, then ends.
    return [
      [indent, *tokenizer.encode("return 1"), end_of_text] if m is not None else [] for m in masks
    ]

  report = healed_demo_quality(
    tokenizer, tokenizer.vocab_size, continue_prompts, stop_token_ids=(end_of_text,)
  )
  for prompt, ids, mask, sample in zip(
    DEMO_PROMPTS, seen["ids"], seen["masks"], report["samples"], strict=True
  ):
    # Each prompt starts a document, as the training stream's files follow <|endoftext|>.
    full = [end_of_text, *tokenizer.encode(prompt)]
    if prompt.endswith("\n"):
      assert ids == full[:-1] and mask[indent]
      assert sample["continuation"] == "    return 1" and sample["ended"] and sample["parses"]
      assert sample["new_tokens"] == 1 + len(tokenizer.encode("return 1")) + 1
    else:
      assert ids == full and mask is None and sample["continuation"] == ""
      assert not sample["ended"] and sample["new_tokens"] == 0


def test_validation_prompts_are_other_prompts_of_the_same_kinds_and_are_continued_when_asked():
  from jaxspec.__main__ import DEFAULT_MODEL
  from jaxspec.tokenizer import load_tokenizer
  from jaxspec.training.demos import DEMO_PROMPTS, VALIDATION_PROMPTS, healed_demo_quality

  assert not set(VALIDATION_PROMPTS) & set(DEMO_PROMPTS)
  assert len(set(VALIDATION_PROMPTS)) == len(VALIDATION_PROMPTS) >= len(DEMO_PROMPTS)
  for prompt in VALIDATION_PROMPTS:  # each is the head of a function or a class, as the demos
    assert prompt.startswith(("def ", "class ", "import ")), prompt
  tokenizer = load_tokenizer(DEFAULT_MODEL)
  full = [tokenizer.encode_prompt(p) for p in VALIDATION_PROMPTS]
  seen = []

  def continue_prompts(ids, masks):
    seen.extend(ids)
    return [f[len(i) :] for f, i in zip(full, ids, strict=True)]  # what healing took away

  report = healed_demo_quality(
    tokenizer, tokenizer.vocab_size, continue_prompts, VALIDATION_PROMPTS, stop_token_ids=(0,)
  )
  assert [s["prompt"] for s in report["samples"]] == list(VALIDATION_PROMPTS)
  assert [s["continuation"] for s in report["samples"]] == [""] * len(VALIDATION_PROMPTS)
  assert [f[: len(i)] for f, i in zip(full, seen, strict=True)] == seen


def test_the_validation_rank_puts_the_bar_first_then_repeats_then_parsing_then_the_later_step():
  from jaxspec.training import trainer
  from jaxspec.training.demos import meets_bar

  assert meets_bar(2, 0.51) and not meets_bar(3, 1.0) and not meets_bar(1, 0.5)

  def record(step, repeats, parse_rate):
    return {
      "step": step,
      "validation_demo_max_line_repeats": repeats,
      "validation_demo_parse_rate": parse_rate,
    }

  def kept(*records):
    return max(records, key=trainer._validation_key)["step"]

  assert kept(record(0, 1, 0.5), record(250, 2, 0.6)) == 250  # only the second meets the bar
  assert kept(record(0, 1, 0.6), record(250, 2, 1.0)) == 0  # both do: fewer repeats
  assert kept(record(0, 2, 0.6), record(250, 2, 0.9)) == 250  # then the larger share parsing
  assert kept(record(0, 2, 0.9), record(250, 2, 0.9), record(500, 4, 1.0)) == 250  # the later
  assert kept(record(0, 3, 0.2), record(250, 5, 0.9)) == 0  # neither: fewer repeats


def test_worst_of_takes_the_most_repeated_line_and_the_lowest_parse_rate_of_any_report():
  prompt = "def f():\n"
  looping = demo_quality([(prompt, "    x = 1\n" * 4, False), ("class A:\n", "    pass\n", True)])
  clean = demo_quality([(prompt, "    return 1\n", True), ("class A:\n", "    x = (\n", False)])
  report = worst_of({"bfloat16": clean, "float32": looping}, samples_from="bfloat16")
  assert report["max_line_repeats"] == 4 and looping["max_line_repeats"] == 4
  assert report["parse_rate"] == 0.5 == clean["parse_rate"] and looping["parse_rate"] == 1.0
  assert report["samples"] == clean["samples"] and report["ended"] == clean["ended"] == 1
  assert report["by_name"] == {
    "bfloat16": {"max_line_repeats": 1, "parse_rate": 0.5},
    "float32": {"max_line_repeats": 4, "parse_rate": 1.0},
  }
  with pytest.raises(ValueError, match="samples_from 'fp8'"):
    worst_of({"bfloat16": clean}, samples_from="fp8")
  other = demo_quality([("def g():\n", "    return 1\n", True), ("class A:\n", "    pass\n", True)])
  with pytest.raises(ValueError, match="different prompts"):
    worst_of({"bfloat16": clean, "float32": other}, samples_from="bfloat16")
