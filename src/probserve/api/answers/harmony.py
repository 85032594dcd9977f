"""gpt-oss's harmony replies split into reasoning, answer and tool calls, on token ids.

A harmony reply is a run of messages, each `<|start|>` header `<|message|>` body, ended by
`<|end|>` (more follows), `<|return|>` (the answer is done) or `<|call|>` (a tool call is
done). The prompt ends with `<|start|>assistant`, so the reply begins inside the first header.
A header names the message's channel (`<|channel|>analysis|commentary|final`) and maybe its
recipient (`to=functions.NAME`, before or after the channel) and content type
(`<|constrain|>json`). The analysis channel is the reasoning; the final channel, and commentary
with no recipient (a preamble the user sees), the answer; a commentary message to
`functions.NAME` a tool call: with tools asked for, its pieces read as a Hermes call
(`<tool_call>{"name": NAME, "arguments": ` ... `}</tool_call>`) to the reply's tool parser,
which makes it a call like any other (`formats.ToolParser.HARMONY`). Channels are read from the
tokens' ids, never from the text, so harmony markup in a message's text is only text. Every
marker's piece keeps its logprobs in its message's channel and shows no text (the stop token
that ends the reply is hidden, as any reply's is)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from probserve.api.answers.text_stream import Piece
from probserve.api.answers.thinking import ReasoningParser, ThinkMarkers, ThinkSplit, think_markers
from probserve.api.answers.tokens import TokenTable

NAMES = {
    "start": "<|start|>", "end": "<|end|>", "message": "<|message|>", "channel": "<|channel|>",
    "constrain": "<|constrain|>", "ret": "<|return|>", "call": "<|call|>",
}  # fmt: skip
CALL_OPENER = "<tool_call>"
CALL_CLOSER = "</tool_call>"
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


@dataclass(frozen=True)
class HarmonyMarkers:
    """Harmony's control tokens' ids (o200k_harmony's: 200006, 200007, 200008, 200005,
    200003, 200002, 200012)."""

    start: int
    end: int
    message: int
    channel: int
    constrain: int
    ret: int
    call: int

    @property
    def stops(self) -> tuple[int, int]:
        """The ids that end a reply: `<|return|>` and `<|call|>`."""
        return (self.ret, self.call)

    @property
    def ids(self) -> frozenset[int]:
        return frozenset(dataclasses.astuple(self))


def harmony_markers(
    template: str | None, added: Mapping[str, int], auto: bool
) -> HarmonyMarkers | None:
    """The markers of a model whose tokenizer's added tokens are `added`: None unless it has
    them all and (`auto`) its chat template writes `<|channel|>` (gpt-oss's)."""
    ids = {k: added.get(name) for k, name in NAMES.items()}
    if any(v is None for v in ids.values()):
        return None
    if auto and NAMES["channel"] not in (template or ""):
        return None
    return HarmonyMarkers(**{k: int(v) for k, v in ids.items() if v is not None})


class HarmonySplit:
    """One reply's pieces, as they come, into (reasoning, answer). A header's pieces are held
    until its `<|message|>` says where the message goes; `calls`: the request has tools (a
    call's pieces then read as a Hermes call; without tools its arguments are answer text)."""

    def __init__(self, markers: HarmonyMarkers, table: TokenTable, calls: bool) -> None:
        self.m, self.table, self.calls = markers, table, calls
        self.header: list[Piece] = []
        self.header_text = ""
        self.where = "header"  # or "reasoning", "answer", "call", "done"
        self.last = "start"  # the side the last message went to ("start": none yet)

    @property
    def state(self) -> str:
        """As `ThinkSplit.state`: "answer" once a message after the reasoning began."""
        return "answer" if self.last == "answer" else "thinking"

    def split(self, pieces: list[Piece], final: bool = False) -> tuple[list[Piece], list[Piece]]:
        out: dict[str, list[Piece]] = {"reasoning": [], "answer": []}
        m = self.m
        for p in pieces:
            tid = p.token_id
            if self.where == "header":
                self.header.append(p)
                self.header_text += self.table.token_bytes(tid).decode("utf-8", "replace")
                if tid == m.message:
                    self._open(out)
                elif tid in m.stops:  # a reply that stops inside a header
                    self._flush(out, "reasoning" if self.last == "reasoning" else "answer")
                    self.where = "done"
                continue
            side = "answer" if self.where in ("call", "done", "between") else self.where
            if tid == m.start:
                self.header, self.header_text = [p], ""
                self.where = "header"
                continue
            if tid == m.end or tid in m.stops:
                if self.where == "call" and self.calls:  # the call's object closed (the stop
                    # token stays hidden, its logprobs unreported as any reply's stop token's)
                    out[side].append(dataclasses.replace(p, text="}" + CALL_CLOSER))
                else:
                    out[side].append(_silent(p))
                self.where = "between" if tid == m.end else "done"
                continue
            if self.where == "between":  # not a harmony reply's order: as answer text
                self.where = "answer"
                side = "answer"
            out[side].append(_silent(p) if tid in m.ids else p)  # a stray marker: no text
        if final:
            self._flush(out, "reasoning" if self.last == "reasoning" else "answer")
        return out["reasoning"], out["answer"]

    def _open(self, out: dict[str, list[Piece]]) -> None:
        """The header is whole: where its message goes, its pieces sent there silent."""
        head = self.header_text
        channel = _CHANNEL.search(head)
        name = channel.group(1) if channel else "final"
        recipient = _RECIPIENT.search(head)
        if name == "analysis" and recipient is None:
            self.where = "reasoning"
        elif recipient is not None:
            self.where = "call"
        else:
            self.where = "answer"
        side = "reasoning" if self.where == "reasoning" else "answer"
        self.last = side
        if self.where == "call" and self.calls and recipient is not None:
            opener = f'{CALL_OPENER}{{"name": {json.dumps(recipient.group(1))}, "arguments": '
            last = dataclasses.replace(self.header[-1], text=opener)
            self.header[-1] = last
            out[side] += [_silent(p) for p in self.header[:-1]] + [last]
        else:
            out[side] += [_silent(p) for p in self.header]
        self.header, self.header_text = [], ""

    def _flush(self, out: dict[str, list[Piece]], side: str) -> None:
        out[side] += [_silent(p) for p in self.header]
        self.header = []


Markers = ThinkMarkers | HarmonyMarkers


def reply_markers(
    template: str | None, added: Mapping[str, int], asked: ReasoningParser
) -> Markers | None:
    """How a model's replies are split, as `asked` (`--reasoning-parser`): auto picks harmony
    for a gpt-oss template and tokenizer, else `<think>` where the template thinks; None: no
    split."""
    if asked in (ReasoningParser.AUTO, ReasoningParser.HARMONY):
        found = harmony_markers(template, added, auto=asked is ReasoningParser.AUTO)
        if found is not None or asked is ReasoningParser.HARMONY:
            return found
    return think_markers(template, added, asked)


def harmony_reasoning_positions(
    m: HarmonyMarkers, ids: Sequence[int], roles: Sequence[str], table: TokenTable
) -> list[bool]:
    """Per prompt token, whether it lies in an analysis message (thinking.reasoning_positions'
    meaning for harmony): from its header's `<|channel|>` to its `<|end|>` (or the prompt's end),
    both included. Only the template's and an assistant's markers count; a header's channel and
    recipient are read from its text as a reply's are (`HarmonySplit`)."""
    out = [False] * len(ids)
    header_from: int | None = None  # where the header began (its `<|channel|>`)
    inside = False
    for i, (tid, role) in enumerate(zip(ids, roles, strict=True)):
        ours = role in ("template", "assistant")
        if not ours:
            if inside:
                out[i] = True
            continue
        if tid == m.start:
            header_from, inside = None, False
        elif tid == m.channel and header_from is None and not inside:
            header_from = i
        elif tid == m.message and header_from is not None:
            head = table.decode(list(ids[header_from:i]))
            channel = _CHANNEL.search(head)
            analysis = channel is not None and channel.group(1) == "analysis"
            if analysis and not _RECIPIENT.search(head):
                inside = True
                out[header_from:i] = [True] * (i - header_from)
            header_from = None
        if inside:
            out[i] = True
            if tid == m.end or tid in m.stops:
                inside = False
    return out


def reply_split(markers: Markers, table: TokenTable, calls: bool) -> ThinkSplit | HarmonySplit:
    """The splitter of one reply (`calls`: the request has tools)."""
    if isinstance(markers, HarmonyMarkers):
        return HarmonySplit(markers, table, calls)
    return ThinkSplit(markers)


def _silent(p: Piece) -> Piece:
    """A marker's (or a header's) piece: its logprobs kept, its text none."""
    return p if not p.text else dataclasses.replace(p, text="")
