"""Structured outputs' common terms, below both the request plans (api/plans/grammar.py) and
the tools (api/tools/grammar.py), which each build grammars from them: what a request asked
for (`GrammarAsk`), JSON as models write it (`JSON_OPTIONS`), and object schemas closed to the
keys they name (`closed_objects`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# JSON as models write it, one way: ", " between items, ": " after keys, no other whitespace
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarAsk:
    """What the request asked for (`kind`: json_schema, json_object, regex, choice, grammar;
    lark: a grammar of the server's own, for tool calls),
    the field that asked (`param`), and the source before it is compiled."""

    kind: str
    param: str
    source: Any


# keywords whose value is a schema, a list of schemas, or a map of name -> schema
_SCHEMA = ("additionalProperties", "items", "contains", "propertyNames", "not", "if", "then",
           "else", "unevaluatedItems", "unevaluatedProperties", "additionalItems")  # fmt: skip
_SCHEMAS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any, close: bool = True) -> Any:
    """`schema` with every object schema that names its properties and does not say
    `additionalProperties` (or `unevaluatedProperties`) closed to keys it names, as vLLM's
    default backend and llama.cpp read schemas: a model given `{name, country}` writes those
    keys, not a third. An allOf branch is not closed itself (its keys are its siblings' too).
    A new value; the schema given is not changed."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = dict(schema)
    for key in _SCHEMA:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in _SCHEMAS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(s, close=False) for s in out["allOf"]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    names_keys = "properties" in out or "patternProperties" in out
    said = "additionalProperties" in out or "unevaluatedProperties" in out
    if close and names_keys and not said:
        out["additionalProperties"] = False
    return out
