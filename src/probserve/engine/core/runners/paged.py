"""PagedRunner: the packed step of the families models/llama.py runs, over a paged KV cache.

Every chunk of the step goes into one forward (models/llama.py) and logits are computed only for
the rows that need them: the sampled position of each sequence that reaches its last token, and
prompt positions of sequences that score their prompt (cached-prefix positions included, from the
cached hidden states). Prompt rows leave as hidden states (`ScoreRows`): the scorer turns them into
logits a slice at a time, so scoring a long cached prompt never holds all its logits at once.

The forward runs on its backend (core/backend.py), decided before the runner is built. Where
it is deterministic (the row-invariant kernels, or the GPU path's) attention reads each token's
keys through its sequence's block table, and the logprobs' reductions go through the backend's
row math (`InvariantRowMath`, `DeviceRowMath`): a token's numbers do not depend on the rest of
the step; elsewhere (torch's operations) the step plans torch's attention groups.

On the GPU path (`--device cuda`) the same forward runs op by op on the Triton kernels
(kernels/gpu/), the KV cache and the step's tensors on the device; the rows of logits stay
there, where the logprobs' reductions run and greedy rows are chosen (only a row with
processors, and the small results, come to the host). Decode steps replay a CUDA graph of
their batch-size bucket (decode_graphs.py).
"""

from __future__ import annotations

from typing import Any

import torch

from probserve.engine.config import EngineConfig
from probserve.engine.core import prompt_scoring
from probserve.engine.core.backend import Backend
from probserve.engine.core.row_math import RowMath
from probserve.engine.core.runners.decode_graphs import DecodeGraphs
from probserve.engine.core.sequence import Sequence
from probserve.engine.core.step import Chunk, RunOutput, ScoreRows, empty_logits
from probserve.engine.types import RoutedExperts
from probserve.kernels.attention_plan import AttentionPlan, PrefillGroup
from probserve.models.deltanet import Span
from probserve.models.family import family
from probserve.models.llama import KVCache, LlamaForward, moe_layers
from probserve.models.loader import LoadedModel


class PagedRunner:
    prefix_caching = True
    speculates = True  # runs proposed tokens as extra rows (core/speculation.py)
    replays_graphs = True  # the GPU path's decode steps replay CUDA graphs

    @staticmethod
    def kv_bytes_per_token(config: Any) -> int:
        return KVCache.bytes_per_token(config)

    @staticmethod
    def state_bytes_per_sequence(config: Any) -> int:
        return 0  # (a hybrid model's recurrent state: runners/recurrent.py)

    @staticmethod
    def routing_shape(config: Any) -> tuple[tuple[int, ...], int]:
        layers = moe_layers(config)
        return (layers, family(config).top_k) if layers else ((), 0)

    keeps_hidden = True  # each position's final hidden state, beside its KV

    def hidden(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        slots = self._slots(seq.block_table, start, end).to(self.device)
        return self.cache.hidden.index_select(0, slots).cpu()

    def routing(self, seq: Sequence, start: int, end: int) -> RoutedExperts:
        """The experts and weights the forward kept for positions [start, end) of `seq` (each
        position's slot through its block table)."""
        slots = self._slots(seq.block_table, start, end).to(self.device)
        experts, weights = self.cache.routing(slots)
        return RoutedExperts(experts.cpu().numpy(), weights.cpu().numpy())

    def __init__(
        self, loaded: LoadedModel, num_blocks: int, config: EngineConfig, backend: Backend
    ) -> None:
        model = loaded.model
        self.backend = backend
        self.device = backend.device
        ops, row_math = backend.build(loaded)
        self.row_math: RowMath = row_math
        # a GGUF file's blocks (loaded.weights): kept, or dequantized a matrix at a time
        self.forward = LlamaForward(model, ops, loaded.weights)
        self.block_size = block_size = config.block_size
        self.graphs: DecodeGraphs | None = None
        # the GPU path's decode steps replay CUDA graphs (decode_graphs.py), their padding rows
        # in a scratch block past the pool's
        graphs = backend.graphs and self.replays_graphs
        blocks = num_blocks + int(graphs)
        self.cache = KVCache.allocate(model.config, blocks, block_size, self.device)
        self.vocab = self.forward.vocab_size
        if graphs:
            longest = min(
                config.max_model_len or loaded.context_length, (num_blocks - 1) * block_size
            )
            self.graphs = DecodeGraphs(
                self.forward, self.cache, scratch_block=num_blocks, max_len=longest,
                max_seqs=config.max_num_seqs, device=self.device,
            )  # fmt: skip

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rows of logits, where the forward runs (the logprobs' reductions run there too)."""
        return self.forward.logits(hidden)

    def release_source_weights(self) -> None:
        self.forward.release_source()

    def _slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def _plan(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionPlan]:
        ids: list[int] = []
        for ch in chunks:
            ids += ch.token_ids
        positions = torch.cat([torch.arange(ch.start, ch.end) for ch in chunks])
        plan = AttentionPlan(
            slots=torch.cat([self._slots(c.seq.block_table, c.start, c.end) for c in chunks])
        )
        input_ids = torch.tensor(ids, dtype=torch.long)
        plan.max_position = max(ch.end for ch in chunks) - 1
        if self.backend.deterministic:  # every token through its sequence's block table
            plan.tables = self._tables(chunks)
            lengths = torch.tensor([c.length for c in chunks])
            plan.token_seq = torch.repeat_interleave(torch.arange(len(chunks)), lengths)
            plan.token_len = positions + 1
        else:
            self._sdpa_groups(chunks, plan)
        if self.device.type != "cpu":  # the GPU path: the step's tensors moved once
            input_ids, positions = input_ids.to(self.device), positions.to(self.device)
            for name in ("slots", "tables", "token_seq", "token_len"):
                setattr(plan, name, getattr(plan, name).to(self.device))
        return input_ids, positions, plan

    def _sdpa_groups(self, chunks: list[Chunk], plan: AttentionPlan) -> None:
        """The SDPA path's groups: every decode token in one padded batch, each prefill chunk
        on its own."""
        decode_rows: list[int] = []
        decode_seqs: list[Chunk] = []
        row = 0
        for ch in chunks:
            if ch.length == 1:
                decode_rows.append(row)
                decode_seqs.append(ch)
            else:
                keys = self._slots(ch.seq.block_table, 0, ch.end)
                mask = None
                if ch.start > 0:
                    q_pos = torch.arange(ch.start, ch.end).unsqueeze(1)
                    mask = torch.arange(ch.end).unsqueeze(0) <= q_pos
                rows = slice(row, row + ch.length)
                plan.prefills.append(PrefillGroup(rows, keys, mask, ch.start))
            row += ch.length
        if decode_seqs:
            lengths = torch.tensor([c.end for c in decode_seqs])
            longest = int(lengths.max())
            tables = self._tables(decode_seqs)
            pos = torch.arange(longest)
            valid = pos.unsqueeze(0) < lengths.unsqueeze(1)
            keys = tables[:, pos // self.block_size] * self.block_size + pos % self.block_size
            # masked positions read the zeroed null block, never unwritten memory
            plan.decode_keys = torch.where(valid, keys, 0)
            plan.decode_mask = valid.view(len(decode_seqs), 1, 1, longest)
            plan.decode_rows = torch.tensor(decode_rows, dtype=torch.long)
            plan.decode_len = lengths

    def _tables(self, chunks: list[Chunk]) -> torch.Tensor:
        """[len(chunks), width] block tables, each chunk's up to its end (zero padded: the null
        block)."""
        width = max(-(-c.end // self.block_size) for c in chunks)
        tables = torch.zeros((len(chunks), width), dtype=torch.long)
        for i, c in enumerate(chunks):
            table = c.seq.block_table[: -(-c.end // self.block_size)]
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
        return tables

    def _spans(self, chunks: list[Chunk]) -> list[Span]:
        """The step's sequences with their recurrent states (none: every layer attends)."""
        return []

    def _computed(self, chunks: list[Chunk], spans: list[Span]) -> None:
        """After the forward: what the recurrent states saved (none here)."""

    def warm(self) -> None:
        """The decode graphs captured ahead of the first request (a GPU's)."""
        if self.graphs is not None:
            with torch.inference_mode():
                self.graphs.capture_all()

    def _replayed(self, chunks: list[Chunk]) -> torch.Tensor | None:
        """The step's logits from its bucket's CUDA graph, where it is a decode step the
        graphs run (every chunk one token that samples, no prompt rows, no proposals)."""
        if self.graphs is None or not chunks:
            return None
        for ch in chunks:
            a, b = prompt_scoring.score_range(ch)
            if ch.length != 1 or not ch.samples or ch.proposed or b > a:
                return None
        bs = self.block_size
        positions = [ch.start for ch in chunks]
        tables = [ch.seq.block_table[: ch.start // bs + 1] for ch in chunks]
        slots = [t[-1] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
        ids = [ch.seq.token_ids[ch.start] for ch in chunks]
        return self.graphs.run(ids, positions, slots, tables)

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> RunOutput:
        replayed = self._replayed(chunks)
        if replayed is not None:
            return RunOutput(replayed)
        input_ids, positions, plan = self._plan(chunks)
        spans = self._spans(chunks)
        hidden = self.forward.forward(input_ids, positions, plan, self.cache, spans)
        self._computed(chunks, spans)
        sample_rows: list[int] = []
        prompt_rows: dict[str, ScoreRows] = {}
        row = 0
        for ch in chunks:
            a, b = prompt_scoring.score_range(ch)
            if b > a:
                parts = []
                if a < ch.start:  # cached prefix positions: from the cached hidden states
                    cached = self._slots(ch.seq.block_table, a, ch.start).to(self.device)
                    parts.append(self.cache.hidden.index_select(0, cached))
                    a = ch.start
                if b > a:
                    parts.append(hidden[row + a - ch.start : row + b - ch.start])
                rows = parts[0] if len(parts) == 1 else torch.cat(parts)
                prompt_rows[ch.seq.request_id] = ScoreRows(rows, self._logits)
            if ch.samples:  # the last token's row, then each proposal's
                last = row + ch.length - 1
                sample_rows += range(last - len(ch.proposed), last + 1)
            row += ch.length
        sample = self._logits(hidden[sample_rows]) if sample_rows else empty_logits(self.vocab)
        return RunOutput(sample, prompt_rows)
