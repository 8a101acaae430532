"""The checks behind issue 16's demo bar: repeated lines and `ast.parse` of the cut text."""

from jaxspec.training.demos import demo_quality, max_line_repeats, parses_as_python


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


def test_demo_quality_sums_up_the_samples():
  report = demo_quality([("def f():", "\n    return 1\n"), ("def g():", "\n    if x:\n")])
  assert report["parse_rate"] == 0.5 and report["max_line_repeats"] == 1
  assert [s["parses"] for s in report["samples"]] == [True, False]


def test_healed_demos_continue_the_healed_prompts_and_score_the_text_after_the_prompt():
  from jaxspec.__main__ import DEFAULT_MODEL
  from jaxspec.tokenizer import load_tokenizer
  from jaxspec.training.demos import DEMO_PROMPTS, healed_demo_quality

  tokenizer = load_tokenizer(DEFAULT_MODEL)
  (indent,) = tokenizer.encode("\n    ")
  seen = {}

  def continue_prompts(ids, masks):
    seen.update(ids=ids, masks=masks)
    # A prompt healed from its newline goes on with the newline-and-indent token.
    return [[indent, *tokenizer.encode("return 1\n")] if m is not None else [] for m in masks]

  report = healed_demo_quality(tokenizer, tokenizer.vocab_size, continue_prompts)
  for prompt, ids, mask, sample in zip(
    DEMO_PROMPTS, seen["ids"], seen["masks"], report["samples"], strict=True
  ):
    full = tokenizer.encode(prompt)
    if prompt.endswith("\n"):
      assert ids == full[:-1] and mask[indent]
      assert sample["continuation"] == "    return 1\n" and sample["parses"]
    else:
      assert ids == full and mask is None and sample["continuation"] == ""


def test_validation_prompts_are_other_prompts_of_the_same_kinds_and_are_continued_when_asked():
  from jaxspec.__main__ import DEFAULT_MODEL
  from jaxspec.tokenizer import load_tokenizer
  from jaxspec.training.demos import DEMO_PROMPTS, VALIDATION_PROMPTS, healed_demo_quality

  assert not set(VALIDATION_PROMPTS) & set(DEMO_PROMPTS)
  assert len(set(VALIDATION_PROMPTS)) == len(VALIDATION_PROMPTS) >= len(DEMO_PROMPTS)
  for prompt in VALIDATION_PROMPTS:  # each is the head of a function or a class, as the demos
    assert prompt.startswith(("def ", "class ", "import ")), prompt
  tokenizer = load_tokenizer(DEFAULT_MODEL)
  full = [tokenizer.encode(p) for p in VALIDATION_PROMPTS]
  seen = []

  def continue_prompts(ids, masks):
    seen.extend(ids)
    return [f[len(i) :] for f, i in zip(full, ids, strict=True)]  # what healing took away

  report = healed_demo_quality(
    tokenizer, tokenizer.vocab_size, continue_prompts, VALIDATION_PROMPTS
  )
  assert [s["prompt"] for s in report["samples"]] == list(VALIDATION_PROMPTS)
  assert [s["continuation"] for s in report["samples"]] == [""] * len(VALIDATION_PROMPTS)
  assert [f[: len(i)] for f, i in zip(full, seen, strict=True)] == seen
