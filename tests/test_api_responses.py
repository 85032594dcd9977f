"""POST /v1/responses: logprobs against the independent reference, streaming, the openai SDK."""

from __future__ import annotations

import json

import openai
import pytest
from reference import full_logprobs

from probserve.api.prompts import render_chat
from probserve.models import LoadedModel

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
LOGPROBS = ["message.output_text.logprobs"]
JAPANESE = "Say hello in Japanese."


def _prompt_ids(smol: LoadedModel, text: str, instructions: str | None = None) -> list[int]:
    msgs = ([{"role": "system", "content": instructions}] if instructions else []) + [
        {"role": "user", "content": text}
    ]
    return render_chat(smol, msgs, True, {})


def test_logprobs_equal_the_reference(client: openai.OpenAI, smol: LoadedModel):
    r = client.responses.create(
        model=MODEL,
        input="What is the capital of France?",
        instructions="Answer briefly.",
        max_output_tokens=8,
        temperature=0,
        include=LOGPROBS,
        top_logprobs=3,
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    part = r.output[0].content[0]
    assert part.type == "output_text" and r.output_text == part.text
    ids = _prompt_ids(smol, "What is the capital of France?", "Answer briefly.")
    out_ids = smol.tokenizer(part.text, add_special_tokens=False).input_ids
    assert r.usage.input_tokens == len(ids) and r.usage.output_tokens == 8
    ref = full_logprobs(smol.model, ids + out_ids)
    assert len(part.logprobs) == len(out_ids) == 8
    for j, entry in enumerate(part.logprobs):
        row = ref[len(ids) + j - 1]
        assert abs(entry.logprob - float(row[out_ids[j]])) < 1e-4
        assert entry.top_logprobs[0].logprob == pytest.approx(float(row.max()), abs=1e-4)
        assert len(entry.top_logprobs) == 3
    assert b"".join(bytes(e.bytes) for e in part.logprobs).decode() == part.text


def test_bytes_rebuild_split_characters_and_stream_equals_non_stream(client: openai.OpenAI, http):  # type: ignore[no-untyped-def]
    body = {"model": MODEL, "input": JAPANESE, "max_output_tokens": 16, "temperature": 0,
            "top_logprobs": 2, "include": LOGPROBS}  # fmt: skip
    full = client.responses.create(**body)
    assert full.status == "incomplete"
    part = full.output[0].content[0]
    assert any(len(c.encode()) > 1 for c in part.text)
    assert any(e.token.startswith("\\x") for e in part.logprobs)  # a split character
    assert b"".join(bytes(e.bytes) for e in part.logprobs).decode() == part.text

    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        lines = list(r.iter_lines())
    names = [ln[7:] for ln in lines if ln.startswith("event: ")]
    data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
    assert names == [d["type"] for d in data]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    deltas = [d for d in data if d["type"] == "response.output_text.delta"]
    assert "".join(d["delta"] for d in deltas) == part.text
    streamed = [lp for d in deltas for lp in d["logprobs"]]
    assert len(streamed) == len(part.logprobs)
    for a, b in zip(streamed, part.logprobs, strict=True):
        assert a["token"] == b.token and abs(a["logprob"] - b.logprob) < 1e-4
        assert a["bytes"] == b.bytes
    final = data[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["output"][0]["content"][0]["text"] == part.text
    assert final["usage"]["output_tokens"] == 16


def test_the_sdk_stream_helper(client: openai.OpenAI):
    # a stop string (vLLM's extension) ends the reply: the SDK's helper wants response.completed
    kw = dict(model=MODEL, input="Reply with just: OK", max_output_tokens=40, temperature=0,
              include=LOGPROBS, extra_body={"stop": ["."]})  # fmt: skip
    full = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        text = "".join(ev.delta for ev in stream if ev.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == full.status == "completed"
    assert text == final.output_text == full.output_text
    got, want = final.output[0].content[0].logprobs, full.output[0].content[0].logprobs
    assert [e.token for e in got] == [e.token for e in want]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(got, want, strict=True))


def test_logprobs_switches(http):  # type: ignore[no-untyped-def]
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 3, "temperature": 0}

    def part(**extra: object) -> dict:
        r = http.post("/v1/responses", json={**body, **extra})
        assert r.status_code == 200, r.text
        return r.json()["output"][0]["content"][0]

    assert part()["logprobs"] is None  # not asked
    explicit_null = part(include=LOGPROBS, top_logprobs=None)["logprobs"]
    assert len(explicit_null) == 3 and all(e["top_logprobs"] == [] for e in explicit_null)
    four = part(include=LOGPROBS, top_logprobs=4)["logprobs"]
    assert all(len(e["top_logprobs"]) == 4 for e in four)
    assert len(part(top_logprobs=2)["logprobs"]) == 3


def test_messages_input_and_errors(client: openai.OpenAI, http):  # type: ignore[no-untyped-def]
    r = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Reply with just: OK"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "OK"}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Again:"}]},
        ],
        max_output_tokens=20,
        temperature=0,
    )
    assert r.status == "completed" and r.incomplete_details is None
    assert "<|im_end|>" not in r.output_text
    for extra, param in (
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),  # function tools only
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format"),  # no schema
        ({"max_output_tokens": 10**9}, "max_output_tokens"),
    ):
        resp = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", **extra})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
