"""DecodeGraphs: the GPU path's decode steps replayed from CUDA graphs, one graph per
batch-size bucket, so a step's Python (hundreds of kernel launches for an 8B model) runs once
at capture instead of every step.

A step fits when every chunk is one token that samples (no prompt to score, no speculative
proposals) and the step has no more sequences than the largest bucket. Its rows are padded
to the bucket: a padding row is token 0 at position 0 of a sequence whose every block is the
scratch block (one block past the pool's, never handed out), so it writes and reads nothing
of a real sequence. The kernels are row-invariant (kernels/gpu/), so a real row's bits are the
same replayed among padding rows as run eagerly alone: the graphs change no number.

Each bucket's static buffers (token ids, positions, cache slots, block tables as wide as the
longest sequence may grow, attention lengths) are filled for the step (the tables up to the
step's longest), then its graph replays the forward and the head into a static logits buffer.
A bucket is captured the first time a step needs it (on a GPU, every bucket at the engine's
warm-up, largest first, the graphs sharing one memory pool: a replay's logits are copied out
before the next replay): the forward runs twice eagerly on a side stream (Triton compiles its
kernels, the forward places the host tensors it keeps on the device), then once under
capture. The RoPE tables are grown to the longest sequence before the first capture and held
here, so their device copies (which the graphs read) live as long as the graphs, and no
position a step can hold is past them. A forward that syncs with the host in a step (a mixture
of experts grouped on the host, which the GPU path no longer does) cannot be captured: such a
bucket runs eagerly from then on (logged once).

Under Triton's interpreter (CPU tensors: how this is tested without a GPU) nothing can be
captured: a bucket's "replay" runs the same forward on the same padded static buffers, which
checks the padding, the buffers and the bucket choice; the capture itself runs only on a GPU
(scripts/gpu_check.sh).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from probserve.kernels.attention_plan import AttentionPlan
from probserve.models.llama import KVCache, LlamaForward

log = logging.getLogger(__name__)

# batch sizes with a graph of their own (a step pads to the next one up; max_num_seqs last)
BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def buckets(max_seqs: int) -> tuple[int, ...]:
    return (*(b for b in BUCKETS if b < max_seqs), max_seqs)


@dataclass
class _Bucket:
    """One bucket's static buffers, and what replays the step on them."""

    ids: torch.Tensor  # [b] int64
    positions: torch.Tensor  # [b] int64
    slots: torch.Tensor  # [b] int64
    tables: torch.Tensor  # [b, width] int64
    seq: torch.Tensor  # [b] int64: row i reads table i
    lengths: torch.Tensor  # [b] int64: keys each row attends to (its position + 1)
    replay: Callable[[], None] | None = None


class DecodeGraphs:
    def __init__(
        self,
        forward: LlamaForward,
        cache: KVCache,
        *,
        scratch_block: int,
        max_len: int,
        max_seqs: int,
        device: torch.device,
    ) -> None:
        self.forward = forward
        self.cache = cache
        self.block_size = cache.block_size
        self.scratch = scratch_block
        self.max_len = max_len
        self.width = -(-max_len // self.block_size)
        self.sizes = buckets(max_seqs)
        self.device = device
        self.captures = device.type == "cuda"  # else: the interpreter's eager replay
        self._buckets: dict[int, _Bucket] = {}
        self._failed: set[int] = set()  # buckets whose capture failed: eager from then on
        self._pool: Any = None  # the graphs' shared memory pool (a GPU's)
        self._tables: list[torch.Tensor] = []  # the RoPE tables the graphs read, held
        # every bucket's replay writes its logits here ([:size]): one buffer, not one a bucket
        self._logits: torch.Tensor | None = None
        self.steps: dict[int, int] = {}  # bucket -> decode steps replayed in it

    def bucket(self, n: int) -> int | None:
        """The bucket a step of n decode rows pads to (None: past the largest, or its capture
        failed)."""
        size = next((b for b in self.sizes if b >= n), None)
        return None if size is None or size in self._failed else size

    def capture_all(self) -> None:
        """Every bucket's graph, largest first (a GPU's; the interpreter captures nothing)."""
        if not self.captures:
            return
        for size in sorted(self.sizes, reverse=True):
            if size not in self._buckets and size not in self._failed:
                self._try_capture(size, [], [], [], [])  # padding rows only: the scratch block

    def _try_capture(
        self,
        size: int,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
    ) -> _Bucket | None:
        """The bucket of `size`, its buffers filled with these rows and its graph captured
        (None: it could not be; it decodes eagerly from now on)."""
        try:
            b = self._buckets.get(size) or self._buffers(size)
            self._fill(b, ids, positions, slots, tables)
            b.replay = self._capture(b)
        except Exception as exc:  # a forward that cannot be captured runs as it did
            log.warning("decode step of %d rows: no CUDA graph (%s); eager from now", size, exc)
            self._failed.add(size)
            self._buckets.pop(size, None)
            return None
        return b

    def run(
        self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]]
    ) -> torch.Tensor | None:
        """Logits [n, V] of a decode step of n rows (row i: token ids[i] at positions[i],
        written at slots[i], its sequence's block table tables[i]), replayed in its bucket;
        None when the step is not one the graphs run (the runner runs it eagerly)."""
        n = len(ids)
        size = self.bucket(n)
        if size is None:
            return None
        b = self._buckets.get(size)
        if b is not None and b.replay is not None:
            self._fill(b, ids, positions, slots, tables)
        else:
            b = self._try_capture(size, ids, positions, slots, tables)
            if b is None:
                return None
        assert b.replay is not None
        b.replay()
        assert self._logits is not None
        self.steps[size] = self.steps.get(size, 0) + 1
        # copied out: the next replay (of any bucket) writes the same buffer, and the graphs'
        # shared pool may lend this step's memory to another graph
        return self._logits[:n].clone()

    def _buffers(self, size: int) -> _Bucket:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=self.device)

        b = _Bucket(
            ids=zeros(size), positions=zeros(size), slots=zeros(size),
            tables=zeros(size, self.width),
            seq=torch.arange(size, device=self.device), lengths=zeros(size),
        )  # fmt: skip
        self._buckets[size] = b
        return b

    def _fill(
        self,
        b: _Bucket,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
    ) -> None:
        """The step's rows, then padding rows (token 0 at position 0 of the scratch block's
        sequence), written into the bucket's buffers in one copy each."""
        size, n = b.ids.shape[0], len(ids)
        pad = size - n
        # the columns up to the step's longest table: a row reads its table only up to its
        # length, so what lies past it (an earlier step's blocks) is never read
        wide = max((len(t) for t in tables), default=1)
        table = torch.full((size, wide), self.scratch, dtype=torch.int64)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
        host = torch.tensor(
            [
                ids + [0] * pad,
                positions + [0] * pad,
                slots + [self.scratch * self.block_size] * pad,
                [p + 1 for p in positions] + [1] * pad,
            ],
            dtype=torch.int64,
        )
        b.ids.copy_(host[0], non_blocking=True)
        b.positions.copy_(host[1], non_blocking=True)
        b.slots.copy_(host[2], non_blocking=True)
        b.lengths.copy_(host[3], non_blocking=True)
        b.tables[:, :wide].copy_(table, non_blocking=True)

    def _body(self, b: _Bucket) -> None:
        plan = AttentionPlan(
            slots=b.slots, tables=b.tables, token_seq=b.seq, token_len=b.lengths,
            max_position=self.max_len - 1,
        )  # fmt: skip
        hidden = self.forward.forward(b.ids, b.positions, plan, self.cache)
        logits = self.forward.logits(hidden)
        if self._logits is None:  # allocated before any capture: outside the graphs' pool
            rows = self.sizes[-1]
            self._logits = torch.empty((rows, logits.shape[1]), device=logits.device)
        self._logits[: logits.shape[0]].copy_(logits)

    def _capture(self, b: _Bucket) -> Callable[[], None]:
        if not self.captures:
            return lambda: self._body(b)
        torch.cuda.synchronize(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles the kernels; places the host tensors the forward keeps
                self._body(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._tables = self.forward.rope_tables()  # grown by the warm-up: what the graphs read
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call another thread makes meanwhile does not spoil the capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._body(b)
        log.info("decode steps of %d rows: a CUDA graph captured", b.ids.shape[0])
        return graph.replay
