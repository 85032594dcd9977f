"""One tool call in Qwen3-Coder's XML-like syntax (Qwen3-Coder, Qwen3.5, Qwen3.6), scanned as it
is written: `<function=NAME>`, then per argument `<parameter=P>\\nvalue\\n</parameter>`, then
`</function>` (the `<tool_call>` around it is the reply parser's).

The call's name is known once its tag closes; each argument is reported once its
`</parameter>` is written, as JSON: a value whose schema type is a string stays the text
written (one newline each side dropped, as the template puts them there), any other is the
JSON it holds (text that does not parse as the type asked stays a string). The arguments are
OpenAI's: one JSON object, `{"P": value, ...}`. The object has the same interface as
`CallObject` (JSON calls), so the reply parser drives both alike."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

_WHITESPACE = " \t\n\r"
_FUNCTION = "<function="
_PARAMETER = "<parameter="
_PARAMETER_END = "</parameter>"
_FUNCTION_END = "</function>"
_NAME_MOST = 256  # a tag's name longer than this is no call's


class XmlCall:
    """`schemas`: each function's arguments schema by name (what types its parameters are)."""

    def __init__(self, schemas: Mapping[str, Any]) -> None:
        self._schemas = schemas
        self._raw: list[str] = []
        self._tag = ""  # a tag being read (from its "<")
        self._value: list[str] = []  # a parameter's value being read
        self._parameter: str | None = None
        self._pending = ""  # arguments text not yet reported
        self._any = False  # an argument was written
        self._sent = 0
        self.name: str | None = None
        self.done = False
        self.failed = False
        self.committed = False

    @property
    def raw(self) -> str:
        return "".join(self._raw)

    def feed(self, c: str) -> None:
        """One character (after `done` or `failed`: not to be called)."""
        self._raw.append(c)
        if self.name is None:
            self._opening(c)
        elif self._parameter is not None:
            self._value_char(c)
        elif self._tag or c == "<":
            self._tag_char(c)
        elif c not in _WHITESPACE:
            self.failed = True  # text between a call's tags: not the syntax

    def _opening(self, c: str) -> None:
        """`<function=NAME>`: a reply that writes anything else is no call."""
        self._tag += c
        if len(self._tag) <= len(_FUNCTION):
            if not _FUNCTION.startswith(self._tag):
                self.failed = True
            return
        if c == ">":
            name = self._tag[len(_FUNCTION) : -1]
            self._tag = ""
            if name.strip():
                self.name = name.strip()
            else:
                self.failed = True
        elif c == "\n" or len(self._tag) > len(_FUNCTION) + _NAME_MOST:
            self.failed = True

    def _tag_char(self, c: str) -> None:
        """A tag between arguments: a parameter's, or the function's close."""
        self._tag += c
        tag = self._tag
        if tag == _FUNCTION_END:
            self._tag = ""
            self._pending += "}" if self._any else "{}"
            self.done = True
        elif tag.startswith(_PARAMETER) and c == ">":
            self._parameter = tag[len(_PARAMETER) : -1].strip()
            self._tag = ""
        else:
            known = _FUNCTION_END.startswith(tag) or _PARAMETER.startswith(tag[: len(_PARAMETER)])
            if not known or c == "\n" or len(tag) > len(_PARAMETER) + _NAME_MOST:
                self.failed = True

    def _value_char(self, c: str) -> None:
        self._value.append(c)
        if c != ">" or len(self._value) < len(_PARAMETER_END):
            return
        text = "".join(self._value)
        if not text.endswith(_PARAMETER_END):
            self._value = [text]
            return
        assert self._parameter is not None
        value = argument_value(text[: -len(_PARAMETER_END)], self._schema(self._parameter))
        key = json.dumps(self._parameter, ensure_ascii=False)
        self._pending += ("{" if not self._any else ", ") + f"{key}: {value}"
        self._any = True
        self._parameter, self._value = None, []

    def _schema(self, parameter: str) -> Any:
        """The parameter's schema (None: its function's schema does not say)."""
        schema = self._schemas.get(self.name or "")
        properties = schema.get("properties") if isinstance(schema, dict) else None
        return properties.get(parameter) if isinstance(properties, dict) else None

    def arguments_delta(self) -> str:
        """The arguments' JSON written since the last call: each argument once whole."""
        delta, self._pending = self._pending, ""
        self._sent += len(delta)
        return delta

    def missing_arguments(self) -> str:
        """Nothing: a finished call's object is closed by `</function>` ("{}" if empty)."""
        return ""


def schema_types(schema: Any) -> set[str]:
    """The JSON types a schema names (`type`, or its `enum` / `const` values'; none: any)."""
    if not isinstance(schema, dict):
        return set()
    named = schema.get("type")
    if isinstance(named, str):
        return {named}
    if isinstance(named, list):
        return {t for t in named if isinstance(t, str)}
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else None
    if "const" in schema:
        values = [schema["const"]]
    if values is not None:
        return {"string" if isinstance(v, str) else "other" for v in values}
    return set()


def argument_value(text: str, schema: Any) -> str:
    """One argument's value as JSON: the text between the tags, less the newline the template
    writes on each side; a string where the schema says only string (or the text is no JSON,
    or a JSON string), else the JSON value the text holds."""
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    if schema_types(schema) == {"string"}:
        return json.dumps(text, ensure_ascii=False)
    try:
        value = json.loads(text)
    except ValueError:  # not JSON: the text, as a string
        return json.dumps(text, ensure_ascii=False)
    # a JSON string's quotes are the text's own (the template writes strings unquoted)
    return json.dumps(text if isinstance(value, str) else value, ensure_ascii=False)
