"""Tool calls over HTTP: chat and Responses with the embedded model's generic format and with a
Hermes-style template (a second server), the openai SDK's tool round trip, streamed calls equal
to whole ones, logprobs that cover every generated token, and hostile tool requests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from hostile_util import canary, check_after

from probserve.models import LoadedModel
from probserve.serving import with_chat_template

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _chat(http: httpx.Client, **body: object) -> dict:
    r = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 48, **body},
    )
    assert r.status_code == 200, r.text
    return r.json()


def _follows_schema(call: dict) -> None:
    args = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "add":
        assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
    else:
        assert call["function"]["name"] == "get_weather", call
        assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")


def _streamed(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    return [json.loads(ln) for ln in lines if ln != "[DONE]"]


def _joined(chunks: list[dict]) -> tuple[str | None, list[dict], str | None, list[str]]:
    """A streamed chat reply put back together: content, calls, finish reason, logprob tokens."""
    content, calls, finish, tokens = None, {}, None, []  # type: ignore[var-annotated]
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("content"):
                content = (content or "") + delta["content"]
            for part in delta.get("tool_calls") or ():
                call = calls.setdefault(part["index"], {"function": {"arguments": ""}})
                if "id" in part:
                    assert "id" not in call, "a call's first delta comes once"
                    call.update(id=part["id"], type=part["type"])
                    call["function"]["name"] = part["function"]["name"]
                call["function"]["arguments"] += part["function"].get("arguments", "")
            if choice.get("logprobs"):
                tokens += [e["token"] for e in choice["logprobs"]["content"]]
            finish = choice.get("finish_reason") or finish
    return content, [calls[i] for i in sorted(calls)], finish, tokens


def test_required_calls_parse_stream_as_whole_and_logprobs_cover_every_token(http):  # type: ignore[no-untyped-def]
    body = {"tools": [WEATHER, ADD], "tool_choice": "required", "logprobs": True, "top_logprobs": 2}
    whole = _chat(http, **body)
    choice = whole["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert (
        calls
        and choice["message"]["content"] is None
        and choice["finish_reason"] in ("tool_calls", "length")
    )
    for call in calls[:-1] if choice["finish_reason"] == "length" else calls:
        _follows_schema(call)
        assert call["id"].startswith("call_") and call["type"] == "function"
    entries = choice["logprobs"]["content"]
    assert len(entries) == whole["usage"]["completion_tokens"]  # the calls' tokens have theirs
    # the wrapper's start is in the prompt (docs/tools.md): the tokens begin with the name
    assert "".join(e["token"] for e in entries).startswith('get_weather", "arguments": ')
    chunks = _streamed(
        http,
        "/v1/chat/completions",
        {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 48, **body},
    )
    content, streamed, finish, tokens = _joined(chunks)
    assert content is None and finish == choice["finish_reason"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]
    assert tokens == [e["token"] for e in entries]


def test_one_call_a_named_call_auto_and_none(http):  # type: ignore[no-untyped-def]
    one = _chat(http, tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False)
    message = one["choices"][0]["message"]
    assert len(message["tool_calls"]) == 1 and one["choices"][0]["finish_reason"] == "tool_calls"
    _follows_schema(message["tool_calls"][0])
    named = _chat(
        http, tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}}
    )
    (call,) = named["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "add"
    _follows_schema(call)
    auto = _chat(http, tools=[WEATHER, ADD], max_tokens=64)["choices"][0]
    assert auto["message"]["tool_calls"] or auto["message"]["content"] is not None
    # tool_choice "none": the tools stay out of the prompt, the reply is plain text
    plain = _chat(http, max_tokens=8)
    none = _chat(http, tools=[WEATHER, ADD], tool_choice="none", max_tokens=8)
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert none["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert "tool_calls" not in none["choices"][0]["message"]


def test_the_sdk_tool_round_trip(client: openai.OpenAI, http):  # type: ignore[no-untyped-def]
    messages: list = list(ASK)
    first = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=40,
        temperature=0,
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"]
    messages.append(message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18}'})
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=16, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the result reached the prompt, as /tokenize renders it with the same tools
    counted = http.post(
        "/tokenize", json={"model": MODEL, "messages": messages, "tools": [WEATHER]}
    )
    assert counted.json()["count"] == second.usage.prompt_tokens
    text = http.post("/detokenize", json={"tokens": counted.json()["tokens"]}).json()["prompt"]
    assert '{"tool_result": {"tool_call_id": "' + call.id in text and '"temp_c": 18' in text
    assert '"name": "get_weather"' in text  # the tools, in the system message
    # the SDK's stream helper puts the streamed call together
    with client.chat.completions.stream(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=40,
        temperature=0,
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    (streamed,) = final.choices[0].message.tool_calls or []
    assert streamed.function.arguments == call.function.arguments


def test_responses_function_calls_and_their_round_trip(client: openai.OpenAI, http):  # type: ignore[no-untyped-def]
    tool = {"type": "function", **WEATHER["function"]}
    body = {
        "model": MODEL,
        "input": ASK,
        "tools": [tool],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 40,
        "temperature": 0,
        "include": ["message.output_text.logprobs"],
    }
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    (item,) = out["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather"
    assert item["call_id"].startswith("call_") and item["status"] == "completed"
    assert json.loads(item["arguments"])["unit"] in ("c", "f")
    assert len(item["logprobs"]) == out["usage"]["output_tokens"]  # every token, on its item
    assert out["tool_choice"] == "required" and out["tools"][0]["name"] == "get_weather"
    events = _streamed(http, "/v1/responses", body)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    deltas = "".join(
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
    )
    assert deltas == item["arguments"]
    done = next(e for e in events if e["type"] == "response.output_item.done")["item"]
    assert done["arguments"] == item["arguments"] and done["logprobs"] == item["logprobs"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    # the SDK: the call back, then its output
    first = client.responses.create(**{k: v for k, v in body.items() if k != "include"})
    call = first.output[0]
    assert call.type == "function_call"
    follow = [
        *ASK,
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
    ]
    second = client.responses.create(
        model=MODEL,
        input=follow,
        tools=[tool],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    assert second.status in ("completed", "incomplete") and second.output_text


TWO_CITIES = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]


def _calls(calls: list[dict] | None) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls or ()]


def _prefix_calls(cut: list[tuple[str, str]], whole: list[tuple[str, str]]) -> bool:
    """`cut`: `whole`'s first calls, the last one's arguments as far as they were written."""
    pairs = list(zip(cut, whole, strict=False))
    return len(cut) <= len(whole) and all(a == c and d.startswith(b) for (a, b), (c, d) in pairs)


def test_a_reply_cut_inside_a_call_gives_no_call_text_as_content(http):  # type: ignore[no-untyped-def]
    """max_tokens cuts the reply (two calls, in the generic format) anywhere: the content is
    never the cut call's text (`{"tool_calls": [{"na`, ` {"name": "get_`), the calls are the
    whole reply's so far, finish_reason says "length"; streamed, the same. The Messages and
    Responses APIs, on the same parser, give no such text block or message either."""
    body = {"model": MODEL, "messages": TWO_CITIES, "tools": [WEATHER, ADD], "temperature": 0}
    full = _chat(http, **body, max_tokens=96)["choices"][0]
    whole_calls = _calls(full["message"]["tool_calls"])
    assert full["message"]["content"] is None and len(whole_calls) >= 2, full
    for cut in range(1, 40, 3):
        choice = _chat(http, **body, max_tokens=cut)["choices"][0]
        message, calls = choice["message"], _calls(choice["message"].get("tool_calls"))
        assert choice["finish_reason"] == "length"
        assert message["content"] is None, (cut, message)
        assert _prefix_calls(calls, whole_calls), (cut, calls)
        chunks = _streamed(http, "/v1/chat/completions", {**body, "max_tokens": cut})
        content, streamed, finish, _ = _joined(chunks)
        assert (content, _calls(streamed), finish) == (None, calls, "length"), cut
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
             for t in (WEATHER, ADD)]  # fmt: skip
    items = [{"type": "function", **t["function"]} for t in (WEATHER, ADD)]
    for cut in (4, 11, 34):
        anthropic = {"messages": TWO_CITIES, "tools": tools, "temperature": 0, "max_tokens": cut}
        r = http.post("/v1/messages", json=anthropic).json()
        assert r["stop_reason"] == "max_tokens"
        assert all(b["type"] == "tool_use" for b in r["content"]), (cut, r["content"])
        events = _streamed(http, "/v1/messages", anthropic)
        starts = [e["content_block"]["type"] for e in events
                  if e["type"] == "content_block_start"]  # fmt: skip
        assert starts == [b["type"] for b in r["content"]], (cut, starts)
        responses = {"input": TWO_CITIES, "tools": items, "temperature": 0,
                     "max_output_tokens": cut}  # fmt: skip
        out = http.post("/v1/responses", json=responses).json()
        assert out["status"] == "incomplete"
        assert all(o["type"] == "function_call" for o in out["output"]), (cut, out["output"])
        events = _streamed(http, "/v1/responses", responses)
        added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
        assert added == [o["type"] for o in out["output"]], (cut, added)


def _error(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_hostile_tool_requests_are_400s_and_harm_nothing(http):  # type: ignore[no-untyped-def]
    before = canary(http)
    base = {"model": MODEL, "messages": ASK, "max_tokens": 4}
    post = lambda **kw: http.post("/v1/chat/completions", json={**base, **kw})  # noqa: E731
    _error(post(tool_choice="required"), "tool_choice")
    _error(post(tools=[]), "tools")
    _error(post(tools=[ADD, ADD]), "tools")
    _error(
        post(tools=[ADD], tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool_choice",
    )
    _error(post(tools=[ADD] * 65), "tools")
    bad_name = {"type": "function", "function": {"name": "a b" * 40}}
    _error(post(tools=[bad_name]), "tools[0].function.name")
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    _error(post(tools=[bad_schema], tool_choice="required"), "tools")
    huge = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"x": {"enum": [f"v{i}" for i in range(9000)]}},
            },
        },
    }
    _error(post(tools=[huge], tool_choice="required"), "tools")
    deep: dict = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"x": deep}}
    _error(
        post(tools=[{"type": "function", "function": {"name": "f", "parameters": deep}}]),
        "tools[0].function.parameters",
    )
    _error(
        post(tools=[ADD], tool_choice="required", response_format={"type": "json_object"}),
        "response_format",
    )
    wordy = [{"type": "function", "function": {"name": f"f{i}", "description": "x" * 30_000}}
             for i in range(40)]  # fmt: skip
    _error(post(tools=wordy), "tools")  # the definitions count toward --max-message-chars
    orphan = [*ASK, {"role": "tool", "content": "3"}]
    _error(post(messages=orphan), "messages[1].tool_call_id")
    # one call id made twice (in one message, or in two): a result would answer both
    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}  # fmt: skip
    answer = {"role": "tool", "tool_call_id": "call_1", "content": "3"}
    twice = [*ASK, {"role": "assistant", "tool_calls": [call, call]}, answer]
    _error(post(messages=twice), "messages[1].tool_calls[1].id")
    again = [*ASK, {"role": "assistant", "tool_calls": [call]}, answer,
             {"role": "assistant", "tool_calls": [call]}, answer]  # fmt: skip
    _error(post(messages=again), "messages[3].tool_calls[0].id")
    _error(http.post("/tokenize", json={"model": MODEL, "messages": twice}),
           "messages[1].tool_calls[1].id")  # fmt: skip
    fc = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "3"}
    _error(
        http.post("/v1/responses", json={"model": MODEL, "input": [*ASK, fc, fc, output],
                                         "max_output_tokens": 4}),
        "input[2].call_id",
    )  # fmt: skip
    lone = {"type": "function", "function": {"name": "f", "description": "\ud800"}}
    _error(
        http.post(
            "/v1/chat/completions",
            content=json.dumps({**base, "tools": [lone]}),
            headers={"content-type": "application/json"},
        ),
        "tools[0].function.description",
    )
    resp = {"model": MODEL, "input": "Hi", "max_output_tokens": 4}
    _error(
        http.post("/v1/responses", json={**resp, "tools": [{"type": "web_search"}]}),
        "tools[0].type",
    )
    # a denormal top_p (schemathesis found it with tools: []) keeps the most likely token
    tiny = http.post("/v1/responses", json={**resp, "tools": [], "top_p": 5e-324, "seed": -3})
    assert tiny.status_code == 200, tiny.text
    check_after(http, before)


@pytest.fixture(scope="module")
def hermes(smol: LoadedModel) -> Iterator[httpx.Client]:
    """A server over the embedded model with a Hermes-style tool template (as Qwen's)."""
    from server_util import running_server

    template = (Path(__file__).parent / "templates" / "hermes.jinja").read_text()
    served = running_server(with_chat_template(smol, template), "--worker", "inline")
    with served as url, httpx.Client(base_url=url, timeout=300) as c:
        yield c


def test_a_hermes_template_gets_the_tools_and_its_calls_parse(hermes):  # type: ignore[no-untyped-def]
    counted = hermes.post(
        "/tokenize", json={"model": MODEL, "messages": ASK, "tools": [WEATHER]}
    ).json()
    text = hermes.post("/detokenize", json={"tokens": counted["tokens"]}).json()["prompt"]
    assert "<tools>" in text and '"name": "get_weather"' in text  # the template's own rendering
    body = {"tools": [WEATHER, ADD], "tool_choice": "required", "logprobs": True}
    whole = _chat(hermes, **body, max_tokens=64)
    choice = whole["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert calls and choice["message"]["content"] is None
    for call in calls[:-1] if choice["finish_reason"] == "length" else calls:
        _follows_schema(call)
    generated = "".join(e["token"] for e in choice["logprobs"]["content"])
    assert (
        generated.startswith("<tool_call>\n{")
        and len(choice["logprobs"]["content"]) == whole["usage"]["completion_tokens"]
    )
    chunks = _streamed(
        hermes,
        "/v1/chat/completions",
        {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 64, **body},
    )
    _, streamed, finish, _ = _joined(chunks)
    assert finish == choice["finish_reason"]
    assert [c["function"] for c in streamed] == [c["function"] for c in calls]
    # auto: free text (no grammar), parsed as it comes; the stream says the same as the whole
    auto = {"tools": [WEATHER], "max_tokens": 40}
    free = _chat(hermes, **auto)["choices"][0]
    content, streamed, finish, _ = _joined(
        _streamed(
            hermes,
            "/v1/chat/completions",
            {"model": MODEL, "messages": ASK, "temperature": 0, **auto},
        )
    )
    assert content == free["message"]["content"] and finish == free["finish_reason"]
    assert [c["function"] for c in streamed] == [
        c["function"] for c in free["message"].get("tool_calls") or []
    ]
    # a call sent back renders as the template writes calls, and its result as a tool response
    history = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "c"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18"},
    ]
    counted = hermes.post(
        "/tokenize", json={"model": MODEL, "messages": history, "tools": [WEATHER]}
    ).json()
    text = hermes.post("/detokenize", json={"tokens": counted["tokens"]}).json()["prompt"]
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in text
    )
    assert "<tool_response>\n18\n</tool_response>" in text
