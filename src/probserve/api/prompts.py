"""Prompts: request text, token ids or chat messages -> token ids and their text pieces.

One home for prompt building, used by every route that takes a prompt, `/tokenize` and the CLI.
Tokenizers and chat templates run in a worker thread (`off_loop`), never on the event loop, and
the cheap checks (sizes, the context length) come before any expensive work, so a hostile prompt
is refused before it can cost anything.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from probserve.api.errors import bad_request
from probserve.api.limits import Limits
from probserve.api.protocol import ChatMessage
from probserve.api.text_stream import Piece, TextStream
from probserve.api.tokens import TokenTable
from probserve.models import LoadedModel

T = TypeVar("T")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking tokenizer/template work in a worker thread: the event loop stays free."""
    return await asyncio.to_thread(fn, *args)


@dataclass
class Prompt:
    ids: list[int]
    text: str  # the prompt's text as its tokens decode (what echo returns)
    pieces: list[Piece]  # one per prompt token, offsets from 0


def check_ids(ids: list[int], vocab_size: int, max_tokens: int, param: str = "prompt") -> None:
    """Length first (O(1)), then every id in the vocabulary."""
    if not ids:
        raise bad_request("a prompt is empty: at least one token is needed", param)
    if len(ids) > max_tokens:
        raise bad_request(
            f"this model's maximum context length is {max_tokens} tokens; the prompt has "
            f"{len(ids)} tokens",
            param,
        )
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param)


def with_pieces(table: TokenTable, ids: list[int]) -> Prompt:
    ts = TextStream(table)
    ts.add_all(ids)
    pieces = ts.release(final=True)
    return Prompt(ids, ts.text, pieces)


def completion_id_lists(prompt: object) -> list[str] | list[list[int]]:
    """The four shapes of a completions prompt, as a list of texts or a list of id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) for p in prompt):
            return [list(p) for p in prompt]
    raise bad_request(
        "prompt must be a non-empty string, list of strings, list of token ids or list of "
        "lists of token ids",
        "prompt",
    )


def check_text_size(limits: Limits, texts: list[str], param: str = "prompt") -> None:
    chars = sum(len(t) for t in texts)
    if chars > limits.max_prompt_chars:
        raise bad_request(
            f"the prompt holds {chars} characters; the limit is {limits.max_prompt_chars}", param
        )


def build_completion_prompts(
    loaded: LoadedModel, table: TokenTable, prompts: list[str] | list[list[int]], max_tokens: int
) -> list[Prompt]:
    """Tokenize (texts), check and decode every prompt: blocking, run it `off_loop`."""
    out = []
    for p in prompts:
        ids = p if isinstance(p, list) else list(loaded.tokenizer(p).input_ids)
        check_ids(ids, loaded.vocab_size, max_tokens)
        out.append(with_pieces(table, ids))
    return out


# ---- chat -------------------------------------------------------------------------------------


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    out = []
    for m in messages:
        if m.content is None:
            content = ""
        elif isinstance(m.content, str):
            content = m.content
        else:
            content = "".join(part.text for part in m.content)
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": content})
    return out


def _reserved_template_names() -> frozenset[str]:
    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    names = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    return frozenset(names | {"self", "messages", "raise_exception", "strftime_now"})


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """Template variables only: never the template itself (a client's Jinja would run here and
    could loop or allocate without bound), nor any argument of apply_chat_template."""
    if not kwargs:
        return {}
    reserved = _reserved_template_names()
    for key in kwargs:
        if not key.isidentifier() or key.startswith("_") or key in reserved:
            raise bad_request(
                f"chat_template_kwargs may not set {key!r}: only variables of the model's own "
                "chat template are accepted",
                f"chat_template_kwargs.{key}" if key.isidentifier() else "chat_template_kwargs",
            )
    return kwargs


def check_messages(limits: Limits, messages: list[ChatMessage]) -> list[dict[str, str]]:
    dicts = message_dicts(messages)
    limits.check_messages(len(dicts), sum(len(m["content"]) for m in dicts))
    return dicts


def render_chat(
    loaded: LoadedModel,
    dicts: list[dict[str, str]],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any],
) -> list[int]:
    """The model's chat template over the messages, tokenized: blocking, run it `off_loop`."""
    tok = loaded.tokenizer
    if not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    try:
        text = tok.apply_chat_template(
            dicts, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
        )
    except Exception as exc:  # a template that rejects the conversation (jinja raise_exception)
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from exc
    return list(tok(text, add_special_tokens=False).input_ids)


async def chat_prompt_ids(
    loaded: LoadedModel,
    limits: Limits,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    dicts = check_messages(limits, messages)
    kwargs = check_template_kwargs(template_kwargs)
    return await off_loop(render_chat, loaded, dicts, add_generation_prompt, kwargs)
