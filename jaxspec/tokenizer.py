"""Text <-> token ids: a checkpoint's `tokenizer.json` (Hugging Face `tokenizers`) or raw bytes."""

from pathlib import Path
from typing import Protocol

import tokenizers


class Tokenizer(Protocol):
  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
  """One token per UTF-8 byte (ids 0..255); for models without a trained tokenizer."""

  vocab_size = 256

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids: list[int]) -> str:
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HfTokenizer:
  """Wraps a `tokenizers.Tokenizer` loaded from `tokenizer.json`, as GLM checkpoints ship it."""

  def __init__(self, path: str | Path):
    self._tokenizer = tokenizers.Tokenizer.from_file(str(path))

  @property
  def vocab_size(self) -> int:
    return self._tokenizer.get_vocab_size()

  def encode(self, text: str) -> list[int]:
    return self._tokenizer.encode(text, add_special_tokens=False).ids

  def decode(self, ids: list[int]) -> str:
    return self._tokenizer.decode(ids, skip_special_tokens=True)


def load_tokenizer(model_dir: str | Path) -> HfTokenizer:
  """The `tokenizer.json` of a checkpoint directory; a clear error when it has none."""
  path = Path(model_dir) / "tokenizer.json"
  if not path.exists():
    raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
  return HfTokenizer(path)
