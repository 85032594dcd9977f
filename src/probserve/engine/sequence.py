"""A sequence: one request's state inside the engine."""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field
from typing import Any

import torch

from probserve.engine.types import EngineRequest, FinishReason


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request: EngineRequest
    max_total_tokens: int  # prompt + output may not pass this (context or max_tokens)
    stop_ids: frozenset[int]  # token ids that end generation (EOS unless ignored, stop ids)
    status: SeqStatus = SeqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    cache: Any = None  # the runner's per-sequence KV state; None when not held
    num_computed: int = 0  # tokens whose KV is in `cache`
    generator: torch.Generator | None = None
    prompt_tensor: torch.Tensor = field(init=False)
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        self.prompt_tensor = torch.tensor(self.request.prompt_token_ids, dtype=torch.long)
        sp = self.request.sampling
        if not sp.greedy:
            self.generator = torch.Generator()
            self.generator.manual_seed(sp.seed if sp.seed is not None else secrets.randbits(63))

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def total_len(self) -> int:
        return self.num_prompt_tokens + len(self.output_ids)

    @property
    def prefilled(self) -> bool:
        return self.num_computed > 0

    def pending_token_ids(self) -> list[int]:
        """Tokens whose KV is not computed yet (the whole prompt, or the last output token)."""
        all_ids = list(self.request.prompt_token_ids) + self.output_ids
        return all_ids[self.num_computed :]

    def release(self) -> None:
        """Free what the sequence holds (its KV state)."""
        self.cache = None
        self.num_computed = 0
