"""The step's data: what the scheduler hands a runner (`Chunk`: one sequence's tokens of this
step) and what the runner hands back (`RunOutput`: the logits rows to sample, and `ScoreRows` for
the prompt positions a chunk scores). A low room of its own, so the scheduler, the runners and
prompt scoring share these shapes without importing each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from probserve.engine.core.sequence import Sequence


@dataclass
class Chunk:
    """The tokens of one sequence computed in this step: positions [start, start + length), the
    last `len(proposed)` of them speculative tokens proposed past the sequence's end
    (core/speculation.py), whose rows are checked by the sampler."""

    seq: Sequence
    start: int
    length: int
    proposed: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def real_end(self) -> int:
        """The end of the sequence's own tokens in this chunk (the proposals after it)."""
        return self.end - len(self.proposed)

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.real_end] + list(self.proposed)

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token: its logits row is sampled (and those
        of its proposals, checked in order)."""
        return self.real_end == self.seq.num_tokens and not self.seq.score_only


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


def empty_logits(vocab: int) -> torch.Tensor:
    return torch.empty((0, vocab))
