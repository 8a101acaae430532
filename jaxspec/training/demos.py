"""Demo prompts and what a continuation of them reads like: repeated lines, and whether it parses.

The default model's first impression is `python -m jaxspec generate --prompt "def fibonacci(n):"`;
a small code model decoded greedily tends to loop on one line. These checks put numbers on that
(issue 16's bar: no line more than twice in 96 new tokens, and more continuations that parse as
Python than not); the trainer logs them and `scripts/check_default_model.py` reports them.
"""

import ast
import collections
from collections.abc import Callable, Collection

import numpy as np

from jaxspec.serving.token_healing import continuation_text, heal_prompt
from jaxspec.tokenizer import HfTokenizer

# The README's prompt and five more: functions, classes and docstrings.
DEMO_PROMPTS = (
  "def fibonacci(n):",
  'def is_prime(n):\n    """Return True if n is a prime number."""\n',
  "class Stack:\n    def __init__(self):",
  'def read_lines(path):\n    """Return the lines of a text file, without line endings."""\n',
  "import os\n\n\ndef list_python_files(root):",
  'class Point:\n    """A point in the plane."""\n\n    def __init__(self, x, y):',
)

# Other prompts of the same kinds, for choosing between candidate checkpoints, so that the demo
# prompts above stay an unseen test of the chosen one.
VALIDATION_PROMPTS = (
  "def factorial(n):",
  'def gcd(a, b):\n    """Return the greatest common divisor of a and b."""\n',
  "class Queue:\n    def __init__(self):",
  'def count_words(text):\n    """Return a dict mapping each word of text to its count."""\n',
  "import json\n\n\ndef load_config(path):",
  'class Rectangle:\n    """A rectangle with a width and a height."""\n\n'
  "    def __init__(self, w, h):",
  "def binary_search(items, target):",
  'def flatten(nested):\n    """Return a flat list of the items of a list of lists."""\n',
  "class LinkedList:\n    def __init__(self):",
  "import sys\n\n\ndef main(argv):",
  'def merge_dicts(a, b):\n    """Return a new dict with the items of a, updated by b."""\n',
  'class Timer:\n    """Measure elapsed wall time."""\n\n    def __init__(self):',
)

DEMO_NEW_TOKENS = 96  # tokens per continuation (issue 16's bar)
# Issue 16's bar for a set of continuations: no line more than this many times, and a share
# that parses above `MIN_PARSE_RATE`.
MAX_LINE_REPEATS = 2
MIN_PARSE_RATE = 0.5


def meets_bar(max_line_repeats: int, parse_rate: float) -> bool:
  """Whether continuations with this most repeated line count and parse share meet the bar."""
  return max_line_repeats <= MAX_LINE_REPEATS and parse_rate > MIN_PARSE_RATE


def max_line_repeats(text: str) -> tuple[int, str]:
  """(count, line) of the most repeated non-blank line (trailing spaces ignored); (0, "") if none.

  A greedy loop shows as the same line over and over; the issue's bar is at most two copies.
  """
  counts = collections.Counter(line.rstrip() for line in text.splitlines() if line.strip())
  if not counts:
    return 0, ""
  line, count = counts.most_common(1)[0]
  return count, line


def parses_as_python(prompt: str, continuation: str, ended: bool = False) -> bool:
  """`ast.parse` of prompt + continuation cut after its last complete line (the last newline), or
  whole when the continuation `ended` at the model's end-of-text token (its last line is complete).

  A continuation that completes no line of its own (no newline, not ended) does not count as
  parsing.
  """
  text = prompt + continuation
  cut = text if ended else text[: text.rfind("\n") + 1]
  if len(cut) <= len(prompt):
    return False
  try:
    ast.parse(cut)
  except (SyntaxError, ValueError):  # ValueError: a null byte in the text
    return False
  return True


def demo_quality(samples: list[tuple[str, str, bool]]) -> dict:
  """Per (prompt, continuation, ended at end-of-text): the most repeated line and whether it
  parses; and the totals."""
  rows = []
  for prompt, continuation, ended in samples:
    count, line = max_line_repeats(prompt + continuation)
    rows.append(
      {
        "prompt": prompt,
        "continuation": continuation,
        "ended": ended,
        "max_line_repeats": count,
        "most_repeated_line": line,
        "parses": parses_as_python(prompt, continuation, ended),
      }
    )
  return {
    "samples": rows,
    "max_line_repeats": max((r["max_line_repeats"] for r in rows), default=0),
    "parse_rate": sum(r["parses"] for r in rows) / max(1, len(rows)),
    "ended": sum(r["ended"] for r in rows),
  }


def worst_of(reports: dict[str, dict], samples_from: str) -> dict:
  """The worse of several `demo_quality` reports of the same prompts (e.g. one model's weights in
  two precisions): the most repeated line of any, the lowest parse rate; `samples` and `ended`
  from `reports[samples_from]`, and each report's two totals under `by_name`.

  Greedy decoding follows the argmax, and rounding the weights can flip one argmax and with it
  a whole continuation: a checkpoint's demos passed the bar in bf16 and repeated a line four times
  with the same weights in float32.
  """
  if samples_from not in reports:
    raise ValueError(f"samples_from {samples_from!r} is not one of the reports {list(reports)}")
  prompts = {name: [s["prompt"] for s in r["samples"]] for name, r in reports.items()}
  if any(p != prompts[samples_from] for p in prompts.values()):
    raise ValueError(f"the reports continue different prompts: {prompts}")
  chosen = reports[samples_from]
  return {
    "samples": chosen["samples"],
    "max_line_repeats": max(r["max_line_repeats"] for r in reports.values()),
    "parse_rate": min(r["parse_rate"] for r in reports.values()),
    "ended": chosen["ended"],
    "by_name": {
      name: {"max_line_repeats": r["max_line_repeats"], "parse_rate": r["parse_rate"]}
      for name, r in reports.items()
    },
  }


def healed_demo_quality(
  tokenizer: HfTokenizer,
  vocab_size: int,
  continue_prompts: Callable[[list[list[int]], list[np.ndarray | None]], list[list[int]]],
  prompt_texts: tuple[str, ...] = DEMO_PROMPTS,
  *,
  stop_token_ids: Collection[int],
) -> dict:
  """`demo_quality` of the demo prompts (or `prompt_texts`, e.g. `VALIDATION_PROMPTS`) continued
  as `python -m jaxspec generate` continues them: each prompt encoded with the tokenizer's
  document start (`HfTokenizer.encode_prompt`) and healed (`token_healing.heal_prompt`),
  `continue_prompts(ids, first_token_masks)` returning the new tokens of each (cut after a stop
  token, which they then end with, as `Generator.generate` returns them), and the text read after
  the prompt. A continuation ending in one of `stop_token_ids` counts as ended; each sample also
  gives its `new_tokens`, the stop token included."""
  prompts = [tokenizer.encode_prompt(p) for p in prompt_texts]
  healed = [heal_prompt(tokenizer, p, vocab_size) for p in prompts]
  ids = [i for i, _ in healed]
  continuations = continue_prompts(ids, [mask for _, mask in healed])
  samples = [
    (text, continuation_text(tokenizer, p, i, c), bool(c) and c[-1] in stop_token_ids)
    for text, p, i, c in zip(prompt_texts, prompts, ids, continuations, strict=True)
  ]
  report = demo_quality(samples)
  for row, continuation in zip(report["samples"], continuations, strict=True):
    row["new_tokens"] = len(continuation)
  return report
