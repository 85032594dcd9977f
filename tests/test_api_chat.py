"""/v1/chat/completions against the logprobs contract."""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
JAPANESE = [{"role": "user", "content": "Say hello in Japanese."}]


def test_logprobs_entries_and_bytes_rebuild_multibyte_content(client: openai.OpenAI):
    r = client.chat.completions.create(
        model=MODEL, messages=JAPANESE, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3
    )
    ch = r.choices[0]
    content = ch.message.content
    assert any(len(c.encode()) > 1 for c in content), content  # really multi-byte output
    entries = ch.logprobs.content
    assert b"".join(bytes(e.bytes) for e in entries).decode() == content
    assert any(e.token.startswith("\\x") for e in entries)  # a split character, escaped
    for e in entries:
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.logprob
        assert e.top_logprobs[0].logprob == max(t.logprob for t in e.top_logprobs)


def test_refusal_key_and_empty_top_list(http):
    r = http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3,
            "logprobs": True,
        },
    ).json()
    lp = r["choices"][0]["logprobs"]
    assert set(lp) == {"content", "refusal"} and lp["refusal"] is None
    assert all(e["top_logprobs"] == [] for e in lp["content"])


def test_end_of_turn_token_not_in_content(client: openai.OpenAI):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply with just: OK"}],
        temperature=0,
        logprobs=True,
    )
    ch = r.choices[0]
    assert ch.finish_reason == "stop"
    assert "<|im_end|>" not in ch.message.content
    assert all(e.token != "<|im_end|>" for e in ch.logprobs.content)
    assert "".join(e.token for e in ch.logprobs.content) == ch.message.content


def test_top_logprobs_rules(client: openai.OpenAI):
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=msgs, top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"
    assert err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=msgs, logprobs=True, top_logprobs=21)
    assert err.value.body["param"] == "top_logprobs"


def test_content_parts_system_and_max_completion_tokens(client: openai.OpenAI):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
        ],
        max_completion_tokens=4,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


def test_n_seed_and_stop(client: openai.OpenAI):
    kw = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 9,
    }
    a = client.chat.completions.create(**kw, n=2)
    b = client.chat.completions.create(**kw, n=2)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len(a.choices) == 2
    assert a.choices[0].message.content != a.choices[1].message.content  # one seed, two draws
    full = client.chat.completions.create(**{**kw, "temperature": 0}).choices[0].message.content
    word = full.split()[1]
    r = client.chat.completions.create(**{**kw, "temperature": 0}, stop=[word])
    assert r.choices[0].message.content == full[: full.index(word)]
    assert r.choices[0].finish_reason == "stop"


def test_stream_equals_non_stream(client: openai.OpenAI):
    kw = {
        "model": MODEL,
        "messages": JAPANESE,
        "max_tokens": 16,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    full = client.chat.completions.create(**kw).choices[0]
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    entries = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert text == full.message.content
    # the second request may reuse the first one's cached prompt blocks: a different batch
    # shape, so logprobs agree within the contract's 1e-4 rather than bit for bit
    assert len(entries) == len(full.logprobs.content)
    for got, want in zip(entries, full.logprobs.content, strict=True):
        assert (got.token, got.bytes) == (want.token, want.bytes)
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs]
        for a, b in zip(got.top_logprobs, want.top_logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    for c in chunks:  # each chunk's logprobs cover exactly that chunk's text
        if c.choices and c.choices[0].logprobs:
            got = b"".join(bytes(e.bytes) for e in c.choices[0].logprobs.content)
            assert got.decode() == c.choices[0].delta.content
    assert chunks[-1].usage.completion_tokens == 16


def test_prompt_logprobs_extension(http):
    r = http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1,
            "prompt_logprobs": 2,
        },
    ).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r["usage"]["prompt_tokens"]
    assert all(2 <= len(e) <= 3 for e in plp[1:])


def test_system_fingerprint_on_every_answer_and_stable(http):
    """Chat and completions, whole and streamed (every chunk), carry the engine's numerics
    fingerprint, the one /health and /v1/models report, the same on every request."""
    health = http.get("/health").json()
    fp = health["system_fingerprint"]
    assert isinstance(fp, str) and fp.startswith("fp_")
    assert len(health["numerics"]["model_digest"]) == 64
    cards = http.get("/v1/models").json()["data"]
    assert {c["system_fingerprint"] for c in cards} == {fp}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    text = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    for route, body in (("/v1/chat/completions", chat), ("/v1/completions", text)):
        for _ in range(2):
            assert http.post(route, json=body).json()["system_fingerprint"] == fp
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", route, json=streamed) as r:
            events = [
                json.loads(line[6:])
                for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
        assert len(events) >= 3
        assert all(e["system_fingerprint"] == fp for e in events)
