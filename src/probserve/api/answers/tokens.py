"""Token bytes: the exact UTF-8 bytes each vocabulary id stands for.

Text, offsets and the chat `bytes` field are all built from this table, so concatenating the
bytes of a token sequence always rebuilds the decoded text exactly, including characters split
across byte-fallback pieces. Two encodings are understood:
- byte-level BPE (GPT-2 style: each byte is written as one printable unicode character);
- SentencePiece style (`▁` for a space, `<0xNN>` byte-fallback pieces).
Added/special tokens stand for their literal content.
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from typing import Any


def _byte_level_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: printable char -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", []) or []}
    return "ByteLevel" in kinds


class TokenTable:
    """id -> bytes for a tokenizer's whole vocabulary, built once per model."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._bytes = self._build(tokenizer, vocab_size)
        # display texts, computed once: formatting top-20 logprobs per token stays cheap
        self.legacy_texts = [token_text(b, legacy_prefix=True) for b in self._bytes]
        self.chat_texts = [token_text(b, legacy_prefix=False) for b in self._bytes]
        self.byte_lists = [list(b) for b in self._bytes]

    @staticmethod
    def _build(tokenizer: Any, vocab_size: int) -> list[bytes]:
        pieces = tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
        added = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
        table: list[bytes] = []
        if _is_byte_level(tokenizer):
            dec = _byte_level_decoder()
            for i, piece in enumerate(pieces):
                if piece is None:
                    table.append(b"")
                elif i in added or any(ch not in dec for ch in piece):
                    table.append(piece.encode("utf-8"))
                else:
                    table.append(bytes(dec[ch] for ch in piece))
            return table
        for i, piece in enumerate(pieces):
            if piece is None:
                table.append(b"")
            elif i in added:
                table.append(piece.encode("utf-8"))
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                table.append(bytes([int(piece[3:5], 16)]))
            else:
                table.append(piece.replace("▁", " ").encode("utf-8"))
        return table

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < len(self._bytes):
            return self._bytes[token_id]
        return b""

    def decode(self, token_ids: list[int] | tuple[int, ...]) -> str:
        """Text of a token sequence: its bytes joined, invalid UTF-8 replaced (U+FFFD)."""
        return b"".join(self.token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(int(i) for i in getattr(self.tokenizer, "all_special_ids", []))

    @cached_property
    def added_ids(self) -> frozenset[int]:
        """The tokenizer's added tokens (special or not: `<|im_end|>`, `<think>`)."""
        return frozenset(self.added_vocab.values())

    @cached_property
    def added_texts(self) -> re.Pattern[str] | None:
        """A pattern of the added tokens' texts (None: the tokenizer has none): what a
        client's text may hold that its tokenizer would read as a control token."""
        texts = sorted(self.added_vocab, key=len, reverse=True)
        return re.compile("|".join(re.escape(t) for t in texts)) if texts else None

    @cached_property
    def added_vocab(self) -> dict[str, int]:
        """The added tokens' texts and ids (read once: the tokenizer builds it on each call)."""
        get = getattr(self.tokenizer, "get_added_vocab", None)
        return {str(k): int(v) for k, v in (get() if get is not None else {}).items() if k}


def escape_bytes(data: bytes) -> str:
    """`\\xe2\\x80` style escapes for bytes that are not valid UTF-8 on their own."""
    return "".join(f"\\x{b:02x}" for b in data)


def token_text(data: bytes, legacy_prefix: bool) -> str:
    """A token's display text: its UTF-8 text, or escapes when its bytes are not valid UTF-8 on
    their own (`bytes:\\xe2\\x80` in completions, as OpenAI's legacy API; `\\xe2\\x80` in chat)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return ("bytes:" if legacy_prefix else "") + escape_bytes(data)
