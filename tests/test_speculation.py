"""Speculative decoding that changes no bit (engine/core/speculation.py): with proposals checked
as extra rows, every token and logprobs field is the same bits as plain decoding, greedy and
seeded sampling alike, whatever the proposals (the true continuation, random tokens, always
wrong ones), alone and among other requests with a small step budget; prompt lookup proposes
what recurs."""

from __future__ import annotations

import random
import time
import types

import numpy as np
import pytest
from conftest import run_core
from hypothesis import given, settings
from hypothesis import strategies as st

from probserve.engine import (
    EngineConfig,
    EngineCore,
    EngineRequest,
    LogprobsMode,
    LogprobsSpec,
    SamplingParams,
)
from probserve.engine.core import speculation
from probserve.engine.core.host import engine_over
from probserve.engine.core.speculation import REST_MOST, NgramProposer, Speculation
from probserve.models import LoadedModel, load_model

SPEC = LogprobsSpec(top_k=4, mode=LogprobsMode.BOTH, target_ids=(5, 900), entropy=True)
REPEAT = [int(t) for t in np.random.default_rng(3).integers(10, 40000, size=9)]
PROMPT = REPEAT * 3 + REPEAT[:4]  # a text whose continuation is in its prompt


def _requests() -> list[EngineRequest]:
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=24, ignore_eos=True)
    return [
        EngineRequest("greedy", tuple(PROMPT), SamplingParams(temperature=0, max_tokens=24), SPEC),
        EngineRequest("sampled", tuple(PROMPT[1:]), sampled, SPEC),
        EngineRequest(
            "penalised", tuple(PROMPT[5:]),
            SamplingParams(temperature=0.7, seed=4, max_tokens=16, repetition_penalty=1.3,
                           frequency_penalty=0.4, min_tokens=3),
            SPEC,
        ),
    ]  # fmt: skip


def _numbers(outs: list) -> tuple[list[int], dict[str, bytes]]:
    """The tokens, and each logprobs array over all the outputs (rows in any grouping)."""
    tokens = [t for o in outs for t in o.new_token_ids]
    fields: dict[str, list[np.ndarray]] = {}
    for o in outs:
        for kind, lp in (("raw", o.logprobs), ("processed", o.logprobs and o.logprobs.processed)):
            if lp is None:
                continue
            for name in ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs",
                         "target_logprobs", "entropy"):  # fmt: skip
                arr = getattr(lp, name)
                if arr is not None:
                    fields.setdefault(f"{kind}.{name}", []).append(np.asarray(arr))
    return tokens, {k: np.concatenate(v).tobytes() for k, v in fields.items()}


def _run(
    model: LoadedModel, reqs: list[EngineRequest], proposer=None, draft=None, **config
) -> dict:
    core = engine_over(model, EngineConfig(kv_cache_gib=0.05, block_size=4, **config), draft)
    if proposer is not None:
        core.speculator.proposer = proposer
    outs = run_core(core, reqs)
    return {rid: _numbers(o) for rid, o in outs.items()} | {"_core": core}


class _Each:
    """A proposer from its subclass's `propose`: every ask answered in turn."""

    def propose_many(self, asks) -> dict[str, tuple[int, ...]]:
        return {rid: self.propose(tokens, k) for rid, tokens, k in asks}  # type: ignore[attr-defined]


class _Fixed(_Each):
    """Proposes from a table of known continuations, or random tokens."""

    def __init__(self, table: dict[tuple[int, ...], list[int]] | None, seed: int = 0) -> None:
        self.table, self.rng = table, random.Random(seed)

    def propose(self, tokens: list[int], k: int) -> tuple[int, ...]:
        if self.table is None:
            return tuple(self.rng.randrange(10, 40000) for _ in range(k))
        for prompt, full in self.table.items():
            if tuple(tokens[: len(prompt)]) == prompt and len(full) >= len(tokens):
                return tuple(full[len(tokens) : len(tokens) + k])
        return ()


@pytest.fixture(scope="module")
def plain(tiny: LoadedModel) -> dict:
    return _run(tiny, _requests(), speculative="off")


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    ngram = NgramProposer()
    assert ngram.propose([1, 2, 3, 9, 1, 2, 3], 3) == (9, 1, 2)
    assert ngram.propose([1, 2, 3, 9, 1, 2, 3], 1) == (9,)
    assert ngram.propose([5, 6, 7, 8], 4) == ()  # nothing recurs
    assert ngram.propose([7, 1, 9, 7, 1, 2, 7, 1], 2) == (2, 7)  # the latest occurrence
    assert ngram.propose([7, 1, 7, 2, 7], 2) == ()  # one token recurring is not a match
    assert NgramProposer(min_n=1).propose([7, 1, 7, 2, 7], 2) == (2, 7)
    assert ngram.propose([4, 4, 4], 3) == (4,)
    assert ngram.propose([1, 2], 0) == ()


def test_guesses_that_keep_missing_rest_the_sequence():
    """Misses in a row rest it 1, 3, 7, 15, 31, then REST_MOST steps; a kept token ends the
    rests (text that does not repeat costs an extra row about once in REST_MOST + 1 steps)."""
    spec = Speculation(4)
    rests = []
    for _ in range(8):
        spec.proposed = (1, 2)
        spec.settle(0, 4)
        skipped = 0
        while spec.resting():
            skipped += 1
        rests.append(skipped)
    assert rests == [1, 3, 7, 15, 31, REST_MOST, REST_MOST, REST_MOST]
    assert spec.limit == 1 and spec.drafted == 16
    spec.proposed = (5,)
    spec.settle(1, 4)
    assert not spec.resting() and spec.limit == 2 and spec.misses == 0


def test_auto_speculates_where_it_was_measured():
    """`--speculative auto` (the default): prompt lookup on the CPU engine for a model without a
    recurrent state, off on the GPU path (on a device or interpreted) and for a hybrid model;
    any other setting as asked."""
    from probserve.engine.core.speculator import default_mode

    auto = EngineConfig()
    assert auto.speculative == "auto"
    assert default_mode(auto, "cpu", hybrid=False) == "ngram"
    assert default_mode(auto, "cuda", hybrid=False) == "off"
    assert default_mode(auto, "interpreted", hybrid=False) == "off"
    assert default_mode(auto, "cpu", hybrid=True) == "off"
    for asked in ("off", "ngram", "draft"):
        assert default_mode(EngineConfig(speculative=asked), "cuda", hybrid=True) == asked  # type: ignore[arg-type]


def test_a_lookup_that_matches_nothing_looks_again_next_step(tiny: LoadedModel):
    """No n-gram matched: no rest (a reply that starts to copy its prompt is caught at once);
    only guesses that were checked and missed rest it."""
    from probserve.engine.core.speculator import Speculator

    spec = Speculator.lookup(EngineConfig(speculative="ngram"), "ngram")
    seq = types.SimpleNamespace(speculation=Speculation(4))
    spec.propose([(seq, ("r", [5, 6, 7, 8, 9], 3))], 1)  # type: ignore[list-item]
    assert seq.speculation.proposed == () and seq.speculation.misses == 0
    assert not seq.speculation.resting()
    spec.propose([(seq, ("r", [5, 6, 7, 5, 6], 3))], 1)  # type: ignore[list-item]
    assert seq.speculation.proposed == (7, 5, 6)


def test_auto_proposes_unasked_only_while_few_sequences_run():
    """`auto`'s lookup (measured to cost more than 3% from 4 streams on text that does not
    repeat): a request that did not ask gets proposals while at most AUTO_MOST_RUNNING
    sequences run, none beyond (its last ones dropped); one that asked gets them at any load,
    and so does every request under an explicit `--speculative ngram`."""
    from probserve.engine.core.speculator import AUTO_MOST_RUNNING, Speculator

    def seqs() -> list:
        return [
            types.SimpleNamespace(
                speculation=Speculation(4), request=types.SimpleNamespace(speculative=asked)
            )
            for asked in (None, True)
        ]

    copy = [5, 6, 7, 5, 6]
    auto = Speculator.lookup(EngineConfig(), "ngram")
    unasked, asked = seqs()
    unasked.speculation.proposed = (1, 2)  # the last step's, checked already
    auto.propose([(unasked, ("u", copy, 3)), (asked, ("a", copy, 3))], AUTO_MOST_RUNNING + 1)
    assert unasked.speculation.proposed == () and asked.speculation.proposed == (7, 5, 6)
    unasked, asked = seqs()
    auto.propose([(unasked, ("u", copy, 3)), (asked, ("a", copy, 3))], AUTO_MOST_RUNNING)
    assert unasked.speculation.proposed == asked.speculation.proposed == (7, 5, 6)
    ngram = Speculator.lookup(EngineConfig(speculative="ngram"), "ngram")
    unasked, _ = seqs()
    ngram.propose([(unasked, ("u", copy, 3))], 64)
    assert unasked.speculation.proposed == (7, 5, 6)


@pytest.mark.parametrize("proposer", ["ngram", "oracle", "random"])
def test_speculation_changes_no_bit(
    tiny: LoadedModel, plain: dict, proposer: str, monkeypatch: pytest.MonkeyPatch
):
    """Greedy, seeded sampling and penalties with min_tokens: the tokens and every logprobs
    field (raw and processed, top-k, target ids, entropy) the same bits with each proposer;
    the true continuation is accepted whole, random tokens almost never (no rests: every
    step checks a proposal)."""
    monkeypatch.setattr(speculation, "REST_MOST", 0)
    table = {
        tuple(r.prompt_token_ids): [*r.prompt_token_ids, *plain[r.request_id][0]]
        for r in _requests()
    }
    # (prompt lookup on single tokens: the tiny random model's text repeats no pair of them)
    ngram = NgramProposer(min_n=1)
    chosen = {"ngram": ngram, "oracle": _Fixed(table), "random": _Fixed(None, 5)}[proposer]
    spec = _run(tiny, _requests(), chosen, speculative="ngram")
    core = spec.pop("_core")
    for rid in ("greedy", "sampled", "penalised"):
        assert spec[rid] == plain[rid], rid
    assert core.speculator.drafted > 0
    if proposer == "oracle":
        assert core.speculator.accepted == core.speculator.drafted
    if proposer == "random":
        assert core.speculator.accepted < core.speculator.drafted // 4


def test_speculation_among_other_requests_and_a_small_budget(tiny: LoadedModel, plain: dict):
    """Proposals count against the step's token budget (a budget of 6 tokens among 5 other
    requests): the same bits."""
    others = [
        EngineRequest(f"o{i}", tuple(PROMPT[i : i + 7]),
                      SamplingParams(temperature=0, max_tokens=5 + i), SPEC)
        for i in range(5)
    ]  # fmt: skip
    mixed = _run(
        tiny, [*others[:2], *_requests(), *others[2:]], speculative="ngram",
        max_num_batched_tokens=6, speculative_tokens=3,
    )  # fmt: skip
    mixed.pop("_core")
    for rid in ("greedy", "sampled", "penalised"):
        assert mixed[rid] == plain[rid], rid


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 6), st.floats(0.0, 1.0))
def test_any_proposals_change_no_bit(tiny: LoadedModel, plain: dict, seed, most, right):
    """Proposals mixing the true continuation and random tokens (a `right` share correct), up
    to `most` a step, no rests after misses: the same bits as plain decoding."""
    rng = random.Random(seed)
    truths = {tuple(r.prompt_token_ids): [*r.prompt_token_ids, *plain[r.request_id][0]]
              for r in _requests()}  # fmt: skip

    class Mixed(_Each):
        def propose(self, tokens: list[int], k: int) -> tuple[int, ...]:
            for prompt, full in truths.items():
                if tuple(tokens[: len(prompt)]) == prompt:
                    want = full[len(tokens) : len(tokens) + k]
                    return tuple(t if rng.random() < right else rng.randrange(40000) for t in want)
            return ()

    with pytest.MonkeyPatch.context() as no_rests:
        no_rests.setattr(speculation, "REST_MOST", 0)
        spec = _run(tiny, _requests(), Mixed(), speculative="ngram", speculative_tokens=most)
    spec.pop("_core")
    for rid in ("greedy", "sampled", "penalised"):
        assert spec[rid] == plain[rid], rid


TEXT = "The quick brown fox jumps over the lazy dog. " * 3 + "The quick brown"


def _metric(text: str, name: str) -> float:
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name))


# requests beside a speculating one: sampled (seeded) and greedy, one not speculating itself
MATES = [
    ("/v1/completions", {"prompt": "My favourite animal is", "max_tokens": 16, "temperature": 0.9,
                         "seed": 5, "logprobs": 2, "ignore_eos": True}),
    ("/v1/completions", {"prompt": "Rivers of Europe:", "max_tokens": 16, "temperature": 0,
                         "logprobs": 2, "ignore_eos": True, "speculative": False}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three rivers."}],
                              "max_tokens": 16, "temperature": 0.7, "seed": 2, "logprobs": True,
                              "top_logprobs": 2}),
]  # fmt: skip


@pytest.mark.slow
def test_the_server_answers_the_same_bits_with_speculation(smol: LoadedModel, http):
    """The embedded model, a server with --speculative ngram against the session's answers
    with `speculative: false`:
    completions (echo, top logprobs, entropy) and seeded sampled chat, whole and streamed, the
    same JSON; the drafted and accepted tokens counted on /metrics, the default on /health, a
    request's `speculative: false` honoured; the sampled chat alone has proposals checked and
    accepted (its own); requests batched with a speculating one answer as plain decoding does."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from server_util import InFlight, running_server, wait_until

    completion = {
        "prompt": TEXT, "max_tokens": 24, "temperature": 0, "logprobs": 3, "echo": True,
        "return_entropy": True, "ignore_eos": True,
    }  # fmt: skip
    chat = {
        "messages": [{"role": "user", "content": "Copy this: " + TEXT}], "max_tokens": 20,
        "temperature": 0.8, "seed": 7, "logprobs": True, "top_logprobs": 2,
    }  # fmt: skip

    def answers(c, **off: bool) -> list:
        got = [c.post("/v1/completions", json=completion | off).json()["choices"]]
        got.append(c.post("/v1/chat/completions", json=chat | off).json()["choices"])
        with c.stream("POST", "/v1/completions", json={**completion, "stream": True, **off}) as s:
            got.append([ln for ln in s.iter_lines() if ln.startswith("data: {")])
        return got

    def scrubbed(got: list) -> list:
        """The stream as one choice: its chunks' texts and logprobs lists joined (speculation
        delivers several tokens a chunk, so the chunks' boundaries differ, not their sum)."""
        import json

        joined: dict = {"text": "", "finish_reason": None}
        for ln in got[2]:
            choice = json.loads(ln[6:])["choices"][0]
            joined["text"] += choice["text"]
            joined["finish_reason"] = choice["finish_reason"] or joined["finish_reason"]
            for key, values in (choice["logprobs"] or {}).items():
                joined.setdefault(key, []).extend(values)
        return [got[0], got[1], joined]

    def mate(base: str, path: str, body: dict) -> list:
        return httpx.post(f"{base}{path}", json=body, timeout=120).json()["choices"]

    plain = scrubbed(answers(http, speculative=False))
    base = str(http.base_url).rstrip("/")
    plain_mates = [mate(base, path, {**body, "speculative": False}) for path, body in MATES]
    with running_server(smol, "--speculative", "ngram") as url:
        c = httpx.Client(base_url=url, timeout=120)
        assert c.get("/health").json()["speculative"] == "ngram"
        spec = scrubbed(answers(c))

        def settled(name: str) -> float:  # the engine's figures arrive with its next step
            time.sleep(0.5)
            return _metric(c.get("/metrics").text, name)

        drafted = settled("vllm:spec_decode_num_draft_tokens_total")
        first = settled('vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="'
                        'smollm2-135m-instruct",position="0"}')  # fmt: skip
        accepted = settled("vllm:spec_decode_num_accepted_tokens_total")
        off = c.post("/v1/completions", json={**completion, "speculative": False}).json()
        after = settled("vllm:spec_decode_num_draft_tokens_total")

        def accepted_now() -> float:
            return _metric(c.get("/metrics").text, "vllm:spec_decode_num_accepted_tokens_total")

        # the seeded sampled chat alone on the server: its own proposals checked and accepted
        before = accepted_now()
        alone = c.post("/v1/chat/completions", json=chat).json()["choices"]
        sampled_accepted = wait_until(lambda: accepted_now() > before)
        # batch-mates: while a greedy copy (speculating, thousands of tokens to go) runs
        hog = InFlight(url, {"prompt": TEXT, "max_tokens": 4000, "temperature": 0,
                             "ignore_eos": True})  # fmt: skip
        assert hog.started.wait(120)
        drafting = _metric(c.get("/metrics").text, "vllm:spec_decode_num_draft_tokens_total")
        with ThreadPoolExecutor(len(MATES)) as pool:
            mates = list(pool.map(lambda m: mate(url, *m), MATES))
        beside = c.get("/health").json()["running"]  # the copy still running: they shared steps
        drafted_beside = _metric(c.get("/metrics").text, "vllm:spec_decode_num_draft_tokens_total")
        hog.leave()
        hog_status, _, _ = hog.join()
    assert spec[0] == plain[0] and spec[1] == plain[1]
    assert spec[2] == plain[2] and spec[2]["text"]
    assert drafted > 0 and 0 < accepted <= drafted and 0 < first <= accepted
    assert off["choices"] == plain[0] and after == drafted
    assert alone == plain[1] and sampled_accepted
    assert beside >= 1 and hog_status == 200 and drafted_beside > drafting
    assert mates == plain_mates


def test_a_grammars_forced_tokens_are_proposed_and_change_no_bit(smol: LoadedModel):
    """A JSON schema with fixed keys and a choice: the tokens the grammar forces are proposed
    and accepted (fewer steps), and the tokens, raw and processed logprobs and the constraint's
    mass are the same bits as without speculation, greedy and sampled."""
    from probserve.api.plans.grammar import GrammarAsk, compile_grammar

    schema = {
        "type": "object",
        "properties": {
            "keeper_name": {"type": "string", "maxLength": 16},
            "mood": {"enum": ["cheerful and content", "quietly melancholic"]},
            "year_of_automation": {"type": "integer"},
        },
        "required": ["keeper_name", "mood", "year_of_automation"],
        "additionalProperties": False,
    }
    grammar = compile_grammar(GrammarAsk("json_schema", "test", schema), 65_536, 1024)
    ids = tuple(smol.tokenizer("The keeper, Tom, was happy. As JSON:").input_ids)
    spec = LogprobsSpec(top_k=3, mode=LogprobsMode.BOTH)

    def requests() -> list[EngineRequest]:
        return [
            EngineRequest("g", ids, SamplingParams(temperature=0, max_tokens=60), spec,
                          grammar=grammar),
            EngineRequest("s", ids, SamplingParams(temperature=0.8, seed=3, max_tokens=60), spec,
                          grammar=grammar),
        ]  # fmt: skip

    def numbers(core: EngineCore) -> tuple[dict, int]:
        outs = run_core(core, requests())
        got = {}
        for rid, o in outs.items():
            tokens, fields = _numbers(o)
            masses = [np.asarray(x.logprobs.constraint_logmass) for x in o if x.logprobs]
            got[rid] = (tokens, fields, np.concatenate(masses).tobytes(), o[-1].finish_reason)
        steps = sum(len(o) for o in outs.values())
        return got, steps

    off = EngineConfig(kv_cache_gib=0.1, speculative="off")
    plain, plain_steps = numbers(EngineCore(smol, off))
    core = EngineCore(smol, EngineConfig(kv_cache_gib=0.1, speculative="ngram"))
    spec_on, spec_steps = numbers(core)
    assert spec_on == plain
    spec = core.speculator
    assert spec.accepted > 10 and spec.accepted >= 0.8 * spec.drafted
    assert spec_steps < plain_steps  # outputs: one a step
    text = smol.tokenizer.decode(plain["g"][0], skip_special_tokens=True)
    assert text.startswith('{"keeper_name": "'), text


def test_a_draft_models_guesses_change_no_bit(tiny: LoadedModel, tiny_dir, smol, plain: dict):
    """--speculative draft --draft-model MODEL: a draft model with the same tokenizer guesses
    greedily (its own engine); the same model as its own draft has every greedy guess
    accepted; the tokens and logprobs the same bits either way. A draft with another tokenizer,
    a malformed mode, or a draft mode without its model (or a model without the mode) stops the
    start."""
    draft = load_model(str(tiny_dir), EngineConfig().weights_to_load())
    same = _run(tiny, _requests(), draft=draft, speculative="draft")
    core = same.pop("_core")
    for rid in ("greedy", "sampled", "penalised"):
        assert same[rid] == plain[rid], rid
    assert core.info.speculative == f"draft:{draft.name}"
    assert 0 < core.speculator.accepted <= core.speculator.drafted
    greedy_only = _run(tiny, _requests()[:1], draft=draft, speculative="draft")
    greedy_core = greedy_only.pop("_core")
    assert greedy_only["greedy"] == plain["greedy"]
    assert greedy_core.speculator.accepted == greedy_core.speculator.drafted > 0
    with pytest.raises(ValueError, match="must be auto, off, ngram or draft"):
        EngineCore(tiny, EngineConfig(kv_cache_gib=0.05, speculative="draft:"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a draft model"):
        engine_over(tiny, EngineConfig(kv_cache_gib=0.05, speculative="draft"))
    with pytest.raises(ValueError, match="needs a draft model"):
        engine_over(tiny, EngineConfig(kv_cache_gib=0.05, speculative="ngram"), draft)
    with pytest.raises(ValueError, match="must be auto, off, ngram or draft"):
        EngineCore(tiny, EngineConfig(kv_cache_gib=0.05, speculative="eagle"))


def test_a_draft_with_another_tokenizer_is_refused(tiny: LoadedModel, tmp_path, smol):
    """A draft whose vocabulary differs from the served model's would guess other tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    smol.tokenizer.save_pretrained(tmp_path)
    draft = load_model(str(tmp_path), EngineConfig().weights_to_load())
    with pytest.raises(ValueError, match="another tokenizer"):
        engine_over(tiny, EngineConfig(kv_cache_gib=0.05, speculative="draft"), draft)
