"""A sequence: one request's state inside the engine."""

from __future__ import annotations

import enum
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from probserve.engine.core.speculation import Speculation
from probserve.engine.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    RoutedExperts,
    TokenLogprobs,
)


@dataclass
class PromptScores:
    """One sequence's prompt scores so far."""

    parts: list[TokenLogprobs] = field(default_factory=list)
    done: bool = False  # computed (and sent once)


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
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    num_cached: int = 0  # of those, how many came from the prefix cache at admission
    num_hashed_blocks: int = 0  # full blocks registered in the prefix cache
    last_block_hash: bytes | None = None
    prompt_scores: PromptScores = field(default_factory=PromptScores)
    prompt_routed_sent: bool = False  # RoutingSpec.prompt: the prompt's routing went out
    runner_state: Any = None  # a runner's private per-sequence state (HF runner: its cache)
    matcher: Any = None  # the grammar's llguidance matcher, at the output so far (core/grammar.py)
    seed: int | None = None  # the draws' seed (None: greedy); each draw keyed by its position
    speculation: Speculation | None = None  # speculative decoding's state (None: off)
    arrival: float = field(default_factory=time.monotonic)
    queue_time: float | None = None  # seconds from arrival to first being scheduled
    cached_tokens: int | None = None  # prompt tokens the prefix cache held at that first time
    prompt_tensor: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.request.prompt_token_ids)
        self.prompt_tensor = torch.tensor(self.request.prompt_token_ids, dtype=torch.long)
        sp = self.request.sampling
        if not sp.greedy:
            # any integer seeds (a draw's key takes 64 bits): seeds equal modulo 2**64 agree
            seed = sp.seed if sp.seed is not None else secrets.randbits(63)
            self.seed = seed % 2**64

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def group(self) -> str:
        return self.request.group or self.request.request_id

    @property
    def score_only(self) -> bool:
        """max_tokens 0: the prompt is scored, nothing is generated (echo, /v1/distributions)."""
        return self.request.sampling.max_tokens == 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    def output(
        self,
        finish: FinishReason | None,
        new_token_ids: tuple[int, ...] = (),
        logprobs: TokenLogprobs | None = None,
        prompt_logprobs: TokenLogprobs | None = None,
        error: str | None = None,
        routed: RoutedExperts | None = None,
        prompt_routed: RoutedExperts | None = None,
        embedding: np.ndarray | None = None,
    ) -> EngineOutput:
        """This step's news for its request, with its queue time and cached tokens."""
        return EngineOutput(
            self.request_id, new_token_ids=new_token_ids, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, finish_reason=finish, error=error,
            queue_time=self.queue_time, cached_tokens=self.cached_tokens, routed=routed,
            prompt_routed=prompt_routed, embedding=embedding,
        )  # fmt: skip

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append(self, token: int) -> None:
        self.token_ids.append(token)
        self.output_ids.append(token)
