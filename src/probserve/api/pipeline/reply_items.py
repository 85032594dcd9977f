"""A reply as items as it grows: a thinking model's reasoning, the assistant message's text and
the tool calls the reply makes, each with its tokens' logprob entries, and the steps (`Said`)
each feed took. The Responses API (output items) and the Messages API (content blocks) render
the same items."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from probserve.api.answers.text_stream import Piece
from probserve.api.pipeline.run import Run
from probserve.api.protocol import ChatLogprobEntry
from probserve.api.tools.reply import ReplyDelta, ReplyParser, cut_short


class CallItem:
    """A function_call output item as it grows."""

    def __init__(self, call_id: str, name: str) -> None:
        self.id = f"fc_{uuid.uuid4().hex}"
        self.call_id, self.name = call_id, name
        self.arguments = ""
        self.logprobs: list[ChatLogprobEntry] = []
        self.complete = False  # its object closed: its arguments are whole
        self.closed = False  # its closing events were sent (a stream)


class ThoughtItem:
    """A thinking model's reasoning as it grows (before the message and any call)."""

    def __init__(self) -> None:
        self.id = f"rs_{uuid.uuid4().hex}"
        self.text = ""
        self.logprobs: list[ChatLogprobEntry] = []
        self.closed = False  # its closing events were sent (a stream)


# what a reply did in one step, each becoming its Responses events
@dataclass(frozen=True)
class ThoughtSaid:
    """Reasoning the reply adds, with its tokens' logprob entries (`begun`: its first)."""

    text: str
    entries: list[ChatLogprobEntry]
    begun: bool


@dataclass(frozen=True)
class MessageBegun:
    """The assistant message's item begins (the reply has content)."""


@dataclass(frozen=True)
class TextSaid:
    """Content the message adds, with its tokens' logprob entries."""

    text: str
    entries: list[ChatLogprobEntry]


@dataclass(frozen=True)
class CallBegun:
    """Call `index` begins (its name is known)."""

    index: int


@dataclass(frozen=True)
class ArgumentsSaid:
    """Arguments call `index` adds."""

    index: int
    text: str


@dataclass(frozen=True)
class CallDone:
    """Call `index`'s arguments are whole: its closing events."""

    index: int


Said = ThoughtSaid | MessageBegun | TextSaid | CallBegun | ArgumentsSaid | CallDone


class ReplyItems:
    """The reply as it grows: its text (the assistant message) and, a request with tools, the
    calls it makes, in the order of the output. Without tools the message is there from the
    start; with tools each item appears when its text does. Each piece's logprob entries go
    with the item its text went into."""

    def __init__(self, run: Run, k: int | None, token_id_names: bool = False) -> None:
        self.run, self.k = run, k
        self.token_id_names = token_id_names  # return_tokens_as_token_ids
        self.id = run.id
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.text = ""
        self.logprobs: list[ChatLogprobEntry] = []
        self.finish: str | None = None
        tools = run.plan.tools
        self.parser = ReplyParser.of(tools) if tools is not None else None
        self.calls: list[CallItem] = []
        # a thinking model's reply: the message begins with its first text (after the thinking)
        self.thinks = run.plan.thinking is not None
        self.thought: ThoughtItem | None = None  # the reasoning, once the reply thinks
        self.order: list[int | None] = [] if tools is not None or self.thinks else [None]
        self._pending: list[Piece] = []  # pieces whose text the parser still holds
        self._owner: int | None = None  # where the last piece went (None: the message)

    def think(self, pieces: list[Piece]) -> list[Said]:
        """The reasoning's pieces (a thinking model's): its text and their logprob entries."""
        if not pieces:
            return []
        begun = self.thought is None
        if self.thought is None:
            self.thought = ThoughtItem()
        text = "".join(p.text for p in pieces)
        entries = self._entries(pieces)
        self.thought.text += text
        self.thought.logprobs += entries
        return [ThoughtSaid(text, entries, begun)]

    def message_begins(self) -> bool:
        """The message's item begins now (a thinking model's, without tools: at its first
        answer piece, or at the end); False where it has already."""
        if None in self.order:
            return False
        self.order.append(None)
        return True

    def add(self, pieces: list[Piece]) -> tuple[str, list[ChatLogprobEntry]]:
        text = "".join(p.text for p in pieces)
        entries = self._entries(pieces)
        self.text += text
        self.logprobs += entries
        return text, entries

    def _entries(self, pieces: list[Piece]) -> list[ChatLogprobEntry]:
        if self.k is None or not pieces:
            return []
        return self.run.state.formatter(self.token_id_names).chat(pieces, self.k)

    def add_with_tools(self, pieces: list[Piece], ended: str | None) -> list[Said]:
        """Feed each piece to the reply's parser; each piece's logprobs go with the item its
        text went into (a piece held back: with the next one's; at the end: the last item's).
        `ended`: the reply's finish reason, once these pieces end it (None: more to come)."""
        assert self.parser is not None
        said: list[Said] = []
        for p in pieces:
            self._pending.append(p)
            said += self._parsed(self.parser.feed(p.text))
        if ended is not None:
            said += self._parsed(self.parser.close(cut_short(ended)), final=True)
        return said

    def _parsed(self, delta: ReplyDelta, final: bool = False) -> list[Said]:
        said: list[Said] = []
        if delta.content:
            self._begin(None, said)
        for c in delta.calls:
            if c.id is not None and c.name is not None:
                self._close_done(said)  # a call before this one: closed before it begins
                self.calls.append(CallItem(c.id, c.name))
                self._begin(len(self.calls) - 1, said)
            if c.arguments:
                self.calls[c.index].arguments += c.arguments
                said.append(ArgumentsSaid(c.index, c.arguments))
            if c.done:
                self.calls[c.index].complete = True
        if delta or final:
            owner = self._owner
            if delta.calls:
                owner = delta.calls[-1].index
            elif delta.content:
                owner = None
            # tokens that showed nothing (an empty reply, a call cut before its name): the
            # message carries their logprobs, as the Messages API's empty text block does
            if owner is None and None not in self.order and self._pending and self.k is not None:
                self._begin(None, said)
            entries = self._entries(self._pending)
            self._pending = []
            self._owner = owner
            if owner is None:
                self.text += delta.content
                self.logprobs += entries
                if delta.content or entries:
                    said.append(TextSaid(delta.content, entries))
            else:
                self.calls[owner].logprobs += entries
                if delta.content:  # content and a call in one piece: the text is the message's
                    self.text += delta.content
                    said.append(TextSaid(delta.content, []))
        self._close_done(said, None if final else self._owner)
        return said

    def _close_done(self, said: list[Said], keep: int | None = None) -> None:
        """Close the whole calls (but `keep`, whose last tokens' logprobs may be to come): a
        call is closed once its arguments are whole, before a later call begins."""
        for i, call in enumerate(self.calls):
            if call.complete and not call.closed and i != keep:
                call.closed = True
                said.append(CallDone(i))

    def _begin(self, item: int | None, said: list[Said]) -> None:
        if item not in self.order:
            self.order.append(item)
            said.append(CallBegun(item) if item is not None else MessageBegun())

    def output_index(self, item: int | None) -> int:
        """Item `item`'s place in the output (the reasoning, where there is one, is first)."""
        return self.order.index(item) + (self.thought is not None)
