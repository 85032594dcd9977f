"""EngineCore: the synchronous engine. One `step()` is: schedule, run, sample, update.

The scheduler owns the sequences' bookkeeping (what is computed, which blocks are cached, when a
sequence ends); the runner, chosen with its backend before the engine is built
(runners/choice.py), turns chunks into logits rows; the sampler picks tokens and computes their
logprobs (verify.py: proposals checked in order); prompt scoring (prompt_scoring.py) collects a
prompt's own logprobs; the speculator (speculator.py: prompt lookup, or the draft model's
proposer the host's `drafter` builds) settles each sequence's proposals and asks for the next.
`apply()` and `safe_step()` are what a host loop calls (the inline thread or the worker process):
an exception one request causes fails that request alone, one raised by a step fails the step's
sequences, and the engine goes on serving.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

from probserve.engine.config import EngineConfig
from probserve.engine.core import disk_cache, prompt_scoring
from probserve.engine.core.figures import engine_stats
from probserve.engine.core.grammar import Grammars
from probserve.engine.core.runners.choice import Runner, choose_runner
from probserve.engine.core.runners.recurrent import RecurrentRunner
from probserve.engine.core.scheduler import Scheduler
from probserve.engine.core.sequence import Sequence
from probserve.engine.core.speculation import Proposer
from probserve.engine.core.speculator import Ask, Speculator, default_mode
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
from probserve.models.llama import KVCache
from probserve.models.loader import LoadedModel

log = logging.getLogger(__name__)


def _joined(parts: list[TokenLogprobs]) -> TokenLogprobs | None:
    return None if not parts else parts[0] if len(parts) == 1 else TokenLogprobs.concat(parts)


class EngineCore:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        drafter: Callable[[], Proposer] | None = None,
    ) -> None:
        """An engine over `loaded`. `drafter`: builds a draft model's proposer (its own engine:
        core/host.py), called only where the runner chosen checks proposals; without one,
        prompt lookup's: what `--speculative ngram` runs and a request's `speculative: true`
        gets where the server's default is off."""
        self.loaded = loaded
        self.config = config = config or EngineConfig()
        self.choice = choice = choose_runner(loaded, config)
        self.eos_ids = loaded.eos_token_ids
        self.grammars = Grammars(loaded.tokenizer, loaded.vocab_size, self.eos_ids)
        self._deferred: list[EngineRequest] = []  # waiting for their grammar's set-up (apply)
        # the runner (weights packed, KV cache allocated) is built by the thread that steps the
        # engine: torch runs markedly slower on a thread other than the one that first used it
        self._runner: Runner | None = None
        self.pool = choice.block_pool()
        self.scheduler = Scheduler(self.pool, choice.num_seqs, config.max_num_batched_tokens)
        if choice.state_bytes:  # a cached prefix ends where a state snapshot is kept
            self.scheduler.restorable = self._restorable
            self.pool.on_allocate = self._forget_snapshot
        # speculative decoding where the runner checks proposals (a request may ask, or not)
        self.speculator: Speculator | None = None
        if choice.cls.speculates:
            device = str(choice.backend.facts().get("device", "cpu"))
            mode = default_mode(config, device, bool(choice.state_bytes))
            self.speculator = (
                Speculator(drafter(), config, mode) if drafter else Speculator.lookup(config, mode)
            )
        self.iteration_tokens = IterationTokens()
        self.process_usage = ProcessUsage()
        spec = self.speculator
        speculative = spec.proposer.name if spec and spec.default != "off" else "off"
        self.info = choice.info(loaded, self.pool.prefix_caching, speculative)
        # the prefix cache's second level (--prefix-cache-dir), keyed by the fingerprint
        fingerprint = self.info.system_fingerprint or ""
        self.disk = disk_cache.attach(
            self.pool, config.prefix_cache_dir, config.prefix_cache_disk_gib, fingerprint,
            self._kv_cache,
        )  # fmt: skip

    @property
    def runner(self) -> Runner:
        if self._runner is None:
            self._runner = self.choice.build(self.loaded)
            self.choice.log_built(self.pool.prefix_caching, self.info)
        return self._runner

    def _kv_cache(self) -> KVCache:  # the paged runner's (the one runner caching prefixes)
        cache: KVCache = self.runner.cache  # type: ignore[attr-defined]
        return cache

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
        """The engine's figures (core/figures.py)."""
        totals = self.speculator.figures() if self.speculator else {}
        totals |= self.disk.figures() if self.disk else {}
        return engine_stats(
            self.scheduler, self.pool, len(self._deferred), self.process_usage,
            self.iteration_tokens, totals, states=bool(self.choice.state_bytes),
        )  # fmt: skip

    def _restorable(self, block: int) -> bool:  # a hybrid model's: its snapshot still kept
        return cast(RecurrentRunner, self.runner).restorable(block)

    def _forget_snapshot(self, block: int) -> None:  # a block handed out: its snapshot goes
        if self._runner is not None:  # (none taken before the runner is built)
            cast(RecurrentRunner, self._runner).forget(block)

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
            self.speculator.propose(asks, len(self.scheduler.running))
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

    def close(self) -> None:
        """At shutdown, on the thread that steps: the prefix cache's blocks written to disk
        (with --prefix-cache-dir)."""
        if self.disk is not None:
            self.disk.close(self.pool)

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
