"""The scheduler: continuous batching with a token budget, chunked prefill, preemption by
recomputation and prefix caching.

Each step gets at most `max_num_batched_tokens` tokens. Running sequences come first, in
admission order (a decode costs one token; an unfinished prefill takes what the budget leaves,
in chunks). Waiting sequences are admitted while budget, blocks and `max_num_seqs` allow; on
admission the longest cached prefix of full blocks is reused. When a running sequence needs a
block and none is free, the latest admitted sequence is preempted: its blocks are freed and it
goes back to the head of the queue, to be recomputed later.

Fairness: sequences belong to groups (the candidates of one API request). Admission takes the
waiting sequence whose group runs the fewest sequences (first come, first served among equals),
and when every slot is taken while a group waits that runs two or more sequences fewer than the
largest group, the largest group's latest sequence is preempted to make room. One request with
`n` = `max_num_seqs` therefore uses the whole batch while it is alone, and yields its share as
soon as another request arrives.

Lanes: sequences that only read their prompt (max_tokens 0: embeddings, prompt scoring) and
sequences that generate share the batch as two lanes. Admission takes from the lane that runs
fewer sequences (generation on a tie) before it looks at groups; with every slot taken, the lane
running two or more fewer gets seats by preemption of the other's latest; and while both lanes
ask for tokens, neither is kept below half of a step's budget (a lane takes the whole budget
less what the other asks for, up to half). A flood of embedding inputs therefore cannot hold a
one-token completion back (it is admitted at the next step, its prompt given half the budget or
more), and generations cannot hold the prompt-only lane off its seats.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable

from probserve.engine.core import prompt_scoring
from probserve.engine.core.block_pool import BlockPool
from probserve.engine.core.sequence import SeqStatus, Sequence
from probserve.engine.core.step import Chunk
from probserve.engine.prefix_hash import BlockHash, block_hash
from probserve.engine.types import FinishReason


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_query_tokens = 0  # tokens of admitted sequences looked up in the cache
        self.prefix_hit_tokens = 0  # prompt tokens whose KV came from the prefix cache
        # full blocks being computed right now, by hash: a request that would compute the same
        # block again waits for it instead (lm-eval sends a context's continuations together)
        self._in_flight: dict[BlockHash, Sequence] = {}
        # where a cached prefix may end (a hybrid model: a block whose state snapshot is kept);
        # None: anywhere
        self.restorable: Callable[[int], bool] | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    # ---- blocks ---------------------------------------------------------------------------
    def _blocks_needed(self, seq: Sequence, end: int) -> int:
        return -(-end // self.block_size) - len(seq.block_table)

    def _grow(self, seq: Sequence, end: int) -> bool:
        """Give `seq` blocks for positions < end; all or nothing."""
        need = self._blocks_needed(seq, end)
        if need > self.pool.num_available():
            return False
        for _ in range(need):
            block = self.pool.allocate()
            assert block is not None
            seq.block_table.append(block)
        return True

    def _free_blocks(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.pool.release(block)
        seq.block_table.clear()
        for h in [h for h, owner in self._in_flight.items() if owner is seq]:
            del self._in_flight[h]
        seq.num_computed = seq.num_cached = seq.num_hashed_blocks = 0
        seq.last_block_hash = None
        seq.runner_state = None  # a runner's private per-sequence state goes with the blocks

    def _use_prefix_cache(self, seq: Sequence) -> list[BlockHash]:
        """Reuse the longest run of cached full blocks, leaving at least one token to compute.
        Returns the hashes of the full blocks the sequence will compute itself."""
        if not self.pool.prefix_caching:
            return []
        bs, parent = self.block_size, None
        missing: list[BlockHash] = []
        hits: list[BlockHash] = []
        for i in range((seq.num_tokens - 1) // bs):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = block_hash(parent, tokens)
            block = None if missing else self.pool.lookup(h, tokens)
            if block is None:
                missing.append(h)
            else:
                seq.block_table.append(block)
                hits.append(h)
            parent = h
        if self.restorable is not None:  # no further than a block the runner can resume after
            while seq.block_table and not self.restorable(seq.block_table[-1]):
                self.pool.release(seq.block_table.pop())
                missing.insert(0, hits.pop())
        last_hit = hits[-1] if hits else None
        seq.num_computed = seq.num_cached = len(seq.block_table) * bs
        seq.num_hashed_blocks = len(seq.block_table)
        seq.last_block_hash = last_hit
        return missing

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Offer each newly completed block to the prefix cache."""
        bs = self.block_size
        while (seq.num_hashed_blocks + 1) * bs <= seq.num_computed:
            i = seq.num_hashed_blocks
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = block_hash(seq.last_block_hash, tokens)
            self.pool.register(seq.block_table[i], h, tokens)
            if self._in_flight.get(h) is seq:
                del self._in_flight[h]
            seq.last_block_hash = h
            seq.num_hashed_blocks += 1

    # ---- the step ---------------------------------------------------------------------------
    def _lane(self) -> bool:
        """The lane to admit from: True for the prompt-only one when it runs fewer sequences than
        the generating one (or only it waits), else False."""
        waiting = {seq.score_only for seq in self.waiting}
        if len(waiting) == 1:
            return waiting.pop()
        prompt_only = sum(1 for seq in self.running if seq.score_only)
        return prompt_only < len(self.running) - prompt_only

    def _next_waiting(self, running: Counter[str]) -> int:
        """Index of the waiting sequence to admit next: in the lane `_lane` picks, the first of
        the least-served group."""
        lane = self._lane()
        best, fewest = -1, -1
        for i, seq in enumerate(self.waiting):
            if seq.score_only != lane:
                continue
            n = running[seq.group]
            if fewest < 0 or n < fewest:
                best, fewest = i, n
                if n == 0:
                    break
        return best

    def _rebalance(self) -> None:
        """With every slot taken: while the lane to admit from runs at least two fewer sequences
        than the other, preempt the other's latest (at most as many as that lane has waiting);
        else preempt one of the largest group when a waiting group runs at least two fewer. A
        preempted sequence is recomputed later, from the prefix cache."""
        if len(self.running) < self.max_num_seqs or not self.waiting:
            return
        waiting = self.waiting[self._next_waiting(Counter(s.group for s in self.running))]
        lane = waiting.score_only
        wanting = sum(1 for s in self.waiting if s.score_only == lane)
        mine = sum(1 for s in self.running if s.score_only == lane)
        freed = 0
        while freed < wanting and len(self.running) - mine >= mine + freed + 2:
            self._preempt(next(s for s in reversed(self.running) if s.score_only != lane))
            freed += 1
        if freed:
            return
        running = Counter(seq.group for seq in self.running if seq.score_only == lane)
        largest, count = running.most_common(1)[0] if running else (None, 0)
        if count >= running[waiting.group] + 2:
            victim = next(s for s in reversed(self.running) if s.group == largest)
            self._preempt(victim)

    def _lane_budgets(self) -> dict[bool, int]:
        """What each lane's chunks may take of a step (by `score_only`): the whole budget less
        what the other lane asks for, up to half of it (so a lane alone takes everything, and
        one that asks for little leaves the rest to the other)."""
        budget = self.max_num_batched_tokens
        asks = {True: 0, False: 0}
        for seq in (*self.running, *self.waiting):
            asks[seq.score_only] += seq.num_tokens - seq.num_computed
        half = budget // 2
        return {lane: budget - min(asks[not lane], half) for lane in (True, False)}

    def schedule(self) -> list[Chunk]:
        self._rebalance()
        budget = self.max_num_batched_tokens
        lanes = self._lane_budgets()  # of `budget`, what each lane may take
        chunks: list[Chunk] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget, lanes[seq.score_only])
            if n <= 0:
                i += 1
                continue
            proposed = self._proposed(seq, n, budget)
            while not self._grow(seq, seq.num_computed + n + len(proposed)):
                if proposed:  # no room for the proposals' rows: the plain step
                    proposed = ()
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                chunks.append(Chunk(seq, seq.num_computed, n + len(proposed), proposed))
                budget -= n + len(proposed)
                lanes[seq.score_only] -= n + len(proposed)
                i += 1
                continue
            break  # seq itself was preempted: nothing more fits
        deferred: list[Sequence] = []
        running = Counter(seq.group for seq in self.running)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            index = self._next_waiting(running)
            seq = self.waiting[index]
            if lanes[seq.score_only] <= 0:  # that lane's share is spent: the other's turn
                index = self._first_of_lane(not seq.score_only)
                if index < 0 or lanes[not seq.score_only] <= 0:
                    break
                seq = self.waiting[index]
            missing = self._use_prefix_cache(seq)
            if missing and missing[0] in self._in_flight:
                self._free_blocks(seq)  # its next block is being computed: wait for it
                del self.waiting[index]
                deferred.append(seq)
                continue
            n = min(seq.num_tokens - seq.num_computed, budget, lanes[seq.score_only])
            if not self._grow(seq, seq.num_computed + n):
                self._free_blocks(seq)
                break
            del self.waiting[index]
            running[seq.group] += 1
            self.prefix_hit_tokens += seq.num_cached
            self.prefix_query_tokens += seq.num_tokens
            if seq.queue_time is None:
                seq.queue_time = time.monotonic() - seq.arrival
                seq.cached_tokens = seq.num_cached
            for h in missing:
                self._in_flight.setdefault(h, seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chunks.append(Chunk(seq, seq.num_computed, n))
            budget -= n
            lanes[seq.score_only] -= n
        self.waiting.extendleft(reversed(deferred))
        return chunks

    def _first_of_lane(self, lane: bool) -> int:
        """Index of the first waiting sequence of a lane (by `score_only`), or -1."""
        return next((i for i, seq in enumerate(self.waiting) if seq.score_only == lane), -1)

    @staticmethod
    def _proposed(seq: Sequence, n: int, budget: int) -> tuple[int, ...]:
        """The speculative tokens a decoding sequence's step checks: its proposals, as many as
        the step's budget leaves room for (they count against it like any token)."""
        spec = seq.speculation
        if spec is None or not spec.proposed or n != 1:
            return ()
        return spec.proposed[: max(0, budget - 1)]

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_blocks(seq)
        prompt_scoring.restart(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- after the step ----------------------------------------------------------------------
    def computed(self, chunks: list[Chunk]) -> None:
        """The chunks' tokens are in the KV cache now: count them, offer full blocks to the
        prefix cache."""
        for ch in chunks:
            ch.seq.num_computed = ch.real_end  # the proposals' KV counts once they are accepted
            self._register_full_blocks(ch.seq)

    def accepted(self, seq: Sequence, count: int) -> None:
        """`count` proposals of the sequence's last step were accepted (now its tokens): their
        KV, computed in that step, is its own."""
        if seq.status is SeqStatus.RUNNING and count:
            seq.num_computed += count
            self._register_full_blocks(seq)

    def append_token(self, seq: Sequence, token: int) -> FinishReason | None:
        """Add a sampled token; when it ends the sequence (a stop id, or the length reached),
        finish it and say why."""
        seq.append(token)
        finish: FinishReason | None = None
        if token in seq.stop_ids:
            finish = FinishReason.STOP
        elif seq.num_tokens >= seq.max_total_tokens:
            finish = FinishReason.LENGTH
        if finish is not None:
            self.finish(seq)
        return finish

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence from whichever queue holds it and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self._free_blocks(seq)
