"""The scheduler: a FIFO waiting queue and a bounded running set.

Each step runs every running sequence once: a prefill for a new one, one decode token for the
others. Admission is first come, first served, up to `max_num_seqs` at a time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from probserve.engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledBatch:
    prefills: list[Sequence]
    decodes: list[Sequence]

    @property
    def seqs(self) -> list[Sequence]:
        return self.prefills + self.decodes

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


class Scheduler:
    def __init__(self, max_num_seqs: int = 8) -> None:
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        prefills = [s for s in self.running if not s.prefilled]
        decodes = [s for s in self.running if s.prefilled]
        return ScheduledBatch(prefills, decodes)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence from whichever queue holds it and free its state."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.release()
