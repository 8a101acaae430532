"""Token healing: back the prompt up by its last token and let the first new token re-cover it.

A tokenizer merges text across the point where the prompt ends: byte-level BPE encodes "\\n    "
(a newline and the next line's indentation) as one token, so a prompt ending in "\\n" ends with
the lone newline token, which in training text is followed only by an unindented line, and the
model dedents. Token healing (Lundberg, "The Art of Prompt Design: Prompt Boundaries and Token
Healing", 2023, in the `guidance` library; Hugging Face transformers'
`generate(token_healing=True)`) removes the prompt's last token and allows as the first new token
only the tokens whose text starts with the removed token's text (that token included), so the
model can pick "\\n    " itself. The constraint is a mask on the first token's logits
(`Generator.generate(first_token_masks=...)`): greedy decoding takes the argmax over the allowed
tokens, sampling renormalises over them, and speculative decoding stays lossless.

Texts are compared as the bytes each token decodes to (`HfTokenizer.token_bytes`): a byte-level
token may hold part of a UTF-8 character, which a decoded string cannot show.
"""

import bisect
import weakref
from collections.abc import Sequence

import numpy as np

from jaxspec.tokenizer import HfTokenizer


class _PrefixIndex:
  """A tokenizer's token bytes, sorted once: the tokens extending a prefix form one run."""

  def __init__(self, tokenizer: HfTokenizer):
    self.pieces = tokenizer.token_bytes()  # [V] bytes
    order = sorted(range(len(self.pieces)), key=self.pieces.__getitem__)
    self.sorted_pieces = [self.pieces[i] for i in order]
    self.sorted_ids = np.asarray(order, np.int64)  # [V]

  def extending(self, prefix: bytes) -> np.ndarray:
    """Ids of the tokens whose bytes start with `prefix`: int64 [n].

    Sorting by the whole byte string also sorts by its first len(prefix) bytes, so the run is
    found by two binary searches.
    """
    start = bisect.bisect_left(self.sorted_pieces, prefix)
    stop = bisect.bisect_right(
      self.sorted_pieces, prefix, lo=start, key=lambda piece: piece[: len(prefix)]
    )
    return self.sorted_ids[start:stop]


_INDEXES: "weakref.WeakKeyDictionary[HfTokenizer, _PrefixIndex]" = weakref.WeakKeyDictionary()


def heal_prompt(
  tokenizer: HfTokenizer, ids: Sequence[int], vocab_size: int
) -> tuple[list[int], np.ndarray | None]:
  """(the prompt without its last token, allowed first tokens bool [vocab_size]).

  Allowed are the tokens whose bytes start with the last token's bytes, the last token included;
  ids past the tokenizer's vocabulary (a model's padded rows) are not. Nothing is healed, and
  (ids, None) comes back, for a prompt of one token, a last token without text (a special token)
  or one that no other token extends. The vocabulary is indexed once per tokenizer.
  """
  if vocab_size < tokenizer.vocab_size:
    raise ValueError(
      f"vocab_size ({vocab_size}) must cover the tokenizer's {tokenizer.vocab_size} tokens"
    )
  ids = [int(i) for i in ids]
  if len(ids) < 2:
    return ids, None
  index = _INDEXES.get(tokenizer)
  if index is None:
    index = _INDEXES[tokenizer] = _PrefixIndex(tokenizer)
  removed = index.pieces[ids[-1]]
  extending = index.extending(removed) if removed else []
  if len(extending) < 2:
    return ids, None
  allowed = np.zeros(vocab_size, bool)
  allowed[extending] = True
  return ids[:-1], allowed


def continuation_text(
  tokenizer: HfTokenizer, prompt_ids: Sequence[int], ids: Sequence[int], new_tokens: Sequence[int]
) -> str:
  """The text `new_tokens` add after the prompt `prompt_ids`, generated after `ids` (the prompt,
  healed or not): decode(ids + new_tokens) without the prompt's text.

  A healed first token re-covers the removed token's text, which is part of the prompt; decoding
  the whole sequence keeps a UTF-8 character split across the boundary whole.
  """
  prompt_text = tokenizer.decode(list(prompt_ids))
  text = tokenizer.decode([*ids, *new_tokens])
  if not text.startswith(prompt_text):
    raise ValueError(
      f"the tokens generated after ids do not decode to text after the prompt {prompt_text!r}: "
      f"{text!r}"
    )
  return text[len(prompt_text) :]
