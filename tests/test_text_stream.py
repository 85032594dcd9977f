"""TextStream: UTF-8 assembly, hold-back of possible stop strings, truncation."""

from __future__ import annotations

import pytest

from probserve.api.answers.text_stream import TextStream
from probserve.api.answers.tokens import TokenTable
from probserve.models import LoadedModel


@pytest.fixture(scope="module")
def table(smol: LoadedModel) -> TokenTable:
    return TokenTable(smol.tokenizer, smol.vocab_size)


def _ids(smol: LoadedModel, text: str) -> list[int]:
    return smol.tokenizer(text, add_special_tokens=False).input_ids


def test_table_rebuilds_text_exactly(smol: LoadedModel, table: TokenTable):
    for text in ("héllo 日本語 🎉 café", "<|im_start|>user\nHi<|im_end|>", "  tabs\tand\nlines"):
        ids = _ids(smol, text)
        assert table.decode(ids) == text == smol.tokenizer.decode(ids)


def test_never_releases_a_broken_character(smol: LoadedModel, table: TokenTable):
    ids = _ids(smol, "a🎉b")
    ts = TextStream(table, base_offset=10)
    released = []
    for t in ids:
        ts.add(t)
        released += ts.release()
        assert "\ufffd" not in "".join(p.text for p in released)
    released += ts.release(final=True)
    assert "".join(p.text for p in released) == "a🎉b"
    offsets = [p.offset for p in released]
    assert offsets[0] == 10 and offsets == sorted(offsets)


def test_holds_back_possible_stop_string_then_truncates(smol: LoadedModel, table: TokenTable):
    ids = _ids(smol, "hello world, goodbye moon")
    ts = TextStream(table, stop=("goodbye",))
    out = []
    for t in ids:
        ts.add(t)
        out += ts.release()
        assert "good" not in "".join(p.text for p in out)
        if ts.stopped:
            break
    out += ts.release(final=True)
    assert ts.stopped and "".join(p.text for p in out) == "hello world, "
    assert out[-1].text  # the arrays end with a token that contributes text


def test_hold_back_released_when_it_does_not_match(smol: LoadedModel, table: TokenTable):
    ts = TextStream(table, stop=("END!",))
    for t in _ids(smol, "the END is near"):
        ts.add(t)
    out = ts.release()
    assert "".join(p.text for p in out) == "the END is near"
    assert not ts.stopped


def test_hidden_and_skipped_special_tokens(smol: LoadedModel, table: TokenTable):
    ts = TextStream(table, skip_special_tokens=True)
    ts.add_all(_ids(smol, "Hi<|im_start|>there"))
    ts.add(2, hidden=True)
    out = ts.release(final=True)
    assert ts.text == "Hithere"
    assert [p.hidden for p in out] == [False, True, False, True]
