"""Clients read a thinking model's answer and its reasoning where each looks for them: the
anthropic SDK (a `thinking` block before the `text` block), LangChain's ChatOpenAI over the
Responses API (the reasoning item, then the text, among the message's content blocks;
LangChain reads no reasoning from chat completions), instructor (the answer parsed into its
model from `content`, the reasoning beside it in the raw completion's `message.reasoning`).
The OpenAI SDK's own checks are in test_clients.py. The model is test_reasoning's tiny random
Qwen2 on R1-distill's tokenizer, served with a Qwen3.5-shaped template (the prompt opens the
thinking), steered to think a few tokens then answer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field
from test_reasoning import ASK, BUDGET, QWEN35, _steer, r1

from probserve.models import LoadedModel
from probserve.serving import with_chat_template

pytestmark = pytest.mark.slow  # a server per module

__all__ = ["r1"]  # the model fixture, shared with test_reasoning

MARKERS = ("<think>", "</think>")


@pytest.fixture(scope="module")
def url(r1: LoadedModel) -> Iterator[str]:
    from server_util import running_server

    with running_server(with_chat_template(r1, QWEN35)) as base:
        yield base


def _steering(route: str) -> dict[str, Any]:
    """`_steer`'s fields but the thinking budget, which each SDK asks for its own way."""
    out = _steer("q_http", route=route)
    out.pop("thinking", None)
    out.pop("thinking_budget", None)
    out.pop("temperature")
    return out


def test_the_anthropic_sdk_reads_a_thinking_block_then_the_text(url: str) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    msg = client.messages.create(
        model="r1-tiny", max_tokens=64, messages=ASK,  # type: ignore[arg-type]
        thinking={"type": "enabled", "budget_tokens": BUDGET},
        extra_body={**_steering("messages"), "temperature": 0},  # (this SDK takes none)
    )  # fmt: skip
    kinds = [b.type for b in msg.content]
    assert kinds == ["thinking", "text"], kinds
    thinking, text = msg.content
    assert isinstance(thinking, anthropic.types.ThinkingBlock) and thinking.thinking.strip()
    assert isinstance(text, anthropic.types.TextBlock) and text.text.strip()
    assert not any(m in text.text or m in thinking.thinking for m in MARKERS)


def test_langchain_reads_reasoning_and_text_blocks_over_responses(url: str) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model="r1-tiny", base_url=f"{url}/v1", api_key="unused", temperature=0,  # type: ignore[arg-type]
        max_retries=0, use_responses_api=True, max_tokens=64,  # type: ignore[call-arg]
        extra_body={**_steering("responses"), "thinking_budget": BUDGET},
    )  # fmt: skip
    msg = chat.invoke(ASK[0]["content"])
    # the Responses output as LangChain keeps it: the reasoning item (its `reasoning_text`
    # content, as vLLM sends it; LangChain's standard block reads only a `summary`, which
    # probserve leaves empty as vLLM does), then the text
    assert isinstance(msg.content, list)
    kinds = [b["type"] for b in msg.content if isinstance(b, dict)]
    assert kinds == ["reasoning", "text"], msg.content
    item = msg.content[0]
    assert isinstance(item, dict)
    thought = "".join(part["text"] for part in item["content"])
    assert thought.strip() and msg.text.strip()
    assert not any(m in msg.text or m in thought for m in MARKERS)
    assert [b["type"] for b in msg.content_blocks] == ["reasoning", "text"]


class Answer(BaseModel):
    verdict: Literal["yes", "no"]
    n: int = Field(ge=0, le=9)


def test_instructor_parses_the_answer_and_leaves_the_reasoning_beside_it(url: str) -> None:
    import instructor
    import openai

    client = instructor.from_openai(
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0),
        mode=instructor.Mode.JSON_SCHEMA,
    )
    steer = _steering("chat")
    steer.pop("structured_outputs")  # instructor's response_format shapes the answer
    answer, completion = client.chat.completions.create_with_completion(
        model="r1-tiny", response_model=Answer, messages=ASK,  # type: ignore[arg-type]
        max_tokens=64, temperature=0, max_retries=1,
        extra_body={**steer, "thinking_budget": BUDGET},
    )  # fmt: skip
    assert isinstance(answer, Answer)
    message = completion.choices[0].message
    assert message.content is not None and not any(m in message.content for m in MARKERS)
    reasoning = (message.model_extra or {}).get("reasoning")
    assert isinstance(reasoning, str) and reasoning.strip()
    assert not any(m in reasoning for m in MARKERS)
