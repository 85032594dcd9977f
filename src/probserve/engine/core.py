"""EngineCore: the synchronous engine. One `step()` is: schedule, run, sample, emit."""

from __future__ import annotations

import itertools
from typing import Protocol

from probserve.engine.logprobs import score_positions
from probserve.engine.runner import HFRunner, RunOutput
from probserve.engine.sampler import SamplerRow, sample
from probserve.engine.scheduler import ScheduledBatch, Scheduler
from probserve.engine.sequence import Sequence
from probserve.engine.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    RequestError,
    TokenLogprobs,
)
from probserve.models.loader import LoadedModel


class Runner(Protocol):
    def run(self, batch: ScheduledBatch, score_prompt: set[str]) -> RunOutput: ...


class EngineCore:
    def __init__(
        self, loaded: LoadedModel, runner: Runner | None = None, max_num_seqs: int = 8
    ) -> None:
        self.loaded = loaded
        self.vocab_size = loaded.vocab_size
        self.context_length = loaded.context_length
        self.eos_ids = loaded.eos_token_ids
        self.runner: Runner = runner or HFRunner(loaded.model)
        self.scheduler = Scheduler(max_num_seqs)
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------
    def validate(self, req: EngineRequest) -> int:
        """Check a request against the model; returns the max total length it may reach."""
        n = len(req.prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty: at least one token is needed", "prompt")
        bad = [t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(
                f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                "prompt",
            )
        sp = req.sampling
        if sp.max_tokens is not None and n + sp.max_tokens > self.context_length:
            raise RequestError(
                f"this model's maximum context length is {self.context_length} tokens; the "
                f"prompt has {n} tokens and max_tokens is {sp.max_tokens} "
                f"({n + sp.max_tokens} in all)",
                "max_tokens",
            )
        if sp.max_tokens is None and n >= self.context_length:
            raise RequestError(
                f"this model's maximum context length is {self.context_length} tokens; the "
                f"prompt has {n} tokens, which leaves no room to generate",
                "prompt",
            )
        for tid in (*sp.stop_token_ids, *sp.logit_bias.keys()):
            if not 0 <= tid < self.vocab_size:
                raise RequestError(f"token id {tid} is outside the vocabulary", "logit_bias")
        if sp.max_tokens is None:
            return self.context_length
        return n + sp.max_tokens

    def add_request(self, req: EngineRequest) -> None:
        max_total = self.validate(req)
        if self.scheduler.find(req.request_id) is not None:
            raise RequestError(f"request id {req.request_id!r} is already in use")
        sp = req.sampling
        stop = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stop |= self.eos_ids
        self.scheduler.add(Sequence(req, max_total, frozenset(stop)))

    def abort_request(self, request_id: str) -> EngineOutput | None:
        seq = self.scheduler.find(request_id)
        if seq is None:
            return None
        self.scheduler.finish(seq)
        return EngineOutput(
            request_id, finish_reason=FinishReason.ABORT, num_prompt_tokens=seq.num_prompt_tokens
        )

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def num_requests(self) -> tuple[int, int]:
        """(waiting, running)."""
        return len(self.scheduler.waiting), len(self.scheduler.running)

    def held_caches(self) -> int:
        """How many sequences hold KV state (0 when idle: nothing leaks)."""
        seqs = (*self.scheduler.running, *self.scheduler.waiting)
        return sum(1 for s in seqs if s.cache is not None)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        batch = self.scheduler.schedule()
        # score-only requests (max_tokens 0) that need no forward finish right away
        for seq in list(batch.prefills):
            if seq.request.sampling.max_tokens == 0 and not self._wants_prompt_scores(seq):
                batch.prefills.remove(seq)
                outputs.append(self._finish(seq, FinishReason.LENGTH, prompt_logprobs=None))
        if not batch:
            return outputs
        score = {s.request_id for s in batch.prefills if self._wants_prompt_scores(s)}
        run = self.runner.run(batch, score)
        to_sample: list[tuple[int, Sequence]] = []
        prompt_lp: dict[str, TokenLogprobs] = {}
        for i, seq in enumerate(batch.seqs):
            if seq.request_id in run.prompt_logits:
                k = seq.request.logprobs.top_k if seq.request.logprobs else 0
                prompt_lp[seq.request_id] = score_positions(
                    run.prompt_logits[seq.request_id], seq.prompt_tensor[1:], k
                )
            if seq.request.sampling.max_tokens == 0:
                outputs.append(
                    self._finish(seq, FinishReason.LENGTH, prompt_lp.get(seq.request_id))
                )
            else:
                to_sample.append((i, seq))
        if not to_sample:
            return outputs
        rows = [self._sampler_row(seq) for _, seq in to_sample]
        result = sample(run.sample_logits[[i for i, _ in to_sample]], rows)
        for j, (_, seq) in enumerate(to_sample):
            outputs.append(self._emit(seq, int(result.token_ids[j]), result.logprobs[j], prompt_lp))
        return outputs

    # ---- helpers --------------------------------------------------------------------------
    @staticmethod
    def _wants_prompt_scores(seq: Sequence) -> bool:
        spec = seq.request.logprobs
        return bool(spec and spec.prompt and seq.num_prompt_tokens > 1)

    def _sampler_row(self, seq: Sequence) -> SamplerRow:
        return SamplerRow(
            params=seq.request.sampling,
            logprobs=seq.request.logprobs,
            generator=seq.generator,
            prompt_ids=seq.prompt_tensor,
            output_ids=seq.output_ids,
            stop_ids=seq.stop_ids,
        )

    def _emit(
        self,
        seq: Sequence,
        token: int,
        logprobs: TokenLogprobs | None,
        prompt_lp: dict[str, TokenLogprobs],
    ) -> EngineOutput:
        seq.output_ids.append(token)
        finish: FinishReason | None = None
        if token in seq.stop_ids:
            finish = FinishReason.STOP
        elif seq.total_len >= seq.max_total_tokens:
            finish = FinishReason.LENGTH
        if finish is not None:
            self.scheduler.finish(seq)
        return EngineOutput(
            seq.request_id,
            new_token_ids=(token,),
            logprobs=logprobs,
            prompt_logprobs=prompt_lp.get(seq.request_id),
            finish_reason=finish,
            num_prompt_tokens=seq.num_prompt_tokens,
        )

    def _finish(
        self, seq: Sequence, reason: FinishReason, prompt_logprobs: TokenLogprobs | None
    ) -> EngineOutput:
        self.scheduler.finish(seq)
        return EngineOutput(
            seq.request_id,
            prompt_logprobs=prompt_logprobs,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
        )

    def fail_running(self, message: str) -> list[EngineOutput]:
        """Fail the running requests (after an unexpected error in a step); the waiting ones
        are untouched and the engine goes on serving."""
        outs = []
        for seq in list(self.scheduler.running):
            self.scheduler.finish(seq)
            outs.append(
                EngineOutput(
                    seq.request_id,
                    finish_reason=FinishReason.ERROR,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    error=message,
                )
            )
        return outs
