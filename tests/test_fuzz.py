"""Fuzzing: hypothesis on the detokenizer and offsets; schemathesis on every route."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from probserve.api.logprobs_format import LogprobsFormatter
from probserve.api.text_stream import TextStream
from probserve.api.tokens import TokenTable
from probserve.models import LoadedModel


@pytest.fixture(scope="module")
def table(smol: LoadedModel) -> TokenTable:
    return TokenTable(smol.tokenizer, smol.vocab_size)


@pytest.fixture(scope="module")
def partial_ids(table: TokenTable) -> list[int]:
    """Byte-fallback pieces: tokens whose bytes are not valid UTF-8 on their own."""
    out = []
    for i in range(table.vocab_size):
        try:
            table.token_bytes(i).decode("utf-8")
        except UnicodeDecodeError:
            out.append(i)
    assert len(out) > 50
    return out


FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@FUZZ
@given(data=st.data())
def test_offsets_spans_and_bytes_rebuild_the_text(
    table: TokenTable, partial_ids: list[int], data: st.DataObject
):
    ids = data.draw(
        st.lists(
            st.one_of(st.integers(17, table.vocab_size - 1), st.sampled_from(partial_ids)),
            min_size=1,
            max_size=40,
        )
    )
    base = data.draw(st.integers(0, 50))
    ts = TextStream(table, base_offset=base)
    pieces = []
    for t in ids:
        ts.add(t)
        pieces += ts.release()
    pieces += ts.release(final=True)
    text = "".join(p.text for p in pieces)
    assert text == ts.text
    offsets = [p.offset for p in pieces]
    assert offsets == sorted(offsets) and offsets[0] == base
    ends = [*offsets[1:], base + len(text)]
    assert "".join(text[a - base : b - base] for a, b in zip(offsets, ends, strict=True)) == text
    raw = b"".join(table.token_bytes(t) for t in ids)
    assert text == raw.decode("utf-8", errors="replace")
    # completions arrays stay aligned
    lp = LogprobsFormatter(table).completion(pieces, 0)
    assert len(lp.tokens) == len(lp.text_offset) == len(ids)


@FUZZ
@given(data=st.data())
def test_stop_strings_never_leak(table: TokenTable, smol: LoadedModel, data: st.DataObject):
    words = data.draw(
        st.lists(
            st.sampled_from(
                ["alpha", "beta", " gamma", "\n", "é", "🎉", "de", "lta", " stop", "!"]
            ),
            min_size=1,
            max_size=30,
        )
    )
    stop = data.draw(st.sampled_from(["gamma", "delta", "\n\n", "é🎉", "stop!"]))
    ids = smol.tokenizer("".join(words), add_special_tokens=False).input_ids
    ts = TextStream(table, stop=(stop,))
    out = []
    for t in ids:
        ts.add(t)
        out += ts.release()
        assert stop not in "".join(p.text for p in out)
        if ts.stopped:
            break
    out += ts.release(final=True)
    full = table.decode(ids)
    text = "".join(p.text for p in out)
    assert text == (full[: full.index(stop)] if stop in full else full)
    if out and ts.stopped:
        assert out[-1].text  # arrays end with a token that contributes text


schemathesis = pytest.importorskip("schemathesis")


@pytest.mark.slow
def test_schemathesis_every_route(smol: LoadedModel):
    """Every route of the OpenAPI schema, with generated requests (seeded, bounded): never a
    5xx, every response conforms to the schema."""
    from hypothesis import Phase
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import response_schema_conformance
    from server_util import running_server

    with running_server(smol, "--request-timeout", "3", "--max-sequences", "4") as url:
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        failures = []
        ran = 0
        for op in schema.get_all_operations():
            operation = op.ok()

            @settings(
                max_examples=25,
                deadline=None,
                derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy())
            def check(case):  # type: ignore[no-untyped-def]
                nonlocal ran
                ran += 1
                response = case.call(base_url=url, timeout=30)
                try:
                    case.validate_response(
                        response, checks=(not_a_server_error, response_schema_conformance)
                    )
                except Exception as exc:  # collect, report all at the end
                    failures.append(f"{case.operation.label}: {exc}"[:2000])

            check()
        assert ran > 50
        assert not failures, "\n\n".join(failures[:5])
