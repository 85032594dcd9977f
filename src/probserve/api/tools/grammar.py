"""The grammar a tool ask needs, in the model's own call syntax: calls only for tool_choice
"required" or a named function (one call for a named one or parallel_tool_calls false); for
"auto", content or calls, constrained only where the request needs it (a `strict` function,
or at most one call), since free text needs no grammar. Generic-format replies are always
constrained: they are one JSON object, calls or content. Each call's arguments follow its
function's schema."""

from __future__ import annotations

import json
from typing import Any

from probserve.api.structured import JSON_OPTIONS, GrammarAsk
from probserve.api.tools.ask import ToolAsk
from probserve.api.tools.formats import ToolParser
from probserve.api.tools.xml_grammar import xml_call_rules


def call_schema(ask: ToolAsk, arguments: str = "arguments") -> dict[str, Any]:
    """One call: {"name": one of the offered functions, `arguments`: that one's schema (as
    `ask.schemas` holds it)}."""
    options = []
    for f, schema in ask.offered_schemas:
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, arguments: schema},
                "required": ["name", arguments],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def generic_schema(ask: ToolAsk) -> dict[str, Any]:
    """The generic format's reply: {"tool_calls": [calls]} or, for "auto", {"content": text}."""
    calls: dict[str, Any] = {
        "type": "array",
        "items": call_schema(ask),
        "minItems": 1,
    }
    if ask.most_calls is not None:
        calls["maxItems"] = ask.most_calls
    reply = {
        "type": "object",
        "properties": {"tool_calls": calls},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    if ask.forced:
        return reply
    content = {
        "type": "object",
        "properties": {"content": {"type": "string"}},
        "required": ["content"],
        "additionalProperties": False,
    }
    return {"anyOf": [reply, content]}


def primed_grammar(ask: ToolAsk) -> str:
    """The generic format's calls after `ask.primer` (in the prompt): a named function's
    arguments and the wrapper's close; or each call's name (one of the offered), its arguments
    and the object's close, with more calls where several may be, then the list's close."""

    def arguments(schema: Any) -> str:
        return f"%json {json.dumps({'x-guidance': JSON_OPTIONS, **object_schema(schema)})}"

    if ask.choice == "named":
        ((_, schema),) = ask.offered_schemas
        return f"start: args {json.dumps('}]}')}\nargs: {arguments(schema)}"
    rules = []
    for i, (f, schema) in enumerate(ask.offered_schemas):
        head = json.dumps(f'{f.name}", "arguments": ')
        rules.append(f"f{i}: {head} a{i} {json.dumps('}')}\na{i}: {arguments(schema)}")
    call = " | ".join(f"f{i}" for i in range(len(ask.offered)))
    again = json.dumps(', {"name": "')
    more = "" if ask.most_calls == 1 else f" ({again} call)*"
    return "\n".join([f"start: call{more} {json.dumps(']}')}", f"call: {call}", *rules])


def object_schema(schema: Any) -> dict[str, Any]:
    """A schema as a dict (a boolean schema: true is any value, false none)."""
    if isinstance(schema, dict):
        return schema
    return {} if schema else {"not": {}}


def tool_grammar(
    ask: ToolAsk,
    special_id: int | None,
    primed: bool = False,
    tags: tuple[int, int] | None = None,
) -> GrammarAsk | None:
    """The grammar for `ask` (None: the reply is free). `special_id`: the opener's token id,
    where it is a special token (Mistral's [TOOL_CALLS]); the arguments follow `ask.schemas`;
    `primed`: the reply begins after `ask.primer`, which the prompt holds; `tags`: Hermes' (and
    Qwen3-Coder's) `<tool_call>` and `</tool_call>` ids where the tokenizer has them as added
    tokens (Qwen's), which the grammar then names as tokens (as text they would be barred)."""
    fmt = ask.fmt
    if fmt.parser is ToolParser.GENERIC:
        if primed:
            return GrammarAsk("lark", "tools", primed_grammar(ask))
        return GrammarAsk("json_schema", "tools", generic_schema(ask))
    if not ask.forced and ask.parallel and not ask.strict:
        return None
    schema = {"x-guidance": JSON_OPTIONS, **call_schema(ask, fmt.arguments)}
    call = f"%json {json.dumps(schema)}"
    call_rules = [f"call: {call}"]
    if fmt.parser is ToolParser.QWEN3_CODER:  # XML calls, each in its own <tool_call>
        call_rules = xml_call_rules(ask)
        first, then = '"<tool_call>\\n" call "</tool_call>"', '"\\n"'
        if tags is not None:
            first = f'<[{tags[0]}]> "\\n" call <[{tags[1]}]>'
        text = r"TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/"
        free = "start: TEXT | TEXT? calls"
    elif fmt.parser in (ToolParser.HERMES, ToolParser.HARMONY):
        # harmony's replies reach it as Hermes calls where they are split (else not harmony's)
        first, then = '"<tool_call>\\n" call "\\n</tool_call>"', '"\\n"'
        if tags is not None:
            first = f'<[{tags[0]}]> "\\n" call "\\n" <[{tags[1]}]>'
        text = r"TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/"
        free = "start: TEXT | TEXT? calls"
    elif fmt.parser is ToolParser.MISTRAL:
        opener = f"<[{special_id}]>" if special_id is not None else json.dumps(fmt.opener)
        first, then = f'{opener} "[" call', '", "'
        text = r"TEXT: /(?s:.*)/ & ~/(?s:.*\[TOOL_CALLS\].*)/"
        free = "start: TEXT | TEXT? calls"
    else:  # Llama 3's JSON: a reply that is calls begins with "{"
        first, then = "call", '"; "'
        text = r"TEXT: /(?s:.*)/ & ~/(?s:\s*\{.*)/"
        free = "start: TEXT | calls"
    # the first call, then (where several may be) more after the format's separator
    again = first if fmt.tagged else "call"
    calls = first if ask.most_calls == 1 else f"{first} ({then} {again})*"
    if fmt.parser is ToolParser.MISTRAL:
        calls += ' "]"'
    rules = [f"calls: {calls}", *call_rules]
    start = "start: calls" if ask.forced else free
    if not ask.forced:
        rules.append(text)
    return GrammarAsk("lark", "tools", "\n".join([start, *rules]))
