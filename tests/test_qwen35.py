"""Qwen3.5 dense, Qwen3.5-MoE and Qwen3-Next (hybrid: Gated DeltaNet layers among gated
full-attention ones, models/deltanet.py; Qwen3-Next's projections packed per key head) on the
paged forward, against transformers' own float32 forward: tiny random models of its classes
(both layer kinds, GQA in the linear layers, partial rotary, a shared expert), prompt and
generated logprobs within 1e-4 on both paths (deterministic kernels and torch), greedy tokens
transformers' argmax, the MoE layers' routing; bitwise the same alone, among five others with a
7-token step budget (chunked prefill across the recurrence), from the prefix cache (a block's
state snapshot restored; a prefix ends at a block with one) and after preemption; speculation's
rejected proposals rolled back bit for bit; the recurrent state counted (reserved out of the KV
budget, held bytes in the engine's figures); Qwen3.5 on the GPU path too; the native rule
(kernels/deltanet.cpp) against the torch one, bitwise the same in chunks and on one thread."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_core
from reference import full_logprobs
from test_families import _check_routing, _request, against_transformers

from probserve.engine import (
    EngineConfig,
    EngineCore,
)
from probserve.engine.core.runners import recurrent
from probserve.models import LoadedModel
from probserve.models.family import family

KINDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


def _config(kind: str, vocab: int) -> Any:
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    common = {
        "vocab_size": vocab, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 8, "max_position_embeddings": 256, "eos_token_id": 2,
        "tie_word_embeddings": False,
        # linear, full, linear, full: both kinds, a linear layer after an attention one
        "layer_types": ["linear_attention", "full_attention"] * 2,
    }  # fmt: skip
    if kind == "qwen3_5":
        return Qwen3_5TextConfig(**common, intermediate_size=96)
    if kind == "qwen3_next":  # its projections packed per key head; layer 1 dense
        return Qwen3NextConfig(
            **common, intermediate_size=96, num_experts=8, num_experts_per_tok=3,
            moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1],
        )  # fmt: skip
    return Qwen3_5MoeTextConfig(
        **common, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    )  # fmt: skip


def tiny_hybrid(kind: str, smol: LoadedModel) -> LoadedModel:
    """A tiny random model of transformers' class for `kind` (one of KINDS), its norms and
    weights off their init, with SmolLM2's tokenizer (tests/test_exactness.py's float64 rule
    reads it too)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(11)
    config = _config(kind, smol.vocab_size)
    config._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.requires_grad_(False)
    off_init(hf)
    return LoadedModel(
        model=hf,
        tokenizer=smol.tokenizer,
        name=f"tiny-{kind}",
        eos_token_ids=frozenset({2}),
        context_length=256,
        vocab_size=smol.vocab_size,
    )


@pytest.fixture(scope="module", params=KINDS)
def model(request: pytest.FixtureRequest, smol: LoadedModel) -> LoadedModel:
    return tiny_hybrid(request.param, smol)


def _prompt(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, 40000, size=n)]


def _numbers(outs: list) -> list[bytes]:
    """The tokens and every logprobs array of a request's outputs, each field joined over them
    (rows in any grouping: a step that accepts proposals sends several tokens at once)."""
    fields: dict[str, list[bytes]] = {}
    for o in outs:
        fields.setdefault("tokens", []).append(np.asarray(o.new_token_ids, np.int64).tobytes())
        for kind, lp in (("gen", o.logprobs), ("prompt", o.prompt_logprobs)):
            if lp is not None:
                arrays = (lp.token_ids, lp.logprobs, lp.top_ids, lp.top_logprobs, lp.entropy)
                for i, arr in enumerate(arrays):
                    fields.setdefault(f"{kind}{i}", []).append(np.ascontiguousarray(arr).tobytes())
    return [name.encode() + b"".join(parts) for name, parts in sorted(fields.items())]


def _joined(outs: list) -> list[bytes]:
    """The tokens and each generated logprobs array over all the outputs (rows in any grouping:
    a step that accepts proposals sends several tokens at once)."""
    arrays: dict[str, list[np.ndarray]] = {"tokens": [np.asarray(o.new_token_ids) for o in outs]}
    for o in outs:
        if o.logprobs is not None:
            for name in ("token_ids", "logprobs", "top_ids", "top_logprobs", "entropy"):
                arrays.setdefault(name, []).append(np.asarray(getattr(o.logprobs, name)))
    return [np.concatenate(v).tobytes() for v in arrays.values()]


def test_its_family_is_hybrid(model: LoadedModel):
    fam = family(model.model.config)
    assert fam.linear == (True, False, True, False)
    assert fam.rotary_dim == 4 and fam.attn_gate and fam.norm_plus_one
    assert fam.shared_expert == bool(fam.experts)
    assert fam.packed_linear == (model.name == "tiny-qwen3_next")


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_paged_forward_equals_transformers(model: LoadedModel, deterministic: bool):
    core = EngineCore(
        model, EngineConfig(deterministic=deterministic, kv_cache_gib=0.02, block_size=4)
    )
    assert core.info.runner == "RecurrentRunner" and core.info.deterministic == deterministic
    ids = _prompt(1, 23)
    routed = bool(family(model.model.config).experts)  # its MoE layers' routing returned too
    outs = run_core(core, [_request(ids, "r", 10, routing=routed)])["r"]
    gen = [t for o in outs for t in o.new_token_ids]
    if routed:
        _check_routing(model, outs, ids, gen)
    against_transformers(model, outs, ids, gen)


def test_a_request_is_bitwise_the_same_among_others_and_in_chunks(model: LoadedModel):
    canary = _prompt(2, 19)
    alone_core = EngineCore(model, EngineConfig(deterministic=True, kv_cache_gib=0.02))
    alone = run_core(alone_core, [_request(canary, "c")])["c"]
    core = EngineCore(
        model,
        EngineConfig(deterministic=True, kv_cache_gib=0.02, block_size=4, max_num_batched_tokens=7),
    )
    others = [_request(_prompt(10 + i, 5 + 4 * i), f"o{i}", 3 + i) for i in range(5)]
    mixed = run_core(core, [*others[:2], _request(canary, "c"), *others[2:]])["c"]
    hits = core.scheduler.prefix_hit_tokens
    again = run_core(core, [_request(canary, "again")])["again"]  # its state from a snapshot
    assert core.scheduler.prefix_hit_tokens - hits == 16  # four blocks of 4 (one token left)
    assert _numbers(mixed) == _numbers(alone) == _numbers(again)
    # every sequence's state went with it
    assert core.stats().recurrent_state_bytes == 0 and core.stats().held_caches == 0


def _cold(model: LoadedModel, ids: list[int], rid: str) -> list:
    config = EngineConfig(deterministic=True, kv_cache_gib=0.02, prefix_caching=False)
    return run_core(EngineCore(model, config), [_request(ids, rid)])[rid]


def test_a_cached_prefix_ends_at_a_block_with_a_snapshot(
    model: LoadedModel, monkeypatch: pytest.MonkeyPatch
):
    """Snapshots every SNAPSHOT_TOKENS tokens (here 8: every second block of 4) and at the
    blocks a prompt's repeat and continuation end at, three kept at most (the least recently
    used dropped): a prompt reuses its cached prefix up to the last block whose snapshot is
    kept, and its numbers are the cold run's."""
    monkeypatch.setattr(recurrent, "SNAPSHOT_TOKENS", 8)
    canary = _prompt(8, 21)
    state = EngineCore(model, EngineConfig(kv_cache_gib=0.02)).choice.state_bytes
    config = EngineConfig(
        deterministic=True, kv_cache_gib=0.02, block_size=4, prefix_cache_gib=3.5 * state / 2**30
    )
    core = EngineCore(model, config)
    assert core.choice.snapshots == 3
    first = run_core(core, [_request(canary, "first", 1)])["first"]
    # 5 full blocks: the 2nd and 4th (every 8 tokens) and the 5th (where a repeat ends) kept
    where = {tokens: b for b, _, tokens in core.pool.cached_blocks()}
    kept = [where[_blocks(canary, 4)[i]] for i in (1, 3, 4)]
    assert sorted(core.runner.snapshots) == sorted(kept)  # type: ignore[attr-defined]
    # the whole canary again: 5 blocks, the 5th's snapshot kept (its 20 tokens reused)
    hits = core.scheduler.prefix_hit_tokens
    again = run_core(core, [_request(canary, "again", 1)])["again"]
    assert core.scheduler.prefix_hit_tokens - hits == 20
    assert _numbers(again) == _numbers(first)
    # 3 blocks in common (12 tokens), the 3rd without a snapshot: the prefix ends at the 2nd
    short = canary[:14] + _prompt(9, 5)
    hits = core.scheduler.prefix_hit_tokens
    got = run_core(core, [_request(short, "short")])["short"]
    assert core.scheduler.prefix_hit_tokens - hits == 8
    assert _numbers(got) == _numbers(_cold(model, short, "short"))


def _blocks(ids: list[int], bs: int) -> list[tuple[int, ...]]:
    return [tuple(ids[i : i + bs]) for i in range(0, len(ids) - bs + 1, bs)]


def test_a_block_handed_out_again_loses_its_snapshot(model: LoadedModel):
    """A block's snapshot is the state past that block's content: when the pool hands the block
    out again (another content), the snapshot goes with the old content, so a later prefix
    ending at that block never restores another sequence's state."""
    canary = _prompt(8, 21)
    core = EngineCore(model, EngineConfig(deterministic=True, kv_cache_gib=0.02, block_size=4))
    run_core(core, [_request(canary, "first", 1)])
    kept = set(core.runner.snapshots)  # type: ignore[attr-defined]
    assert kept
    # every cached block evicted and handed out again (the pool's blocks, all at once)
    taken = [core.pool.allocate() for _ in range(core.pool.num_available())]
    assert kept <= set(taken)
    assert not core.runner.snapshots  # type: ignore[attr-defined]
    for block in taken:
        core.pool.release(block)  # type: ignore[arg-type]
    hits = core.scheduler.prefix_hit_tokens
    again = run_core(core, [_request(canary, "again")])["again"]
    assert core.scheduler.prefix_hit_tokens == hits
    assert _numbers(again) == _numbers(_cold(model, canary, "again"))


def test_a_snapshot_is_the_saved_state_itself(model: LoadedModel, monkeypatch: pytest.MonkeyPatch):
    """The states a step saves past its blocks' last tokens are kept as the snapshots
    themselves, each its own tensors: no copy made beside them (a prompt of 6 blocks of
    Qwen3.5-4B's shape saved 6 states of 6.5 MB and held their copies as well). Every block
    a snapshot's here (SNAPSHOT_TOKENS one block): the mechanism, whatever the choice."""
    monkeypatch.setattr(recurrent, "SNAPSHOT_TOKENS", 4)
    core = EngineCore(model, EngineConfig(deterministic=True, kv_cache_gib=0.02, block_size=4))
    runner: Any = core.runner
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    computed = runner._computed

    def spy(chunks: list, spans: list) -> None:
        for span in spans:
            conv, delta = span.state.saved_conv, span.state.saved_delta
            if conv is not None and delta is not None:
                saved.extend(zip(list(conv), list(delta), strict=True))
        computed(chunks, spans)

    runner._computed = spy
    run_core(core, [_request(_prompt(5, 13), "s", 1)])
    kept = list(runner.snapshots.values())
    assert len(kept) == 3 and len(saved) == 3
    for conv, delta in kept:
        assert any(conv is c and delta is d for c, d in saved)
        assert conv._base is None and delta._base is None  # its own storage, no larger one's


def test_a_step_holds_no_more_snapshots_than_the_limit(
    model: LoadedModel, monkeypatch: pytest.MonkeyPatch
):
    """A step that completes more blocks than the snapshots kept saves the states of the last
    `snapshot_limit` alone, and makes room for them before its forward: the snapshots and the
    step's saved states together never exceed the limit (a step of 32 completed blocks of
    Qwen3.5-4B's shape held 40 snapshots and 32 saved states, 470 MB, for 40 kept); the
    snapshots kept are the same, and so are the bits served from them. Every block a
    snapshot's here (SNAPSHOT_TOKENS one block)."""
    monkeypatch.setattr(recurrent, "SNAPSHOT_TOKENS", 4)
    canary = _prompt(8, 21)
    cold = run_core(
        EngineCore(
            model, EngineConfig(deterministic=True, kv_cache_gib=0.02, prefix_caching=False)
        ),
        [_request(canary, "c")],
    )["c"]
    state = EngineCore(model, EngineConfig(kv_cache_gib=0.02)).choice.state_bytes
    config = EngineConfig(
        deterministic=True, kv_cache_gib=0.02, block_size=4, prefix_cache_gib=2.5 * state / 2**30
    )
    core = EngineCore(model, config)
    runner: Any = core.runner
    held: list[int] = []
    forward = runner.forward.forward

    def spy(*args: Any) -> torch.Tensor:
        spans = args[4]
        saved = sum(len(span.state.saved_conv or ()) for span in spans)
        held.append(len(runner.snapshots) + saved)
        return forward(*args)

    runner.forward.forward = spy
    run_core(core, [_request(canary, "first", 1)])  # 5 blocks in one step, 2 snapshots kept
    assert held[0] == 2 and max(held) <= 2
    blocks = core.scheduler.prefix_hit_tokens
    run_core(core, [_request(canary[:16] + _prompt(9, 5), "other", 1)])
    assert core.scheduler.prefix_hit_tokens - blocks == 16 and max(held) <= 2
    hits = core.scheduler.prefix_hit_tokens
    again = run_core(core, [_request(canary, "again")])["again"]
    assert core.scheduler.prefix_hit_tokens - hits == 16 and max(held) <= 2
    assert _numbers(again) == _numbers(cold)


def test_a_preempted_request_recomputes_its_state_from_zeros(model: LoadedModel):
    """A KV pool too small for everyone: sequences are preempted (their states dropped with
    their blocks) and recomputed, and the canary's numbers are its numbers alone."""
    canary = _prompt(3, 17)
    alone = run_core(
        EngineCore(model, EngineConfig(deterministic=True, kv_cache_gib=0.02)),
        [_request(canary, "c", 12)],
    )["c"]
    config = _config(model.name.removeprefix("tiny-"), model.vocab_size)
    per_block = EngineCore(model, EngineConfig(kv_cache_gib=0.02, block_size=4)).choice
    per_token = per_block.cls.kv_bytes_per_token(config)
    # max_num_seqs 4: their states (each with those kept for proposals: half the budget holds
    # them), 12 snapshots for the prefix cache (a preempted sequence resumes from its own; at
    # most a quarter of the budget), then 16 blocks
    state = per_block.state_bytes
    reserved = state * (4 * (2 + per_block.config.speculative_tokens) + 12)
    budget = (reserved + 16 * 4 * per_token) / 2**30
    core = EngineCore(
        model,
        EngineConfig(
            deterministic=True, kv_cache_gib=budget, block_size=4, max_num_seqs=4,
            prefix_cache_gib=12 * state / 2**30,
        ),
    )  # fmt: skip
    assert core.pool.num_blocks == 16 and core.choice.snapshots == 12
    assert core.scheduler.max_num_seqs == 4
    others = [_request(_prompt(20 + i, 11), f"o{i}", 12) for i in range(3)]
    mixed = run_core(core, [*others, _request(canary, "c", 12)])["c"]
    assert core.scheduler.num_preemptions > 0
    assert _numbers(mixed) == _numbers(alone)


def test_the_native_rule_is_the_torch_rule_and_ignores_chunking_and_threads() -> None:
    """kernels/deltanet.cpp against kernels/delta_rule.py's torch rule (GQA, a value width
    that is not a whole number of vector lanes, states saved mid-span), and bitwise the same
    outputs, states and saved states for a sequence alone in chunks of 3, 1 and 4 rows, on one
    thread, as beside another sequence on every thread."""
    import torch.nn.functional as F

    from probserve.kernels.delta_rule import DeltaLayer, DeltaSpan, torch_gated_delta
    from probserve.kernels.invariant import InvariantKernels

    torch.manual_seed(0)
    nk, nv, dk, dv, k = 2, 4, 8, 76, 4  # dv: 4 vectors walked together, then the rest
    c = 2 * nk * dk + nv * dv
    layer = DeltaLayer(torch.randn(k, c) * 0.5, -torch.rand(nv) - 0.1, torch.randn(nv), nk, nv,
                       dk, dv)  # fmt: skip
    proj = torch.randn(13, c + nv * dv + 2 * nv)
    start = [(torch.randn(k - 1, c), torch.randn(nv, dk, dv) * 0.1) for _ in range(2)]

    def both(rule: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        states = [(conv.clone(), delta.clone()) for conv, delta in start]
        saved = [(torch.empty(k - 1, c), torch.empty(nv, dk, dv)) for _ in range(3)]
        spans = [
            DeltaSpan(0, 5, *states[0], ((1, *saved[0]), (3, *saved[1]))),
            DeltaSpan(5, 13, *states[1], ((6, *saved[2]),)),
        ]
        out = rule(proj, layer, spans)
        return out, [t for pair in states + saved for t in pair]

    ops = InvariantKernels()
    native, held = both(ops.gated_delta)
    torch_out, torch_held = both(lambda p, lay, sp: torch_gated_delta(F.silu, p, lay, sp))
    assert (native - torch_out).abs().max() < 1e-5
    for a, b in zip(held, torch_held, strict=True):
        assert (a - b).abs().max() < 1e-5
    # the second sequence alone, in chunks, on one thread
    conv, delta = start[1][0].clone(), start[1][1].clone()
    saved_conv, saved_delta = torch.empty(k - 1, c), torch.empty(nv, dk, dv)
    outs, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for a, b in ((0, 3), (3, 4), (4, 8)):
            saves = ((6 - a, saved_conv, saved_delta),) if a <= 6 < b else ()
            span = DeltaSpan(0, b - a, conv, delta, saves)
            outs.append(ops.gated_delta(proj[5 + a : 5 + b], layer, [span]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.cat(outs), native[5:])
    assert torch.equal(conv, held[2]) and torch.equal(delta, held[3])
    assert torch.equal(saved_conv, held[8]) and torch.equal(saved_delta, held[9])


def test_the_native_rule_over_a_long_span_is_exact_and_ignores_chunking() -> None:
    """A span of 150 rows (a prefill chunk's length, not the few rows above): states saved early,
    mid-span and on its last row equal the torch rule's, and the span cut into chunks anywhere
    gives the whole span's outputs and states bit for bit."""
    import torch.nn.functional as F

    from probserve.kernels.delta_rule import DeltaLayer, DeltaSpan, torch_gated_delta
    from probserve.kernels.invariant import InvariantKernels

    torch.manual_seed(1)
    nk, nv, dk, dv, k = 1, 2, 16, 40, 4
    c = 2 * nk * dk + nv * dv
    layer = DeltaLayer(torch.randn(k, c) * 0.5, -torch.rand(nv) - 0.1, torch.randn(nv), nk, nv,
                       dk, dv)  # fmt: skip
    n = 150
    proj = torch.randn(n, c + nv * dv + 2 * nv)
    rows = (10, 63, 64, 130, n - 1)
    start = torch.randn(nv, dk, dv) * 0.1

    def run(rule: Any, cuts: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        conv, delta = torch.zeros(k - 1, c), start.clone()
        saved = {r: (torch.empty(k - 1, c), torch.empty(nv, dk, dv)) for r in rows}
        outs = []
        for a, b in zip((0, *cuts), (*cuts, n), strict=True):
            saves = tuple((r - a, *saved[r]) for r in rows if a <= r < b)
            outs.append(rule(proj[a:b], layer, [DeltaSpan(0, b - a, conv, delta, saves)]))
        return torch.cat(outs), [conv, delta, *(t for r in rows for t in saved[r])]

    ops = InvariantKernels()
    whole, held = run(ops.gated_delta, ())
    ref, ref_held = run(lambda p, lay, sp: torch_gated_delta(F.silu, p, lay, sp), ())
    assert (whole - ref).abs().max() < 1e-5
    for a, b in zip(held, ref_held, strict=True):
        assert (a - b).abs().max() < 1e-5
    for cuts in ((70,), (1, 64, 65, 129)):
        out, states = run(ops.gated_delta, cuts)
        assert torch.equal(out, whole)
        assert all(torch.equal(a, b) for a, b in zip(states, held, strict=True))


def test_the_state_is_reserved_and_counted(model: LoadedModel):
    config = EngineConfig(deterministic=True, kv_cache_gib=0.02, block_size=4, max_num_seqs=3)
    core = EngineCore(model, config)
    per_seq = core.info.state_bytes_per_sequence
    # 2 linear layers: conv (C = 2*2*8 + 4*8 = 64 channels, 3 columns) and 4 heads of 8 x 8
    assert per_seq == 4 * 2 * (64 * 3 + 4 * 8 * 8)
    per_block = core.choice.cls.kv_bytes_per_token(model.model.config) * 4
    states = 3 * (2 + config.speculative_tokens)  # each its own, and those kept for proposals
    snapshots = int(0.02 / 4 * 2**30) // per_seq  # a quarter of the KV budget (< 0.25 GiB)
    assert core.choice.snapshots == snapshots
    reserved = (states + snapshots) * per_seq
    assert core.pool.num_blocks == (int(0.02 * 2**30) - reserved) // per_block
    assert core.info.prefix_caching and not core.info.prefix_caching_off
    none = EngineCore(model, EngineConfig(kv_cache_gib=0.02, prefix_cache_gib=0.0))
    assert not none.info.prefix_caching
    assert none.info.prefix_caching_off == "--prefix-cache-gib holds no recurrent state snapshot"
    from probserve.api.routes.misc import serving_facts  # what /health and /v1/models show

    facts = serving_facts(none.info)
    assert facts["state_bytes_per_sequence"] == per_seq
    assert facts["prefix_caching_off"] == none.info.prefix_caching_off
    assert serving_facts(core.info)["prefix_caching_off"] is None
    core.add_request(_request(_prompt(4, 9), "s", 3))
    core.step()  # the prompt computed: its state held
    assert core.stats().recurrent_state_bytes == per_seq
    while core.has_work():
        core.step()
    assert core.stats().recurrent_state_bytes == 0
    # half of a budget of 24 states holds two sequences' (each with those kept for 4 proposals)
    small = EngineCore(model, EngineConfig(kv_cache_gib=24 * per_seq / 2**30, max_num_seqs=8))
    assert small.choice.max_seqs == small.scheduler.max_num_seqs == 2
    with pytest.raises(ValueError, match="recurrent state"):
        EngineCore(model, EngineConfig(kv_cache_gib=per_seq * 4 / 2**30, max_num_seqs=8))


class _Proposer:
    """Proposes each sequence's true continuation with its last token wrong every other time,
    so a step's proposals are partly accepted, partly rejected (their state updates undone)."""

    def __init__(self, truths: dict[tuple[int, ...], list[int]]) -> None:
        self.truths, self.calls = truths, 0

    def propose_many(self, asks: list) -> dict[str, tuple[int, ...]]:
        out = {}
        for rid, tokens, k in asks:
            self.calls += 1
            for prompt, full in self.truths.items():
                if tuple(tokens[: len(prompt)]) == prompt:
                    want = list(full[len(tokens) : len(tokens) + k])
                    if self.calls % 2 and len(want) > 1:
                        want[-1] += 1
                    out[rid] = tuple(want)
        return out


def test_speculation_rolls_back_rejected_proposals_bit_for_bit(model: LoadedModel):
    """Proposals, some accepted and some rejected, among other requests in 7-token steps: the
    same bits as decoding one token a step, and the kept states are counted then freed."""
    from probserve.engine.core.host import engine_over

    prompts = {"a": _prompt(6, 13), "b": _prompt(7, 9)}
    plain = run_core(
        EngineCore(model, EngineConfig(deterministic=True, kv_cache_gib=0.02)),
        [_request(ids, rid, 12) for rid, ids in prompts.items()],
    )
    truths = {
        tuple(ids): [*ids, *(t for o in plain[rid] for t in o.new_token_ids)]
        for rid, ids in prompts.items()
    }
    config = EngineConfig(
        deterministic=True, kv_cache_gib=0.02, block_size=4, speculative="ngram",
        max_num_batched_tokens=7, speculative_tokens=3,
    )  # fmt: skip
    core = engine_over(model, config)
    assert core.speculator is not None
    core.speculator.proposer = _Proposer(truths)  # type: ignore[assignment]
    others = [_request(_prompt(30 + i, 6), f"o{i}", 4) for i in range(2)]
    spec = run_core(core, [others[0], *(_request(i, r, 12) for r, i in prompts.items()), others[1]])
    assert 0 < core.speculator.accepted < core.speculator.drafted
    for rid in prompts:
        assert _joined(spec[rid]) == _joined(plain[rid]), rid
    assert core.stats().recurrent_state_bytes == 0


GPU_VOCAB = 256  # a small head: the interpreter runs every program of every kernel in Python


def test_the_gpu_path_serves_qwen3_5_exactly_and_invariantly(smol: LoadedModel) -> None:
    """Qwen3.5 dense on the GPU path (its Triton kernels; under Triton's interpreter on the host
    here): within 1e-4 of transformers, and the same bits alone and among others in 7-token
    steps (no decode graphs: each sequence's state is its own)."""
    import triton  # noqa: F401  (a dev dependency: without it this fails, it never skips)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    config = _config("qwen3_5", GPU_VOCAB)
    config._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.copy_(torch.randn_like(param) * (0.3 if "norm" in name else 0.1))
    model = LoadedModel(
        model=hf, tokenizer=smol.tokenizer, name="tiny-qwen3_5", eos_token_ids=frozenset({2}),
        context_length=256, vocab_size=GPU_VOCAB,
    )  # fmt: skip

    def gpu(**more: Any) -> EngineConfig:
        return EngineConfig(device="cuda", kv_cache_gib=0.01, block_size=4, **more)

    def prompt(seed: int, n: int) -> list[int]:
        return [int(t) for t in np.random.default_rng(seed).integers(3, GPU_VOCAB, size=n)]

    core = EngineCore(model, gpu())
    core.warmup()
    assert core.info.runner == "RecurrentRunner" and core.info.deterministic
    assert core.info.device == ("cuda" if torch.cuda.is_available() else "interpreted")
    ids = prompt(1, 15)
    outs = run_core(core, [_request(ids, "r", 5)])["r"]
    gen = [t for o in outs for t in o.new_token_ids]
    ref = full_logprobs(hf, ids + gen).double()
    got = np.asarray(next(o.prompt_logprobs for o in outs if o.prompt_logprobs).logprobs)
    assert np.abs(got - ref[np.arange(len(ids) - 1), ids[1:]].numpy()).max() < 1e-4
    rows = np.arange(len(ids) - 1, len(ids) - 1 + len(gen))
    lps = np.concatenate([np.asarray(o.logprobs.logprobs) for o in outs if o.logprobs is not None])
    assert np.abs(lps - ref[rows, gen].numpy()).max() < 1e-4
    assert gen == [int(ref[r].argmax()) for r in rows]
    mixed_core = EngineCore(model, gpu(max_num_batched_tokens=7))
    others = [_request(prompt(10 + i, 4 + 3 * i), f"o{i}", 2 + i) for i in range(3)]
    mixed = run_core(mixed_core, [*others[:1], _request(ids, "r", 5), *others[1:]])["r"]
    assert _numbers(mixed) == _numbers(outs)


def test_a_qwen3_5_checkpoint_directory_is_served_on_the_paged_forward(
    smol: LoadedModel, tmp_path: Any
) -> None:
    """A directory as Qwen3.5 checkpoints ship (the vision-language class, `qwen3_5`, its text
    weights under model.language_model): loaded as the text model, served by RecurrentRunner,
    its logprobs within 1e-4 of transformers'."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from probserve.models import load_model

    torch.manual_seed(3)
    text = _config("qwen3_5", smol.vocab_size).to_dict()
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2,
              "out_hidden_size": 64}  # fmt: skip
    vlm = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision))
    vlm.save_pretrained(tmp_path)
    smol.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    core = EngineCore(loaded, EngineConfig(kv_cache_gib=0.02))
    assert core.info.runner == "RecurrentRunner" and core.info.architecture == "qwen3_5_text"
    ids = _prompt(5, 12)
    outs = run_core(core, [_request(ids, "d", 4)])["d"]
    ref = full_logprobs(loaded.model, ids)
    got = np.asarray(next(o.prompt_logprobs for o in outs if o.prompt_logprobs).logprobs)
    assert np.abs(got - np.array([float(ref[j, ids[j + 1]]) for j in range(11)])).max() < 1e-4


def off_init(hf: Any) -> None:
    """A hybrid model's norms (1 + w; the gated norm's plain w) and weights off their init."""
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.copy_(torch.randn_like(param) * 0.3 + 1.0)
            elif "norm" in name:
                param.copy_(torch.randn_like(param) * 0.3)
            elif name.endswith(("A_log", "dt_bias")):
                param.copy_(torch.randn_like(param) * 0.5)
            else:
                param.normal_(0.0, 0.1)
