"""Engine logprobs (ids and float32 arrays) -> OpenAI's completions and chat logprobs shapes.

JSON floats are finite: -inf (a token masked in processed mode) is written -9999.0, OpenAI's
marker. float32 values become Python floats exactly, so they round-trip. Token texts come from
the TokenTable's precomputed lists, and the response models are built without re-validation
(`model_construct`): this runs for every token of every logprobs request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from probserve.api.answers.text_stream import Piece
from probserve.api.answers.tokens import TokenTable
from probserve.api.protocol import (
    ChatLogprobEntry,
    ChatLogprobs,
    CompletionLogprobs,
    ProcessedLogprobs,
    PromptTokenSource,
    TargetRow,
    TopLogprob,
)
from probserve.engine import TokenLogprobs

NEG_INF_MARKER = -9999.0


def finite(x: float) -> float:
    """-inf -> -9999.0; NaN (never expected) is reported the same way rather than as NaN."""
    x = float(x)
    if math.isfinite(x):
        return x
    return -NEG_INF_MARKER if x > 0 else NEG_INF_MARKER


def finite_row(values: np.ndarray) -> np.ndarray:
    """`finite` over a row at once (float64: each float32 value exactly)."""
    return np.nan_to_num(
        values.astype(np.float64), nan=NEG_INF_MARKER, posinf=-NEG_INF_MARKER, neginf=NEG_INF_MARKER
    )


def alternatives(lp: TokenLogprobs, j: int, k: int) -> list[tuple[int, float]]:
    """Row j's `k` best alternatives as (token id, logprob), best first: the one place an
    answer cuts the rows the engine computed (which may hold more: a prompt's and its
    candidates' asks share one computation, best_of ranks on its own) to what it shows."""
    return list(zip(lp.top_ids[j, :k].tolist(), lp.top_logprobs[j, :k].tolist(), strict=True))


class _IdNames:
    """vLLM's `return_tokens_as_token_ids`: every token named `token_id:N`, which a client maps
    back to the id without the tokenizer. As in vLLM, a chosen token's `bytes` stay its own
    and an alternative's are those of its name."""

    def __init__(self, as_bytes: bool) -> None:
        self.as_bytes = as_bytes

    def __getitem__(self, tid: int) -> str | list[int]:
        name = f"token_id:{tid}"
        return list(name.encode()) if self.as_bytes else name


class LogprobsFormatter:
    """A model's logprobs shapes; `as_ids`: tokens named by id (`token_id:N`), not by text."""

    def __init__(self, table: TokenTable, as_ids: bool = False) -> None:
        self.table = table
        self.legacy_texts: Sequence[str] = table.legacy_texts
        self.chat_texts: Sequence[str] = table.chat_texts
        self.byte_lists: Sequence[list[int] | None] = table.byte_lists
        self._target_names: dict[tuple[int, ...], list[str]] = {}  # each asked ids' texts
        if as_ids:
            self.legacy_texts = self.chat_texts = _IdNames(False)  # type: ignore[assignment]
            self.byte_lists = _IdNames(True)  # type: ignore[assignment]

    # ---- /v1/completions ------------------------------------------------------------------
    def _completion_top(self, lp: TokenLogprobs, j: int, k: int, text: str, value: float) -> dict:
        texts = self.legacy_texts
        top: dict[str, float] = {}
        for tid, v in alternatives(lp, j, k):
            top.setdefault(texts[tid], v if math.isfinite(v) else finite(v))
        top.setdefault(text, value)
        return top

    def completion(self, pieces: Iterable[Piece], k: int) -> CompletionLogprobs:
        texts = self.legacy_texts
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        extras = _Extras()
        for p in pieces:
            text = texts[p.token_id]
            tokens.append(text)
            offsets.append(p.offset)
            lp = p.logprobs
            if lp is None:  # the first prompt token: no context
                values.append(None)
                tops.append(None)
                extras.add_empty()
                continue
            j = p.row
            value = finite(lp.logprobs[j])
            values.append(value)
            tops.append(self._completion_top(lp, j, k, text, value))
            proc_top = None
            if lp.processed is not None:
                pv = finite(lp.processed.logprobs[j])
                proc_top = self._completion_top(lp.processed, j, k, text, pv)
            extras.add(lp, j, proc_top)
        out = CompletionLogprobs.model_construct(
            tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets
        )
        return extras.fill(out) if extras.used else out

    # ---- /v1/chat/completions -------------------------------------------------------------
    def _top(self, token_id: int, value: float) -> TopLogprob:
        return TopLogprob.model_construct(
            token=self.chat_texts[token_id],
            logprob=value if math.isfinite(value) else finite(value),
            bytes=self.byte_lists[token_id],
        )

    def _tops(self, lp: TokenLogprobs, j: int, k: int) -> list[TopLogprob]:
        return [self._top(tid, v) for tid, v in alternatives(lp, j, k)]

    def chat(self, pieces: Iterable[Piece], k: int) -> list[ChatLogprobEntry]:
        entries: list[ChatLogprobEntry] = []
        for p in pieces:
            if p.hidden or p.logprobs is None:
                continue
            lp, j = p.logprobs, p.row
            entry = ChatLogprobEntry.model_construct(
                token=self.chat_texts[p.token_id],
                logprob=finite(lp.logprobs[j]),
                bytes=self.table.byte_lists[p.token_id],  # the token's own (vLLM's too)
                top_logprobs=self._tops(lp, j, k),
            )
            if lp.target_logprobs is not None:
                entry.target_logprobs = self.targets(lp, j)
            if lp.entropy is not None:
                entry.entropy = float(lp.entropy[j])
            if lp.processed is not None:
                entry.processed_logprob = finite(lp.processed.logprobs[j])
                entry.processed_top_logprobs = self._tops(lp.processed, j, k)
            if lp.constraint_logmass is not None:
                entry.constraint_logmass = finite(lp.constraint_logmass[j])
            entries.append(entry)
        return entries

    def targets(self, lp: TokenLogprobs, j: int) -> TargetRow:
        """The requested ids' logprobs at row j, in the order they were asked for."""
        assert lp.target_logprobs is not None
        ids = tuple(lp.target_ids)
        names = self._target_names.get(ids)
        if names is None:
            names = self._target_names[ids] = [self.chat_texts[t] for t in ids]
        return TargetRow(ids, names, finite_row(lp.target_logprobs[j]).tolist())

    def chat_logprobs(
        self, pieces: Iterable[Piece], k: int | None, thinking: Sequence[Piece] | None = None
    ) -> ChatLogprobs | None:
        """A chat choice's `logprobs` (None: not asked for); a thinking model's reasoning
        tokens' entries under `reasoning`, beside the answer's `content`."""
        if k is None:
            return None
        reasoning = self.chat(thinking, k) if thinking else None
        return ChatLogprobs(content=self.chat(pieces, k), refusal=None, reasoning=reasoning)

    def prompt_scores(
        self,
        scores: TokenLogprobs | None,
        k: int | None,
        sources: Sequence[tuple[int | None, str]],
        reasoning: Sequence[bool] = (),
    ) -> dict[str, object]:
        """A chat choice's prompt fields (none where `k`, prompt_logprobs, is None):
        prompt_logprobs (vLLM's shape), where each prompt token comes from (`sources`: message
        index and role; `reasoning`: per token, inside a thinking span), and, aligned with
        prompt_logprobs (nothing for the first token, then
        one per scored position), the entropy and target ids' logprobs where asked."""
        if k is None or scores is None:
            return {}
        out: dict[str, object] = {
            "prompt_logprobs": self.prompt_logprobs(scores, k),
            "prompt_token_sources": [
                PromptTokenSource(message_index=i, role=role, reasoning=inside)
                for (i, role), inside in zip(
                    sources, reasoning or [False] * len(sources), strict=True
                )
            ],
        }
        if scores.entropy is not None:
            out["prompt_entropy"] = [None, *(float(v) for v in scores.entropy)]
        if scores.target_logprobs is not None:
            out["prompt_target_logprobs"] = [None] + [
                self.targets(scores, j) for j in range(len(scores))
            ]
        return out

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
            for r, (aid, v) in enumerate(alternatives(scores, j, k), start=1):
                entry.setdefault(str(aid), self._vllm_entry(aid, v, r))
            out.append(entry)
        return out

    def _vllm_entry(self, tid: int, value: float, rank: int) -> dict[str, object]:
        return {
            "logprob": finite(value),
            "rank": int(rank),
            "decoded_token": self.chat_texts[int(tid)],
        }


class _Extras:
    """probserve's optional completions arrays (target ids, entropy, processed), aligned with
    the tokens; built only when a row carries them."""

    def __init__(self) -> None:
        self.used = False
        self.targets: list[dict[str, float] | None] = []
        self.entropy: list[float | None] = []
        self.proc_values: list[float | None] = []
        self.proc_tops: list[dict[str, float] | None] = []
        self.logmass: list[float | None] = []
        self.has_targets = self.has_entropy = self.has_processed = self.has_logmass = False

    def add_empty(self) -> None:
        self.targets.append(None)
        self.entropy.append(None)
        self.proc_values.append(None)
        self.proc_tops.append(None)
        self.logmass.append(None)

    def add(self, lp: TokenLogprobs, j: int, processed_top: dict[str, float] | None) -> None:
        if lp.target_logprobs is not None:
            self.used = self.has_targets = True
            self.targets.append(
                {
                    str(t): finite(v)
                    for t, v in zip(lp.target_ids, lp.target_logprobs[j].tolist(), strict=True)
                }
            )
        else:
            self.targets.append(None)
        if lp.entropy is not None:
            self.used = self.has_entropy = True
            self.entropy.append(float(lp.entropy[j]))
        else:
            self.entropy.append(None)
        if lp.processed is not None:
            self.used = self.has_processed = True
            self.proc_values.append(finite(lp.processed.logprobs[j]))
            self.proc_tops.append(processed_top)
        else:
            self.proc_values.append(None)
            self.proc_tops.append(None)
        if lp.constraint_logmass is not None:
            self.used = self.has_logmass = True
            self.logmass.append(finite(lp.constraint_logmass[j]))
        else:
            self.logmass.append(None)

    def fill(self, out: CompletionLogprobs) -> CompletionLogprobs:
        if self.has_targets:
            out.target_logprobs = self.targets
        if self.has_entropy:
            out.entropy = self.entropy
        if self.has_processed:
            out.processed = ProcessedLogprobs.model_construct(
                token_logprobs=self.proc_values, top_logprobs=self.proc_tops
            )
        if self.has_logmass:
            out.constraint_logmass = self.logmass
        return out
