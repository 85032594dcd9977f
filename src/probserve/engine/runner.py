"""Model runners: scheduled chunks in, the logits rows the step needs out.

`PagedRunner` (Llama family) packs every chunk of the step into one forward over the paged KV
cache (models/llama.py) and computes logits only for the rows that need them: the sampled
position of each sequence that reaches its last token, and prompt positions of sequences that
score their prompt (cached-prefix positions included, from the cached hidden states). Prompt rows
leave the runner as hidden states (`ScoreRows`): the scorer turns them into logits a slice at a
time, so scoring a long cached prompt never holds all its logits at once.
`HFRunner` (any other causal LM) runs transformers' own forward per sequence with a DynamicCache.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from probserve.engine.scheduler import Chunk
from probserve.models.llama import AttentionPlan, KVCache, LlamaForward, PrefillGroup


@dataclass
class ScoreRows:
    """The rows that score a chunk's prompt positions (Chunk.score_range), as hidden states and
    the head that makes them logits, or as logits already (`head` None)."""

    rows: torch.Tensor  # [n, H] hidden states, or [n, V] logits
    head: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def logits(self, start: int, end: int) -> torch.Tensor:
        rows = self.rows[start:end]
        return rows if self.head is None else self.head(rows)


@dataclass
class RunOutput:
    sample_logits: torch.Tensor  # [S, V]: rows of the chunks that sample, in chunk order
    prompt_rows: dict[str, ScoreRows] = field(default_factory=dict)  # request id -> its rows


class Runner(Protocol):
    prefix_caching: bool

    def run(self, chunks: list[Chunk]) -> RunOutput: ...


def _empty_logits(vocab: int) -> torch.Tensor:
    return torch.empty((0, vocab))


class PagedRunner:
    prefix_caching = True

    def __init__(self, model: Any, num_blocks: int, block_size: int) -> None:
        self.forward = LlamaForward(model)
        self.block_size = block_size
        self.cache = KVCache.allocate(model.config, num_blocks, block_size)
        self.vocab = self.forward.vocab_size

    def _slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def _plan(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionPlan]:
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        plan = AttentionPlan(slots=torch.empty(0, dtype=torch.long))
        decode_rows: list[int] = []
        decode_seqs: list[Chunk] = []
        row = 0
        for ch in chunks:
            ids += ch.seq.token_ids[ch.start : ch.end]
            positions.append(torch.arange(ch.start, ch.end))
            slots.append(self._slots(ch.seq.block_table, ch.start, ch.end))
            if ch.length == 1:
                decode_rows.append(row)
                decode_seqs.append(ch)
            else:
                keys = self._slots(ch.seq.block_table, 0, ch.end)
                mask = None
                if ch.start > 0:
                    q_pos = torch.arange(ch.start, ch.end).unsqueeze(1)
                    mask = torch.arange(ch.end).unsqueeze(0) <= q_pos
                plan.prefills.append(PrefillGroup(slice(row, row + ch.length), keys, mask))
            row += ch.length
        plan.slots = torch.cat(slots)
        if decode_seqs:
            lengths = torch.tensor([c.end for c in decode_seqs])
            longest = int(lengths.max())
            width = -(-longest // self.block_size)
            tables = torch.zeros((len(decode_seqs), width), dtype=torch.long)
            for i, c in enumerate(decode_seqs):
                table = c.seq.block_table[:width]
                tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
            pos = torch.arange(longest)
            valid = pos.unsqueeze(0) < lengths.unsqueeze(1)
            keys = tables[:, pos // self.block_size] * self.block_size + pos % self.block_size
            # masked positions read the zeroed null block, never unwritten memory
            plan.decode_keys = torch.where(valid, keys, 0)
            plan.decode_mask = valid.view(len(decode_seqs), 1, 1, longest)
            plan.decode_rows = torch.tensor(decode_rows, dtype=torch.long)
        return torch.tensor(ids, dtype=torch.long), torch.cat(positions), plan

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> RunOutput:
        input_ids, positions, plan = self._plan(chunks)
        hidden = self.forward.forward(input_ids, positions, plan, self.cache)
        sample_rows: list[int] = []
        prompt_rows: dict[str, ScoreRows] = {}
        row = 0
        for ch in chunks:
            a, b = ch.score_range
            if b > a:
                parts = []
                if a < ch.start:  # cached prefix positions: from the cached hidden states
                    cached = self._slots(ch.seq.block_table, a, ch.start)
                    parts.append(self.cache.hidden.index_select(0, cached))
                    a = ch.start
                if b > a:
                    parts.append(hidden[row + a - ch.start : row + b - ch.start])
                rows = parts[0] if len(parts) == 1 else torch.cat(parts)
                prompt_rows[ch.seq.request_id] = ScoreRows(rows, self.forward.logits)
            if ch.samples:
                sample_rows.append(row + ch.length - 1)
            row += ch.length
        sample = (
            self.forward.logits(hidden[sample_rows]) if sample_rows else _empty_logits(self.vocab)
        )
        return RunOutput(sample, prompt_rows)


class HFRunner:
    """Any transformers causal LM, one sequence at a time, through its own forward."""

    prefix_caching = False

    def __init__(self, model: Any) -> None:
        from transformers import DynamicCache

        self.model = model
        self._cache_cls = DynamicCache
        params = inspect.signature(model.forward).parameters
        # transformers >= 5.2x names the cache argument `cache`; older ones `past_key_values`
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.vocab = int(model.get_output_embeddings().weight.shape[0])

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> RunOutput:
        rows: list[torch.Tensor] = []
        prompt_rows: dict[str, ScoreRows] = {}
        for ch in chunks:
            seq = ch.seq
            if seq.runner_state is None:
                seq.runner_state = self._cache_cls(config=self.model.config)
            ids = torch.tensor([seq.token_ids[ch.start : ch.end]], dtype=torch.long)
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_arg: seq.runner_state})
            logits = out.logits[0].float()
            a, b = ch.score_range
            if b > a:
                prompt_rows[seq.request_id] = ScoreRows(logits[a - ch.start : b - ch.start])
            if ch.samples:
                rows.append(logits[-1])
        sample = torch.stack(rows) if rows else _empty_logits(self.vocab)
        return RunOutput(sample, prompt_rows)
