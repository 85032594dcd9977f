"""One parse of a GGUF file's header per load.

gguf's `GGUFReader` builds a numpy view for every element of every metadata array, so parsing a
file whose tokenizer holds Gemma's 262k vocabulary takes ~20 s on a 2-core machine (SmolLM2's
49k, ~4 s). A first start reads the header up to four times: transformers for the configuration,
again for the tokenizer (and twice more for a float32 copy), and the blocks reader once more.
Within `parsed_once()` every `gguf.GGUFReader(path)` of a file already parsed in it returns that
first parse (read-only, memory-mapped), so each file is parsed once per load. transformers and
models/gguf_blocks.py both import the reader from the `gguf` module when they are called, which
is what the context swaps for its duration and restores after; nested uses share the outer one.
A parse kept for later holds the file's mapping, so `release_pages` drops the pages read through
it from the process's memory once their contents are elsewhere (the blocks cache written).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def parsed_once() -> Iterator[None]:
    import gguf

    reader_class = gguf.GGUFReader
    if getattr(reader_class, "parses_once", False):  # an outer parsed_once() is in force
        yield
        return
    parsed: dict[str, Any] = {}

    def reader(path: str | Path, mode: str = "r") -> Any:
        if mode != "r":
            return reader_class(path, mode)  # type: ignore[arg-type]
        key = str(Path(path).resolve())
        if key not in parsed:
            parsed[key] = reader_class(path, mode)  # type: ignore[arg-type]
        return parsed[key]

    def release(path: str | Path) -> None:
        held = parsed.get(str(Path(path).resolve()))
        pages = getattr(getattr(held, "data", None), "_mmap", None)  # numpy's memmap's mmap
        if pages is not None and hasattr(pages, "madvise"):
            pages.madvise(mmap.MADV_DONTNEED)  # read-only and file-backed: reread if touched

    reader.parses_once = True  # type: ignore[attr-defined]
    reader.release = release  # type: ignore[attr-defined]
    gguf.GGUFReader = reader  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gguf.GGUFReader = reader_class  # type: ignore[misc]
        parsed.clear()


def release_pages(path: str | Path) -> None:
    """Within parsed_once(): the pages of `path` read so far leave this process's resident
    memory (the parse stays). Outside it nothing holds the file once its arrays are dropped."""
    import gguf

    release = getattr(gguf.GGUFReader, "release", None)
    if release is not None:
        release(path)


class _WithoutFields:
    """A parsed reader less the metadata fields whose names begin with `prefix` (or one of)."""

    def __init__(self, reader: Any, prefix: str | tuple[str, ...]) -> None:
        self._reader = reader
        self.fields = {k: v for k, v in reader.fields.items() if not k.startswith(prefix)}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


@contextmanager
def without_fields(prefix: str | tuple[str, ...]) -> Iterator[None]:
    """Every `gguf.GGUFReader` opened within reads no metadata field whose name begins with
    `prefix` (or one of them): for transformers' GGUF loader, which fails on some fields
    (gpt-oss's rope.scaling.*: it takes each field's first part, the key's length, for its
    value; Gemma 4's per-layer arrays); the caller reads those fields itself. Nests with
    parsed_once()."""
    import gguf

    reader_class = gguf.GGUFReader

    def reader(path: str | Path, mode: str = "r") -> Any:
        return _WithoutFields(reader_class(path, mode), prefix)  # type: ignore[arg-type]

    for attr in ("parses_once", "release"):
        if hasattr(reader_class, attr):
            setattr(reader, attr, getattr(reader_class, attr))
    gguf.GGUFReader = reader  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gguf.GGUFReader = reader_class  # type: ignore[misc]
