"""Engine logprobs (ids and float32 arrays) -> OpenAI's completions and chat logprobs shapes.

JSON floats are finite: -inf (a token masked in processed mode) is written -9999.0, OpenAI's
marker. float32 values become Python floats exactly, so they round-trip. Token texts come from
the TokenTable's precomputed lists, and the response models are built without re-validation
(`model_construct`): this runs for every token of every logprobs request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from probserve.api.protocol import ChatLogprobEntry, CompletionLogprobs, TopLogprob
from probserve.api.text_stream import Piece
from probserve.api.tokens import TokenTable
from probserve.engine import TokenLogprobs

NEG_INF_MARKER = -9999.0


def finite(x: float) -> float:
    """-inf -> -9999.0; NaN (never expected) is reported the same way rather than as NaN."""
    x = float(x)
    if math.isfinite(x):
        return x
    return -NEG_INF_MARKER if x > 0 else NEG_INF_MARKER


class LogprobsFormatter:
    def __init__(self, table: TokenTable) -> None:
        self.table = table

    # ---- /v1/completions ------------------------------------------------------------------
    def completion(self, pieces: Iterable[Piece], k: int) -> CompletionLogprobs:
        texts = self.table.legacy_texts
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for p in pieces:
            text = texts[p.token_id]
            tokens.append(text)
            offsets.append(p.offset)
            if p.logprobs is None:  # the first prompt token: no context
                values.append(None)
                tops.append(None)
                continue
            lp, j = p.logprobs, p.row
            value = finite(lp.logprobs[j])
            values.append(value)
            top: dict[str, float] = {}
            for tid, v in zip(
                lp.top_ids[j, :k].tolist(), lp.top_logprobs[j, :k].tolist(), strict=True
            ):
                top.setdefault(texts[tid], v if math.isfinite(v) else finite(v))
            top.setdefault(text, value)
            tops.append(top)
        return CompletionLogprobs.model_construct(
            tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets
        )

    # ---- /v1/chat/completions -------------------------------------------------------------
    def _top(self, token_id: int, value: float) -> TopLogprob:
        return TopLogprob.model_construct(
            token=self.table.chat_texts[token_id],
            logprob=value if math.isfinite(value) else finite(value),
            bytes=self.table.byte_lists[token_id],
        )

    def chat(self, pieces: Iterable[Piece], k: int) -> list[ChatLogprobEntry]:
        entries: list[ChatLogprobEntry] = []
        for p in pieces:
            if p.hidden or p.logprobs is None:
                continue
            lp, j = p.logprobs, p.row
            alts = [
                self._top(tid, v)
                for tid, v in zip(
                    lp.top_ids[j, :k].tolist(), lp.top_logprobs[j, :k].tolist(), strict=True
                )
            ]
            entries.append(
                ChatLogprobEntry.model_construct(
                    token=self.table.chat_texts[p.token_id],
                    logprob=finite(lp.logprobs[j]),
                    bytes=self.table.byte_lists[p.token_id],
                    top_logprobs=alts,
                )
            )
        return entries

    def prompt_logprobs(
        self, scores: TokenLogprobs, k: int
    ) -> list[dict[str, dict[str, object]] | None]:
        """vLLM-style prompt logprobs: None for the first token, then for each position a dict
        token_id -> {logprob, rank, decoded_token} holding the prompt token and the top k."""
        out: list[dict[str, dict[str, object]] | None] = [None]
        for j in range(len(scores)):
            entry: dict[str, dict[str, object]] = {}
            tid = int(scores.token_ids[j])
            entry[str(tid)] = self._vllm_entry(tid, scores.logprobs[j], scores.ranks[j])
            alts = zip(
                scores.top_ids[j, :k].tolist(), scores.top_logprobs[j, :k].tolist(), strict=True
            )
            for r, (aid, v) in enumerate(alts, start=1):
                entry.setdefault(str(aid), self._vllm_entry(aid, v, r))
            out.append(entry)
        return out

    def _vllm_entry(self, tid: int, value: float, rank: int) -> dict[str, object]:
        return {
            "logprob": finite(value),
            "rank": int(rank),
            "decoded_token": self.table.chat_texts[int(tid)],
        }
