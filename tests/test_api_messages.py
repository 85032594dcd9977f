"""Anthropic's Messages API over HTTP with the `anthropic` SDK: the same reply and logprobs as
chat for the same conversation, the SDK's stream helper putting together what the whole answer
says, the tool-use round trip, stop reasons, structured outputs, Claude Code's request shapes,
count_tokens, and errors in Anthropic's envelope that harm nothing."""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import httpx
import pytest
from hostile_util import canary, check_after

pytestmark = pytest.mark.slow  # the session's server (its worker is a process)

MODEL = "smollm2-135m-instruct"
GREEDY = {"temperature": 0}  # the SDK sends sampling fields through extra_body
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def _chat(http: httpx.Client, **body: Any) -> dict:
    r = http.post("/v1/chat/completions", json={"model": MODEL, **GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_message_is_chats_reply_with_chats_logprobs(claude, http):  # type: ignore[no-untyped-def]
    system = "You answer in one short sentence."
    message = claude.messages.create(
        model=MODEL, max_tokens=12, system=system, messages=ASK,
        extra_body={**GREEDY, "logprobs": True, "top_logprobs": 3},
    )  # fmt: skip
    chat = _chat(
        http, max_tokens=12, logprobs=True, top_logprobs=3,
        messages=[{"role": "system", "content": system}, *ASK],
    )  # fmt: skip
    (block,) = message.content
    choice = chat["choices"][0]
    assert block.type == "text" and block.text == choice["message"]["content"]
    assert message.stop_reason == "max_tokens" and choice["finish_reason"] == "length"
    assert getattr(block, "logprobs") == choice["logprobs"]["content"]  # noqa: B009
    usage = message.usage
    assert usage.output_tokens == chat["usage"]["completion_tokens"] == 12
    assert usage.input_tokens + usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    counted = claude.messages.count_tokens(model=MODEL, system=system, messages=ASK)
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]
    assert message.id.startswith("msg_") and message.role == "assistant"


def test_the_sdk_stream_helper_puts_together_the_whole_answer(claude, http):  # type: ignore[no-untyped-def]
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 16, "messages": ASK}
    extra = {**GREEDY, "logprobs": True, "top_logprobs": 1}
    whole = claude.messages.create(**body, extra_body=extra)
    with claude.messages.stream(**body, extra_body=extra) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == 16
    # the events, as sent: their order, and each text delta's logprobs
    with http.stream("POST", "/v1/messages", json={**body, **extra, "stream": True}) as s:
        assert s.status_code == 200
        lines = [ln for ln in s.iter_lines() if ln]
    names = [ln.split(": ", 1)[1] for ln in lines if ln.startswith("event: ")]
    datas = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
    assert [d["type"] for d in datas] == names
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    entries = [e for d in datas if d["type"] == "content_block_delta" for e in d["logprobs"]]
    assert entries == whole.content[0].logprobs  # type: ignore[union-attr]
    assert datas[-2]["usage"]["output_tokens"] == 16
    assert datas[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}


def test_stop_sequences_and_the_stop_reasons(claude) -> None:  # type: ignore[no-untyped-def]
    free = claude.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY)
    text = free.content[0].text
    word = text.split()[2]
    stopped = claude.messages.create(
        model=MODEL, max_tokens=24, messages=ASK, stop_sequences=["zzz", word],
        extra_body=GREEDY,
    )  # fmt: skip
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[: text.index(word)]
    ended = claude.messages.create(model=MODEL, max_tokens=400, messages=ASK, extra_body=GREEDY)
    assert ended.stop_reason == "end_turn" and ended.stop_sequence is None


def test_the_tool_use_round_trip(claude, http) -> None:  # type: ignore[no-untyped-def]
    body: dict[str, Any] = {
        "model": MODEL, "max_tokens": 48, "messages": ASK, "tools": [WEATHER],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    }  # fmt: skip
    first = claude.messages.create(**body, extra_body={**GREEDY, "logprobs": True})
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "get_weather"
    assert set(use.input) == {"city", "unit"} and use.input["unit"] in ("c", "f")
    assert len(getattr(use, "logprobs")) == first.usage.output_tokens  # noqa: B009
    with claude.messages.stream(**body, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [  # type: ignore[union-attr]
        ("tool_use", use.name, use.input)
    ]
    # the call is chat's for the same conversation and tool_choice: its name and arguments,
    # and an id of the same shape, fresh for each reply
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"], "strict": True}}]  # fmt: skip
    chat = _chat(http, max_tokens=48, messages=ASK, tools=tools, tool_choice="required",
                 parallel_tool_calls=False)["choices"][0]  # fmt: skip
    (chat_call,) = chat["message"]["tool_calls"]
    assert chat["finish_reason"] == "tool_calls" and chat_call["type"] == "function"
    assert chat_call["function"]["name"] == use.name
    assert json.loads(chat_call["function"]["arguments"]) == use.input
    shape = re.compile(r"[a-z]+_[0-9a-f]{24}")
    ids = [use.id, streamed.content[0].id, chat_call["id"]]  # type: ignore[union-attr]
    assert all(shape.fullmatch(i) for i in ids) and len(set(ids)) == 3, ids
    # the result goes back as a tool_result block; the prompt is chat's with a tool message
    conversation = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": '{"temp_c": 18}'},
            {"type": "text", "text": "Thanks."},
        ]},
    ]  # fmt: skip
    second = claude.messages.create(
        model=MODEL, max_tokens=8, messages=conversation, tools=[WEATHER], extra_body=GREEDY
    )
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    call = {"id": use.id, "type": "function",
            "function": {"name": use.name, "arguments": json.dumps(use.input)}}  # fmt: skip
    chat_messages = [
        *ASK,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": use.id, "content": '{"temp_c": 18}'},
        {"role": "user", "content": "Thanks."},
    ]
    counted = http.post("/tokenize", json={"model": MODEL, "messages": chat_messages,
                                           "tools": tools}).json()  # fmt: skip
    usage = second.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == counted["count"]
    assert (
        claude.messages.count_tokens(
            model=MODEL, messages=conversation, tools=[WEATHER]
        ).input_tokens
        == counted["count"]
    )
    # a failed tool's result is given as an error
    failed = [
        *conversation[:2],
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": "timeout",
                    "is_error": True,
                }
            ],
        },
    ]
    errs = [
        *chat_messages[:2],
        {"role": "tool", "tool_call_id": use.id, "content": "Error: timeout"},
    ]
    assert claude.messages.count_tokens(
        model=MODEL, messages=failed, tools=[WEATHER]
    ).input_tokens == http.post(
        "/tokenize", json={"model": MODEL, "messages": errs, "tools": tools}
    ).json()["count"]  # fmt: skip


def test_a_final_assistant_message_is_continued(claude, http) -> None:  # type: ignore[no-untyped-def]
    """A prefill: the reply continues the assistant's text, as chat's continue_final_message."""
    prefill = "The capital of France is"
    message = claude.messages.create(
        model=MODEL, max_tokens=6, extra_body=GREEDY,
        messages=[{"role": "user", "content": "Tell me about France."},
                  {"role": "assistant", "content": prefill}],
    )  # fmt: skip
    chat = _chat(
        http, max_tokens=6, add_generation_prompt=False, continue_final_message=True,
        messages=[{"role": "user", "content": "Tell me about France."},
                  {"role": "assistant", "content": prefill}],
    )  # fmt: skip
    assert message.content[0].text == chat["choices"][0]["message"]["content"]


def test_structured_output_follows_the_schema(claude) -> None:  # type: ignore[no-untyped-def]
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    message = claude.messages.create(
        model=MODEL, max_tokens=32, messages=[{"role": "user", "content": "What is 2+2?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body=GREEDY,
    )  # fmt: skip
    assert message.stop_reason == "end_turn"
    assert isinstance(json.loads(message.content[0].text)["answer"], int)


def test_claude_codes_request_shape(http) -> None:  # type: ignore[no-untyped-def]
    """What Claude Code sends: beta headers and query, a billing header in the system blocks
    (left out of the prompt: it changes every request), cache_control everywhere, metadata,
    thinking, tools with cache_control, a stream; its thinking blocks sent back."""
    beta = "claude-code-20250219,interleaved-thinking-2025-05-14"
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": beta, "x-api-key": "unused"}
    sampling = ("max_tokens", "stream", "metadata", "temperature")

    def body(cch: str) -> dict[str, Any]:
        return {
            "model": MODEL, "max_tokens": 32000, "stream": True,
            "system": [
                {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={cch};"},
                {"type": "text", "text": "You are Claude Code.",
                 "cache_control": {"type": "ephemeral"}},
            ],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "List files.",
                                              "cache_control": {"type": "ephemeral"}}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "I should list.", "signature": "abc"},
                    {"type": "text", "text": "Sure."}]},
                {"role": "user", "content": "Go on."},
            ],
            "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}],
            "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "temperature": 1,
        }  # fmt: skip

    counts = []
    for cch in ("abc12", "ffe90"):
        shape = {k: v for k, v in body(cch).items() if k not in sampling}
        r = http.post("/v1/messages/count_tokens?beta=true", json=shape, headers=headers)
        assert r.status_code == 200, r.text
        counts.append(r.json()["input_tokens"])
    plain = body("x")
    plain["system"] = plain["system"][1:]
    plain = {k: v for k, v in plain.items() if k not in sampling}
    alone = http.post("/v1/messages/count_tokens", json=plain).json()["input_tokens"]
    assert counts == [alone, alone]
    stream_body = {**body("abc12"), "max_tokens": 6, "thinking": {"type": "adaptive"}}
    with http.stream("POST", "/v1/messages?beta=true", json=stream_body, headers=headers) as s:
        assert s.status_code == 200
        assert "x-ignored-fields" not in s.headers  # every field is one this server implements
        events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: ")]
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"


def test_errors_are_in_anthropics_envelope_and_harm_nothing(http) -> None:  # type: ignore[no-untyped-def]
    before = canary(http)
    user = [{"role": "user", "content": "Hi"}]
    cases: list[tuple[dict[str, Any], int, str | None]] = [
        ({"model": MODEL, "messages": user}, 400, "max_tokens"),
        ({"model": MODEL, "max_tokens": 0, "messages": user}, 400, "max_tokens"),
        ({"model": MODEL, "max_tokens": 4, "messages": []}, 400, "messages"),
        ({"model": "nope", "max_tokens": 4, "messages": user}, 404, "model"),
        ({"model": MODEL, "max_tokens": 4, "messages": user, "temperature": 1.5}, 400,
         "temperature"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "data": "x"}}]}]}, 400,
         "messages[0].content[0].type"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]}, 400,
         "messages[0].content[0].tool_use_id"),
        ({"model": MODEL, "max_tokens": 4, "messages": user,
          "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools[0].type"),
        ({"model": MODEL, "max_tokens": 4, "messages": user, "tools": [WEATHER],
          "tool_choice": {"type": "tool"}}, 400, "tool_choice.name"),
        ({"model": MODEL, "max_tokens": 4, "messages": user, "stop_sequences": [""] * 5000}, 400,
         "stop_sequences"),
        ({"model": MODEL, "max_tokens": 2000, "messages": user,
          "thinking": {"type": "enabled", "budget_tokens": 4000}}, 400, "thinking.budget_tokens"),
        ({"model": MODEL, "max_tokens": 4, "messages": user, "top_logprobs": 2}, 400,
         "top_logprobs"),
        ({"model": MODEL, "max_tokens": 4, "messages": user, "return_routed_experts": True}, 400,
         "return_routed_experts"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "\ud800"}]},
         400, "messages[0].content"),
        ({"model": MODEL, "max_tokens": 2**70, "messages": user}, 400, "max_tokens"),
        ({"model": MODEL, "max_tokens": True, "messages": user}, 400, "max_tokens"),
        ({"model": MODEL, "max_tokens": 4, "messages": user, "temperature": True}, 400,
         "temperature"),
    ]  # fmt: skip
    # two tool_use blocks of one id (a tool_result would answer both), in one message or two
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "x"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}
    other = {**use, "id": "toolu_2"}
    cases += [
        ({"model": MODEL, "max_tokens": 4, "tools": [WEATHER], "messages": [
            *user, {"role": "assistant", "content": [use, use]},
            {"role": "user", "content": [result]}]}, 400, "messages[1].content[1].id"),
        ({"model": MODEL, "max_tokens": 4, "tools": [WEATHER], "messages": [
            *user, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]},
            {"role": "assistant", "content": [other, use]}]}, 400, "messages[3].content[1].id"),
    ]  # fmt: skip
    for body, status, param in cases:
        r = http.post("/v1/messages", content=json.dumps(body).encode(),
                      headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == status, (body, r.text)
        got = r.json()
        assert got["type"] == "error", got
        assert set(got["error"]) == {"type", "message", "param", "code"}
        assert got["error"]["param"] == param, (body, got)
        kind = {400: "invalid_request_error", 404: "not_found_error"}[status]
        assert got["error"]["type"] == kind
    bad = http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": "x"})
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    twice = [*user, {"role": "assistant", "content": [use, use]}]
    bad = http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": twice})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[1].content[1].id"
    results = [result, {**result, "tool_use_id": "toolu_2"}]
    unique = [*user, {"role": "assistant", "content": [use, other]},
              {"role": "user", "content": results}]  # fmt: skip
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "tools": [WEATHER],
                                        "messages": unique})  # fmt: skip
    assert r.status_code == 200, r.text
    deep: Any = {}
    for _ in range(40):
        deep = {"a": deep}
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": deep}]}]})  # fmt: skip
    assert r.status_code == 400 and r.json()["type"] == "error"
    # what chat's own messages bound, named on the message that broke it
    many = [{"type": "tool_use", "id": f"t{i}", "name": "f", "input": {}} for i in range(65)]
    nested = "[" * 40 + "]" * 40
    for content in (many, [{"type": "tool_result", "tool_use_id": "t0", "content": nested}]):
        history = [{"role": "assistant", "content": many[:1]}, {"role": "user", "content": content}]
        if content is many:
            history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": many}]
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = http.post(path, json={"model": MODEL, "max_tokens": 4, "messages": history})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "messages[1]"
    check_after(http, before)
