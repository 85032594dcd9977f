"""--deterministic: the row-invariant kernels, and whole requests compared bit for bit whether
alone or among others, chunked at any size, cached or not, preempted or not."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import run_core
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from probserve.engine import (
    EngineConfig,
    EngineCore,
    EngineOutput,
    EngineRequest,
    LogprobsSpec,
    SamplingParams,
)
from probserve.engine.types import LogprobsMode, TokenLogprobs
from probserve.kernels.build import KernelBuildError, build
from probserve.kernels.invariant import InvariantKernels
from probserve.models import LoadedModel

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def kernels() -> InvariantKernels:
    return InvariantKernels()


# ---- the kernels --------------------------------------------------------------------------
def _subsets(m: int, rng: random.Random) -> list[tuple[int, int]]:
    """(start, rows) slices of a batch of m rows: every size 1..m at a random start."""
    return [(s, n) for n in range(1, m + 1) for s in [rng.randrange(0, m - n + 1)]]


@pytest.mark.parametrize("shape", [(37, 19), (576, 64), (100, 1536), (33, 1)])
def test_linear_rows_do_not_depend_on_the_batch(kernels: InvariantKernels, shape):
    n, k = shape
    g = torch.Generator().manual_seed(n * k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(64, k, generator=g)
    packed = kernels.pack(w, b)
    full = kernels.linear(x, packed)
    torch.testing.assert_close(full, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    for start, rows in _subsets(64, random.Random(k)):
        assert torch.equal(
            kernels.linear(x[start : start + rows], packed), full[start : start + rows]
        )


def test_results_do_not_depend_on_the_thread_count(kernels: InvariantKernels):
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(300, 200, generator=g), torch.randn(50, 200, generator=g)
    packed = kernels.pack(w)
    logits = torch.randn(8, 20000, generator=g)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append((kernels.linear(x, packed), kernels.log_softmax(logits)))
    finally:
        torch.set_num_threads(threads)
    for lin, lsm in results[1:]:
        assert torch.equal(lin, results[0][0]) and torch.equal(lsm, results[0][1])


def test_off_where_it_cannot_run_and_says_why(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    assert not EngineCore(tiny, EngineConfig(runner="hf", kv_cache_gib=0.05)).info.deterministic
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(KernelBuildError, match="needs a C\\+\\+ compiler"):
        build()
    core = EngineCore(tiny, EngineConfig(kv_cache_gib=0.05))
    assert not core.info.deterministic
    assert "deterministic mode is off" in caplog.text and "apt install g++" in caplog.text
    assert len(run_core(core, [_canary(tiny)])["canary"]) > 0  # it serves all the same


def test_row_kernels_do_not_depend_on_the_batch(kernels: InvariantKernels):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 100, generator=g)
    w = torch.randn(100, generator=g)
    gate_up = torch.randn(40, 2 * 77, generator=g) * 6
    logits = torch.randn(40, 5000, generator=g) * 4
    logits[3, 10:900] = float("-inf")  # a processed row: masked tokens
    norm, act = kernels.rms_norm(x, w, 1e-5), kernels.silu_mul(gate_up)
    lp = kernels.log_softmax(logits)
    ent = kernels.entropy(lp)
    vals, ids = kernels.topk(lp, 20)
    torch.testing.assert_close(norm, F.rms_norm(x, (100,), w, 1e-5), atol=1e-5, rtol=1e-5)
    ref_act = F.silu(gate_up[:, :77]) * gate_up[:, 77:]
    torch.testing.assert_close(act, ref_act, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1), atol=1e-5, rtol=0)
    ref_ent = torch.special.entr(torch.log_softmax(logits, -1).exp()).sum(1)
    torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=1e-5)
    assert torch.isfinite(ent).all() and torch.isinf(lp[3, 10:900]).all()
    ref_top = torch.topk(lp, 20)
    assert torch.equal(vals, ref_top.values) and torch.equal(ids, ref_top.indices)
    for start, rows in _subsets(40, random.Random(1)):
        sl = slice(start, start + rows)
        assert torch.equal(kernels.rms_norm(x[sl], w, 1e-5), norm[sl])
        assert torch.equal(kernels.silu_mul(gate_up[sl]), act[sl])
        assert torch.equal(kernels.log_softmax(logits[sl]), lp[sl])
        assert torch.equal(kernels.entropy(lp[sl]), ent[sl])
        assert torch.equal(kernels.topk(lp[sl], 20)[1], ids[sl])


def test_fused_scores_equal_the_log_softmax_path(kernels: InvariantKernels):
    """`score` reads logits and never writes their log-softmax; its logprob, rank and top-k
    are the very bits that log_softmax, gather, counting and topk give: on ties (coarse
    values), masked rows (-inf), a row with one finite entry, widths that are not a multiple
    of the vector width, every k up to the most it keeps, and any subset of rows."""
    from probserve.engine.core.row_math import score_from_log_softmax
    from probserve.kernels.invariant import SCORE_MAX_K

    g = torch.Generator().manual_seed(11)
    for v in (49152, 1003, 70, 16, 5):
        logits = (torch.randn(24, v, generator=g) * 8).round() / 4  # many ties
        logits[3, : v // 2] = float("-inf")
        logits[4, 1:] = float("-inf")
        logits[5] = logits[5] * 1e-3 + 1e4  # large values: the subtractions round
        targets = torch.randint(0, v, (24,), generator=g)
        targets[4] = 0
        targets[6] = int(logits[6].argmax())  # the best: rank 1
        targets[3] = 1  # a masked entry: -inf, ranked after every finite one
        for k in sorted({0, 1, 2, 5, 20, min(v, SCORE_MAX_K)}):
            if k > v:
                continue
            got = kernels.score(logits, targets, k)
            want = score_from_log_softmax(kernels, logits, targets, k)
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b), (v, k)
            assert int(got[1][6]) == 1
            for start, rows in _subsets(24, random.Random(k)):
                sl = slice(start, start + rows)
                part = kernels.score(logits[sl], targets[sl], k)
                assert all(torch.equal(a, b[sl]) for a, b in zip(part, got, strict=True))
    with pytest.raises(IndexError):
        kernels.score(torch.zeros(2, 8), torch.tensor([0, 8]), 1)


def test_fused_rope_and_cache_write_equal_torch(kernels: InvariantKernels):
    """One call rotates q and k and writes k and v into their cache slots: the same bits as
    torch's x * cos + rotate_half(x) * sin and index_copy_, which the model runs without the
    kernels; slots and positions outside their tables are refused before any write."""
    from probserve.kernels.torch_ops import _rotate_half

    g = torch.Generator().manual_seed(5)
    nq, nkv, d, t = 9, 3, 64, 37
    qkv = torch.randn(t, (nq + 2 * nkv) * d, generator=g) * 3
    cos, sin = torch.randn(300, d, generator=g), torch.randn(300, d, generator=g)
    positions = torch.randint(0, 300, (t,), generator=g)
    slots = torch.randperm(128, generator=g)[:t]
    kc, vc = torch.zeros(128, nkv, d), torch.zeros(128, nkv, d)
    q = kernels.rope_cache(qkv, (nq, nkv, d), cos, sin, positions, slots, kc, vc)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q_ref = qkv[:, : nq * d].view(t, nq, d)
    k_ref = qkv[:, nq * d : (nq + nkv) * d].view(t, nkv, d)
    kc_ref, vc_ref = torch.zeros_like(kc), torch.zeros_like(vc)
    kc_ref.index_copy_(0, slots, k_ref * c + _rotate_half(k_ref) * s)
    vc_ref.index_copy_(0, slots, qkv[:, (nq + nkv) * d :].view(t, nkv, d))
    assert torch.equal(q, q_ref * c + _rotate_half(q_ref) * s)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    with pytest.raises(IndexError):
        kernels.rope_cache(qkv, (nq, nkv, d), cos, sin, positions, slots + 128, kc, vc)
    with pytest.raises(IndexError):
        kernels.rope_cache(qkv, (nq, nkv, d), cos, sin, positions + 300, slots, kc, vc)


def test_topk_orders_ties_by_id_and_is_a_prefix(kernels: InvariantKernels):
    row = torch.tensor([[0.5, 2.0, 1.0, 2.0, -1.0, 1.0, 2.0, float("-inf"), 1.0, 0.5]])
    vals, ids = kernels.topk(row, 10)
    assert ids[0].tolist() == [1, 3, 6, 2, 5, 8, 0, 9, 4, 7]
    assert vals[0].tolist() == sorted(row[0].tolist(), reverse=True)
    for k in range(1, 10):
        assert torch.equal(kernels.topk(row, k)[1], ids[:, :k])
    wide = torch.randn(2, 3000).round()  # many ties, and the k > 64 path
    v200, i200 = kernels.topk(wide, 200)
    v50, i50 = kernels.topk(wide, 50)
    assert torch.equal(i200[:, :50], i50) and torch.equal(v200[:, :50], v50)
    order = sorted(range(3000), key=lambda j: (-float(wide[0, j]), j))[:200]
    assert i200[0].tolist() == order


@pytest.mark.parametrize("nq, d", [(6, 40), (6, 64), (9, 64), (4, 128)])
@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (9, 7.5), (None, 2.0)])
def test_paged_attention_equals_sdpa_and_is_row_invariant(
    kernels: InvariantKernels, nq, d, window, softcap
):
    """Head sizes of the generic loops (40, 128) and of the register-blocked ones (64), token
    tiles of a prefill chunk against each token alone; sliding windows (a token reads its last
    `window` keys: transformers' `kv_idx > q_idx - window`) and Gemma 2's score soft-capping."""
    g = torch.Generator().manual_seed(3)
    nkv, bs, slots = 2 if nq % 2 == 0 else 3, 4, 64
    kc, vc = torch.randn(slots, nkv, d, generator=g), torch.randn(slots, nkv, d, generator=g)
    tables = torch.tensor([[3, 9, 1, 12, 5], [2, 7, 14, 0, 0]])  # two sequences' blocks
    # a chunk of 7 consecutive positions (one tile), lone tokens of both sequences
    seq = torch.tensor([0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1])
    lengths = torch.tensor([1, 9, 17, 6, 11, 12, 13, 14, 15, 16, 17, 11])
    q = torch.randn(len(seq), nq, d, generator=g)
    args = (window, softcap)
    out = kernels.attention(q, kc, vc, 0.125, tables, seq, lengths, bs, *args)
    for t in range(len(seq)):
        length = int(lengths[t])
        pos = torch.arange(max(0, length - window) if window else 0, length)
        keys_at = tables[seq[t], pos // bs] * bs + pos % bs
        k = kc[keys_at].transpose(0, 1).repeat_interleave(nq // nkv, 0)  # [nq, L, d]
        v = vc[keys_at].transpose(0, 1).repeat_interleave(nq // nkv, 0)
        scores = q[t].unsqueeze(1) @ k.transpose(1, 2) * 0.125  # transformers' eager order
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        ref = torch.softmax(scores, dim=-1) @ v
        torch.testing.assert_close(out[t], ref.reshape(-1), atol=1e-5, rtol=1e-5)
        alone = kernels.attention(q[t : t + 1], kc, vc, 0.125, tables, seq[t : t + 1],
                                  lengths[t : t + 1], bs, *args)  # fmt: skip
        assert torch.equal(alone[0], out[t])


@pytest.mark.parametrize(
    "nq, nkv, d",
    [(16, 4, 256), (8, 2, 80), (12, 4, 96), (4, 4, 64), (6, 1, 128), (2, 1, 128)],
)
@pytest.mark.parametrize("window", [None, 70])
def test_paged_attention_over_long_rows_is_exact_and_row_invariant(
    kernels: InvariantKernels, nq, nkv, d, window
):
    """Rows longer than a block of the P.V pass's keys (32), heads of 256 (two heads a key on
    AVX2), 80 and 96 (register paths of two columns), and every grouping of the P.V pass: a
    prefill tile's many (token, head) pairs, a decode token's 1, 2, 4 or 6 heads of one KV head;
    a sliding window of 70 (a tile's rows start at different keys, none at a block's edge).
    Each token's output equals the token alone, bit for bit, and the float64 reference."""
    g = torch.Generator().manual_seed(7)
    bs, blocks = 16, 24
    kc = torch.randn(blocks * bs, nkv, d, generator=g)
    vc = torch.randn(blocks * bs, nkv, d, generator=g)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:20] for _ in range(2)])
    # a chunk of 10 consecutive positions (a tile of 8 and one of 2), then decode tokens
    seq = torch.tensor([0] * 10 + [1, 0, 1])
    lengths = torch.tensor([*range(281, 291), 300, 129, 1])
    q = torch.randn(len(seq), nq, d, generator=g)
    out = kernels.attention(q, kc, vc, d**-0.5, tables, seq, lengths, bs, window)
    for t in range(len(seq)):
        length = int(lengths[t])
        pos = torch.arange(max(0, length - window) if window else 0, length)
        at = tables[seq[t], pos // bs] * bs + pos % bs
        k = kc[at].transpose(0, 1).repeat_interleave(nq // nkv, 0).double()
        v = vc[at].transpose(0, 1).repeat_interleave(nq // nkv, 0).double()
        ref = torch.softmax(q[t].double().unsqueeze(1) @ k.transpose(1, 2) * d**-0.5, -1) @ v
        torch.testing.assert_close(out[t].double(), ref.reshape(-1), atol=2e-6, rtol=1e-5)
        alone = kernels.attention(q[t : t + 1], kc, vc, d**-0.5, tables, seq[t : t + 1],
                                  lengths[t : t + 1], bs, window)  # fmt: skip
        assert torch.equal(alone[0], out[t])


def test_geglu_and_softcap_kernels_equal_torch_and_are_row_invariant(kernels: InvariantKernels):
    g = torch.Generator().manual_seed(5)
    gu = torch.randn(9, 2 * 37, generator=g) * 4
    out = kernels.gelu_tanh_mul(gu)
    ref = F.gelu(gu[:, :37], approximate="tanh") * gu[:, 37:]
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(kernels.gelu_tanh_mul(gu[3:4])[0], out[3])
    x = torch.randn(5, 301, generator=g) * 100
    capped = kernels.softcap(x, 30.0)
    torch.testing.assert_close(capped, torch.tanh(x / 30.0) * 30.0, atol=1e-5, rtol=1e-5)
    assert torch.equal(kernels.softcap(x[2:3], 30.0)[0], capped[2])


# ---- whole requests -----------------------------------------------------------------------
def _bits(outs: list[EngineOutput]) -> list[bytes]:
    """Every number a request's outputs carry, as raw bytes (NaN and -0.0 included), each
    field's joined over the outputs in order: the same whether a step's tokens came one an
    output or several (speculation proposes, or not, as the load allows: core/speculator.py)."""
    fields: dict[str, list[bytes]] = {}

    def put(name: str, data: bytes) -> None:
        fields.setdefault(name, []).append(data)

    def add(prefix: str, lp: TokenLogprobs | None) -> None:
        if lp is None:
            return
        for name in ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs",
                     "target_logprobs", "entropy", "full"):  # fmt: skip
            arr = getattr(lp, name, None)
            if arr is not None:
                put(prefix + name, np.ascontiguousarray(arr).tobytes())
        add(prefix + "processed.", lp.processed)

    for o in outs:
        put("new_token_ids", np.asarray(o.new_token_ids, np.int64).tobytes())
        add("logprobs.", o.logprobs)
        add("prompt.", o.prompt_logprobs)
        if o.finish_reason is not None:
            put("finish", str(o.finish_reason).encode())
    return [name.encode() + b"=" + b"".join(parts) for name, parts in sorted(fields.items())]


def _canary(m: LoadedModel, rid: str = "canary", seeded: bool = False) -> EngineRequest:
    ids = tuple(m.tokenizer("In a hole in the ground there lived a hobbit. Not a nasty,").input_ids)
    sampling = (
        SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=10, ignore_eos=True)
        if seeded
        else SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )
    spec = LogprobsSpec(
        top_k=5,
        prompt_top_k=3,
        mode=LogprobsMode.BOTH if seeded else LogprobsMode.RAW,
        target_ids=(11, 502),
        entropy=True,
    )
    return EngineRequest(rid, ids, sampling, spec)


def _others(m: LoadedModel, count: int, seed: int) -> list[EngineRequest]:
    rng = random.Random(seed)
    vocab = m.vocab_size
    reqs = []
    for i in range(count):
        ids = tuple(rng.randrange(10, vocab) for _ in range(rng.randrange(1, 60)))
        k = rng.choice([0, 2, 20])
        sampling = SamplingParams(
            temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randrange(1, 14), ignore_eos=True,
            seed=rng.randrange(1000),
        )  # fmt: skip
        spec = LogprobsSpec(top_k=k, prompt_top_k=rng.choice([None, 1]))
        reqs.append(EngineRequest(f"other{i}", ids, sampling, spec))
    return reqs


def _det(**config: object) -> EngineConfig:
    """Plain decoding's invariance (speculation's: tests/test_speculation.py)."""
    config.setdefault("kv_cache_gib", 0.1)
    config.setdefault("speculative", "off")
    return EngineConfig(deterministic=True, **config)  # type: ignore[arg-type]


def test_a_request_among_63_others_is_bitwise_the_same(smol: LoadedModel):
    core = EngineCore(smol, _det(max_num_seqs=64))
    assert core.info.deterministic
    for seeded in (False, True):
        alone = run_core(core, [_canary(smol, seeded=seeded)])["canary"]
        crowd = _others(smol, 63, seed=5)
        mixed = run_core(core, [*crowd[:30], _canary(smol, seeded=seeded), *crowd[30:]])
        assert _bits(mixed["canary"]) == _bits(alone)


def test_a_step_scores_every_prompt_with_one_head_pass_and_the_same_bits(
    smol: LoadedModel, monkeypatch: pytest.MonkeyPatch
):
    from probserve.models.llama import LlamaForward

    rng = random.Random(3)
    reqs = [
        EngineRequest(
            f"p{i}",
            tuple(rng.randrange(10, smol.vocab_size) for _ in range(rng.randrange(2, 40))),
            SamplingParams(max_tokens=0),
            LogprobsSpec(prompt_top_k=k, entropy=i == 5),
        )
        for i, k in enumerate([0, 3, 1, 20, 3, 2])
    ]
    core = EngineCore(smol, _det(max_num_seqs=8, prefix_caching=False))
    alone = {r.request_id: run_core(core, [r])[r.request_id] for r in reqs}
    calls: list[int] = []
    real = LlamaForward.logits

    def counting(self: LlamaForward, hidden: torch.Tensor) -> torch.Tensor:
        calls.append(int(hidden.shape[0]))
        return real(self, hidden)

    monkeypatch.setattr(LlamaForward, "logits", counting)
    together = run_core(core, reqs)
    # one head product for the five plain prompts of the step, one for the one with entropy
    assert len(calls) == 2, calls
    for r in reqs:
        got, want = together[r.request_id], alone[r.request_id]
        scored = got[-1].prompt_logprobs
        assert scored is not None and len(scored) == len(r.prompt_token_ids) - 1
        assert scored.top_ids.shape[1] == r.logprobs.prompt_top_k  # type: ignore[union-attr]
        assert _bits(got) == _bits(want), r.request_id


@pytest.mark.parametrize("budget", [1, 6, 16, 512])
def test_chunk_size_and_prefix_cache_leave_the_bits_alone(smol: LoadedModel, budget: int):
    reference = run_core(EngineCore(smol, _det(prefix_caching=False)), [_canary(smol)])["canary"]
    core = EngineCore(smol, _det(max_num_batched_tokens=budget, block_size=4))
    cold = run_core(core, [_canary(smol), *_others(smol, 3, seed=budget)])["canary"]
    hits = core.scheduler.prefix_hit_tokens
    warm = run_core(core, [_canary(smol, "again")])["again"]
    assert core.scheduler.prefix_hit_tokens > hits  # the second one read its prefix cached
    assert _bits(cold) == _bits(reference) == _bits(warm)


def test_preempted_and_recomputed_requests_keep_their_bits(smol: LoadedModel):
    reqs = [_canary(smol, f"c{i}") for i in range(3)] + _others(smol, 5, seed=9)
    alone = {r.request_id: run_core(EngineCore(smol, _det()), [r])[r.request_id] for r in reqs[::3]}
    per_token = 4 * (2 * 30 * 3 * 64 + 576)
    tight = EngineCore(smol, _det(block_size=4, kv_cache_gib=40 * 4 * per_token / 2**30))
    outs = run_core(tight, reqs)
    assert tight.scheduler.num_preemptions > 0
    for rid, expected in alone.items():
        assert _bits(outs[rid]) == _bits(expected)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    others=st.integers(0, 12),
    seed=st.integers(0, 10**6),
    budget=st.integers(1, 96),
    block_size=st.sampled_from([1, 4, 16]),
    prefix_caching=st.booleans(),
    seeded=st.booleans(),
)
def test_random_batch_mixes_are_bitwise_invariant(
    tiny: LoadedModel, others, seed, budget, block_size, prefix_caching, seeded
):
    reference = run_core(EngineCore(tiny, _det()), [_canary(tiny, seeded=seeded)])["canary"]
    core = EngineCore(tiny, _det(max_num_batched_tokens=budget, block_size=block_size,
                                 prefix_caching=prefix_caching))  # fmt: skip
    crowd = _others(tiny, others, seed)
    at = random.Random(seed).randrange(0, others + 1)
    outs = run_core(core, [*crowd[:at], _canary(tiny, seeded=seeded), *crowd[at:]])
    assert _bits(outs["canary"]) == _bits(reference)


# ---- over HTTP ----------------------------------------------------------------------------
def _stream(c: httpx.Client, path: str, body: dict) -> list[dict]:
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]


@pytest.mark.slow
def test_http_answers_are_the_same_bytes_alone_under_load_and_streamed(smol: LoadedModel):
    from server_util import running_server

    comp = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
            "logprobs": 5, "echo": True, "temperature": 0}  # fmt: skip
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 8, "logprobs": True, "top_logprobs": 5, "temperature": 0}  # fmt: skip
    load = [
        {
            "model": MODEL,
            "prompt": f"Story {i}: once upon a time" * (1 + i % 5),
            "max_tokens": 24,
            "logprobs": 3,
            "temperature": 1.0,
            "seed": i,
        }
        for i in range(12)
    ]
    with (
        running_server(smol, "--deterministic") as url,
        httpx.Client(base_url=url, timeout=300) as c,
    ):
        assert c.get("/health").json()["deterministic"] is True
        alone_c = c.post("/v1/completions", json=comp).json()["choices"]
        alone_h = c.post("/v1/chat/completions", json=chat).json()["choices"]
        with ThreadPoolExecutor(len(load)) as pool:
            busy = [pool.submit(c.post, "/v1/completions", json=b) for b in load]
            time.sleep(0.5)  # the others are in the batch
            loaded_c = c.post("/v1/completions", json=comp).json()["choices"]
            loaded_h = c.post("/v1/chat/completions", json=chat).json()["choices"]
            assert all(f.result().status_code == 200 for f in busy)
        assert loaded_c == alone_c
        assert loaded_h == alone_h
        # streamed: the same values, chunk by chunk
        chunks = _stream(c, "/v1/chat/completions", chat)
        streamed = [e for ch in chunks for e in (ch["choices"][0].get("logprobs") or {})
                    .get("content", [])]  # fmt: skip
        assert streamed == alone_h[0]["logprobs"]["content"]
        plain = {**comp, "echo": False}
        whole = c.post("/v1/completions", json=plain).json()["choices"][0]["logprobs"]
        chunks = _stream(c, "/v1/completions", plain)
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            got = [v for ch in chunks for v in ch["choices"][0]["logprobs"][key]]
            assert got == whole[key]


def test_embedding_rows_refuse_ids_outside_the_table(kernels: InvariantKernels):
    packed = kernels.pack(torch.arange(40.0).view(10, 4))
    assert kernels.rows(packed, torch.tensor([9, 0])).tolist() == [[36, 37, 38, 39], [0, 1, 2, 3]]
    for bad in ([10], [-1]):
        with pytest.raises(IndexError):
            kernels.rows(packed, torch.tensor(bad))
