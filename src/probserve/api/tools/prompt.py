"""Tools in the prompt. A native format's template gets the tools (`apply_chat_template(tools=)`)
and the conversation's calls and results as it expects them. The generic format tells the model
in the system message (`generic_instructions`); earlier calls
become the assistant's JSON replies and each tool result a user message holding it as JSON
(a result that is JSON itself, as its value)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from probserve.api.protocol import FunctionDefinition
from probserve.api.tools.ask import NO_ARGUMENTS, ToolAsk
from probserve.api.tools.formats import ToolFormat


@dataclass
class ToolPrompt:
    """The messages as the template is to get them, the template's extra arguments, and for
    each message the index of the request's message it stands for (None: one of probserve's)."""

    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any]
    origins: list[int | None]
    primed: bool = False  # the last message is the reply's primer, to be continued

    def request_sources(
        self, sources: list[tuple[int | None, str]], request: list[dict[str, Any]]
    ) -> list[tuple[int | None, str]]:
        """Prompt tokens' sources over these messages, as sources over the `request`'s: a
        message of probserve's (the generic tools' system message) counts as template."""
        out: list[tuple[int | None, str]] = []
        for i, _ in sources:
            origin = self.origins[i] if i is not None else None
            out.append((None, "template") if origin is None else (origin, request[origin]["role"]))
        return out


def definitions(ask: ToolAsk) -> list[dict[str, Any]]:
    """The functions offered, as JSON (a function without parameters takes none)."""
    return [_definition(f) for f in ask.functions]


def _definition(f: FunctionDefinition) -> dict[str, Any]:
    out: dict[str, Any] = {"name": f.name}
    if f.description is not None:
        out["description"] = f.description
    out["parameters"] = f.parameters if f.parameters is not None else NO_ARGUMENTS
    return out


def tools_chars(ask: ToolAsk | None) -> int:
    """The definitions' characters as JSON: what the tools add to the prompt, about."""
    return len(json.dumps(definitions(ask), ensure_ascii=False)) if ask is not None else 0


def generic_instructions(ask: ToolAsk) -> str:
    """The generic format's part of the system message (docs/tools.md shows it): the tools
    as JSON, and the one JSON object to reply with."""
    lines = [
        "You can call functions. They are, as JSON:",
        json.dumps(definitions(ask), ensure_ascii=False),
        'To call functions, reply with only this JSON: {"tool_calls": [{"name": "<a function\'s '
        'name>", "arguments": {<its arguments>}}]}'
        + (" (one call)." if ask.most_calls == 1 else " (one or more calls)."),
    ]
    if ask.choice == "named":
        lines.append(f"You must call {ask.named}.")
    elif ask.forced:
        lines.append("You must call a function.")
    else:
        lines.append(
            'To answer without calling a function, reply with only {"content": "<your answer>"}.'
        )
    lines.append('Function results come back as {"tool_result": ...}.')
    return "\n".join(lines)


def _generic_history(message: dict[str, Any]) -> dict[str, Any]:
    """An earlier call as the generic reply that made it; a tool result as a user message."""
    if message["role"] == "assistant" and message.get("tool_calls"):
        calls = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in message["tool_calls"]
        ]
        return {
            "role": "assistant",
            "content": json.dumps({"tool_calls": calls}, ensure_ascii=False),
        }
    if message["role"] == "tool":
        result = {
            "tool_call_id": message.get("tool_call_id"),
            "content": _value(message["content"]),
        }
        if message.get("name"):
            result["name"] = message["name"]
        content = json.dumps({"tool_result": result}, ensure_ascii=False)
        return {"role": "user", "content": content}
    return message


def _value(text: str) -> Any:
    """A result that is JSON, as its value (the model reads it unescaped); else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def tool_prompt(dicts: list[dict[str, Any]], ask: ToolAsk | None, fmt: ToolFormat) -> ToolPrompt:
    """The messages and template arguments that show the tools; a reply that must be calls in
    the generic format begins in the prompt (`ToolAsk.primer`, an assistant turn continued)."""
    origins: list[int | None] = list(range(len(dicts)))
    if fmt.native:
        # the tools as chat templates take them (OpenAI's shape)
        tools = [{"type": "function", "function": d} for d in definitions(ask)] if ask else None
        return ToolPrompt(dicts, {"tools": tools} if tools is not None else {}, origins)
    messages = [_generic_history(m) for m in dicts]
    if ask is None:
        return ToolPrompt(messages, {}, origins)
    text = generic_instructions(ask)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        messages[0] = {**first, "content": f"{first['content']}\n\n{text}".lstrip()}
    else:
        messages.insert(0, {"role": "system", "content": text})
        origins.insert(0, None)
    if ask.primer:  # the reply's certain start, as an assistant turn to continue
        messages.append({"role": "assistant", "content": ask.primer})
        origins.append(None)
        return ToolPrompt(messages, {}, origins, primed=True)
    return ToolPrompt(messages, {}, origins)
