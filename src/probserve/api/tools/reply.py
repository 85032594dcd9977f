"""A reply's text split into content and tool calls, as it streams: `feed` takes the text each
step adds and says what can be sent now; `close` sends the rest. A whole (non-streamed) reply
goes through the same two calls, so both give the same content and calls.

Text that may still become a call (an opener not yet complete, a call object whose name is not
yet known) is held back; once a call's name is known it is a call, and its arguments stream
as written. Text that turns out not to be a call is content, as written; in a reply cut short
(max_tokens), text that might still have become a call is no content: the tail of a call is
never text. Whitespace between content and calls is dropped."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from probserve.api.tools.ask import ToolAsk
from probserve.api.tools.call_object import CallObject
from probserve.api.tools.formats import ToolFormat, ToolParser

_WHITESPACE = " \t\n\r"
_GENERIC_CALLS = '{"tool_calls": ['
_GENERIC_CONTENT = '{"content": "'
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class CallDelta:
    """Part of call `index`: the first has its id and name, any may add arguments; `done`: the
    call's object closed in this delta (its arguments are whole)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
    done: bool = False


@dataclass
class ReplyDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


class _Text:
    """Text built in pieces (a long reply is fed one character at a time: joined once)."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def add(self, text: str) -> None:
        self.parts.append(text)

    def take(self) -> str:
        text = "".join(self.parts)
        self.parts = [text] if text else []
        return text


@dataclass
class Call:
    id: str
    name: str
    arguments: str
    complete: bool = False  # its object closed (not cut short by a length limit)


class ReplyParser:
    """One candidate's reply in `fmt`. States: "content", "opened" (after an opener, before
    an object), "object" (in a call object), "between" (after an object: a separator, a
    closer, or the end of the calls), "string" (generic: the content string). `forced`: a
    grammar makes the reply calls only (tool_choice "required" or a named function), so text
    cut short before a call's name is known is no content: it is dropped."""

    def __init__(self, fmt: ToolFormat, forced: bool = False, primer: str = "") -> None:
        self.fmt = fmt
        self.forced = forced
        self.calls: list[Call] = []
        self._state = "start"
        self._held = ""  # text that may still be a call, or whitespace before one
        self._object: CallObject | None = None
        self._escape = ""  # generic content: an escape not yet whole
        self._out = ReplyDelta()
        self._sent = _Text()  # content in the delta being built
        self._all = _Text()  # all content sent
        self.content_sent = False
        self._listed = False
        for c in primer:  # the reply's start, in the prompt: what it says goes out with `feed`
            self._char(c)

    @classmethod
    def of(cls, ask: ToolAsk) -> ReplyParser:
        """The parser of a reply to `ask` (its format, forced or not, its primer)."""
        return cls(ask.fmt, ask.forced, ask.primer)

    # ---- the two entry points ----------------------------------------------------------------

    def feed(self, text: str) -> ReplyDelta:
        for c in text:
            self._char(c)
        if self._state == "content":
            self._flush_content(final=False)
        return self._take()

    def close(self, cut: bool = False) -> ReplyDelta:
        """The rest. `cut`: the reply was cut short (CUT_SHORT), so what may still have become
        a call (an opener, a call object whose name is not yet known, a part of an opener)
        is the start of a call that never came: never content. A call whose name is known
        is a call, with the arguments it wrote."""
        if cut and self._state == "content":
            keep = _opener_prefix(self._held, self.fmt.opener)
            if keep:
                self._held = self._held[:-keep].rstrip(_WHITESPACE)
        # calls only (forced), or cut short: a cut call's start is none
        if (self.forced or cut) and self._state != "content":
            if self._object is not None and self._object.name is not None:
                self._finish_object()
            self._held = ""
            self._flush_content(final=True)
            return self._take()
        if self._state == "object" and self._object is not None:
            if self._object.name is None:  # never became a call: it was content
                self._content(self._held + self._object.raw)
                self._held = ""
            else:
                self._finish_object()
        elif self._state in ("start", "opened", "content") or (
            self._state == "between" and not self.calls
        ):
            self._content(self._held)
        self._held = ""
        self._flush_content(final=True)
        return self._take()

    @property
    def content(self) -> str | None:
        """Everything sent as content (None: none, the reply was calls only)."""
        return self._all.take() if self.content_sent else None

    # ---- states --------------------------------------------------------------------------------

    def _char(self, c: str) -> None:
        state = self._state
        if state == "start":
            self._start(c)
        elif state == "content":
            self._held += c
            if self.fmt.opener and self._held.endswith(self.fmt.opener):
                self._match_opener()
        elif state == "opened":
            self._held += c
            if c in _WHITESPACE:
                return
            if c == "[" and self.fmt.parser is ToolParser.MISTRAL and not self._listed:
                self._listed = True  # Mistral's calls are a JSON list
                return
            if c == "{":
                self._begin_object(c)
            else:
                self._to_content()
        elif state == "object":
            self._object_char(c)
        elif state == "between":
            self._between(c)
        elif state == "string":
            self._string_char(c)

    def _start(self, c: str) -> None:
        parser = self.fmt.parser
        self._held += c
        if parser is ToolParser.GENERIC:
            for prefix, state in ((_GENERIC_CALLS, "opened"), (_GENERIC_CONTENT, "string")):
                if self._held == prefix:
                    self._held = "" if state == "string" else self._held
                    self._state = state
                    return
                if prefix.startswith(self._held):
                    return
            self._to_content()
        elif parser is ToolParser.LLAMA3_JSON:
            stripped = self._held.lstrip(_WHITESPACE)
            if stripped.startswith(_PYTHON_TAG):
                stripped = stripped[len(_PYTHON_TAG) :].lstrip(_WHITESPACE)
            elif _PYTHON_TAG.startswith(stripped) and stripped:
                return
            if not stripped:
                return
            if stripped == "{":
                self._begin_object("{")
            else:
                self._to_content()
        else:
            self._state = "content"
            self._match_opener()

    def _match_opener(self) -> None:
        opener = self.fmt.opener
        if not opener:
            return
        at = self._held.find(opener)
        if at < 0:
            return
        before, after = self._held[:at], self._held[at + len(opener) :]
        self._content(before.rstrip(_WHITESPACE))
        self._held = opener
        self._state = "opened"
        for c in after:
            self._char(c)

    def _begin_object(self, c: str) -> None:
        keys = (self.fmt.arguments, "arguments", "parameters")
        self._object = CallObject(keys)
        self._held = self._held[: -len(c)]  # the object keeps its own text
        self._state = "object"
        self._object_char(c)

    def _object_char(self, c: str) -> None:
        obj = self._object
        assert obj is not None
        obj.feed(c)
        if obj.failed and obj.name is None:  # not a call after all: what was held is content
            self._content(self._held + obj.raw)
            self._held, self._object = "", None
            self._state = "content"
            return
        if obj.name is not None and not obj.committed:
            self._commit(obj)
        if obj.name is not None:
            self._arguments(obj)
        if obj.done or obj.failed:
            self._finish_object()

    def _commit(self, obj: CallObject) -> None:
        assert obj.name is not None
        call = Call(f"call_{uuid.uuid4().hex[:24]}", obj.name, "")
        obj.committed = True
        self.calls.append(call)
        self._held = ""
        self._out.calls.append(CallDelta(len(self.calls) - 1, call.id, call.name))

    def _arguments(self, obj: CallObject) -> None:
        delta = obj.arguments_delta()
        if obj.done:
            delta += obj.missing_arguments()
        if not delta:
            return
        index = len(self.calls) - 1
        self.calls[index].arguments += delta
        last = self._out.calls[-1] if self._out.calls else None
        if last is not None and last.index == index:
            last.arguments += delta
        else:
            self._out.calls.append(CallDelta(index, arguments=delta))

    def _finish_object(self) -> None:
        obj = self._object
        if obj is not None and obj.name is not None and not obj.done:
            self._arguments(obj)  # cut short (a length limit): what it wrote, and no more
        if obj is not None and obj.name is not None and obj.done:
            index = len(self.calls) - 1
            self.calls[index].complete = True
            last = self._out.calls[-1] if self._out.calls else None
            if last is not None and last.index == index:
                last.done = True
            else:
                self._out.calls.append(CallDelta(index, done=True))
        self._object = None
        self._state = "between"
        self._held = ""

    def _between(self, c: str) -> None:
        """After a call: a Hermes call ends at its closer (text before it is dropped), then
        content or the next call; a Mistral or generic list goes on at "," and ends at "]";
        Llama 3 calls are separated by ";"."""
        parser = self.fmt.parser
        if parser in (ToolParser.HERMES, ToolParser.HARMONY):
            closer = self.fmt.closer
            self._held = (self._held + c)[-len(closer) :]  # what is dropped need not be kept
            if self._held == closer:
                self._held = ""
                self._state = "content"
            return
        if c in _WHITESPACE:
            return
        if (parser is ToolParser.LLAMA3_JSON and c == ";") or (
            parser in (ToolParser.MISTRAL, ToolParser.GENERIC) and c == ","
        ):
            self._state = "opened"
            self._held = ""
        elif parser in (ToolParser.MISTRAL, ToolParser.GENERIC) and c in "]}":
            return  # the list's end, and generic's object's
        else:
            self._state = "content"
            self._held = c

    def _to_content(self) -> None:
        """What was held was not a call: it is content, as written."""
        self._content(self._held)
        self._held = ""
        self._state = "content"

    def _string_char(self, c: str) -> None:
        """Generic content: the JSON string after `{"content": "`, decoded as it streams."""
        if self._escape or c == "\\":
            self._escape += c
            if _escape_whole(self._escape):
                try:
                    self._content(json.loads(f'"{self._escape}"'))
                except ValueError:  # not JSON's: as written
                    self._content(self._escape)
                self._escape = ""
        elif c == '"':
            self._state = "end"  # the rest is the object's close
        else:
            self._content(c)

    # ---- output --------------------------------------------------------------------------------

    def _content(self, text: str) -> None:
        if not text:
            return
        self._sent.add(text)
        self._all.add(text)
        self.content_sent = True

    def _flush_content(self, final: bool) -> None:
        """Send held content except what may still open a call, and trailing whitespace
        (which is dropped if a call follows)."""
        if self._state != "content" or not self._held:
            return
        if final:
            text = self._held
            if self.calls and not text.strip():
                text = ""
            self._content(text)
            self._held = ""
            return
        keep = _opener_prefix(self._held, self.fmt.opener)
        text = self._held[: len(self._held) - keep]
        stripped = text.rstrip(_WHITESPACE)
        self._content(stripped)
        self._held = text[len(stripped) :] + self._held[len(text) :]

    def _take(self) -> ReplyDelta:
        out, self._out = self._out, ReplyDelta()
        out.content = self._sent.take()
        self._sent = _Text()
        return out


def _opener_prefix(text: str, opener: str) -> int:
    """The length of the longest end of `text` that begins `opener`."""
    for n in range(min(len(opener) - 1, len(text)), 0, -1):
        if opener.startswith(text[-n:]):
            return n
    return 0


def _high_surrogate(escape: str) -> bool:
    return escape.startswith("\\u") and 0xD800 <= int(escape[2:6], 16) <= 0xDBFF


def _escape_whole(escape: str) -> bool:
    """A JSON escape that decodes alone (a high surrogate waits for its low one)."""
    if len(escape) < 2:
        return False
    if escape[1] != "u":
        return True
    if len(escape) < 6:
        return False
    if not _high_surrogate(escape):
        return True
    return len(escape) == 12


def whole_reply(
    fmt: ToolFormat, text: str, forced: bool = False, primer: str = "", cut: bool = False
) -> ReplyParser:
    """A whole reply, parsed as its stream would be (`cut`: it was cut short)."""
    parser = ReplyParser(fmt, forced, primer)
    for at in range(0, len(text), 64):  # in pieces, as a stream: what is held stays short
        parser.feed(text[at : at + 64])
    parser.close(cut)
    return parser


def cut_short(finish: str | None) -> bool:
    """Whether a reply that finished so was cut short: by its length limit (max_tokens, the
    context) or a grammar's bound partway, not ended by the model (or a stop string)."""
    return finish in ("length", "grammar_limit")


def finish_reason(parser: ReplyParser | None, finish: str | None) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended (not cut short) with calls."""
    if parser is not None and parser.calls and finish == "stop":
        return "tool_calls"
    return finish
