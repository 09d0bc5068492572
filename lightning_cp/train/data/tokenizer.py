"""Byte-level tokeniser: UTF-8 bytes are the tokens, plus one end-of-document id; nothing to download."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ByteTokenizer:
    """Map text to its UTF-8 bytes (ids 0..255) and optionally append ``eos_id`` (256)."""

    add_eos: bool = True

    eos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        """Return the token ids of ``text``."""
        ids = list(text.encode("utf-8"))
        return [*ids, self.eos_id] if self.add_eos else ids

    def decode(self, ids: list[int]) -> str:
        """Return the text of ``ids``, dropping special ids and invalid byte sequences."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
