"""The high-throughput engine: the paged runner against transformers, batch invariance, prefix
caching, chunked prefill, preemption."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from conftest import run, run_core

from probserve.engine import (
    EngineConfig,
    EngineCore,
    EngineOutput,
    EngineRequest,
    LogprobsSpec,
    SamplingParams,
)
from probserve.engine.core.block_pool import BlockPool
from probserve.engine.core.runners.choice import build_runner
from probserve.engine.core.sequence import Sequence
from probserve.engine.core.step import Chunk
from probserve.engine.prefix_hash import block_hash
from probserve.models import LoadedModel

TEXTS = [
    "The capital of France is",
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with",
    "def add(a, b):\n    return",
    "Water boils at",
    "Once upon a time there was a little girl who lived in a village near the forest.",
    "The three primary colours are",
    "import numpy as np\nx = np.",
    "My favourite food is",
    "The quick brown fox",
]


def _ids(m: LoadedModel, text: str) -> tuple[int, ...]:
    return tuple(m.tokenizer(text).input_ids)


def _req(rid: str, ids: tuple[int, ...], n: int = 8, prompt: bool = True) -> EngineRequest:
    return EngineRequest(
        rid,
        ids,
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
        LogprobsSpec(top_k=5, prompt_top_k=5 if prompt else None),
    )


def _tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _logprobs(outs: list[EngineOutput]) -> np.ndarray:
    parts = [o.logprobs.logprobs for o in outs if o.logprobs is not None]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def _same(a: list[EngineOutput], b: list[EngineOutput]) -> None:
    assert _tokens(a) == _tokens(b)
    np.testing.assert_allclose(_logprobs(a), _logprobs(b), atol=1e-4)
    pa, pb = a[0].prompt_logprobs, b[0].prompt_logprobs
    assert (pa is None) == (pb is None)
    if pa is not None and pb is not None:
        assert pa.token_ids.tolist() == pb.token_ids.tolist()
        np.testing.assert_allclose(pa.logprobs, pb.logprobs, atol=1e-4)
        np.testing.assert_allclose(pa.top_logprobs, pb.top_logprobs, atol=1e-4)


@pytest.mark.parametrize("linear", ["dense", "onednn", "invariant"])
@pytest.mark.parametrize("model_name", ["smol", "tiny"])
def test_paged_runner_logits_equal_transformers(
    model_name: str, linear: str, request: pytest.FixtureRequest
):
    """One packed step mixing a fresh prefill, a chunk after a prefix and decode tokens, with
    each matrix kernel ("invariant": the whole deterministic forward)."""
    m: LoadedModel = request.getfixturevalue(model_name)
    deterministic = linear == "invariant"
    config = EngineConfig(
        kv_cache_gib=0.05,
        block_size=4,
        linear="auto" if deterministic else linear,  # type: ignore[arg-type]
        deterministic=deterministic,
    )
    runner = build_runner(m, config)
    assert runner.forward.ops.kernel == linear  # type: ignore[attr-defined]
    # SmolLM2's tied embedding is read from the head's copy (held once), except beside
    # oneDNN's blocked head; the tiny model's untied one has its own
    tied = model_name == "smol" and linear != "onednn"
    assert (runner.forward.embed is None) == tied  # type: ignore[attr-defined]
    pool = BlockPool(65, 4)
    seqs = [
        Sequence(_req(f"s{i}", _ids(m, t)), 10**6, frozenset()) for i, t in enumerate(TEXTS[:4])
    ]
    for seq in seqs:
        for _ in range(-(-(seq.num_tokens + 2) // 4)):
            seq.block_table.append(pool.allocate())
    # step 1: whole prompt of s0, first 3 tokens of s1, whole prompts of s2, s3
    first = [
        Chunk(seqs[0], 0, seqs[0].num_tokens),
        Chunk(seqs[1], 0, 3),
        Chunk(seqs[2], 0, seqs[2].num_tokens),
        Chunk(seqs[3], 0, seqs[3].num_tokens),
    ]
    runner.run(first)
    for ch in first:
        ch.seq.num_computed = ch.end
    for seq in (seqs[0], seqs[2]):  # one decode token each
        seq.append(42)
    # step 2: decode s0 and s2, the rest of s1's prompt (a chunk after a prefix)
    second = [
        Chunk(seqs[0], seqs[0].num_computed, 1),
        Chunk(seqs[1], 3, seqs[1].num_tokens - 3),
        Chunk(seqs[2], seqs[2].num_computed, 1),
    ]
    out = runner.run(second)
    with torch.inference_mode():
        for row, seq in zip(out.sample_logits, (seqs[0], seqs[1], seqs[2]), strict=True):
            ref = m.model(input_ids=torch.tensor([seq.token_ids]), use_cache=False).logits[0, -1]
            _close(row, ref)
        # prompt rows of s1's second chunk (positions 3..n-2)
        ref = m.model(input_ids=torch.tensor([seqs[1].token_ids]), use_cache=False).logits[0]
        rows = out.prompt_rows["s1"]
        for got, want in zip(
            rows.logits(0, len(rows)), ref[3 : seqs[1].num_prompt_tokens - 1], strict=True
        ):
            _close(got, want)


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Logits agree within 1e-4 where they matter: the 50 most likely tokens (and their
    logprobs). Over the whole 49k-token row, float32 summation order (packed and fused matrix
    products against transformers' separate ones) leaves noise up to ~1e-4 in the far tail, so
    the whole row is held to 2e-4."""
    top = torch.topk(ref, 50).indices
    assert (got[top] - ref[top]).abs().max() <= 1e-4
    lp_got, lp_ref = torch.log_softmax(got, -1), torch.log_softmax(ref, -1)
    assert (lp_got[top] - lp_ref[top]).abs().max() <= 1e-4
    assert (got - ref).abs().max() <= 2e-4


def test_alone_and_among_eight_others_identical(smol: LoadedModel, engine_for):
    eng = engine_for(smol)
    target = _req("target", _ids(smol, TEXTS[1]), n=16)
    alone = run(eng.generate(target))
    others = [_req(f"o{i}", _ids(smol, t), n=12 + i) for i, t in enumerate(TEXTS[:8])]

    async def crowd() -> list[list[EngineOutput]]:
        tasks = [asyncio.ensure_future(eng.generate(r)) for r in others[:4]]
        await asyncio.sleep(0.05)  # the target joins a running batch
        tasks.append(
            asyncio.ensure_future(
                eng.generate(
                    EngineRequest(
                        "target2", target.prompt_token_ids, target.sampling, target.logprobs
                    )
                )
            )
        )
        tasks += [asyncio.ensure_future(eng.generate(r)) for r in others[4:]]
        return await asyncio.gather(*tasks)

    results = run(crowd())
    _same(alone, results[4])


def _mc_requests(m: LoadedModel) -> list[EngineRequest]:
    """lm-eval multiple choice: one long context, several continuations; scored prompts."""
    ctx = _ids(m, " ".join(TEXTS) * 2)
    conts = [" Paris", " London", " a small dog", " forty-two"]
    return [
        EngineRequest(
            f"mc{i}",
            ctx + tuple(m.tokenizer(c, add_special_tokens=False).input_ids),
            SamplingParams(temperature=0, max_tokens=1),
            LogprobsSpec(1, prompt_top_k=1),
        )
        for i, c in enumerate(conts)
    ] + [
        EngineRequest("score0", ctx, SamplingParams(max_tokens=0), LogprobsSpec(3, prompt_top_k=3))
    ]


@pytest.mark.parametrize(
    "config",
    [
        {"prefix_caching": False},
        {"prefix_caching": True, "block_size": 8},
        {"prefix_caching": True, "max_num_batched_tokens": 7, "block_size": 4},
        {"runner": "hf", "max_num_batched_tokens": 9},
    ],
    ids=["no-prefix-cache", "prefix-cache", "tiny-chunks", "hf-runner"],
)
def test_results_do_not_depend_on_engine_settings(smol: LoadedModel, config: dict):
    baseline = run_core(
        EngineCore(smol, EngineConfig(prefix_caching=False, kv_cache_gib=0.25)), _mc_requests(smol)
    )
    core = EngineCore(smol, EngineConfig(kv_cache_gib=0.25, **config))
    # run the batch twice: the second time prompts hit the prefix cache (when on; the hf runner
    # has none, so once)
    for _ in range(1 if config.get("runner") == "hf" else 2):
        outs = run_core(core, _mc_requests(smol))
        for req in _mc_requests(smol):
            got = outs[req.request_id]
            _same(got, baseline[req.request_id])
            plp = got[0].prompt_logprobs
            assert plp is not None and len(plp) == len(req.prompt_token_ids) - 1
    if config.get("prefix_caching") and config.get("runner") != "hf":
        assert core.pool.num_cached() > 0


def test_prefix_cache_hit_scores_the_whole_prompt(smol: LoadedModel):
    core = EngineCore(smol, EngineConfig(block_size=4, kv_cache_gib=0.25))
    reqs = _mc_requests(smol)
    first = run_core(core, reqs[:1])["mc0"]
    again = EngineRequest("again", reqs[0].prompt_token_ids, reqs[0].sampling, reqs[0].logprobs)
    core.add_request(again)
    hits = core.scheduler.prefix_hit_tokens
    outs = []
    while core.has_work():
        outs += core.step()
    # every full block but the last came from the cache, yet every prompt position is scored
    reused = core.scheduler.prefix_hit_tokens - hits
    assert reused == (len(reqs[0].prompt_token_ids) - 1) // 4 * 4 > 0
    assert len(outs[0].prompt_logprobs) == len(reqs[0].prompt_token_ids) - 1
    _same(outs, first)


def test_preemption_by_recomputation(smol: LoadedModel):
    """A KV cache too small for every sequence at once: some are preempted and recomputed,
    and every result equals the one computed alone."""
    reqs = [_req(f"p{i}", _ids(smol, t), n=24) for i, t in enumerate(TEXTS[:6])]
    alone = {
        r.request_id: run_core(
            EngineCore(smol, EngineConfig(block_size=4, kv_cache_gib=0.25)), [r]
        )[r.request_id]
        for r in reqs
    }
    per_token = 4 * (2 * 30 * 3 * 64 + 576)
    tight = EngineCore(smol, EngineConfig(block_size=4, kv_cache_gib=40 * 4 * per_token / 2**30))
    outs = run_core(tight, reqs)
    assert tight.scheduler.num_preemptions > 0
    for rid, expected in alone.items():
        _same(outs[rid], expected)
    assert tight.pool.num_in_use() == 0


def test_block_pool_refcounts_and_eviction():
    pool = BlockPool(4, 2)  # block 0 is the null block: 3 usable
    a, b = pool.allocate(), pool.allocate()
    assert 0 not in (a, b)
    h = block_hash(None, [1, 2])
    pool.register(a, h, [1, 2])
    pool.release(a)  # cached, evictable
    assert pool.num_available() == 2 and pool.num_cached() == 1
    assert pool.lookup(h, [1, 2]) == a and pool.num_available() == 1
    assert pool.lookup(h, [9, 9]) is None  # a hash collision is not a hit
    pool.release(a)
    c = pool.allocate()
    d = pool.allocate()  # evicts a: no free block left otherwise
    assert {c, d} == {a, 3} and pool.num_cached() == 0 and pool.allocate() is None
    pool.release(b)
    assert pool.num_available() == 1


def _serve_unrelated(pool: BlockPool, rounds: int, in_flight: int, blocks_each: int) -> None:
    """`rounds` of `in_flight` requests at once, each filling `blocks_each` blocks of tokens
    no other request has (so all cacheable, none shared), then finishing."""
    for r in range(rounds):
        held = []
        for i in range(in_flight):
            parent = None
            for b in range(blocks_each):
                block = pool.allocate()
                assert block is not None
                tokens = [r, i, b]
                parent = block_hash(parent, tokens)
                pool.register(block, parent, tokens)
                held.append(block)
        for block in held:
            pool.release(block)


def test_block_pool_keeps_resident_memory_to_the_peak_in_flight_plus_retention():
    """Pages of the KV pool are resident once written: blocks go out lowest first, and cached
    blocks of finished requests are reused, least recent first, before an untouched block once
    `retain_blocks` of them are held. Without a bound the cache keeps every block: the whole
    pool ends resident."""
    pool = BlockPool(1000, 4, retain_blocks=20)
    _serve_unrelated(pool, rounds=50, in_flight=8, blocks_each=3)
    # 24 blocks in flight at most, 20 retained, and the null block
    assert pool.num_touched() <= 24 + 20 + 1
    assert pool.num_cached() >= 20  # the retention is used, not thrown away
    last = block_hash(None, [49, 7, 0])  # the latest request's blocks are still cached
    assert pool.lookup(last, [49, 7, 0]) is not None
    first = block_hash(None, [0, 0, 0])  # the oldest were reused
    assert pool.lookup(first, [0, 0, 0]) is None

    unbounded = BlockPool(1000, 4)
    _serve_unrelated(unbounded, rounds=50, in_flight=8, blocks_each=3)
    assert unbounded.num_touched() == 1000 and unbounded.num_cached() == 999

    uncached = BlockPool(1000, 4, prefix_caching=False)  # freed blocks come back lowest first
    _serve_unrelated(uncached, rounds=50, in_flight=8, blocks_each=3)
    assert uncached.num_touched() == 25 and uncached.num_cached() == 0


def test_the_engine_keeps_its_kv_memory_bounded(tiny: LoadedModel):
    """Many unrelated prompts through a large KV pool: the engine reports the part written,
    bounded by what one round in flight needs plus `prefix_cache_gib`; a prompt seen again
    within the retention still hits the cache."""
    config = EngineConfig(block_size=4, kv_cache_gib=0.5, prefix_cache_gib=0.001)
    core = EngineCore(tiny, config)
    retain = core.pool.retain_blocks
    assert 0 < retain < core.pool.num_blocks // 10
    rng = np.random.default_rng(0)
    for r in range(12):
        reqs = [
            _req(f"r{r}-{i}", tuple(int(t) for t in rng.integers(5, 200, 37)), n=3)
            for i in range(4)
        ]
        run_core(core, reqs)
    per_round = 4 * -(-(37 + 3) // 4)
    assert core.pool.num_touched() <= per_round + retain + 1
    stats = core.stats()
    assert stats.kv_cache_resident == (core.pool.num_touched() - 1) / (core.pool.num_blocks - 1)
    hits = core.scheduler.prefix_hit_tokens
    run_core(core, [_req("again", reqs[-1].prompt_token_ids, n=3)])
    assert core.scheduler.prefix_hit_tokens - hits == 36


def test_continuations_sent_together_share_their_context(smol: LoadedModel):
    """lm-eval sends a context's continuations in one request: the later ones wait for the
    context's blocks instead of computing them again, and results stay exact."""
    reqs = _mc_requests(smol)[:4]
    core = EngineCore(smol, EngineConfig(block_size=8, kv_cache_gib=0.25))
    outs = run_core(core, reqs)
    shared_blocks = (len(reqs[0].prompt_token_ids) - 8) // 8
    assert core.scheduler.prefix_hit_tokens >= 3 * shared_blocks * 8
    baseline = run_core(
        EngineCore(smol, EngineConfig(prefix_caching=False, kv_cache_gib=0.25)), reqs
    )
    for req in reqs:
        _same(outs[req.request_id], baseline[req.request_id])
