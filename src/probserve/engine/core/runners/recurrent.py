"""RecurrentRunner: the paged runner of a hybrid model (Qwen3.5, Qwen3-Next: Gated DeltaNet
layers among attention ones, models/deltanet.py), whose sequences carry a recurrent state beside
their KV blocks.

A sequence's state (its conv and delta-rule state in every linear layer) is made when its first
chunk is computed, zeros (or a prefix-cache snapshot), is carried past each chunk it computes,
and goes with its blocks: the scheduler drops it (`Sequence.runner_state`) when the sequence
finishes or is preempted, and a preempted sequence is recomputed like a new one. At most
`max_num_seqs` sequences run, so at most that many states are held (each with the states a
verify step keeps); the engine reserves their bytes out of the KV cache's budget before it
counts blocks (runners/choice.py), and the snapshots' too.

The prefix cache: the state past the last token of some blocks a sequence computes is kept as
that block's snapshot (`snapshot_count` of them at most, the least recently used dropped first):
every SNAPSHOT_TOKENS tokens' block, and the blocks a prompt's repeat and its continuation end
their cached prefix at (`snapshot_blocks`). Not every block: a snapshot is a whole state (MBs),
so one for each block of a long prompt would flush every other prompt's from the least recently
used set (a 4,000-token prompt is 250 blocks) and copy a gigabyte a prompt. The scheduler reuses
a cached prefix only up to a block whose snapshot is kept (`restorable`), and the sequence's
state starts from that snapshot: the bits a cold run reaches there, since the recurrence has one
order whatever the chunking. Room for a step's snapshots is made before its forward, and of the
blocks it completes only the last `snapshot_count` kept ones are saved, so the step never holds
more than that many with its saved states; each saved state is kept as the snapshot itself, no
copy. A block handed out again loses its snapshot (`forget`: the pool
calls it), so a snapshot never outlives the block content it was taken after.

Speculation: a step that verifies a sequence's proposals keeps the state past its last real
token and past each proposal; its next chunk's first position says how many were accepted, and
the state past the last of them is put back (`RecurrentState.settle`): a rejected proposal
leaves no trace, and the numbers are the same bits as decoding one token a step.

Decode steps run the forward itself, not CUDA graphs (the states are per sequence).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from probserve.engine.config import EngineConfig
from probserve.engine.core.backend import Backend
from probserve.engine.core.runners.paged import PagedRunner
from probserve.engine.core.step import Chunk
from probserve.models.deltanet import RecurrentState, Span
from probserve.models.llama import state_shape
from probserve.models.loader import LoadedModel

NO_SNAPSHOTS = "--prefix-cache-gib holds no recurrent state snapshot"
# a snapshot every this many tokens (whole blocks): a shared prefix of any length is reused to
# within this many tokens of its end
SNAPSHOT_TOKENS = 256


def snapshot_blocks(prompt_tokens: int, block_size: int) -> frozenset[int]:
    """The blocks (indices in a sequence) besides every SNAPSHOT_TOKENS tokens' whose state a
    sequence with a prompt of `prompt_tokens` keeps: the last block a repeat of the prompt
    reuses (it leaves one token to compute) and the prompt's last full block (where the next
    turn of a conversation, the prompt and more, ends its cached prefix)."""
    ends = ((prompt_tokens - 1) // block_size - 1, prompt_tokens // block_size - 1)
    return frozenset(b for b in ends if b >= 0)


def snapshot_count(config: EngineConfig, state_bytes: int) -> int:
    """The prefix cache's state snapshots: --prefix-cache-gib's worth, at most a quarter of
    --kv-cache-gib (0 where the prefix cache is off)."""
    if not state_bytes or not config.prefix_caching:
        return 0
    return int(min(config.prefix_cache_gib, config.kv_cache_gib / 4) * 2**30) // state_bytes


class RecurrentRunner(PagedRunner):
    prefix_caching = True  # (from the snapshots at block boundaries)
    speculates = True  # (its states past each verify row kept, the accepted one put back)
    replays_graphs = False

    @staticmethod
    def state_bytes_per_sequence(config: Any) -> int:
        shape = state_shape(config)
        return shape.bytes if shape is not None else 0

    def __init__(
        self, loaded: LoadedModel, num_blocks: int, config: EngineConfig, backend: Backend
    ) -> None:
        super().__init__(loaded, num_blocks, config, backend)
        shape = state_shape(loaded.model.config)
        assert shape is not None
        self.state_shape = shape
        self.snapshot_limit = snapshot_count(config, shape.bytes)
        # a block's snapshot: the state past its last token (conv, delta), least recent first
        self.snapshots: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._snapshot_rows: set[tuple[int, int]] = set()  # the step's to keep: (chunk, row)

    def keeps(self, seq: Any, block_index: int) -> bool:
        """Whether the state past block `block_index` of `seq` becomes a snapshot."""
        every = max(1, SNAPSHOT_TOKENS // self.block_size)
        prompt = len(seq.request.prompt_token_ids)
        return (block_index + 1) % every == 0 or block_index in snapshot_blocks(
            prompt, self.block_size
        )

    def forget(self, block: int) -> None:
        """Block `block` is handed out again: its snapshot (another content's) goes."""
        self.snapshots.pop(block, None)

    def restorable(self, block: int) -> bool:
        """A cached prefix may end at `block`: its snapshot is kept (now the most recent)."""
        if block not in self.snapshots:
            return False
        self.snapshots.move_to_end(block)
        return True

    def _spans(self, chunks: list[Chunk]) -> list[Span]:
        """Each chunk's rows and its sequence's state: at its first chunk a fresh one (zeros,
        or the snapshot of the cached prefix's last block), else the state past its last
        accepted token; the rows whose state is saved: each block's last token whose snapshot
        will be kept (`keeps`, `_make_room`), and with proposals the last real token and each
        proposal."""
        bs = self.block_size
        states: list[RecurrentState] = []
        ends: list[list[int]] = []  # each chunk's rows that end a block
        for ch in chunks:
            state = ch.seq.runner_state
            if ch.start == 0 or not isinstance(state, RecurrentState):
                state = ch.seq.runner_state = RecurrentState.zeros(self.state_shape, self.device)
                if ch.start:
                    self._restore(ch, state)
            state.settle(ch.start)
            states.append(state)
            # (a proposal's too: a block it completes is registered if it is accepted, and its
            # snapshot must then be this one, never an earlier owner's of the block)
            ends.append([p - ch.start for p in range(ch.start, ch.end) if (p + 1) % bs == 0])
        self._make_room(chunks, ends)
        spans, row = [], 0
        for i, (ch, state) in enumerate(zip(chunks, states, strict=True)):
            saves = {r for r in ends[i] if (i, r) in self._snapshot_rows}
            if ch.proposed:
                saves.update(range(ch.real_end - 1 - ch.start, ch.length))
            state.saving(len(saves))
            spans.append(Span(row, row + ch.length, state, tuple(sorted(saves))))
            row += ch.length
        return spans

    def _make_room(self, chunks: list[Chunk], ends: list[list[int]]) -> None:
        """The snapshots this step will keep (`_snapshot_rows`: (chunk, row)), and room for
        them now, before the step's states are saved: the blocks it completes lose an earlier
        owner's snapshot, and the least recently used others go as the new ones would push
        them out after the step. Of the step's blocks `keeps` chooses, only the last
        `snapshot_limit`, in order, are saved at all (the earlier ones would be pushed out by
        the later ones at once). So the snapshots kept after the step are those kept had every
        chosen block's been saved and inserted in order, and the step never holds more than
        the limit's worth of them with its saved states."""
        bs, limit = self.block_size, self.snapshot_limit
        rows = [(i, r) for i, found in enumerate(ends) for r in found]
        wanted = [(i, r) for i, r in rows if self.keeps(chunks[i].seq, (chunks[i].start + r) // bs)]
        kept = wanted[len(wanted) - limit :] if limit else []
        self._snapshot_rows = set(kept)
        for i, r in rows:
            self.snapshots.pop(chunks[i].seq.block_table[(chunks[i].start + r) // bs], None)
        while self.snapshots and len(self.snapshots) + len(kept) > limit:
            self.snapshots.popitem(last=False)

    def _restore(self, ch: Chunk, state: RecurrentState) -> None:
        """A cached prefix's state: its last block's snapshot (the scheduler reused no more)."""
        block = ch.seq.block_table[ch.start // self.block_size - 1]
        snapshot = self.snapshots.get(block)
        if ch.start % self.block_size or snapshot is None:
            raise RuntimeError(f"{ch.seq.request_id}: no recurrent state for position {ch.start}")
        state.restore(*snapshot)

    def _computed(self, chunks: list[Chunk], spans: list[Span]) -> None:
        """The saved states: snapshots of the blocks completed, the verify rows' kept."""
        bs = self.block_size
        for i, (ch, span) in enumerate(zip(chunks, spans, strict=True)):
            state = span.state
            if not span.saves:
                continue
            assert state.saved_conv is not None and state.saved_delta is not None
            for j, row in enumerate(span.saves):
                p = ch.start + row
                conv, delta = state.saved_conv[j], state.saved_delta[j]
                if ch.proposed and p >= ch.real_end - 1:
                    state.kept[p] = (conv, delta)  # (the saved tensors themselves: read only)
                if (i, row) in self._snapshot_rows:
                    self._snapshot(ch.seq.block_table[p // bs], conv, delta)
            state.saving(0)
        self._snapshot_rows = set()

    def _snapshot(self, block: int, conv: torch.Tensor, delta: torch.Tensor) -> None:
        """Keep a saved state (its own tensors, never written again: no copy) as `block`'s
        snapshot."""
        self.snapshots.pop(block, None)
        self.snapshots[block] = (conv, delta)
        while len(self.snapshots) > self.snapshot_limit:
            self.snapshots.popitem(last=False)
