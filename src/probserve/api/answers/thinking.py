"""A thinking model's reply split into its reasoning and its answer, on token ids.

Qwen3 / Qwen3.5, DeepSeek-R1 and its distills, QwQ write their thinking between `<think>` and
`</think>`, each one token of the tokenizer's. The split is detected once per model from its
chat template (it mentions `</think>`) and its tokenizer (both markers are single added tokens),
or set by `--reasoning-parser`. A template that prefills `<think>` in the generation prompt
(Qwen3.5, the newer R1 templates) starts the reply inside the thinking (`ThinkMarkers.opened`,
read from the prompt's ids); otherwise a reply that begins with `<think>` thinks until
`</think>`. The markers' pieces keep their logprobs (in the reasoning channel) and show no text;
each channel's leading whitespace (the template's newlines after a marker) is dropped."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from probserve.api.answers.text_stream import Piece
from probserve.api.answers.tokens import TokenTable

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser(enum.StrEnum):
    """`--reasoning-parser`'s choices: auto (the template and tokenizer say), none (no split:
    the reply as written), think (`<think>...</think>` wherever the tokenizer has both),
    harmony (gpt-oss's channels, answers/harmony.py, wherever the tokenizer has them)."""

    AUTO = "auto"
    NONE = "none"
    THINK = "think"
    HARMONY = "harmony"


@dataclass(frozen=True)
class ThinkMarkers:
    """The markers' token ids; `opened`: the prompt ends inside the thinking (its last token
    but whitespace is `start`), so the reply is reasoning until `end`; `closed`: the prompt
    ends after an `end` (the template closed the thinking: thinking off), so the reply is all
    answer."""

    start: int
    end: int
    opened: bool = False
    closed: bool = False


def think_markers(
    template: str | None, added: Mapping[str, int], asked: ReasoningParser = ReasoningParser.AUTO
) -> ThinkMarkers | None:
    """The markers of a model whose tokenizer's added tokens are `added` and whose chat
    template is `template`, as `asked` (None: no split)."""
    if asked in (ReasoningParser.NONE, ReasoningParser.HARMONY):
        return None
    start, end = added.get(THINK_START), added.get(THINK_END)
    if start is None or end is None:
        return None
    if asked is ReasoningParser.AUTO and THINK_END not in (template or ""):
        return None
    return ThinkMarkers(int(start), int(end))


def opened(markers: ThinkMarkers, ids: Sequence[int], table: TokenTable) -> ThinkMarkers:
    """`markers` for a prompt of `ids`: opened where its last token but whitespace is the start
    marker (the template's prefilled `<think>`), closed where it is the end marker (the
    template's empty think block); a marker a user typed is followed by the template's own
    tokens, so it never counts."""
    for tid in reversed(ids):
        if tid in (markers.start, markers.end):
            started = tid == markers.start
            return dataclasses.replace(markers, opened=started, closed=not started)
        if table.token_bytes(tid).strip():
            break
    return dataclasses.replace(markers, opened=False, closed=False)


def reasoning_positions(
    markers: ThinkMarkers, ids: Sequence[int], roles: Sequence[str]
) -> list[bool]:
    """Per prompt token, whether it lies inside a thinking span: from a start marker to its end
    marker, both included (as a reply's markers are in its reasoning channel), or to the
    prompt's end (the template's prefilled `<think>`). Only the template's markers and an
    assistant's count (`roles`: each token's source role, "template" for the template's own):
    a marker typed in a user's (or system's, or tool's) text opens and closes nothing."""
    out: list[bool] = []
    inside = False
    for tid, role in zip(ids, roles, strict=True):
        ours = role in ("template", "assistant")
        if ours and tid == markers.start:
            inside = True
        out.append(inside)
        if ours and tid == markers.end:
            inside = False
    return out


class ThinkSplit:
    """One reply's pieces, as they come, into (reasoning, answer). States: "start" (nothing
    seen: a start marker opens the thinking, anything else is the answer), "thinking" (until
    the end marker), "answer" (the rest: a marker there shows no text either)."""

    def __init__(self, markers: ThinkMarkers) -> None:
        self.markers = markers
        self.state = "thinking" if markers.opened else "answer" if markers.closed else "start"
        self._said = {"thinking": False, "answer": False}  # a channel's text has begun

    def split(self, pieces: list[Piece], final: bool = False) -> tuple[list[Piece], list[Piece]]:
        reasoning: list[Piece] = []
        answer: list[Piece] = []
        m = self.markers
        for p in pieces:
            marker = p.token_id in (m.start, m.end)
            if self.state == "start":
                self.state = "thinking" if p.token_id == m.start else "answer"
                if marker:
                    reasoning.append(_silent(p))
                    continue
            if self.state == "thinking":
                if p.token_id == m.end:
                    self.state = "answer"
                reasoning.append(_silent(p) if marker else self._shown(p, "thinking"))
            else:
                answer.append(_silent(p) if marker else self._shown(p, "answer"))
        return reasoning, answer

    def _shown(self, p: Piece, channel: str) -> Piece:
        """`p`, its leading whitespace dropped while its channel's text has not begun."""
        if self._said[channel] or p.hidden:
            return p
        text = p.text.lstrip()
        if text:
            self._said[channel] = True
        return p if text == p.text else dataclasses.replace(p, text=text)


def _silent(p: Piece) -> Piece:
    """A marker's piece: its logprobs kept, its text none."""
    return p if not p.text else dataclasses.replace(p, text="")
