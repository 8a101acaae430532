"""A byte-level BPE tokenizer trained with Hugging Face `tokenizers`, saved as `tokenizer.json`.

Byte-level BPE (as GPT-2 introduced it and GLM checkpoints ship it): text is mapped to bytes,
split by the GPT-2 pre-tokenizer regex, and merges are learned over byte pairs, so every string
encodes and decodes losslessly. The one special token, `<|endoftext|>` (id 0), separates documents
in the token stream and is the checkpoint's end-of-sequence token; the post-processor also puts it
before a prompt (`add_special_tokens=True`, as `HfTokenizer.encode_prompt` encodes), so that a
prompt starts a document as the training text's documents do, GPT-2's use of the same token.
"""

from collections.abc import Iterable
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

END_OF_TEXT = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int) -> tokenizers.Tokenizer:
  """Learns `vocab_size - 1` byte-level tokens and merges, plus `<|endoftext|>` as id 0."""
  if vocab_size < 257:
    raise ValueError(f"vocab_size must cover the 256 bytes plus {END_OF_TEXT}, got {vocab_size}")
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=[END_OF_TEXT],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tokenizer.train_from_iterator(texts, trainer=trainer)
  tokenizer.post_processor = processors.TemplateProcessing(
    single=f"{END_OF_TEXT} $A", special_tokens=[(END_OF_TEXT, tokenizer.token_to_id(END_OF_TEXT))]
  )
  return tokenizer


def save_tokenizer(tokenizer: tokenizers.Tokenizer, directory: str | Path) -> Path:
  """Writes `tokenizer` to `directory/tokenizer.json` (creating `directory`) and returns
  that path."""
  path = Path(directory) / "tokenizer.json"
  path.parent.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(path))
  return path
