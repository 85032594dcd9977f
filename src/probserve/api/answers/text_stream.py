"""From token ids to text, one token at a time: UTF-8 assembly, offsets and stop strings.

Each token becomes a `Piece`: the characters it contributes to the returned text and its offset.
A token that completes a multi-byte character carries that character; the partial pieces before
it are zero-width. Tokens whose text is not returned (the stop token that ends generation, and
special tokens when skipped) are `hidden`: zero-width, kept for the completions arrays.

`release()` hands out the pieces that are safe to emit: never a broken character, never text
that could still turn out to begin a stop string. When a stop string appears, the text is cut
before it and the pieces after the cut are dropped, so the pieces never describe text that is not
returned.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

from probserve.api.answers.tokens import TokenTable
from probserve.engine import RoutedExperts, TokenLogprobs


@dataclass
class Piece:
    token_id: int
    text: str  # characters this token contributes to the returned text
    offset: int  # character offset of `text`, counted from the start of the prompt
    hidden: bool = False  # its text is not part of the returned text
    logprobs: TokenLogprobs | None = None  # the row holding this token's logprobs
    row: int = 0
    incomplete: bool = False  # bytes of a character still missing after this token
    routed: RoutedExperts | None = None  # return_routed_experts: the rows holding its routing


class TextStream:
    def __init__(
        self,
        table: TokenTable,
        base_offset: int = 0,
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = False,
    ) -> None:
        self.table = table
        self.base = base_offset
        self.stop = tuple(s for s in stop if s)
        self.skip_special = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # the returned text so far (complete characters), as parts joined on demand: appending
        # one token's characters stays O(1), so a 100k-token prompt costs linear time
        self._parts: list[str] = []
        self._len = 0
        self._pending: list[Piece] = []
        self._open = 0  # index in _pending of the first piece of a character still incomplete
        self.stopped = False  # a stop string was found
        self.matched: str | None = None  # which (the earliest in the text; the first listed)

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _tail(self, n: int) -> str:
        """The last `n` characters of the text (fewer if the text is shorter)."""
        out: list[str] = []
        got = 0
        for part in reversed(self._parts):
            if got >= n:
                break
            out.append(part)
            got += len(part)
        return "".join(reversed(out))[-n:] if n > 0 else ""

    def _append(self, chars: str) -> None:
        if chars:
            self._parts.append(chars)
            self._len += len(chars)

    # ---- feeding --------------------------------------------------------------------------
    def add(
        self,
        token_id: int,
        logprobs: TokenLogprobs | None = None,
        row: int = 0,
        hidden: bool = False,
        routed: RoutedExperts | None = None,
    ) -> None:
        """Token `token_id`, its logprobs and routing (if any) at `row` of theirs."""
        if self.stopped:
            return
        hidden = hidden or (self.skip_special and token_id in self.table.special_ids)
        offset = self.base + self._len
        if hidden:
            self._pending.append(Piece(token_id, "", offset, True, logprobs, row, routed=routed))
            return
        start = self._len
        chars = self._decoder.decode(self.table.token_bytes(token_id), final=False)
        incomplete = bool(self._decoder.getstate()[0])
        self._append(chars)
        self._pending.append(
            Piece(token_id, chars, offset, False, logprobs, row, incomplete, routed)
        )
        if not incomplete:  # a character completed: the pieces that held its bytes are complete
            for p in self._pending[self._open :]:
                p.incomplete = False
            self._open = len(self._pending)
        if self.stop and chars:
            self._check_stop(start)

    def add_all(self, token_ids: list[int] | tuple[int, ...]) -> None:
        for t in token_ids:
            self.add(t)

    def _check_stop(self, new_start: int) -> None:
        longest = max(len(s) for s in self.stop)
        search_from = max(0, new_start - longest + 1)
        window = self._tail(self._len - search_from)
        hits = [(search_from + i, s) for s in self.stop if (i := window.find(s)) >= 0]
        if not hits:
            return
        cut, self.matched = min(hits, key=lambda hit: hit[0])
        self.stopped = True
        self._parts = [self.text[:cut]]
        self._len = cut
        kept: list[Piece] = []
        for p in self._pending:
            start = p.offset - self.base
            if start >= cut:
                break
            if start + len(p.text) > cut:
                p.text = p.text[: cut - start]
            kept.append(p)
        # the arrays end with the last token that contributes a character
        while kept and not kept[-1].text:
            kept.pop()
        self._pending = kept

    # ---- releasing ------------------------------------------------------------------------
    def _holdback(self) -> int:
        """How many trailing characters could still begin a stop string."""
        best = 0
        tail = self._tail(max((len(s) for s in self.stop), default=0))
        for s in self.stop:
            for k in range(min(len(s) - 1, len(tail)), best, -1):
                if tail.endswith(s[:k]):
                    best = k
                    break
        return best

    def release(self, final: bool = False) -> list[Piece]:
        """The pieces that may be emitted now; with `final`, all that remain (flushing any
        incomplete character as U+FFFD)."""
        if final or self.stopped:
            if not self.stopped:
                tail = self._decoder.decode(b"", final=True)
                if tail:
                    target = next((p for p in reversed(self._pending) if not p.hidden), None)
                    if target is not None:
                        target.text += tail
                    self._append(tail)
            out, self._pending, self._open = self._pending, [], 0
            return out
        safe = self.base + self._len - self._holdback()
        n = 0
        for p in self._pending:
            if p.incomplete or p.offset + len(p.text) > safe:
                break
            n += 1
        out, self._pending = self._pending[:n], self._pending[n:]
        self._open = max(0, self._open - n)
        return out
