"""The converted-model cache (models/cache.py) is named by a file's content: the same GGUF
bytes at a second path or under another name (another virtual environment, checkout, download
or copy) reuse its entries instead of writing another copy, and different bytes get entries of
their own."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from gguf_util import write_llama_gguf

from probserve.models.cache import converted_dir, float32_dir, written


def test_one_entry_per_content_however_many_paths_hold_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROBSERVE_CACHE_DIR", str(tmp_path / "cache"))
    for folder in "abc":
        (tmp_path / folder).mkdir()
    first = write_llama_gguf(tmp_path / "a" / "m.gguf", hidden=64, layers=1, ffn=128, heads=4,
                             kv_heads=2)  # fmt: skip
    second = tmp_path / "b" / "another-name.gguf"
    shutil.copyfile(first, second)
    os.utime(second, ns=(1, 1))  # another path, name and modification time, the same bytes

    calls: list[Path] = []
    for path in (first, second):
        got = written(converted_dir(path), lambda out: calls.append(out), "a test entry")
        assert got == converted_dir(first)
    assert len(calls) == 1  # the second name found the first one's entry complete
    assert converted_dir(second) == converted_dir(first)
    assert float32_dir(second) == float32_dir(first)  # and its float32 copy, its blocks
    assert len(list((tmp_path / "cache" / "models").iterdir())) == 1

    other = write_llama_gguf(tmp_path / "c" / "m.gguf", hidden=64, layers=1, ffn=128, heads=4,
                             kv_heads=2, seed=1)  # fmt: skip
    assert converted_dir(other) != converted_dir(first)
