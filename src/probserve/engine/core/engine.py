"""EngineCore: the synchronous engine. One `step()` is: schedule, run, sample, update.

The scheduler owns the sequences' bookkeeping (what is computed, which blocks are cached, when a
sequence ends); the runner turns chunks into logits rows; the sampler picks tokens and computes
their logprobs; prompt scoring (prompt_scoring.py) collects a prompt's own logprobs.
`apply()` and `safe_step()` are what a host loop calls (the inline thread or the worker process):
an exception one request causes fails that request alone, one raised by a step fails the step's
sequences, and the engine goes on serving.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from probserve.engine.config import EngineConfig
from probserve.engine.core import prompt_scoring
from probserve.engine.core.block_pool import BlockPool
from probserve.engine.core.grammar import Grammars
from probserve.engine.core.runners.choice import Runner, choose_runner
from probserve.engine.core.sampler import SamplerRow
from probserve.engine.core.scheduler import Scheduler
from probserve.engine.core.sequence import Sequence
from probserve.engine.core.speculation import DraftProposer, NgramProposer, Speculation
from probserve.engine.core.step import Chunk, RunOutput
from probserve.engine.core.verify import Drawn, draw
from probserve.engine.grammar import first_line
from probserve.engine.info import EngineInfo, validate
from probserve.engine.stats import SPEC_POSITIONS, EngineStats
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
from probserve.models.loader import LoadedModel

log = logging.getLogger(__name__)
FORCED_MOST = SPEC_POSITIONS  # the most tokens a grammar's fast-forward proposes a step


def _joined(parts: list[TokenLogprobs]) -> TokenLogprobs | None:
    return None if not parts else parts[0] if len(parts) == 1 else TokenLogprobs.concat(parts)


def _joined_routing(parts: list[RoutedExperts]) -> RoutedExperts | None:
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    return RoutedExperts(
        np.concatenate([p.experts for p in parts]), np.concatenate([p.weights for p in parts])
    )


class EngineCore:
    def __init__(
        self, loaded: LoadedModel, config: EngineConfig | None = None, runner: Runner | None = None
    ) -> None:
        self.loaded = loaded
        self.choice = choose_runner(loaded, config or EngineConfig())
        self.config = self.choice.config
        self.vocab_size = loaded.vocab_size
        self.context_length = loaded.context_length
        if not 0 <= self.config.max_model_len <= loaded.context_length:
            raise ValueError(
                f"--max-model-len {self.config.max_model_len} is not within the model's context "
                f"({loaded.context_length} tokens)"
            )
        if self.config.max_model_len > 0:
            self.context_length = self.config.max_model_len
        mode = self.config.speculative
        if mode not in ("off", "ngram") and not (mode.startswith("draft:") and mode[6:]):
            raise ValueError(f"--speculative must be off, ngram or draft:MODEL (got {mode!r})")
        if not 1 <= self.config.speculative_tokens <= SPEC_POSITIONS:
            raise ValueError(
                f"--speculative-tokens must be 1 to {SPEC_POSITIONS} "
                f"(got {self.config.speculative_tokens})"
            )
        self.eos_ids = loaded.eos_token_ids
        self.grammars = Grammars(loaded.tokenizer, self.vocab_size, self.eos_ids)
        self._deferred: list[EngineRequest] = []  # waiting for their grammar's set-up (apply)
        num_blocks = self.choice.num_blocks
        # the runner (weights packed, KV cache allocated) is built by the thread that steps the
        # engine: torch runs markedly slower on a thread other than the one that first used it
        self._runner = runner
        self._runner_name = type(runner).__name__ if runner else self.choice.name
        paged = runner.prefix_caching if runner else self.choice.cls.prefix_caching
        self.pool = BlockPool(
            num_blocks,
            self.config.block_size,
            self.config.prefix_caching and paged,
            retain_blocks=self.choice.retain_blocks,
        )
        self.scheduler = Scheduler(
            self.pool, self.config.max_num_seqs, self.config.max_num_batched_tokens
        )
        self.token_capacity = (num_blocks - 1) * self.config.block_size
        # speculative decoding (core/speculation.py): on a runner that checks proposals
        # (a request may ask for it, or not, whatever the server's default)
        speculates = getattr(runner if runner else self.choice.cls, "speculates", False)
        self.proposer = self._proposer(loaded) if speculates else None
        self.spec_drafted = self.spec_accepted = 0  # proposed tokens checked, and kept
        self.spec_per_position = [0] * SPEC_POSITIONS  # kept, by place among a step's
        runner_cls: Any = type(runner) if runner else self.choice.cls
        moe_layers, experts_per_token = runner_cls.routing_shape(loaded.model.config)
        self.iteration_tokens = IterationTokens()
        self.process_usage = ProcessUsage()
        held = self._held(loaded)
        self.info = EngineInfo(
            vocab_size=self.vocab_size,
            context_length=self.context_length,
            max_context=min(self.context_length, self.token_capacity),
            eos_token_ids=tuple(sorted(self.eos_ids)),
            runner=self._runner_name,
            kv_cache_tokens=self.token_capacity,
            prefix_caching=self.pool.prefix_caching,
            deterministic=self.config.deterministic,
            weights=held[0],
            weights_in_blocks=held[1],
            block_sums=held[2],
            products=self._products(loaded),
            kernel_isa=self._kernel_isa(),
            architecture=str(getattr(getattr(loaded.model, "config", None), "model_type", "")),
            speculative=self.config.speculative if self.proposer else "off",
            embeddings=bool(getattr(runner if runner else self.choice.cls, "keeps_hidden", False)),
            hidden_size=int(getattr(getattr(loaded.model, "config", None), "hidden_size", 0) or 0),
            block_size=self.config.block_size,
            moe_layers=moe_layers,
            experts_per_token=experts_per_token,
            **self._device(),
        )

    def _device(self) -> dict[str, str]:
        """Where the forward runs, and the GPU path's precision (engine/device.py)."""
        from probserve.engine.device import gpu_path, interpreted

        gpu = gpu_path(self.config.device) if self.choice.name == "PagedRunner" else None
        if gpu is None:
            return {"device": "cpu", "precision": "exact"}
        where = "interpreted" if gpu.type == "cpu" and interpreted() else gpu.type
        return {"device": where, "precision": self.config.precision}

    def _held(self, loaded: LoadedModel) -> tuple[str, float, bool]:
        """How the weights are held (`weights`, `weights_in_blocks`, `block_sums`): the GGUF
        blocks served in place and their share, or (the GPU path, which dequantizes blocks at
        load) the dtype they are held in on the device."""
        if self._device()["device"] != "cpu":
            return ("bfloat16" if self.config.precision == "bf16" else "float32", 0.0, False)
        share = loaded.weights_in_blocks
        return (loaded.weights_format, round(share, 4), self.config.block_sums and share > 0)

    def _kernel_isa(self) -> str:
        """The C++ kernels' instruction path where the forward runs on them (the deterministic
        paged forward on the CPU), as the library reports it; "" elsewhere."""
        if self._device()["device"] != "cpu" or not self.config.deterministic:
            return ""
        from probserve.kernels.build import isa_path, load

        return isa_path(load())

    def _products(self, loaded: LoadedModel) -> str:
        """ "limbs" where some of the blocks held run in integer limbs (--products limbs, a
        format and CPU limbs.cpp serves, not --block-sums), else "float"."""
        cfg = self.config
        if self._device()["device"] != "cpu":  # the GPU path's products are float throughout
            return "float"
        if cfg.products != "limbs" or cfg.block_sums or loaded.weights_in_blocks <= 0:
            return "float"
        from probserve.kernels.build import load
        from probserve.kernels.invariant import limb_types
        from probserve.kernels.qlayout import FORMATS

        names = {FORMATS[t].name for t in limb_types(load())}
        return "limbs" if names & set(loaded.weights_format.split("+")) else "float"

    @property
    def runner(self) -> Runner:
        if self._runner is None:
            self._runner = self.choice.build(self.loaded)
            log.info(
                "engine: %s, %d KV blocks of %d tokens (%d tokens), prefix caching %s, "
                "deterministic %s, weights %s",
                self._runner_name,
                self.pool.num_blocks,
                self.config.block_size,
                self.token_capacity,
                "on" if self.pool.prefix_caching else "off",
                "on" if self.config.deterministic else "off",
                self.info.weights,
            )
        return self._runner

    def warmup(self) -> None:
        """Build the runner (and let it prepare: the GPU path captures its decode graphs) and
        run one tiny request, on the calling thread."""
        warm = getattr(self.runner, "warm", None)
        if warm is not None:
            warm()
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
        the steps' tokens and its process's memory and CPU."""
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
            spec_draft_tokens=self.spec_drafted,
            spec_accepted_tokens=self.spec_accepted,
            spec_accepted_per_position=tuple(self.spec_per_position),
            iteration_tokens=steps.cumulative(),
            iteration_tokens_sum=steps.total,
            iteration_tokens_count=steps.steps,
            process_resident_memory_bytes=rss,
            process_cpu_seconds=cpu,
        )

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
        rows = [self._sampler_row(ch.seq) for ch in to_sample]
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
        whose prompt is done."""
        to_sample: list[Chunk] = []
        prompt_scores: dict[str, TokenLogprobs] = {}
        outputs: list[EngineOutput] = []
        prompt_scoring.score_step(chunks, run.prompt_rows, self.runner.row_math)
        for ch in chunks:
            seq = ch.seq
            prompt_lp = prompt_scoring.collect(ch)
            if seq.score_only:
                if ch.end >= seq.num_tokens:
                    prompt_routed = self._prompt_routed(seq)
                    embedding = self._embedding(seq)
                    self.scheduler.finish(seq)
                    out = self._output(
                        seq, FinishReason.LENGTH, prompt_logprobs=prompt_lp,
                        prompt_routed=prompt_routed,
                    )  # fmt: skip
                    if embedding is not None:
                        out = dataclasses.replace(out, embedding=embedding)
                    outputs.append(out)
            elif ch.samples:
                to_sample.append(ch)
                if prompt_lp is not None:
                    prompt_scores[seq.request_id] = prompt_lp
        return to_sample, prompt_scores, outputs

    def _update(
        self,
        sampled: list[Chunk],
        drawn: list[Drawn],
        prompt_scores: dict[str, TokenLogprobs],
    ) -> list[EngineOutput]:
        """Each sequence's drawn tokens appended in order (finishing it on a stop id, its length
        or its grammar's end); the proposals accepted become its own; its next proposals."""
        outputs: list[EngineOutput] = []
        asks: list[tuple[Sequence, tuple[str, list[int], int]]] = []
        for ch, got in zip(sampled, drawn, strict=True):
            seq = ch.seq
            if got.error is not None:
                outputs.append(self._fail(seq, got.error))
                continue
            tokens: list[int] = []
            routed: list[RoutedExperts] = []
            prompt_routed = None
            finish: FinishReason | None = None
            for token in got.tokens:
                matcher = seq.matcher
                # a limit met while the mask was computed (it then allows only the stop ids), or
                # while the sampled token is consumed: the grammar ends here, cleanly
                consumed = matcher is None or (
                    not matcher.is_error()
                    and (token in seq.stop_ids or matcher.consume_token(token))
                )
                if not consumed:
                    limit = self._grammar_limit(seq, matcher)
                    if not tokens:  # nothing drawn before it: its own output
                        outputs.append(limit)
                    finish = limit.finish_reason  # else the tokens' output ends with it
                    break
                if seq.request.routing is not None:  # the row that drew it: the last position
                    last = seq.num_tokens - 1
                    routed.append(self.runner.routing(seq, last, last + 1))
                    prompt_routed = prompt_routed or self._prompt_routed(seq)
                tokens.append(token)
                finish = self.scheduler.append_token(seq, token)
                if finish is None and matcher is not None and matcher.is_stopped():
                    self.scheduler.finish(seq)  # the grammar is complete: nothing may follow
                    finish = FinishReason.GRAMMAR
                if finish is not None:
                    break
            else:
                self.scheduler.accepted(seq, got.accepted)
            if not tokens:
                continue  # the grammar met a limit at once (its output is out)
            ask = self._speculate(seq, ch.proposed, got.accepted, finish is None)
            if ask is not None:
                asks.append((seq, ask))
            scores = [lp for lp in got.logprobs[: len(tokens)] if lp is not None]
            outputs.append(
                self._output(
                    seq,
                    finish,
                    new_token_ids=tuple(tokens),
                    logprobs=_joined(scores),
                    prompt_logprobs=prompt_scores.get(seq.request_id),
                    routed=_joined_routing(routed),
                    prompt_routed=prompt_routed,
                )
            )
        self._propose(asks)
        return outputs

    def _proposer(self, loaded: LoadedModel) -> NgramProposer | DraftProposer:
        """`--speculative`'s proposer: a draft model's engine (draft:MODEL), else prompt lookup
        (also what a request's `speculative: true` gets where the server's default is off)."""
        mode = self.config.speculative
        if mode in ("off", "ngram"):
            return NgramProposer()
        from probserve.models.loader import load_model

        draft = load_model(mode[len("draft:") :], self.config.weights_to_load())
        if draft.vocab_size != loaded.vocab_size or (
            draft.tokenizer.get_vocab() != loaded.tokenizer.get_vocab()
        ):
            raise ValueError(
                f"the draft model {draft.name} has another tokenizer than {loaded.name}: its "
                "guesses would be other tokens"
            )
        cfg = self.config
        config = dataclasses.replace(
            cfg, speculative="off", kv_cache_gib=max(0.05, cfg.kv_cache_gib / 4), max_model_len=0
        )
        return DraftProposer(EngineCore(draft, config))

    def _speculate(
        self, seq: Sequence, checked: tuple[int, ...], accepted: int, running: bool
    ) -> tuple[str, list[int], int] | None:
        """Settle the check of `checked`; a running sequence's next proposals: with a grammar,
        the tokens it forces (up to FORCED_MOST), set here; else (or where the grammar forces
        nothing) the proposer's ask (request id, tokens, how many), answered for every
        sequence of the step together (`_update`)."""
        spec = seq.speculation
        if spec is None:
            asked = seq.request.speculative
            wanted = self.config.speculative != "off" if asked is None else asked
            if self.proposer is None or not wanted:
                return None
            spec = seq.speculation = Speculation(self.config.speculative_tokens)
        if checked:
            self.spec_drafted += len(checked)
            self.spec_accepted += accepted
            for j in range(min(accepted, SPEC_POSITIONS)):
                self.spec_per_position[j] += 1
        spec.proposed = checked
        spec.settle(accepted, self.config.speculative_tokens)
        if not running or self.proposer is None:
            return None
        # the drawn token after them; a step checks at most SPEC_POSITIONS
        room = min(seq.max_total_tokens - seq.num_tokens - 1, SPEC_POSITIONS)
        if seq.matcher is not None:
            spec.proposed = self.grammars.forced(seq.matcher, min(FORCED_MOST, room))
            if spec.proposed:
                return None
        # (a grammar's masks ahead stop the check at a proposal it refuses)
        return seq.request_id, seq.token_ids, min(spec.limit, room)

    def _propose(self, asks: list[tuple[Sequence, tuple[str, list[int], int]]]) -> None:
        """The step's proposals, every asking sequence's from one call of the proposer."""
        if not asks or self.proposer is None:
            return
        got = self.proposer.propose_many([ask for _, ask in asks])
        for seq, (rid, _, _) in asks:
            if seq.speculation is not None:
                seq.speculation.proposed = got.get(rid, ())

    def _embedding(self, seq: Sequence) -> np.ndarray | None:
        """The prompt's final hidden states pooled as its request asks (mean: summed in float64
        in position order; last; cls: the first), float32; None where none is asked."""
        how = seq.request.embed
        if how is None:
            return None
        n = seq.num_prompt_tokens
        if how == "mean":
            rows = self.runner.hidden(seq, 0, n).double()
            return (rows.sum(dim=0) / n).float().numpy()
        at = n - 1 if how == "last" else 0
        return self.runner.hidden(seq, at, at + 1)[0].float().numpy().copy()

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
            outs.append(self._output(seq, FinishReason.ERROR, error=message))
        return outs

    # ---- helpers --------------------------------------------------------------------------
    def _sampler_row(self, seq: Sequence) -> SamplerRow:
        return SamplerRow(
            params=seq.request.sampling,
            logprobs=seq.request.logprobs,
            seed=seq.seed,
            prompt_ids=seq.prompt_tensor,
            output_ids=seq.output_ids,
            stop_ids=seq.stop_ids,
            position=seq.num_tokens,
        )

    @staticmethod
    def _output(
        seq: Sequence,
        finish: FinishReason | None,
        new_token_ids: tuple[int, ...] = (),
        logprobs: TokenLogprobs | None = None,
        prompt_logprobs: TokenLogprobs | None = None,
        error: str | None = None,
        routed: RoutedExperts | None = None,
        prompt_routed: RoutedExperts | None = None,
    ) -> EngineOutput:
        return EngineOutput(
            seq.request_id,
            new_token_ids=new_token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            finish_reason=finish,
            error=error,
            queue_time=seq.queue_time,
            cached_tokens=seq.cached_tokens,
            routed=routed,
            prompt_routed=prompt_routed,
        )

    def _grammar_limit(self, seq: Sequence, matcher: Any) -> EngineOutput:
        """The sequence ends where its grammar met a bound of llguidance's (the sampled token
        is not appended); what the bound was is logged, never sent (it holds the grammar)."""
        log.warning(
            "request %s: its grammar met a limit after %d tokens: %s",
            seq.request_id, len(seq.output_ids), first_line(matcher.get_error()),
        )  # fmt: skip
        self.scheduler.finish(seq)
        return self._output(seq, FinishReason.GRAMMAR_LIMIT)

    def _fail(self, seq: Sequence, message: str) -> EngineOutput:
        log.warning("request %s failed: %s", seq.request_id, message)
        self.scheduler.finish(seq)
        return self._output(seq, FinishReason.ERROR, error=message)
