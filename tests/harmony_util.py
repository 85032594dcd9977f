"""gpt-oss's o200k_harmony tokenizer, offline, from the `quicktok-v1` package's o200k vocabulary
(its ranks written back as `o200k_base.tiktoken`, byte for byte the file openai-harmony
hash-checks) plus harmony's special tokens at their ids; and openai-harmony's encoding loaded
from that file (TIKTOKEN_ENCODINGS_BASE), the reference the tests compare against."""

from __future__ import annotations

import base64
import hashlib
import os
import struct
from pathlib import Path
from typing import Any

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
# o200k's split pattern (tiktoken's o200k_base)
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# harmony's special tokens (openai-harmony's o200k_harmony); ids 200000..201087 otherwise reserved
SPECIAL = {
    199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
    200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>",
    200008: "<|message|>", 200012: "<|call|>", 200018: "<|endofprompt|>",
}  # fmt: skip
VOCAB = 201088


def tiktoken_file(folder: Path) -> Path:
    """`folder`/o200k_base.tiktoken, written from quicktok's vocabulary (checked by its hash)."""
    import quicktok

    path = folder / "o200k_base.tiktoken"
    if path.exists():
        return path
    data = (Path(quicktok.__file__).parent / "data" / "o200k.vocab").read_bytes()
    (n,) = struct.unpack_from("<I", data, 0)
    at, lines = 4, []
    for _ in range(n):
        (size,) = struct.unpack_from("<H", data, at)
        token = data[at + 2 : at + 2 + size]
        (rank,) = struct.unpack_from("<I", data, at + 2 + size)
        at += 6 + size
        lines.append(f"{base64.b64encode(token).decode()} {rank}\n")
    text = "".join(lines).encode()
    assert hashlib.sha256(text).hexdigest() == O200K_SHA256
    path.write_bytes(text)
    return path


def harmony_encoding(folder: Path) -> Any:
    """openai-harmony's HARMONY_GPT_OSS encoding, loaded offline from `folder`."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    tiktoken_file(folder)
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def harmony_tokenizer(folder: Path, chat_template: str | None) -> Any:
    """o200k_harmony as a fast tokenizer (merges from the ranks, as transformers converts a
    tiktoken file), the special tokens at harmony's ids, `chat_template` its template."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tk = TikTokenConverter(str(tiktoken_file(folder)), pattern=O200K_PATTERN).converted()
    names = {i: SPECIAL.get(i, f"<|reserved_{i}|>") for i in range(199998, VOCAB)}
    added = [AddedToken(names[i], special=True, normalized=False) for i in sorted(names)]
    tk.add_special_tokens(added)
    assert all(tk.token_to_id(name) == i for i, name in names.items())
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|return|>", pad_token="<|endoftext|>",
        chat_template=chat_template,
    )  # fmt: skip
