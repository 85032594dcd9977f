"""One tool call's JSON object, scanned as it is written: `{"name": ..., "arguments": ...}`.

The scanner follows JSON's structure one character at a time (strings, escapes, depth) and
reports the call's name once its string is whole, and its arguments as they grow: the exact
text the model wrote for them (an object or array streams character by character; an argument
string, which some models write, is decoded once whole). It commits to being a call when the
name is known; before that the object can still turn out not to be one (`failed`)."""

from __future__ import annotations

import contextlib
import json

_WHITESPACE = " \t\n\r"


class CallObject:
    def __init__(self, argument_keys: tuple[str, ...]) -> None:
        self._keys = argument_keys
        self._raw: list[str] = []
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._expect = "open"  # at depth 1: key, colon, value, comma; "open" before "{"
        self._key: str | None = None
        self._string_start = 0
        self._value_start: int | None = None  # where the value being read at depth 1 starts
        self.name: str | None = None
        self._arguments_start: int | None = None  # a container argument value, streaming
        self._arguments: str | None = None  # the whole arguments text, once known
        self._sent = 0  # characters of the arguments reported so far
        self.done = False
        self.failed = False
        self.committed = False  # the reply has made it a call (its name is known)

    @property
    def raw(self) -> str:
        return "".join(self._raw)

    def feed(self, c: str) -> None:
        """One character (after `done` or `failed`: not to be called)."""
        i = len(self._raw)
        self._raw.append(c)
        if self._in_string:
            self._string_char(c, i)
        elif c == '"':
            self._in_string = True
            if self._depth == 1:
                if self._expect == "key":
                    self._string_start = i
                elif self._expect == "value" and self._value_start is None:
                    self._value_start = self._string_start = i
                else:
                    self.failed = True
        elif c in "{[":
            self._open(c, i)
        elif c in "}]":
            self._close(c, i)
        elif self._depth == 1:
            self._top_level(c, i)
        elif self._depth == 0 and c not in _WHITESPACE:
            self.failed = True

    def _string_char(self, c: str, i: int) -> None:
        if self._escaped:
            self._escaped = False
        elif c == "\\":
            self._escaped = True
        elif c == '"':
            self._in_string = False
            if self._depth == 1 and self._expect == "key":
                self._key = json.loads(self.raw[self._string_start : i + 1])
                self._expect = "colon"
            elif self._depth == 1 and self._expect == "value":
                self._value_end(i + 1)

    def _open(self, c: str, i: int) -> None:
        if self._depth == 0:
            if c != "{" or self._expect != "open":
                self.failed = True
                return
            self._expect = "key"
        elif self._depth == 1:
            if self._expect != "value" or self._value_start is not None:
                self.failed = True
                return
            self._value_start = i
            if self._key in self._keys:
                self._arguments_start = i
        self._depth += 1

    def _close(self, c: str, i: int) -> None:
        if self._depth == 1:
            if self._value_start is not None:  # a number, true, false or null ends here
                self._value_end(i)
            if c != "}" or self._expect not in ("key", "comma"):
                self.failed = True
                return
            self._depth = 0
            self.done = True
            if self.name is None:
                self.failed = True
            return
        if self._depth == 0:
            self.failed = True
            return
        self._depth -= 1
        if self._depth == 1:
            self._value_end(i + 1)

    def _top_level(self, c: str, i: int) -> None:
        if c in _WHITESPACE or c in ",:":
            if self._expect == "value" and self._value_start is not None:
                self._value_end(i)
            if c == ":":
                if self._expect != "colon":
                    self.failed = True
                self._expect = "value"
            elif c == ",":
                if self._expect != "comma":
                    self.failed = True
                self._expect = "key"
            return
        if self._expect != "value":
            self.failed = True
        elif self._value_start is None:
            self._value_start = i

    def _value_end(self, end: int) -> None:
        assert self._value_start is not None
        text = self.raw[self._value_start : end]
        if self._key == "name":
            try:
                name = json.loads(text)
            except ValueError:
                name = None
            if isinstance(name, str) and name and self.name is None:
                self.name = name
            else:
                self.failed = True
        elif self._key in self._keys and self._arguments is None:
            if text.startswith('"'):  # arguments written as a JSON string: its text
                with contextlib.suppress(ValueError):
                    text = json.loads(text)
            self._arguments = text
        self._arguments_start = self._value_start = None
        self._expect = "comma"

    def arguments_delta(self) -> str:
        """The arguments' text written since the last call (a streaming object or array: as it
        grows; anything else: whole, once complete)."""
        if self._arguments is not None:
            delta = self._arguments[self._sent :]
        elif self._arguments_start is not None:  # one character per item: O(new) to join
            delta = "".join(self._raw[self._arguments_start + self._sent :])
        else:
            return ""
        self._sent += len(delta)
        return delta

    def missing_arguments(self) -> str:
        """A finished call that had no arguments: OpenAI's "{}" for them."""
        return "{}" if self._arguments is None and self._sent == 0 else ""
