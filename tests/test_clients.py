"""Real clients' requests, as the libraries build or send them: lm-evaluation-harness's
generation payloads, the OpenAI SDK's `extra_body`, vLLM's token-id fields, inspect-ai's
Responses requests, instructor- and LangChain-style tool and schema requests. Each was refused
or answered wrongly before the field policy (docs/operations.md, "Unknown fields")."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from server_util import running_server

from probserve.models import LoadedModel

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"


def _stream(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    return [json.loads(ln) for ln in lines if ln != "[DONE]"]


# ---- lm-evaluation-harness -----------------------------------------------------------------


class _TaskLoader(yaml.SafeLoader):
    """lm-eval's task files use `!function` tags: read as None (only generation_kwargs count)."""


_TaskLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def _generation_kwargs(task_file: str) -> dict[str, Any]:
    import lm_eval

    path = Path(lm_eval.__file__).parent / "tasks" / task_file
    config = yaml.load(path.read_text(), Loader=_TaskLoader)
    return dict(config["generation_kwargs"])


# real tasks whose generation_kwargs hold keys beyond lm-eval's own (do_sample, until, ...)
LM_EVAL_TASKS = [
    "gsm8k/gsm8k.yaml",  # until, do_sample, temperature
    "humaneval/humaneval_64.yaml",  # do_sample true, temperature, top_p, max_gen_toks
    "noreval/norsummarize-instruct/norsummarize_instruct.yaml",  # num_beams, max_new_tokens
    "catalan_bench/terretaqa.yaml",  # max_new_tokens
]


@pytest.mark.parametrize("task_file", LM_EVAL_TASKS)
def test_lm_eval_generation_payloads_are_served(http: httpx.Client, task_file: str) -> None:
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    api = LocalCompletionsAPI(
        model=MODEL, base_url=f"{http.base_url}v1/completions", tokenizer_backend=None
    )
    kwargs = _generation_kwargs(task_file)
    payload = api._create_payload(
        "Question: what is 2 + 3?\nAnswer:", generate=True, gen_kwargs=dict(kwargs), seed=1234
    )
    # a short answer: the task's own token budget, kept if it is the one lm-eval sends
    budget = min(int(payload["max_tokens"]), 6)
    payload["max_tokens"] = budget
    if "max_new_tokens" in payload:
        payload["max_new_tokens"] = budget  # lm-eval sends both: they agree
    r = http.post("/v1/completions", json=payload)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] <= budget
    ignored = r.headers.get("x-ignored-fields")
    unknown = sorted(set(payload) - {"prompt", "model", "max_tokens", "temperature", "stop",
                                     "seed", "top_p", "max_new_tokens"})  # fmt: skip
    assert (ignored.split(", ") if ignored else []) == unknown


def test_max_new_tokens_is_max_tokens_and_a_disagreement_is_a_400(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "One, two,", "temperature": 0}
    alone = http.post("/v1/completions", json={**body, "max_new_tokens": 3}).json()
    assert alone["usage"]["completion_tokens"] == 3
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0}
    assert (
        http.post("/v1/chat/completions", json={**chat, "max_new_tokens": 2}).json()["usage"][
            "completion_tokens"
        ]
        == 2
    )
    r = http.post("/v1/completions", json={**body, "max_tokens": 4, "max_new_tokens": 5})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_new_tokens" and "max_tokens" in err["message"]
    # chat's three spellings (its older max_tokens too): given together they agree, or a 400
    # naming the other one (max_new_tokens 3 beside max_tokens 2 was 3 tokens)
    for extra, param in (
        ({"max_tokens": 2, "max_new_tokens": 3}, "max_new_tokens"),
        ({"max_completion_tokens": 2, "max_new_tokens": 3}, "max_new_tokens"),
        ({"max_tokens": 3, "max_completion_tokens": 2}, "max_tokens"),
        ({"max_tokens": 2, "max_completion_tokens": 2, "max_new_tokens": 3}, "max_new_tokens"),
    ):
        r = http.post("/v1/chat/completions", json={**chat, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())
    for extra in (
        {"max_tokens": 2, "max_new_tokens": 2},
        {"max_tokens": 2, "max_completion_tokens": 2, "max_new_tokens": 2},
        {"max_tokens": None, "max_completion_tokens": 2},
    ):
        r = http.post("/v1/chat/completions", json={**chat, **extra})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, (extra, r.text)


def test_the_sdks_extra_body_is_served_and_named_back(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body={"repetition_penalty": 1.1, "guided_decoding_backend": "xgrammar"},
    )
    assert raw.headers["x-ignored-fields"] == "guided_decoding_backend"
    assert raw.parse().usage.completion_tokens == 2


# ---- vLLM's token-id fields ----------------------------------------------------------------


def test_return_tokens_as_token_ids_and_return_token_ids_on_completions(
    http: httpx.Client,
) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3,
            "temperature": 0, "logprobs": 2, "echo": True}  # fmt: skip
    plain = http.post("/v1/completions", json=body).json()["choices"][0]
    ids = http.post(
        "/v1/completions",
        json={**body, "return_tokens_as_token_ids": True, "return_token_ids": True},
    ).json()["choices"][0]
    tok = http.post("/tokenize", json={"model": MODEL, "prompt": body["prompt"]}).json()
    assert ids["prompt_token_ids"] == tok["tokens"]
    assert len(ids["token_ids"]) == 3 and ids["text"] == plain["text"]
    every = ids["prompt_token_ids"] + ids["token_ids"]
    assert ids["logprobs"]["tokens"] == [f"token_id:{t}" for t in every]
    assert ids["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    for named, texts in zip(ids["logprobs"]["top_logprobs"][1:],
                            plain["logprobs"]["top_logprobs"][1:], strict=True):  # fmt: skip
        assert all(k.startswith("token_id:") for k in named)
        assert sorted(named.values()) == sorted(texts.values())
    assert "prompt_token_ids" not in plain and "token_ids" not in plain
    # streamed: the prompt's ids in the choice's first chunk, each chunk its own ids
    chunks = _stream(http, "/v1/completions", {**body, "echo": False, "return_token_ids": True})
    assert chunks[0]["choices"][0]["prompt_token_ids"] == tok["tokens"]
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ids["token_ids"]


def test_return_token_ids_on_chat_streamed_and_whole(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    plain = http.post("/v1/chat/completions", json=body).json()
    whole = http.post(
        "/v1/chat/completions",
        json={**body, "return_token_ids": True, "return_tokens_as_token_ids": True},
    ).json()
    tok = http.post("/tokenize", json={"model": MODEL, "messages": body["messages"]}).json()
    assert whole["prompt_token_ids"] == tok["tokens"]
    out = whole["choices"][0]["token_ids"]
    entries = whole["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in out]
    base = plain["choices"][0]["logprobs"]["content"]
    # as vLLM: the chosen token's bytes are its own, an alternative's are those of its name
    assert [e["bytes"] for e in entries] == [e["bytes"] for e in base]
    assert [e["logprob"] for e in entries] == [e["logprob"] for e in base]
    top = entries[0]["top_logprobs"][0]
    assert bytes(top["bytes"]).decode() == top["token"]
    chunks = _stream(http, "/v1/chat/completions", {**body, "return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == tok["tokens"]
    assert [t for c in chunks[1:] for ch in c["choices"] for t in ch.get("token_ids") or []] == out


def test_return_token_ids_on_responses(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "input": "Say hi",
        "max_output_tokens": 3,
        "temperature": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "top_logprobs": 1,
    }
    r = http.post("/v1/responses", json=body).json()
    assert len(r["token_ids"]) == r["usage"]["output_tokens"] == 3
    assert len(r["prompt_token_ids"]) == r["usage"]["input_tokens"]
    logprobs = r["output"][0]["content"][0]["logprobs"]
    assert [e["token"] for e in logprobs] == [f"token_id:{t}" for t in r["token_ids"]]


def test_continuous_usage_stats_puts_the_tokens_so_far_on_every_chunk(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "One, two,", "max_tokens": 4, "temperature": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    chunks = _stream(http, "/v1/completions", body)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    # (a step's accepted proposals come in one chunk: at least a chunk a step and the usage's)
    assert counts == sorted(counts) and counts[-1] == 4 and len(chunks) >= 2
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    assert all(c["usage"] is not None for c in _stream(http, "/v1/chat/completions", chat))
    only_final = {**chat, "stream_options": {"include_usage": True}}
    chunks = _stream(http, "/v1/chat/completions", only_final)
    assert all(c.get("usage") is None for c in chunks[:-1]) and chunks[-1]["usage"]


CACHED_TEXT = "Name the planets of the solar system, from the closest to the sun outwards, " * 3


def test_streamed_usage_agrees_with_itself_on_a_cached_prompt(http: httpx.Client) -> None:
    """With usage on every chunk, a prompt found in the prefix cache (sent twice) says the same
    cached_tokens on every chunk as on the final one: the first chunk included (it used to say 0,
    the rest 16 or more). n = 2 too: the second candidate finds what the first computed."""
    usage = {"include_usage": True, "continuous_usage_stats": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": CACHED_TEXT}],
            "max_tokens": 3, "temperature": 0, "stream_options": usage}  # fmt: skip
    completion = {"model": MODEL, "prompt": CACHED_TEXT, "max_tokens": 3, "temperature": 0,
                  "stream_options": usage}  # fmt: skip
    for path, body in (
        ("/v1/chat/completions", chat),
        ("/v1/completions", completion),
        ("/v1/chat/completions", {**chat, "n": 2}),
        ("/v1/completions", {**completion, "n": 2}),
    ):
        _stream(http, path, body)  # now it is cached
        chunks = _stream(http, path, body)
        final = chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert final >= 16, (path, chunks[-1]["usage"])
        said = [c["usage"]["prompt_tokens_details"]["cached_tokens"] for c in chunks]
        assert said == [final] * len(chunks), (path, body.get("n"), said)
        prompts = {c["usage"]["prompt_tokens"] for c in chunks}
        assert prompts == {chunks[-1]["usage"]["prompt_tokens"]}
    # the Messages API: message_start's usage names the cache reads the final usage names
    message = {"model": MODEL, "messages": [{"role": "user", "content": CACHED_TEXT}],
               "max_tokens": 3, "temperature": 0}  # fmt: skip
    _stream(http, "/v1/messages", message)
    events = _stream(http, "/v1/messages", message)
    start = events[0]["message"]["usage"]
    (end,) = [e["usage"] for e in events if e["type"] == "message_delta"]
    assert start["cache_read_input_tokens"] == end["cache_read_input_tokens"] >= 16
    assert start["input_tokens"] == end["input_tokens"]


# ---- inspect-ai's Responses requests (openai provider, as its source builds them) ----------


def test_inspect_ais_responses_requests_and_probe_are_served(http: httpx.Client) -> None:
    # completion_params_responses: store false, include the reasoning's encrypted content
    request = {
        "model": MODEL,
        "input": [{"type": "message", "role": "developer",
                   "content": [{"type": "input_text", "text": "Answer briefly."}]},
                  {"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": "Say hi"}]}],
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "max_output_tokens": 4,
        "truncation": "disabled",
        "background": False,
    }  # fmt: skip
    r = http.post("/v1/responses", json=request)
    assert r.status_code == 200, r.text
    assert "x-ignored-fields" not in r.headers
    # its start-up probe (reasoning_summaries)
    probe = {"model": MODEL, "input": "Please say 'hello, world'",
             "reasoning": {"effort": "low", "summary": "auto"}}  # fmt: skip
    assert http.post("/v1/responses", json={**probe, "max_output_tokens": 4}).status_code == 200
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "service_tier": "auto",
        "prompt_cache_key": "k1",
        "reasoning_effort": "low",
    }
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and "x-ignored-fields" not in r.headers
    assert http.post("/v1/responses", json={**probe, "truncation": "auto"}).status_code == 400


def test_a_content_part_with_an_extra_key_is_served(http: httpx.Client) -> None:
    part = {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["x-ignored-fields"] == "messages[0].content[0].cache_control"


def test_stream_options_follow_the_field_policy(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True, "nonsense": 1}}  # fmt: skip
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.headers["x-ignored-fields"] == "stream_options.nonsense"


# ---- schemas that do not say additionalProperties ----------------------------------------


def test_a_schema_without_additional_properties_gets_only_its_keys(http: httpx.Client) -> None:
    # the strings' maxLength bounds the object well within max_tokens: each reply closes it
    text = {"type": "string", "maxLength": 20}
    schema = {"type": "object", "properties": {"name": text, "country": text}}
    for seed in range(4):
        body = {"model": MODEL, "seed": seed, "max_tokens": 100, "temperature": 1.0,
                "messages": [{"role": "user", "content": "A city in France, as JSON"}],
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "city", "schema": schema}}}  # fmt: skip
        r = http.post("/v1/chat/completions", json=body).json()
        content = r["choices"][0]["message"]["content"]
        assert r["choices"][0]["finish_reason"] == "stop", r
        assert set(json.loads(content)) <= {"name", "country"}, content
        assert '"city"' not in content


def test_closed_objects_follow_the_schemas_structure() -> None:
    from probserve.api.structured import closed_objects

    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"a": {}}},
                       "open": {"type": "object", "properties": {}, "additionalProperties": True},
                       "list": {"type": "array", "items": {"properties": {"b": {}}}}},
        "$defs": {"d": {"properties": {"c": {}}}},
        "allOf": [{"properties": {"x": {}}}, {"properties": {"y": {}}}],
    }  # fmt: skip
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert "additionalProperties" not in schema["properties"]["properties"]  # not changed
    assert set(props) == {"properties", "open", "list"}  # a property named "properties" stays
    assert props["properties"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["list"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert all("additionalProperties" not in b for b in closed["allOf"])  # siblings' keys


# ---- tool calls as instructor and LangChain make them --------------------------------------

PING = {"type": "function", "function": {"name": "ping", "description": "Check the server"}}
CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _chat(http: httpx.Client, **body: Any) -> dict:
    r = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "temperature": 0, **body},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_a_function_without_parameters_is_called_with_no_arguments(http: httpx.Client) -> None:
    for seed in range(3):
        choice = _chat(http, tools=[PING], tool_choice="required", max_tokens=30, seed=seed,
                       temperature=1.0)  # fmt: skip
        calls = choice["message"]["tool_calls"]
        assert calls and all(c["function"] == {"name": "ping", "arguments": "{}"} for c in calls), (
            calls
        )


def test_a_named_call_costs_about_its_arguments(http: httpx.Client) -> None:
    # the wrapper up to the arguments is in the prompt: {"city": "Paris"} is 6 tokens, and
    # the close "}]}" 2 more (it took 24 before)
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = _chat(http, tools=[CITY], tool_choice=named, max_tokens=12)
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert set(json.loads(call["function"]["arguments"])) == {"city"}
    # required: the wrapper up to the name in the prompt; the name, arguments and close here
    required = _chat(http, tools=[CITY, PING], tool_choice="required", max_tokens=16,
                     parallel_tool_calls=False)  # fmt: skip
    assert required["finish_reason"] == "tool_calls", required


def test_a_forced_call_cut_before_its_name_leaks_nothing(http: httpx.Client) -> None:
    choice = _chat(http, tools=[CITY, PING], tool_choice="required", max_tokens=1)
    assert choice["message"]["content"] is None and not choice["message"].get("tool_calls")
    assert choice["finish_reason"] == "length"


def test_responses_calls_complete_as_they_close(http: httpx.Client) -> None:
    add = {"type": "function", "name": "add",
           "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                           "b": {"type": "integer"}},
                          "required": ["a", "b"]}}  # fmt: skip
    body = {"model": MODEL, "input": "Add 1 and 2, then 3 and 4.", "tools": [add],
            "tool_choice": "required", "temperature": 0}  # fmt: skip
    # the 135M model calls add again and again: the reply is cut inside a call, which is
    # incomplete, the calls before it completed
    body["max_output_tokens"] = 60
    r = http.post("/v1/responses", json=body).json()
    calls = [o for o in r["output"] if o["type"] == "function_call"]
    status = [c["status"] for c in calls]
    assert r["status"] == "incomplete", r
    assert r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert len(status) >= 2 and set(status[:-1]) == {"completed"}, status
    assert status[-1] == "incomplete", status
    # one call only: the reply ends with it, completed
    one = http.post("/v1/responses", json={**body, "parallel_tool_calls": False}).json()
    assert one["status"] == "completed", one
    assert [(o["type"], o["status"]) for o in one["output"]] == [("function_call", "completed")]
    assert json.loads(one["output"][0]["arguments"]) == json.loads(calls[0]["arguments"])
    events = _stream(http, "/v1/responses", body)
    kinds = [(e["type"], e.get("output_index")) for e in events]
    added = [i for i, (k, _) in enumerate(kinds) if k == "response.output_item.added"]
    closed = [i for i, (k, _) in enumerate(kinds) if k == "response.output_item.done"]
    # each call's done event comes before the next call is added; the stream's calls are the
    # whole reply's
    assert len(added) == len(closed) == len(calls), kinds
    for nxt, done in zip(added[1:], closed, strict=False):
        assert done < nxt, kinds
    items = [events[i]["item"] for i in closed]
    assert [(i["status"], i["arguments"]) for i in items] == [
        (c["status"], c["arguments"]) for c in calls
    ]
    assert events[-1]["type"] == "response.incomplete"


# ---- the strict policy and the access line -----------------------------------------------


@pytest.fixture(scope="module")
def strict(tiny: LoadedModel) -> Iterator[httpx.Client]:
    with running_server(tiny, "--strict-fields") as url, httpx.Client(base_url=url) as c:
        yield c


def test_strict_fields_refuses_the_first_unknown_field_naming_it(strict: httpx.Client) -> None:
    body = {"prompt": "Hi", "max_tokens": 1}
    r = strict.post("/v1/completions", json={**body, "stream_options": {"nonsense": 1}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "unknown_parameter"
    assert err["param"] == "stream_options.nonsense"
    # another server's spelling of a field is no unknown field
    assert strict.post("/v1/completions", json={**body, "max_new_tokens": 1}).status_code == 200


def test_a_400s_access_line_says_its_code_field_and_message(
    http: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    if http.base_url.host != "127.0.0.1" or "PROBSERVE_TEST_SERVER" in __import__("os").environ:
        pytest.skip("the access line is this process's only where the server runs here")
    with caplog.at_level(logging.INFO, logger="probserve.access"):
        http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "logprobs": 10**6})
        http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1,
                                           "frobnicate": 2})  # fmt: skip
    lines = [r for r in caplog.records if r.name == "probserve.access"]
    refused = next(r for r in lines if getattr(r, "status", None) == 400)
    assert refused.error_param == "logprobs" and "logprobs" in refused.error_message
    assert "error=" in refused.getMessage() and "param=logprobs" in refused.getMessage()
    served = next(r for r in lines if getattr(r, "status", None) == 200)
    assert served.ignored_fields == "frobnicate" and "ignored_fields=[frobnicate]" in (
        served.getMessage()
    )


def test_instructors_tools_mode_request_gets_only_the_models_fields(http: httpx.Client) -> None:
    """instructor's Mode.TOOLS: the response model's pydantic schema (no additionalProperties)
    as a function, forced by name; the reply parses back into the model."""
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    schema = City.model_json_schema()
    assert "additionalProperties" not in schema
    tool = {"type": "function", "function": {"name": "City", "description": "A city",
                                             "parameters": schema}}  # fmt: skip
    for seed in range(3):
        choice = _chat(
            http, tools=[tool], tool_choice={"type": "function", "function": {"name": "City"}},
            max_tokens=120, seed=seed, temperature=1.0,  # (a sampled name ran past 40 on AVX2)
            messages=[{"role": "user", "content": "Name a city in France."}],
        )  # fmt: skip
        (call,) = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls", choice
        City.model_validate_json(call["function"]["arguments"])
        assert set(json.loads(call["function"]["arguments"])) == {"name", "country"}
