"""The grammar of one Qwen3-Coder XML call (Qwen3-Coder, Qwen3.5, Qwen3.6), as lark rules for
llguidance: `<function=NAME>\\n`, its parameters in its schema's order (the required ones
always, the others optional), each `<parameter=P>\\nvalue\\n</parameter>\\n`, then
`</function>\\n`. A value whose schema type is only non-string types (integer, number,
boolean, object, array, null) is JSON following that parameter's schema; a string's (or an
untyped one's) is free text up to its closing tag (within its minLength and maxLength; an
enum's or const's strings: those only).
A function whose schema lets in keys it does not name takes more parameters, any name, as
text. `tool_grammar` (grammar.py) wraps the calls in `<tool_call>` tags."""

from __future__ import annotations

import json
from typing import Any

from probserve.api.structured import JSON_OPTIONS
from probserve.api.tools.ask import ToolAsk
from probserve.api.tools.xml_call import schema_types

# a string value and its closing tag: text up to the first `</parameter>`
_TEXT_VALUE = r"TEXT_VALUE: /(?s:.*)\n<\/parameter>/ & ~/(?s:.*<\/parameter>.+)/"
_NAME = r"PARAM_NAME: /[A-Za-z_][A-Za-z0-9_.\-]{0,63}/"


def xml_call_rules(ask: ToolAsk) -> list[str]:
    """`call`: one call to one of the offered functions, and the rules it needs."""
    rules = [_TEXT_VALUE, _NAME]
    names = []
    for i, (f, schema) in enumerate(ask.offered_schemas):
        names.append(f"f{i}")
        rules.extend(_function_rules(i, f.name, schema))
    rules.insert(0, "call: " + " | ".join(names))
    return rules


def _function_rules(i: int, name: str, schema: Any) -> list[str]:
    head = json.dumps(f"<function={name}>\n")
    properties = schema.get("properties") if isinstance(schema, dict) else None
    properties = properties if isinstance(properties, dict) else {}
    required = schema.get("required") if isinstance(schema, dict) else None
    required = set(required) if isinstance(required, list) else set()
    defs = {
        k: schema[k] for k in ("$defs", "definitions") if isinstance(schema, dict) and k in schema
    }
    rules, parts = [], []
    for j, (key, sub) in enumerate(properties.items()):
        tag = json.dumps(f"<parameter={key}>\n")
        value, terminals = _value(sub, defs, f"TEXT_{i}_{j}")
        rules.extend([f'p{i}_{j}: {tag} {value} "\\n"', *terminals])
        parts.append(f"p{i}_{j}" + ("" if key in required else "?"))
    closed = isinstance(schema, dict) and schema.get("additionalProperties") is False
    if not closed:  # keys it does not name: any, as text
        rules.append(f'x{i}: "<parameter=" PARAM_NAME ">\\n" TEXT_VALUE "\\n"')
        parts.append(f"x{i}*")
    close = json.dumps("</function>\n")
    return [f"f{i}: {head} {' '.join(parts)} {close}".replace("  ", " "), *rules]


def _value(schema: Any, defs: dict[str, Any], term: str) -> tuple[str, list[str]]:
    """One parameter's value and its closing tag, and the terminal it needs (named `term`)."""
    types = schema_types(schema)
    end = json.dumps("\n</parameter>")
    if types and "string" not in types:
        body = {"x-guidance": JSON_OPTIONS, **defs, **schema}
        return f"%json {json.dumps(body)} {end}", []
    values = _strings(schema)
    if values is not None:
        return "(" + " | ".join(json.dumps(f"{v}\n</parameter>") for v in values) + ")", []
    bounds = _lengths(schema)
    if bounds is None:
        return "TEXT_VALUE", []
    least, most = bounds
    text = f"/(?s:.{{{least},{most}}})\\n<\\/parameter>/ & ~/(?s:.*<\\/parameter>.+)/"
    return term, [f"{term}: {text}"]


def _lengths(schema: Any) -> tuple[int, str] | None:
    """A string's minLength and maxLength as a regex's bounds (None: neither is set)."""
    if not isinstance(schema, dict) or not ({"minLength", "maxLength"} & set(schema)):
        return None
    least, most = schema.get("minLength", 0), schema.get("maxLength")
    least = least if isinstance(least, int) and least >= 0 else 0
    return least, str(most) if isinstance(most, int) and most >= least else ""


def _strings(schema: Any) -> list[str] | None:
    """A string parameter's only values (an enum or const of strings; None: any text)."""
    if not isinstance(schema, dict):
        return None
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return values
    return None
