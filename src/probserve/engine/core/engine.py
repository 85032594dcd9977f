"""EngineCore: the synchronous engine. One `step()` is: schedule, run, sample, update.

The scheduler owns the sequences' bookkeeping (what is computed, which blocks are cached, when a
sequence ends); the runner, chosen with its backend before the engine is built
(runners/choice.py), turns chunks into logits rows; the sampler picks tokens and computes their
logprobs (verify.py: proposals checked in order); prompt scoring (prompt_scoring.py) collects a
prompt's own logprobs; the speculator (speculator.py), handed in by the host where it runs a
draft model, settles each sequence's proposals and asks for the next.
`apply()` and `safe_step()` are what a host loop calls (the inline thread or the worker process):
an exception one request causes fails that request alone, one raised by a step fails the step's
sequences, and the engine goes on serving.
"""

from __future__ import annotations

import logging
from typing import Any

from probserve.engine.config import EngineConfig
from probserve.engine.core import prompt_scoring
from probserve.engine.core.block_pool import BlockPool
from probserve.engine.core.grammar import Grammars
from probserve.engine.core.runners.choice import Runner, choose_runner
from probserve.engine.core.runners.recurrent import RecurrentRunner
from probserve.engine.core.scheduler import Scheduler
from probserve.engine.core.sequence import Sequence
from probserve.engine.core.speculator import Ask, Speculator
from probserve.engine.core.step import Chunk, RunOutput
from probserve.engine.core.verify import Drawn, draw, sampler_row
from probserve.engine.grammar import first_line
from probserve.engine.info import validate
from probserve.engine.stats import EngineStats
from probserve.engine.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    RequestError,
    RoutedExperts,
    SamplingParams,
    TokenLogprobs,
)
from probserve.engine.usage import IterationTokens, ProcessUsage
from probserve.models.deltanet import RecurrentState
from probserve.models.loader import LoadedModel

log = logging.getLogger(__name__)


def _joined(parts: list[TokenLogprobs]) -> TokenLogprobs | None:
    return None if not parts else parts[0] if len(parts) == 1 else TokenLogprobs.concat(parts)


class EngineCore:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        """An engine over `loaded`. `speculator`: speculative decoding's (a draft model's engine:
        core/host.py builds it); default: prompt lookup, what `--speculative ngram` runs and a
        request's `speculative: true` gets where the server's default is off."""
        self.loaded = loaded
        self.config = config = config or EngineConfig()
        self.choice = choice = choose_runner(loaded, config)
        self.eos_ids = loaded.eos_token_ids
        self.grammars = Grammars(loaded.tokenizer, loaded.vocab_size, self.eos_ids)
        self._deferred: list[EngineRequest] = []  # waiting for their grammar's set-up (apply)
        # the runner (weights packed, KV cache allocated) is built by the thread that steps the
        # engine: torch runs markedly slower on a thread other than the one that first used it
        self._runner: Runner | None = None
        caching = config.prefix_caching and choice.cls.prefix_caching
        caching = caching and not choice.prefix_caching_off
        self.pool = BlockPool(
            choice.num_blocks, config.block_size, caching, retain_blocks=choice.retain_blocks
        )
        seqs = choice.max_seqs or config.max_num_seqs  # (fewer where their states would not fit)
        self.scheduler = Scheduler(self.pool, seqs, config.max_num_batched_tokens)
        if choice.state_bytes:  # a cached prefix ends where a state snapshot is kept
            self.scheduler.restorable = self._restorable
        # speculative decoding: on a runner that checks proposals (a request may ask for it, or
        # not, whatever the server's default)
        self.speculator = (
            (speculator or Speculator.lookup(config)) if choice.cls.speculates else None
        )
        self.iteration_tokens = IterationTokens()
        self.process_usage = ProcessUsage()
        speculative = str(self.speculator.default) if self.speculator else "off"
        self.info = choice.info(loaded, self.pool.prefix_caching, speculative)

    @property
    def runner(self) -> Runner:
        if self._runner is None:
            self._runner = self.choice.build(self.loaded)
            log.info(
                "engine: %s, %d KV blocks of %d tokens (%d tokens), prefix caching %s, "
                "deterministic %s, weights %s",
                self.choice.name, self.pool.num_blocks, self.config.block_size,
                self.choice.token_capacity, "on" if self.pool.prefix_caching else "off",
                "on" if self.info.deterministic else "off", self.info.weights,
            )  # fmt: skip
            if self.info.prefix_caching_off:
                log.info("engine: prefix caching off: %s", self.info.prefix_caching_off)
            if self.choice.state_bytes:
                states = 2 + self.config.speculative_tokens  # its own, and those kept to verify
                log.info(
                    "engine: recurrent state %d bytes a sequence, reserved for %d sequences "
                    "(%d states each: its own and those kept for proposals) and %d prefix-cache "
                    "snapshots", self.choice.state_bytes, self.choice.max_seqs, states,
                    self.choice.snapshots,
                )  # fmt: skip
                if self.choice.max_seqs < self.config.max_num_seqs:
                    log.warning(
                        "engine: %d sequences at once, not --max-num-seqs %d: half of "
                        "--kv-cache-gib holds no more recurrent states",
                        self.choice.max_seqs, self.config.max_num_seqs,
                    )  # fmt: skip
        return self._runner

    def warmup(self) -> None:
        """Build the runner (and let it prepare: the GPU path captures its decode graphs) and
        run one tiny request, on the calling thread."""
        self.runner.warm()
        self.add_request(EngineRequest("__warmup__", (0, 1), SamplingParams(max_tokens=1)))
        while self.has_work():
            self.step()
        self.pool.reset_prefix_cache()
        self.scheduler.prefix_query_tokens = self.scheduler.prefix_hit_tokens = 0

    # ---- requests -------------------------------------------------------------------------
    def validate(self, req: EngineRequest) -> int:
        """Check a request against the model; returns the max total length it may reach."""
        return validate(req, self.info)

    def add_request(self, req: EngineRequest) -> None:
        max_total = self.validate(req)
        if self.scheduler.find(req.request_id) is not None:
            raise RequestError(f"request id {req.request_id!r} is already in use")
        sp = req.sampling
        stop = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stop |= self.eos_ids
        seq = Sequence(req, max_total, frozenset(stop))
        if req.grammar is not None:
            seq.matcher = self.grammars.matcher(req.grammar)
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Drop the request (its caller has stopped listening: nothing is sent for it)."""
        seq = self.scheduler.find(request_id)
        if seq is not None:
            self.scheduler.finish(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._deferred)

    def stats(self) -> EngineStats:
        """The engine's figures (engine/stats.py): its queues, the KV pool, the prefix cache,
        speculation's totals, the steps' tokens and its process's memory and CPU."""
        sched = self.scheduler
        usable = max(1, self.pool.num_blocks - 1)
        seqs = (*sched.running, *sched.waiting)
        rss, cpu = self.process_usage.stats()
        steps = self.iteration_tokens
        return EngineStats(
            waiting=len(sched.waiting) + len(self._deferred),  # and those a grammar holds
            running=len(sched.running),
            held_caches=sum(1 for s in seqs if s.block_table or s.runner_state is not None),
            kv_cache_usage=self.pool.num_in_use() / usable,
            kv_cache_resident=(self.pool.num_touched() - 1) / usable,
            prefix_cache_queries=sched.prefix_query_tokens,
            prefix_cache_hits=sched.prefix_hit_tokens,
            preemptions=sched.num_preemptions,
            iteration_tokens=steps.cumulative(),
            iteration_tokens_sum=steps.total,
            iteration_tokens_count=steps.steps,
            process_resident_memory_bytes=rss,
            process_cpu_seconds=cpu,
            recurrent_state_bytes=self._state_bytes(seqs),
            **(self.speculator.figures() if self.speculator else {}),
        )

    def _restorable(self, block: int) -> bool:
        runner = self.runner
        assert isinstance(runner, RecurrentRunner)
        return runner.restorable(block)

    def _state_bytes(self, seqs: tuple[Sequence, ...]) -> int | None:
        """The recurrent states held now, those kept for proposals included (a hybrid model's:
        None for any other)."""
        if not self.choice.state_bytes:
            return None
        states = (s.runner_state for s in seqs)
        return sum(state.nbytes for state in states if isinstance(state, RecurrentState))

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """Schedule, run, sample, update (a grammar's masks computed while the model runs)."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        self.iteration_tokens.observe(sum(ch.length for ch in chunks))
        sampled = [ch for ch in chunks if ch.samples]
        ahead = {ch.seq.request_id: ch.proposed for ch in sampled if ch.proposed}
        masks = self.grammars.start([ch.seq for ch in sampled], ahead)
        run = self.runner.run(chunks)
        self.scheduler.computed(chunks)
        to_sample, prompt_scores, outputs = self._scored(chunks, run)
        allowed = masks.result()
        if not to_sample:
            return outputs
        rows = [sampler_row(ch.seq) for ch in to_sample]
        grammar = [allowed.get(ch.seq.request_id) for ch in to_sample]
        for row, found in zip(rows, grammar, strict=True):
            row.allowed = found[0] if found else None
        proposed = [ch.proposed for ch in to_sample]
        drawn = draw(run.sample_logits, rows, proposed, self.runner.row_math, grammar)
        return outputs + self._update(to_sample, drawn, prompt_scores)

    def _scored(
        self, chunks: list[Chunk], run: RunOutput
    ) -> tuple[list[Chunk], dict[str, TokenLogprobs], list[EngineOutput]]:
        """Each chunk's prompt scores collected; the chunks to sample (in the runner's row
        order), their prompt scores when complete, and the outputs of score-only sequences
        whose prompt is done (their final hidden states pooled where asked)."""
        to_sample: list[Chunk] = []
        prompt_scores: dict[str, TokenLogprobs] = {}
        outputs: list[EngineOutput] = []
        prompt_scoring.score_step(chunks, run.prompt_rows, self.runner.row_math)
        for ch in chunks:
            seq = ch.seq
            prompt_lp = prompt_scoring.collect(ch)
            if seq.score_only and ch.end >= seq.num_tokens:
                prompt_routed = self._prompt_routed(seq)
                embedding = prompt_scoring.pooled(self.runner.hidden, seq)
                self.scheduler.finish(seq)
                outputs.append(seq.output(
                    FinishReason.LENGTH, prompt_logprobs=prompt_lp,
                    prompt_routed=prompt_routed, embedding=embedding,
                ))  # fmt: skip
            elif ch.samples and not seq.score_only:
                to_sample.append(ch)
                if prompt_lp is not None:
                    prompt_scores[seq.request_id] = prompt_lp
        return to_sample, prompt_scores, outputs

    def _update(
        self, sampled: list[Chunk], drawn: list[Drawn], prompt_scores: dict[str, TokenLogprobs]
    ) -> list[EngineOutput]:
        """Each sequence's drawn tokens appended (`_append`); the proposals accepted become its
        own; its next proposals, every sequence's asked together."""
        outputs: list[EngineOutput] = []
        asks: list[tuple[Sequence, Ask]] = []
        for ch, got in zip(sampled, drawn, strict=True):
            seq = ch.seq
            if got.error is not None:
                outputs.append(self._fail(seq, got.error))
                continue
            routed, prompt_routed = None, None
            if seq.request.routing is not None:  # the rows that drew them, before any finish
                last = seq.num_tokens - 1
                routed = self.runner.routing(seq, last, last + len(got.tokens))
                prompt_routed = self._prompt_routed(seq)
            tokens, finish, limit = self._append(seq, got)
            if limit is not None:  # the grammar met a limit at once: its own output
                outputs.append(limit)
            if not tokens:
                continue
            if self.speculator is not None:
                ask = self.speculator.settle(seq, ch.proposed, got.accepted, finish is None)
                if ask is not None:
                    asks.append((seq, ask))
            scores = [lp for lp in got.logprobs[: len(tokens)] if lp is not None]
            outputs.append(seq.output(
                finish, new_token_ids=tuple(tokens),
                logprobs=_joined(scores),
                prompt_logprobs=prompt_scores.get(seq.request_id),
                routed=routed.span(0, len(tokens)) if routed else None,
                prompt_routed=prompt_routed,
            ))  # fmt: skip
        if self.speculator is not None:
            self.speculator.propose(asks)
        return outputs

    def _append(
        self, seq: Sequence, got: Drawn
    ) -> tuple[list[int], FinishReason | None, EngineOutput | None]:
        """The drawn tokens appended in order, each consumed by the sequence's grammar first,
        finishing it on a stop id, its length or its grammar's end: (the tokens kept, how it
        finished (None: it runs on, its proposals kept), the output of a grammar that met a
        limit before any token was kept)."""
        tokens: list[int] = []
        for token in got.tokens:
            matcher = seq.matcher
            # a limit met while the mask was computed (it then allows only the stop ids), or
            # while the sampled token is consumed: the grammar ends here, cleanly
            consumed = matcher is None or (
                not matcher.is_error() and (token in seq.stop_ids or matcher.consume_token(token))
            )
            if not consumed:
                limit = self._grammar_limit(seq, matcher)
                return tokens, limit.finish_reason, None if tokens else limit
            tokens.append(token)
            finish = self.scheduler.append_token(seq, token)
            if finish is None and matcher is not None and matcher.is_stopped():
                self.scheduler.finish(seq)  # the grammar is complete: nothing may follow
                finish = FinishReason.GRAMMAR
            if finish is not None:
                return tokens, finish, None
        self.scheduler.accepted(seq, got.accepted)
        return tokens, None, None

    def _prompt_routed(self, seq: Sequence) -> RoutedExperts | None:
        """The prompt's routing (the rows before tokens 1..len-1), once, for a request that
        asks; None otherwise."""
        spec = seq.request.routing
        if spec is None or not spec.prompt or seq.prompt_routed_sent:
            return None
        seq.prompt_routed_sent = True
        return self.runner.routing(seq, 0, seq.num_prompt_tokens - 1)

    # ---- for the host loop ------------------------------------------------------------------
    def apply(self, adds: list[EngineRequest], aborts: list[str]) -> list[EngineOutput]:
        """Queue new requests and drop aborted ones; a request that cannot be added gets an
        error output (it fails alone). At most one grammar not seen before is set up a call
        (its matcher built: up to a fraction of a second for a big schema); requests that need
        another wait for the next call, so the running ones keep stepping in between."""
        outputs: list[EngineOutput] = []
        aborted = set(aborts)
        adds, self._deferred = [*self._deferred, *adds], []
        built = False
        for req in adds:
            if req.request_id in aborted:
                aborted.discard(req.request_id)
                continue
            if req.grammar is not None and not self.grammars.ready(req.grammar):
                if built:
                    self._deferred.append(req)
                    continue
                built = True
            try:
                self.add_request(req)
            except RequestError as exc:
                outputs.append(EngineOutput.failure(req.request_id, str(exc)))
            except Exception as exc:  # anything one request causes fails that request alone
                log.exception("request %s could not be added", req.request_id)
                self.abort_request(req.request_id)
                outputs.append(EngineOutput.failure(req.request_id, f"{type(exc).__name__}: {exc}"))
        for request_id in aborted:
            self.abort_request(request_id)
        return outputs

    def safe_step(self) -> list[EngineOutput]:
        """A step; if it raises (a bug, a bad model output), the running sequences fail and the
        waiting ones are untouched."""
        try:
            return self.step()
        except Exception as exc:
            log.exception("engine step failed")
            return self.fail_running(f"engine error: {type(exc).__name__}: {exc}")

    def fail_running(self, message: str) -> list[EngineOutput]:
        outs = []
        for seq in list(self.scheduler.running):
            self.scheduler.finish(seq)
            outs.append(seq.output(FinishReason.ERROR, error=message))
        return outs

    # ---- helpers --------------------------------------------------------------------------
    def _grammar_limit(self, seq: Sequence, matcher: Any) -> EngineOutput:
        """The sequence ends where its grammar met a bound of llguidance's (the sampled token
        is not appended); what the bound was is logged, never sent (it holds the grammar)."""
        log.warning(
            "request %s: its grammar met a limit after %d tokens: %s",
            seq.request_id, len(seq.output_ids), first_line(matcher.get_error()),
        )  # fmt: skip
        self.scheduler.finish(seq)
        return seq.output(FinishReason.GRAMMAR_LIMIT)

    def _fail(self, seq: Sequence, message: str) -> EngineOutput:
        log.warning("request %s failed: %s", seq.request_id, message)
        self.scheduler.finish(seq)
        return seq.output(FinishReason.ERROR, error=message)
