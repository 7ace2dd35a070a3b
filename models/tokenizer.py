"""Text -> token ids for the base's prompt.

A real checkpoint directory brings its own tokenizer (`HFTokenizer`). Presets are random-init
and have no tokenizer files (nothing may be downloaded), so they use `ByteTokenizer`: UTF-8
bytes shifted past a few reserved ids. Its ids are meaningless to a random model anyway; what
matters is that they are deterministic and inside the vocabulary.
"""

from __future__ import annotations

from typing import Any, Protocol


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """One id per UTF-8 byte: id = byte + offset. Offset keeps 0 free for padding."""

    def __init__(self, offset: int = 4, vocab_size: int = 1024) -> None:
        if offset + 256 > vocab_size:
            raise ValueError(f"ByteTokenizer: offset {offset} + 256 exceeds vocab_size {vocab_size}")
        self.offset = offset
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]


class HFTokenizer:
    """Adapter over a transformers tokenizer: no special tokens added (the template adds them)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])
