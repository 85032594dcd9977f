"""Constrained decoding in the engine: the tokens follow the grammar, raw logprobs are the
model's own (the reference's), processed ones the masked distribution renormalised, and
`constraint_logmass` the raw mass the grammar allowed; the same bits alone or in a batch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import run_core
from reference import full_logprobs

from probserve.api.plans.grammar import GrammarAsk, compile_grammar
from probserve.engine import (
    EngineConfig,
    EngineCore,
    EngineRequest,
    FinishReason,
    LogprobsMode,
    LogprobsSpec,
    RequestError,
    SamplingParams,
)
from probserve.engine.core.grammar import Grammars
from probserve.models import LoadedModel

CHOICES = ["positive", "negative", "neutral", "mixed feelings"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _grammar(kind: str, source: object) -> str:
    return compile_grammar(GrammarAsk(kind, "test", source), 65_536, 1024)


@pytest.fixture(scope="module")
def core(smol: LoadedModel) -> EngineCore:
    return EngineCore(smol, EngineConfig(kv_cache_gib=0.25))


def _request(
    smol: LoadedModel, rid: str, prompt: str, grammar: str | None, n: int = 24
) -> EngineRequest:
    ids = tuple(smol.tokenizer(prompt).input_ids)
    spec = LogprobsSpec(top_k=3, mode=LogprobsMode.BOTH)
    return EngineRequest(
        rid, ids, SamplingParams(temperature=0.0, max_tokens=n), spec, grammar=grammar
    )


def _tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_choice_follows_the_grammar_with_exact_logprobs(smol: LoadedModel, core: EngineCore):
    grammar = _grammar("choice", CHOICES)
    req = _request(smol, "c", "Review: I loved every minute of it. Sentiment:", grammar)
    outs = run_core(core, [req])["c"]
    ids = _tokens(outs)
    assert smol.tokenizer.decode(ids) in CHOICES
    assert outs[-1].finish_reason == FinishReason.GRAMMAR
    # the reference, step by step: the grammar's mask from a matcher of the test's own
    grammars = Grammars(smol.tokenizer, smol.vocab_size, smol.eos_token_ids)
    matcher = grammars.matcher(grammar)
    rows = full_logprobs(smol.model, [*req.prompt_token_ids, *ids])
    # one logprobs row a token (an output carries several where the grammar's forced tokens
    # were proposed and kept)
    each = [(out.logprobs, i) for out in outs for i in range(len(out.new_token_ids))]
    for t, ((lp, i), tok) in enumerate(zip(each, ids, strict=True)):
        allowed = grammars.allowed(matcher, frozenset(smol.eos_token_ids))
        ref = rows[len(req.prompt_token_ids) - 1 + t]
        mass = float(torch.logsumexp(ref[allowed].double(), 0))
        assert lp is not None and lp.processed is not None and lp.constraint_logmass is not None
        assert abs(float(lp.logprobs[i]) - float(ref[tok])) < 1e-4  # raw: the model's own
        assert abs(float(lp.constraint_logmass[i]) - mass) < 1e-4
        # processed: the masked distribution renormalised (greedy: nothing else processes it)
        assert abs(float(lp.processed.logprobs[i]) - (float(ref[tok]) - mass)) < 1e-4
        masked = lp.processed.top_ids[i][lp.processed.top_logprobs[i] > -1e30]
        assert all(bool(allowed[int(a)]) for a in masked)
        assert matcher.consume_token(tok)
    assert matcher.is_stopped() or matcher.is_accepting()


def test_json_schema_output_parses_and_is_the_same_in_a_batch(smol: LoadedModel, core: EngineCore):
    grammar = _grammar("json_schema", SCHEMA)
    prompt = "Write a JSON object describing a person called Ada, aged 36:"
    alone = run_core(core, [_request(smol, "j", prompt, grammar, 48)])["j"]
    value = json.loads(smol.tokenizer.decode(_tokens(alone)))
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert len(value["name"]) <= 12
    # among others (constrained and free): the same tokens and the same bits
    others = [
        _request(smol, "free", "Once upon a time", None, 20),
        _request(smol, "choice", "The weather today is", _grammar("choice", CHOICES)),
        _request(smol, "regex", "Phone:", _grammar("regex", r"\+?[0-9]{3}-[0-9]{4}")),
        _request(smol, "j", prompt, grammar, 48),
    ]
    together = run_core(core, others)
    assert _tokens(together["j"]) == _tokens(alone)
    assert all(o.logprobs is not None for o in [*alone, *together["j"]])
    for name in ("logprobs", "top_ids", "top_logprobs", "constraint_logmass"):  # any grouping
        got = np.concatenate([getattr(o.logprobs, name) for o in together["j"]])
        want = np.concatenate([getattr(o.logprobs, name) for o in alone])
        assert np.array_equal(want, got), name
    phone = smol.tokenizer.decode(_tokens(together["regex"]))
    assert phone.lstrip("+")[:3].isdigit() and phone[-5] == "-"
    assert together["free"][-1].logprobs.constraint_logmass is None


def test_the_engine_refuses_a_grammar_llguidance_refuses(smol: LoadedModel, core: EngineCore):
    bad = EngineRequest("bad", (1, 2, 3), SamplingParams(max_tokens=4), grammar='{"grammars": 7}')
    with pytest.raises(RequestError):
        core.add_request(bad)
    assert not core.has_work()


def test_preempted_constrained_requests_keep_their_tokens_and_bits(
    smol: LoadedModel, core: EngineCore
):
    """A KV cache too small for every sequence: constrained ones are preempted, recomputed
    and go on with their matchers where they were; every result equals the one alone."""
    grammar = _grammar("json_schema", SCHEMA)
    prompts = [
        f"Person {i}: write a JSON object describing someone aged {20 + i}:" for i in range(6)
    ]
    reqs = [_request(smol, f"g{i}", p, grammar, 40) for i, p in enumerate(prompts)]
    alone = {r.request_id: run_core(core, [r])[r.request_id] for r in reqs}
    per_token = 4 * (2 * 30 * 3 * 64 + 576)
    tight = EngineCore(smol, EngineConfig(block_size=4, kv_cache_gib=20 * 4 * per_token / 2**30))
    together = run_core(tight, reqs)
    assert tight.scheduler.num_preemptions > 0
    for rid, expected in alone.items():
        assert _tokens(together[rid]) == _tokens(expected), rid
        for name in ("logprobs", "top_logprobs", "constraint_logmass"):  # rows in any grouping
            got = [getattr(o.logprobs, name) for o in together[rid] if o.logprobs is not None]
            want = [getattr(o.logprobs, name) for o in expected if o.logprobs is not None]
            assert np.array_equal(np.concatenate(want), np.concatenate(got)), (rid, name)
        json.loads(smol.tokenizer.decode(_tokens(expected)))
    assert tight.pool.num_in_use() == 0


def test_the_api_compiles_and_checks_a_grammar_once(smol: LoadedModel, monkeypatch):
    """The same schema asked again is not compiled or checked again (the model's cache); a
    different one is, and the cache keeps only its most recent grammars."""
    from types import SimpleNamespace

    from probserve.api.errors import APIError
    from probserve.api.plans import grammar as plans_grammar
    from probserve.api.server.config import ServerConfig
    from probserve.api.server.grammar_cache import GrammarCache
    from probserve.api.server.limits import Limits
    from probserve.engine.grammar import llguidance_tokenizer

    lltok = llguidance_tokenizer(smol.tokenizer, smol.vocab_size, sorted(smol.eos_token_ids))
    model = SimpleNamespace(grammars=GrammarCache(2), grammar_tokenizer=lambda: lltok)
    config = ServerConfig(limits=Limits(), schema_extra_keys="forbid")  # the real settings
    state = SimpleNamespace(config=config, model=model)
    compiled: list[str] = []
    real = plans_grammar.compile_grammar

    def counting(ask: GrammarAsk, *limits: int | bool) -> str:
        compiled.append(ask.kind)
        return real(ask, *limits)  # type: ignore[arg-type]

    monkeypatch.setattr(plans_grammar, "compile_grammar", counting)
    ask = GrammarAsk("json_schema", "response_format", SCHEMA)
    first = plans_grammar._checked(ask, state)  # type: ignore[arg-type]
    assert plans_grammar._checked(ask, state) == first and compiled == ["json_schema"]  # type: ignore[arg-type]
    reordered = {**SCHEMA, "properties": dict(reversed(list(SCHEMA["properties"].items())))}
    assert plans_grammar._checked(GrammarAsk("json_schema", "x", reordered), state) != first  # type: ignore[arg-type]
    plans_grammar._checked(GrammarAsk("choice", "x", CHOICES), state)  # type: ignore[arg-type]
    assert len(model.grammars) == 2 and len(compiled) == 3
    plans_grammar._checked(ask, state)  # type: ignore[arg-type]
    assert len(compiled) == 4  # the first one had gone: at most 2 kept
    with pytest.raises(APIError):  # a bad grammar is refused every time, and never kept
        plans_grammar._checked(GrammarAsk("regex", "x", "(unclosed"), state)  # type: ignore[arg-type]
    assert len(model.grammars) == 2


def test_one_matcher_is_built_per_grammar_and_copied(smol: LoadedModel, monkeypatch):
    import llguidance

    built: list[str] = []
    real = llguidance.LLMatcher

    def counting(*args: object, **kwargs: object) -> object:
        built.append("x")
        return real(*args, **kwargs)

    grammar = _grammar("json_schema", SCHEMA)
    grammars = Grammars(smol.tokenizer, smol.vocab_size, frozenset(smol.eos_token_ids))
    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    first, second = grammars.matcher(grammar), grammars.matcher(grammar)
    assert len(built) == 1 and grammars.ready(grammar)
    token = int(np.flatnonzero(grammars.allowed(first, frozenset({2})).numpy())[0])
    assert first.consume_token(token)
    # the copies are independent: the second is still at the grammar's start
    assert (
        grammars.allowed(second, frozenset({2})).numpy().tolist()
        == grammars.allowed(grammars.matcher(grammar), frozenset({2})).numpy().tolist()
    )


def test_one_new_grammar_is_set_up_a_step(smol: LoadedModel, core: EngineCore):
    a = _grammar("json_schema", {**SCHEMA, "title": "a"})
    b = _grammar("json_schema", {**SCHEMA, "title": "b"})
    reqs = [_request(smol, f"g{i}", "A person:", g, n=4) for i, g in enumerate((a, a, b))]
    outputs = core.apply(reqs, [])
    assert outputs == [] and core.scheduler.find("g0") and core.scheduler.find("g1")
    assert core.scheduler.find("g2") is None and core.has_work()  # b waits for the next call
    core.apply([], [])
    assert core.scheduler.find("g2") is not None
    while core.has_work():
        core.step()


def test_a_grammar_that_meets_a_bound_partway_ends_cleanly(smol: LoadedModel, core: EngineCore):
    ambiguous = _grammar("grammar", 'start: s\ns: s s s s s s | "a" | ""')
    outs = run_core(core, [_request(smol, "amb", "x", ambiguous, n=300)])["amb"]
    assert outs[-1].finish_reason == FinishReason.GRAMMAR_LIMIT and outs[-1].error is None
    assert 0 < len(_tokens(outs)) < 300
    assert not core.has_work() and core.stats().held_caches == 0


def test_a_started_engine_holds_no_tokenizer_and_builds_the_same_grammars(
    smol: LoadedModel, core: EngineCore
):
    """A started engine (the worker's, a Ray replica's) drops the model's tokenizer (the API's
    process holds its own; Qwen3.5's 248k-token one takes 211 MB) and keeps what llguidance's
    tokenizer is built from: a grammar's first request there gives the tokens and bits an
    engine holding the tokenizer gives."""
    from probserve.engine.core.host import start_engine

    started = start_engine(None, EngineConfig(kv_cache_gib=0.25, weights="float32"))
    assert started.core.loaded.tokenizer is None and started.core.grammars._hf is None
    assert started.tokenizer_class  # (named before it went: the API loads the same class)
    grammar = _grammar("json_schema", SCHEMA)
    prompt = "Write a JSON object describing a person called Ada, aged 36:"
    there = run_core(started.core, [_request(smol, "j", prompt, grammar, 48)])["j"]
    here = run_core(core, [_request(smol, "j", prompt, grammar, 48)])["j"]
    assert _tokens(there) == _tokens(here)
    for a, b in zip(there, here, strict=True):
        assert a.logprobs is not None and b.logprobs is not None
        assert np.array_equal(a.logprobs.logprobs, b.logprobs.logprobs)
        assert a.logprobs.processed is not None and b.logprobs.processed is not None
        assert np.array_equal(a.logprobs.processed.logprobs, b.logprobs.processed.logprobs)
