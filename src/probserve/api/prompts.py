"""Prompts: request text, token ids or chat messages -> token ids and their text pieces.

One home for prompt building, used by every route that takes a prompt, `/tokenize` and the CLI.
Tokenizers and chat templates run in a worker thread (`off_loop`), never on the event loop, and
the cheap checks (sizes, the context length) come before any expensive work, so a hostile prompt
is refused before it can cost anything.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from probserve.api.answers.text_stream import Piece, TextStream
from probserve.api.answers.tokens import TokenTable
from probserve.api.errors import APIError, bad_request
from probserve.api.protocol import ChatMessage, ToolCall
from probserve.api.server.limits import Limits
from probserve.api.tools.ask import made_once
from probserve.engine import TokenLogprobs
from probserve.models import ModelRecord

T = TypeVar("T")


@dataclass
class Prompt:
    ids: list[int]
    text: str  # the prompt's text as its tokens decode (what echo returns)
    pieces: list[Piece]  # one per prompt token, offsets from 0

    def scored(self, scores: TokenLogprobs | None, start: int = 1) -> list[Piece]:
        """The pieces of tokens `start`.. joined to their rows of the prompt's `scores`: row
        t - 1 is the distribution that predicts token t (the first token has none). Without
        scores: the pieces alone."""
        if scores is None:
            return self.pieces[start:]
        assert start >= 1, "the first token has no row"
        return [
            replace(p, logprobs=scores, row=t - 1) for t, p in enumerate(self.pieces[start:], start)
        ]


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


def completion_id_lists(prompt: object, param: str = "prompt") -> list[str] | list[list[int]]:
    """The four shapes of a completions prompt, as a list of texts or a list of id lists
    (`param`: the field it came in, for errors: completions' prompt, embeddings' input)."""
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
        f"{param} must be a non-empty string, list of strings, list of token ids or list of "
        "lists of token ids",
        param,
    )


def check_text_size(limits: Limits, texts: list[str], param: str = "prompt") -> None:
    chars = sum(len(t) for t in texts)
    if chars > limits.max_prompt_chars:
        raise bad_request(
            f"the prompt holds {chars} characters; the limit is {limits.max_prompt_chars}", param
        )


def build_completion_prompts(
    loaded: ModelRecord,
    table: TokenTable,
    prompts: list[str] | list[list[int]],
    max_tokens: int,
    param: str = "prompt",
) -> list[Prompt]:
    """Tokenize (texts), check and decode every prompt: blocking, run it `off_loop`. `param`
    names the field the prompts come from, for errors."""
    out = []
    for p in prompts:
        ids = p if isinstance(p, list) else list(loaded.tokenizer(p).input_ids)
        check_ids(ids, loaded.vocab_size, max_tokens, param)
        out.append(with_pieces(table, ids))
    return out


# ---- chat -------------------------------------------------------------------------------------


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as chat templates take them: role and content text, and the tool fields
    (an assistant's calls with their arguments as a JSON value where they parse, as templates
    expect; a tool result's call id and its function's name)."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function name, for the results that answer them
    made: set[str] = set()  # the call ids made so far: each names one call
    for i, m in enumerate(messages):
        if m.content is None:
            content = ""
        elif isinstance(m.content, str):
            content = m.content
        else:
            content = "".join(part.text for part in m.content)
        role = "system" if m.role == "developer" else m.role
        d: dict[str, Any] = {"role": role, "content": content}
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(
                    "only assistant messages hold tool_calls", f"messages[{i}].tool_calls"
                )
            for k, c in enumerate(m.tool_calls):
                made_once(made, c.id, "tool call", f"messages[{i}].tool_calls[{k}].id")
            d["tool_calls"] = [_template_call(c) for c in m.tool_calls]
            names.update((c.id, c.function.name) for c in m.tool_calls)
        if m.role == "tool":
            if m.tool_call_id is None:
                raise bad_request(
                    "a tool message needs the tool_call_id it answers",
                    f"messages[{i}].tool_call_id",
                )
            d["tool_call_id"] = m.tool_call_id
            name = m.name or names.get(m.tool_call_id)
            if name:
                d["name"] = name
        elif m.tool_call_id is not None:
            raise bad_request("only tool messages hold tool_call_id", f"messages[{i}].tool_call_id")
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:  # the template renders it where it keeps earlier thinking
            if m.role != "assistant":
                field = "reasoning" if m.reasoning is not None else "reasoning_content"
                raise bad_request(
                    "only assistant messages hold reasoning", f"messages[{i}].{field}"
                )
            d["reasoning_content"] = reasoning
            d["thinking"] = reasoning  # gpt-oss's template's name for it (its analysis)
        out.append(d)
    return out


def _template_call(call: ToolCall) -> dict[str, Any]:
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


def message_chars(dicts: list[dict[str, Any]]) -> int:
    """The characters of the messages' contents and of their calls (ids, names, arguments)."""
    chars = sum(len(m["content"]) + len(m.get("tool_call_id") or "") for m in dicts)
    for m in dicts:
        for c in m.get("tool_calls", ()):
            arguments = c["function"]["arguments"]
            chars += len(arguments if isinstance(arguments, str) else json.dumps(arguments))
            chars += len(c["id"]) + len(c["function"]["name"])
    return chars


def check_messages(
    limits: Limits, messages: list[ChatMessage], extra_chars: int = 0
) -> list[dict[str, Any]]:
    """The messages as the template takes them, their count and characters checked first
    (`extra_chars`: what else the prompt holds, the tools' definitions)."""
    dicts = message_dicts(messages)
    chars = message_chars(dicts)
    limits.check_messages(len(dicts), chars)
    if chars + extra_chars > limits.max_message_chars:
        raise bad_request(
            f"the messages and tools hold {chars + extra_chars} characters; the limit is "
            f"{limits.max_message_chars}",
            "tools",
        )
    return dicts


def render_chat_text(
    loaded: ModelRecord,
    dicts: list[dict[str, Any]],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any],
    continue_final: bool = False,
) -> str:
    tok = loaded.tokenizer
    if not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    if continue_final and (dicts[-1]["role"] != "assistant" or add_generation_prompt):
        raise bad_request(
            "continue_final_message needs a final assistant message and "
            "add_generation_prompt: false",
            "continue_final_message",
        )
    try:
        return str(
            tok.apply_chat_template(
                dicts, add_generation_prompt=add_generation_prompt, tokenize=False,
                continue_final_message=continue_final, **template_kwargs,
            )
        )  # fmt: skip
    except Exception as exc:  # a template that rejects the conversation (jinja raise_exception)
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from exc


def render_chat(
    loaded: ModelRecord,
    dicts: list[dict[str, Any]],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any],
) -> list[int]:
    """The model's chat template over the messages, tokenized: blocking, run it `off_loop`."""
    text = render_chat_text(loaded, dicts, add_generation_prompt, template_kwargs)
    return list(loaded.tokenizer(text, add_special_tokens=False).input_ids)


@dataclass
class ChatPrompt(Prompt):
    """A rendered chat prompt, each token attributed to the message whose text it carries or to
    the template (`sources`: (message index or None, role or "template") per token);
    `reasoning`: per token, whether it lies inside a thinking span (a thinking model's;
    `thinking.reasoning_positions`), empty for a model whose replies are not split."""

    sources: list[tuple[int | None, str]] = field(default_factory=list)
    continuation: int = 0  # echo: how many trailing tokens are the final assistant message
    reasoning: list[bool] = field(default_factory=list)


Span = tuple[int, int, int]  # (start, end, message index): a message's content in the text


def echo_bridge(
    loaded: ModelRecord,
    dicts: list[dict[str, Any]],
    template_kwargs: dict[str, Any],
    text: str,
    think_end: str,
) -> str:
    """What the template writes between the generation prompt (`text`) and the final
    message's content when it renders that message (continue_final_message): its thinking
    block's rest, closed by `think_end` ("" where the template writes something else there:
    no block, or one it drops, as DeepSeek-R1's does; the answer is then scored after the
    generation prompt as it is)."""
    answer = dicts[-1]["content"]
    try:
        whole = render_chat_text(loaded, dicts, False, template_kwargs, True)
    except APIError:
        return ""
    if not whole.endswith(answer) or not whole.startswith(text):
        return ""
    bridge = whole[len(text) : len(whole) - len(answer)]
    return bridge if think_end in bridge else ""


def _content_spans(
    loaded: ModelRecord,
    dicts: list[dict[str, Any]],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any],
    continue_final: bool,
    text: str,
) -> list[Span] | None:
    """Where each message's content lies in `text`, the rendered template, in text order. The
    template is rendered again with a unique marker in place of each content: the text around
    the markers is the template's own, and putting the contents back where the markers are must
    give `text` again (as sent, or stripped for templates that trim). None when it does not (a
    template that rewrites or branches on contents): then no position can be trusted."""
    tag = uuid.uuid4().hex
    marked = [{**m, "content": f"m{tag}n{i}m" if m["content"] else ""} for i, m in enumerate(dicts)]
    try:
        skeleton = render_chat_text(
            loaded, marked, add_generation_prompt, template_kwargs, continue_final
        )
    except APIError:
        return None
    for strip in (False, True):
        parts: list[str] = []
        spans: list[Span] = []
        at = last = 0
        for match in re.finditer(f"m{tag}n(\\d+)m", skeleton):
            between = skeleton[last : match.start()]
            i = int(match.group(1))
            content = dicts[i]["content"].strip() if strip else dicts[i]["content"]
            parts += [between, content]
            at += len(between)
            spans.append((at, at + len(content), i))
            at += len(content)
            last = match.end()
        parts.append(skeleton[last:])
        if "".join(parts) == text:
            return spans
    return None


def _typed_as_text(
    loaded: ModelRecord,
    table: TokenTable,
    text: str,
    ids: list[int],
    rendering: tuple[list[dict[str, Any]], bool, dict[str, Any], bool],
) -> list[int]:
    """`ids` (`text` tokenized) with every added or special token that a user, system or tool
    message's content wrote (`<think>`, `<|im_end|>` typed as text) tokenized as the text it
    is: a client's words never become the template's control tokens (a fake think block, a
    turn of its own). `rendering`: the messages, generation prompt, template variables and
    continue_final `text` was rendered with (to place each content in it)."""
    tok, pattern, added = loaded.tokenizer, table.added_texts, table.added_ids
    dicts, gen, kwargs, final = rendering
    typed = (d["content"] for d in dicts if d["role"] != "assistant")
    if pattern is None or not any(pattern.search(c) for c in typed):
        return ids  # what nearly every prompt is: no client text reads as a control token
    if not getattr(tok, "is_fast", False):
        return ids
    spans = _content_spans(loaded, dicts, gen, kwargs, final, text)
    places = [(a, b) for a, b, i in spans or () if dicts[i]["role"] != "assistant"]
    if not places:
        return ids
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc.input_ids) != ids:
        return ids
    out: list[int] = []
    for tid, (a, b) in zip(ids, enc.offset_mapping, strict=True):
        if tid in added and any(s <= a and b <= e for s, e in places):
            out += _plain_ids(tok, text[a:b])
        else:
            out.append(tid)
    return out


def _plain_ids(tok: Any, text: str) -> list[int]:
    """`text`'s ids as plain text: the tokenizer's own model over its pre-tokenized pieces,
    no added token matched."""
    backend = tok.backend_tokenizer
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    pre = backend.pre_tokenizer
    pieces = [p for p, _ in pre.pre_tokenize_str(text)] if pre is not None else [text]
    return [t.id for piece in pieces for t in backend.model.tokenize(piece)]


def _search_spans(text: str, dicts: list[dict[str, Any]]) -> list[Span]:
    """The fallback for a template whose contents cannot be placed by markers: each content's
    first occurrence after the previous one's (it can land on template text that happens to
    hold the same characters)."""
    spans: list[Span] = []
    pos = 0
    for i, m in enumerate(dicts):
        at = text.find(m["content"], pos) if m["content"] else -1
        if at >= 0:
            spans.append((at, at + len(m["content"]), i))
            pos = at + len(m["content"])
    return spans


def _sources(
    pieces: list[Piece], spans: list[Span], dicts: list[dict[str, Any]]
) -> list[tuple[int | None, str]]:
    """A token belongs to a message when its characters lie inside that message's content
    (a zero-width piece: its offset does); any other token is the template's, a token that
    straddles a content's edge included."""
    spans = sorted(spans)
    out: list[tuple[int | None, str]] = []
    s = 0
    for p in pieces:
        # a word's token may carry the template's space before the content ("[INST] Hello":
        # "▁Hello"): what lies inside is the text after its leading whitespace
        lead = len(p.text) - len(p.text.lstrip()) if p.text.strip() else 0
        start, end = p.offset + lead, p.offset + max(len(p.text), 1)
        while s < len(spans) and spans[s][1] <= start:
            s += 1
        if s < len(spans) and spans[s][0] <= start and end <= spans[s][1]:
            i = spans[s][2]
            out.append((i, dicts[i]["role"]))
        else:
            out.append((None, "template"))
    return out


def chat_prompt(
    loaded: ModelRecord,
    table: TokenTable,
    dicts: list[dict[str, Any]],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any],
    echo: bool = False,
    continue_final: bool = False,
    think_end: str | None = None,
) -> ChatPrompt:
    """Render, tokenize and attribute: blocking, run it `off_loop`. With `echo`, the final
    (assistant) message is the continuation: the template up to the assistant's turn, then the
    message's own tokens, to be scored. Where the generation prompt leaves a thinking block
    open and the template closes it when it renders the final message (`think_end`: the
    model's end marker; `echo_bridge`), the block as the template closes it (the message's
    reasoning, if sent, and the marker) comes between: the answer is scored after its
    thinking, as the model writes it."""
    tok = loaded.tokenizer
    bridge = ""
    if echo:
        if dicts[-1]["role"] != "assistant" or not dicts[-1]["content"]:
            raise bad_request("echo scores a final assistant message: none was given", "messages")
        shown, gen, final = dicts[:-1], True, False  # the template renders all but the answer
        text = render_chat_text(loaded, shown, gen, template_kwargs)
        answer = dicts[-1]["content"]
        if think_end is not None:
            bridge = echo_bridge(loaded, dicts, template_kwargs, text, think_end)
        cont = list(tok(answer, add_special_tokens=False).input_ids)
        ids = list(tok(text, add_special_tokens=False).input_ids)
        ids = _typed_as_text(loaded, table, text, ids, (shown, gen, template_kwargs, final))
        ids += list(tok(bridge, add_special_tokens=False).input_ids) if bridge else []
        ids += cont
    else:
        shown, gen, final = dicts, add_generation_prompt, continue_final
        text = render_chat_text(loaded, dicts, gen, template_kwargs, final)
        ids, cont, answer = list(tok(text, add_special_tokens=False).input_ids), [], ""
        ids = _typed_as_text(loaded, table, text, ids, (shown, gen, template_kwargs, final))
    built = with_pieces(table, ids)
    spans = None
    if built.text == text + bridge + answer:  # the tokens decode to the rendered text
        spans = _content_spans(loaded, shown, gen, template_kwargs, final, text)
    if spans is None:
        spans = _search_spans(built.text, dicts)
    elif echo:
        last, at = len(dicts) - 1, len(text) + len(bridge)
        thought = str(dicts[-1].get("reasoning_content") or "")
        if thought and thought in bridge:  # the sent reasoning: the assistant's words
            start = len(text) + bridge.index(thought)
            spans.append((start, start + len(thought), last))
        spans.append((at, at + len(answer), last))
    sources = _sources(built.pieces, spans, dicts)
    return ChatPrompt(ids, built.text, built.pieces, sources, len(cont))
