"""What a step's attention reads, planned once a step by the runner (engine/core/runners/paged.py)
and handed to every layer's `LayerOps.attend` (kernels/layer_ops.py): each token's cache slot,
and then either every token's block table (the batch-invariant backends: each token reads its
own sequence's keys in place) or torch's groups (every decode token in one padded batch, each
prefill chunk on its own); a layer's attention constants (`LayerAttention`) and paged cache
(`LayerKV`); and `FlatKernels`, the forward's RoPE and attention for a backend whose kernels
take their arguments flat."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# RoPE for a step: the (cos, sin) tables [P, d] and each token's row in them
Rope = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LayerKV:
    """One layer's paged cache: K and V [slots, nkv, d], slot s = block * block_size + offset."""

    k: torch.Tensor
    v: torch.Tensor
    block_size: int


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention constants: the query scaling, its sliding window (None: global),
    the scores' soft-cap (Gemma 2) and each head's sink logit (gpt-oss)."""

    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None


@dataclass
class PrefillGroup:
    rows: slice  # this chunk's rows in the packed batch
    keys: torch.Tensor  # [L] slots of every key it attends to (positions 0..end-1)
    mask: torch.Tensor | None  # [n, L] bool (True: attend); None: plain causal (no prefix)
    start: int = 0  # the chunk's first position


@dataclass
class AttentionPlan:
    slots: torch.Tensor  # [T] where each token's K/V go
    decode_rows: torch.Tensor | None = None  # [B] rows of decode tokens
    decode_keys: torch.Tensor | None = None  # [B, L] slots (padded with 0)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, L] bool
    decode_len: torch.Tensor | None = None  # [B] keys each decode token attends to
    prefills: list[PrefillGroup] = field(default_factory=list)
    # the batch-invariant backends: every token attends through its sequence's block table
    tables: torch.Tensor | None = None  # [S, width] block ids
    token_seq: torch.Tensor | None = None  # [T] row of `tables`
    token_len: torch.Tensor | None = None  # [T] keys it attends to (its position + 1)
    # the largest position in the step, where the planner knows it on the host (the GPU path:
    # no wait on the device to read it back)
    max_position: int | None = None
    # torch's masks of windowed or soft-capped layers, built once per step and window
    _masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)

    def by_table(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tables, token_seq, token_len): what a batch-invariant attention reads."""
        assert self.tables is not None and self.token_seq is not None
        assert self.token_len is not None
        return self.tables, self.token_seq, self.token_len

    def decode_mask_for(self, window: int | None) -> torch.Tensor | None:
        """The decode tokens' mask [B, 1, 1, L], within the last `window` keys where given."""
        if not window or self.decode_len is None or self.decode_keys is None:
            return self.decode_mask
        if (-1, window) not in self._masks:
            length = self.decode_keys.shape[1]
            first = (self.decode_len - window).view(-1, 1, 1, 1)
            inside = torch.arange(length).view(1, 1, 1, -1) >= first
            self._masks[(-1, window)] = self.decode_mask & inside  # type: ignore[operator]
        return self._masks[(-1, window)]

    def prefill_mask_for(
        self, index: int, window: int | None, explicit: bool
    ) -> tuple[torch.Tensor | None, bool]:
        """Prefill group `index`'s (mask, is_causal): its own, or (`explicit`: a windowed or
        soft-capped layer, which SDPA's causal flag cannot express) causal within `window`."""
        group = self.prefills[index]
        if not explicit:
            return group.mask, group.mask is None
        if (index, window) not in self._masks:
            n = group.rows.stop - group.rows.start
            q_pos = torch.arange(group.start, group.start + n).unsqueeze(1)
            k_pos = torch.arange(group.keys.numel()).unsqueeze(0)
            mask = k_pos <= q_pos
            if window:
                mask = mask & (k_pos > q_pos - window)
            self._masks[(index, window)] = mask
        return self._masks[(index, window)], False


class FlatKernels:
    """`rotate` and `attend` (kernels/layer_ops.py) for a backend whose kernels take their
    arguments flat (the row-invariant library's, the Triton kernels'): RoPE with the cache
    write, and attention through every token's block table."""

    rope_cache: Callable[..., torch.Tensor]
    attention: Callable[..., torch.Tensor]

    def rotate(
        self, qkv: torch.Tensor, heads: tuple[int, int, int], rope: Rope, slots: torch.Tensor,
        kv: LayerKV,
    ) -> torch.Tensor:  # fmt: skip
        return self.rope_cache(qkv, heads, *rope, slots, kv.k, kv.v)

    def attend(
        self, q: torch.Tensor, kv: LayerKV, plan: AttentionPlan, layer: LayerAttention
    ) -> torch.Tensor:
        tables, seq, lengths = plan.by_table()
        return self.attention(
            q, kv.k, kv.v, layer.scale, tables, seq, lengths, kv.block_size, layer.window,
            layer.softcap, layer.sinks,
        )  # fmt: skip
