"""EngineCore: the synchronous engine. One `step()` is: schedule, run, sample, emit."""

from __future__ import annotations

import logging

from probserve.engine.block_pool import BlockPool
from probserve.engine.config import EngineConfig
from probserve.engine.logprobs import score_positions
from probserve.engine.runner import HFRunner, PagedRunner, Runner, ScoreRows
from probserve.engine.sampler import SamplerRow, sample
from probserve.engine.scheduler import Chunk, Scheduler
from probserve.engine.sequence import Sequence
from probserve.engine.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    RequestError,
    SamplingParams,
    TokenLogprobs,
)
from probserve.models import llama
from probserve.models.loader import LoadedModel

log = logging.getLogger(__name__)


def num_kv_blocks(loaded: LoadedModel, config: EngineConfig) -> int:
    per_block = llama.KVCache.bytes_per_token(loaded.model.config) * config.block_size
    return max(2, int(config.kv_cache_gib * 2**30) // per_block)  # block 0 is the null block


def uses_paged_runner(loaded: LoadedModel, config: EngineConfig) -> bool:
    return config.runner == "paged" or (config.runner == "auto" and llama.supports(loaded.model))


def build_runner(loaded: LoadedModel, config: EngineConfig) -> Runner:
    """The paged runner for the Llama family (unless told otherwise), else transformers'."""
    if uses_paged_runner(loaded, config):
        return PagedRunner(loaded.model, num_kv_blocks(loaded, config), config.block_size)
    return HFRunner(loaded.model)


class EngineCore:
    def __init__(
        self, loaded: LoadedModel, config: EngineConfig | None = None, runner: Runner | None = None
    ) -> None:
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.vocab_size = loaded.vocab_size
        self.context_length = loaded.context_length
        self.eos_ids = loaded.eos_token_ids
        num_blocks = num_kv_blocks(loaded, self.config)
        # the runner (weights packed, KV cache allocated) is built by the thread that steps the
        # engine: torch runs markedly slower on a thread other than the one that first used it
        self._runner = runner
        paged = runner.prefix_caching if runner else uses_paged_runner(loaded, self.config)
        self.pool = BlockPool(
            num_blocks, self.config.block_size, self.config.prefix_caching and paged
        )
        self.scheduler = Scheduler(
            self.pool,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
        )
        self.token_capacity = (num_blocks - 1) * self.config.block_size

    @property
    def runner(self) -> Runner:
        if self._runner is None:
            self._runner = build_runner(self.loaded, self.config)
            log.info(
                "engine: %s, %d KV blocks of %d tokens (%d tokens), prefix caching %s",
                type(self._runner).__name__,
                self.pool.num_blocks,
                self.config.block_size,
                self.token_capacity,
                "on" if self.pool.prefix_caching else "off",
            )
        return self._runner

    def warmup(self) -> None:
        """Build the runner and run one tiny request, on the calling thread."""
        self.add_request(EngineRequest("__warmup__", (0, 1), SamplingParams(max_tokens=1)))
        while self.has_work():
            self.step()
        self.pool.reset_prefix_cache()
        self.scheduler.prefix_query_tokens = self.scheduler.prefix_hit_tokens = 0

    @property
    def max_context(self) -> int:
        """Tokens one sequence may hold: the model's context, or the KV cache's if smaller."""
        return min(self.context_length, self.token_capacity)

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
        limit = self.max_context
        if sp.max_tokens is not None and n + sp.max_tokens > limit:
            raise RequestError(
                f"this model's maximum context length is {limit} tokens; the "
                f"prompt has {n} tokens and max_tokens is {sp.max_tokens} "
                f"({n + sp.max_tokens} in all)",
                "max_tokens",
            )
        if sp.max_tokens is None and n >= limit:
            raise RequestError(
                f"this model's maximum context length is {limit} tokens; the "
                f"prompt has {n} tokens, which leaves no room to generate",
                "prompt",
            )
        for tid in (*sp.stop_token_ids, *sp.logit_bias.keys()):
            if not 0 <= tid < self.vocab_size:
                raise RequestError(f"token id {tid} is outside the vocabulary", "logit_bias")
        return limit if sp.max_tokens is None else n + sp.max_tokens

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

    def counters(self) -> dict[str, float]:
        """Engine-wide figures for metrics: KV cache usage and prefix cache and preemption
        counts since start."""
        usable = max(1, self.pool.num_blocks - 1)
        return {
            "kv_cache_usage": self.pool.num_in_use() / usable,
            "prefix_cache_queries": self.scheduler.prefix_query_tokens,
            "prefix_cache_hits": self.scheduler.prefix_hit_tokens,
            "preemptions": self.scheduler.num_preemptions,
        }

    def held_caches(self) -> int:
        """How many sequences hold KV blocks or runner state (0 when idle: nothing leaks)."""
        seqs = (*self.scheduler.running, *self.scheduler.waiting)
        return sum(1 for s in seqs if s.block_table or s.runner_state is not None)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        chunks = self.scheduler.schedule()
        if not chunks:
            return outputs
        run = self.runner.run(chunks)
        to_sample: list[Sequence] = []
        prompt_scores: dict[str, TokenLogprobs] = {}
        for ch in chunks:
            seq = ch.seq
            seq.num_computed = ch.end
            self.scheduler.register_full_blocks(seq)
            prompt_lp = self._collect_prompt_scores(ch, run.prompt_rows.get(seq.request_id))
            if seq.request.sampling.max_tokens == 0:
                if ch.end >= seq.num_tokens:
                    outputs.append(self._finish(seq, FinishReason.LENGTH, prompt_lp))
            elif ch.samples:
                to_sample.append(seq)
                if prompt_lp is not None:
                    prompt_scores[seq.request_id] = prompt_lp
        if not to_sample:
            return outputs
        result = sample(run.sample_logits, [self._sampler_row(seq) for seq in to_sample])
        for j, seq in enumerate(to_sample):
            if result.errors[j] is not None:
                outputs.append(self._fail(seq, result.errors[j] or "sampling failed"))
                continue
            outputs.append(
                self._emit(
                    seq,
                    int(result.token_ids[j]),
                    result.logprobs[j],
                    prompt_scores.get(seq.request_id),
                )
            )
        return outputs

    # ---- helpers --------------------------------------------------------------------------
    def _collect_prompt_scores(self, ch: Chunk, rows: ScoreRows | None) -> TokenLogprobs | None:
        """Score this chunk's prompt rows; once the prompt is complete, return all its scores."""
        seq = ch.seq
        if rows is not None:
            a, b = ch.score_range
            spec = seq.request.logprobs
            k = (spec.prompt_top_k or 0) if spec else 0
            targets = seq.prompt_tensor[a + 1 : b + 1]
            seq.prompt_parts.append(score_positions(rows, targets, k, spec, a))
        if seq.wants_prompt_scores and ch.end >= seq.num_prompt_tokens:
            seq.prompt_scored = True
            parts, seq.prompt_parts = seq.prompt_parts, []
            return parts[0] if len(parts) == 1 else TokenLogprobs.concat(parts)
        return None

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
        prompt_lp: TokenLogprobs | None,
    ) -> EngineOutput:
        seq.append(token)
        finish: FinishReason | None = None
        if token in seq.stop_ids:
            finish = FinishReason.STOP
        elif seq.num_tokens >= seq.max_total_tokens:
            finish = FinishReason.LENGTH
        if finish is not None:
            self.scheduler.finish(seq)
        return EngineOutput(
            seq.request_id,
            new_token_ids=(token,),
            logprobs=logprobs,
            prompt_logprobs=prompt_lp,
            finish_reason=finish,
            num_prompt_tokens=seq.num_prompt_tokens,
            queue_time=seq.queue_time,
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
            queue_time=seq.queue_time,
        )

    def _fail(self, seq: Sequence, message: str) -> EngineOutput:
        log.warning("request %s failed: %s", seq.request_id, message)
        self.scheduler.finish(seq)
        return EngineOutput(
            seq.request_id,
            finish_reason=FinishReason.ERROR,
            num_prompt_tokens=seq.num_prompt_tokens,
            error=message,
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
