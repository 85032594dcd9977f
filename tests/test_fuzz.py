"""Fuzzing: hypothesis on the detokenizer and offsets; schemathesis on every route."""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from probserve.api.answers.logprobs_format import LogprobsFormatter
from probserve.api.answers.text_stream import TextStream
from probserve.api.answers.tokens import TokenTable
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
                max_examples=12,
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
        assert ran > 40
        assert not failures, "\n\n".join(failures[:5])


# ---- hostile values on every field of every POST route -------------------------------------------

HOSTILE_STRINGS = st.one_of(
    st.sampled_from(
        [
            "\ud800",
            "ok \udfff ok",
            "{{ 7 * 7 }}",
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "{{ ''.__class__.__mro__ }}",
            '{{ "x" * 20000000000 }}',
            "\x00\x1b[2J\r\n",
            "é🎉" * 1000,
            "word " * 20_000,
        ]
    ),
    st.text(max_size=40),
)
HOSTILE_NUMBERS = st.one_of(
    st.sampled_from([2**64, -(2**63) - 1, 10**400, -1, 0, 2**31, 1e-40, 1e308, -1e308]),
    st.sampled_from([float("inf"), float("-inf"), float("nan")]),
    st.integers(),
)


def _nested(depth: int) -> object:
    value: object = []
    for _ in range(depth):
        value = [value]
    return value


HOSTILE_VALUES = st.one_of(
    HOSTILE_STRINGS,
    HOSTILE_NUMBERS,
    st.integers(1, 200).map(_nested),
    st.integers(1, 100_000).map(lambda n: [504] * n),
    st.integers(1, 64).map(lambda n: [[504] * 9000] * n),
    st.lists(HOSTILE_STRINGS, max_size=5),
    st.dictionaries(HOSTILE_STRINGS, st.one_of(HOSTILE_STRINGS, HOSTILE_NUMBERS), max_size=3),
    st.just(None),
    st.booleans(),
)

BASE_BODIES: dict[str, dict] = {
    "/v1/completions": {"prompt": "The capital of France is", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/tokenize": {"prompt": "Hello"},
    "/detokenize": {"tokens": [504, 30]},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 2, "top_logprobs": 1},
    "/v1/score": {"query": "Is it?", "items": [" Yes"], "label_token_ids": [504, 30]},
    "/v1/rerank": {"query": "Is it?", "documents": ["Yes it is.", "No."], "top_n": 1},
    "/v1/embeddings": {"input": ["Hello there", "Bye"]},
    "/v1/distributions": {"prompt": "Hello there", "positions": [0, 1]},
    "/v1/messages": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "Hi"}]},
}


JSON = {"content-type": "application/json"}
# length fields that, set to null, let a request generate to the end of the context
UNBOUNDED_WHEN_NULL = frozenset({"max_tokens", "max_completion_tokens", "max_output_tokens"})


def _fields(schema: dict, path: str) -> list[str]:
    """The request body's top-level fields, read from the OpenAPI schema."""
    ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = ref["$ref"].rsplit("/", 1)[1]
    return sorted(schema["components"]["schemas"][name]["properties"])


@pytest.mark.slow
def test_hostile_values_on_every_field(http, base_url: str):  # type: ignore[no-untyped-def]
    """Huge integers, lone surrogates, non-finite floats, deep nesting, long token-id lists and
    template-like strings in every field of every POST route (and in message content): never a
    5xx, every 4xx in the envelope, and afterwards the canary answers exactly as before."""
    canary = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0, "logprobs": 2}
    before = http.post("/v1/completions", json=canary).json()["choices"]
    schema = http.get("/openapi.json").json()
    targets = [(path, f) for path in BASE_BODIES for f in _fields(schema, path)]
    targets += [("/v1/chat/completions", "messages[0].content")]
    seen: set[str] = set()

    @settings(
        max_examples=260,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(target=st.sampled_from(targets), value=HOSTILE_VALUES)
    def check(target: tuple[str, str], value: object) -> None:
        path, field = target
        body = json.loads(json.dumps(BASE_BODIES[path]))
        if path in ("/v1/completions", "/v1/chat/completions"):
            body.update(logprobs=1 if path == "/v1/completions" else True, return_entropy=True)
        if field == "messages[0].content":
            body["messages"][0]["content"] = value
        else:
            body[field] = value
        if field in UNBOUNDED_WHEN_NULL and value is None and path != "/tokenize":
            # no length limit: up to the whole context (minutes of sampling); streamed, and
            # left after its first event (the request is aborted), as it is its acceptance
            # that is checked here
            body["stream"] = True
            raw = json.dumps(body).encode()
            with http.stream("POST", path, content=raw, headers=JSON) as s:
                assert s.status_code < 500, (path, field, s.read()[:300])
                assert next(s.iter_lines(), None) is not None
            seen.add(f"{path} {field}")
            return
        raw = json.dumps(body).encode()  # NaN/Infinity literals and \\ud800 escapes as sent
        r = http.post(path, content=raw, headers=JSON)
        assert r.status_code < 500, (path, field, repr(value)[:200], r.text[:300])
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        seen.add(f"{path} {field}")

    check()
    assert len(seen) > len(targets) // 2
    h = http.get("/health").json()
    assert h["status"] == "ok"
    assert http.post("/v1/completions", json=canary).json()["choices"] == before
