"""The grammar of a gpt-oss (harmony) reply: an analysis message, free (at most the thinking
budget's tokens, then `<|end|>` is forced as a finished analysis message ends), then the final
channel (free, or the request's response_format) or, with tools, a commentary message to
`functions.NAME` with `<|constrain|>json` whose body is that function's arguments (its schema)
ended by `<|call|>`. Markers are written as token ids, never as text."""

from __future__ import annotations

import json

from probserve.api.answers.harmony import HarmonyMarkers
from probserve.api.plans.grammar import named_answer
from probserve.api.structured import JSON_OPTIONS
from probserve.api.tools.ask import ToolAsk
from probserve.api.tools.grammar import object_schema


def harmony_grammar(
    m: HarmonyMarkers, tools: ToolAsk | None, answer: str | None, budget: int | None
) -> str:
    """The reply's grammar (llguidance's JSON form): `answer` (a compiled grammar; None: free)
    applies to the final channel only; `tools`' calls as harmony writes them."""
    limit = f"[max_tokens={budget}]" if budget is not None else ""
    rules = [
        f'analysis: <[{m.channel}]> "analysis" <[{m.message}]> thought <[{m.end}]> '
        f'<[{m.start}]> "assistant"',
        f"thought{limit}: /(.|\\n)*/",
        f'final: <[{m.channel}]> "final" <[{m.message}]> {"@answer" if answer else "TEXT"} '
        f"<[{m.ret}]>",
    ]
    # text the reply's tool parser could take for a call is kept out of a final message
    text = r"/(?s:.*)/ & ~/(?s:.*<tool_call>.*)/" if tools is not None else r"/(?s:.*)/"
    rules.append(f"TEXT: {text}")
    ends = ["final"]
    if tools is not None:
        calls = []
        for i, (f, schema) in enumerate(tools.offered_schemas):
            body = json.dumps({"x-guidance": JSON_OPTIONS, **object_schema(schema)})
            head = json.dumps(f"commentary to=functions.{f.name} ")
            rules.append(
                f'call{i}: <[{m.channel}]> {head} <[{m.constrain}]> "json" <[{m.message}]> '
                f"%json {body} <[{m.call}]>"
            )
            calls.append(f"call{i}")
        ends = calls if tools.forced else ["final", *calls]
    rules.insert(0, f"start: analysis? ({' | '.join(ends)})")
    grammars: list[dict[str, object]] = [{"lark_grammar": "\n".join(rules)}]
    if answer is not None:
        grammars += named_answer(answer)
    return json.dumps({"grammars": grammars})
