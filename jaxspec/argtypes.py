"""argparse types for the command line: a bad value is one `error:` line and exit status 2.

Each factory returns a callable for `add_argument(type=...)`; argparse turns its
`ArgumentTypeError` into `prog: error: argument --name: message` on stderr and exits with 2,
before any model is loaded or anything is compiled.
"""

import argparse
import math
from collections.abc import Callable

# jax.random.key keeps the low 32 bits of a seed when 64-bit mode is off (the default): 2**32
# would silently give the stream of seed 0. Seeds are therefore unsigned 32-bit integers.
MAX_SEED = 2**32 - 1


def _parse_int(text: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _parse_float(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
  if not math.isfinite(value):
    raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
  return value


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
  """An integer in [low, high] (no upper bound when high is None)."""

  def parse(text: str) -> int:
    value = _parse_int(text)
    if value < low or (high is not None and value > high):
      expected = f"at least {low}" if high is None else f"in {low}..{high}"
      raise argparse.ArgumentTypeError(f"must be {expected}, got {value}")
    return value

  return parse


def float_in(
  low: float, high: float | None = None, *, low_open: bool = False
) -> Callable[[str], float]:
  """A finite float in [low, high] ((low, high] with low_open; no upper bound when high is None)."""

  def parse(text: str) -> float:
    value = _parse_float(text)
    below = value <= low if low_open else value < low
    if below or (high is not None and value > high):
      opening = "(" if low_open else "["
      closing = "inf)" if high is None else f"{high:g}]"
      raise argparse.ArgumentTypeError(f"must be in {opening}{low:g}, {closing}, got {text}")
    return value

  return parse


seed = int_in(0, MAX_SEED)
positive_int = int_in(1)


def first_non_utf8(argv: list[str]) -> str | None:
  """The first argument that is not valid UTF-8 (shown escaped), or None.

  Python decodes undecodable argv bytes to lone surrogates (PEP 383); they cannot be tokenized,
  printed or used as paths portably, so the command line rejects them up front.
  """
  for argument in argv:
    try:
      argument.encode("utf-8")
    except UnicodeEncodeError:
      return ascii(argument)
  return None
