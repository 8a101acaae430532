"""Text <-> token ids: a checkpoint's `tokenizer.json` (Hugging Face `tokenizers`) or raw bytes."""

import functools
from pathlib import Path
from typing import Protocol

import tokenizers
from tokenizers import decoders


class Tokenizer(Protocol):
  """What the engine and the command line need of a tokenizer: text to ids and back."""

  def encode(self, text: str) -> list[int]:
    """The text's tokens alone (no special tokens added)."""
    ...

  def encode_prompt(self, text: str) -> list[int]:
    """A prompt's tokens, with the special tokens a sequence starts with."""
    ...

  def decode(self, ids: list[int]) -> str:
    """The text of `ids`, special tokens left out."""
    ...


class ByteTokenizer:
  """One token per UTF-8 byte (ids 0..255); for models without a trained tokenizer."""

  vocab_size = 256

  def encode(self, text: str) -> list[int]:
    """The text's UTF-8 bytes."""
    return list(text.encode("utf-8"))

  def encode_prompt(self, text: str) -> list[int]:
    """As `encode`: byte ids have no special tokens."""
    return self.encode(text)

  def decode(self, ids: list[int]) -> str:
    """Ids below 256 as UTF-8 bytes (invalid sequences become U+FFFD); other ids are dropped."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
  """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the
  others for chr(256 + n) in byte order (`bytes_to_unicode` in GPT-2's `encoder.py`, which
  `tokenizers`' ByteLevel pre-tokenizer and decoder use), so that a space is "Ġ", a newline "Ċ"."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
  printable += range(ord("®"), ord("ÿ") + 1)
  others = [b for b in range(256) if b not in printable]
  alphabet = {chr(b): b for b in printable}
  alphabet.update({chr(256 + n): b for n, b in enumerate(others)})
  return alphabet


class HfTokenizer:
  """Wraps a `tokenizers.Tokenizer` (or the `tokenizer.json` it is read from), as GLM checkpoints
  ship it."""

  def __init__(self, source: str | Path | tokenizers.Tokenizer):
    if isinstance(source, tokenizers.Tokenizer):
      self._tokenizer = source
    else:
      self._tokenizer = tokenizers.Tokenizer.from_file(str(source))

  @property
  def vocab_size(self) -> int:
    """Size of the vocabulary, added (special) tokens included."""
    return self._tokenizer.get_vocab_size()

  def encode(self, text: str) -> list[int]:
    """The text's tokens alone (a piece of a stream: no special tokens added)."""
    return self._tokenizer.encode(text, add_special_tokens=False).ids

  def encode_prompt(self, text: str) -> list[int]:
    """A prompt's tokens, with the special tokens the tokenizer's post-processor puts around a
    sequence (Hugging Face's `tokenizer(text)`), e.g. the default model's document start."""
    return self._tokenizer.encode(text, add_special_tokens=True).ids

  def decode(self, ids: list[int]) -> str:
    """The text of `ids`, special tokens skipped."""
    return self._tokenizer.decode(ids, skip_special_tokens=True)

  def token_bytes(self) -> list[bytes]:
    """The bytes `decode` gives each id, alone: [vocab_size]; b"" for special tokens.

    With a byte-level decoder a token can hold part of a UTF-8 character, which `decode([id])`
    shows as U+FFFD, so the bytes are read from the vocabulary string through the byte-level
    alphabet. Other decoders: the UTF-8 of `decode([id])` (tokens decoding to U+FFFD get b"").
    """
    added = self._tokenizer.get_added_tokens_decoder()  # {id: AddedToken}
    byte_level = isinstance(self._tokenizer.decoder, decoders.ByteLevel)
    alphabet = byte_level_alphabet()

    def piece(i: int) -> bytes:
      if i in added:
        text = "" if added[i].special else added[i].content
      elif byte_level:
        return bytes(alphabet[c] for c in self._tokenizer.id_to_token(i))
      else:
        text = self.decode([i])
      return b"" if "\ufffd" in text else text.encode("utf-8")

    return [piece(i) for i in range(self.vocab_size)]


def load_tokenizer(model_dir: str | Path) -> HfTokenizer:
  """The `tokenizer.json` of a checkpoint directory; a clear error when it has none."""
  path = Path(model_dir) / "tokenizer.json"
  if not path.exists():
    raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
  return HfTokenizer(path)
