"""The GPU path's Triton kernels (kernels/gpu/) under Triton's interpreter on CPU tensors (CI has
no GPU; scripts/gpu_check.sh runs this file on one): each against a torch reference, and each
row's bits the same alone as among others (products at any number of rows, attention for a
token alone or in a chunk, whatever its neighbours)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
import triton  # noqa: F401  (a dev dependency: without it these tests fail, they never skip)

from probserve.kernels.gpu import attention as attention_kernel
from probserve.kernels.gpu import rows
from probserve.kernels.gpu.matmul import matmul
from probserve.kernels.gpu.ops import TritonKernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE)


@pytest.mark.parametrize("k, n", [(64, 96), (100, 37)])
def test_matmul_is_the_product_and_row_invariant(k: int, n: int) -> None:
    x, w, b = _randn(70, k, seed=1), _randn(n, k, seed=2), _randn(n, seed=3)
    y = matmul(x, w, b)
    ref = (x.double() @ w.double().T + b.double()).float()
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-5)
    for rows_at in ([5], [0, 1, 2], list(range(33)), list(range(40, 70))):
        part = matmul(x[rows_at], w, b)
        assert torch.equal(part, y[rows_at]), rows_at
    half = matmul(x, w.to(torch.bfloat16), b)  # bf16 inputs, float32 sums
    bf = (x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().T + b.double()).float()
    # (the interpreter rounds float32 to bf16 by truncation: within one bf16 step of the product)
    torch.testing.assert_close(half, bf, atol=0.15, rtol=2e-2)
    assert torch.equal(matmul(x[3:4], w.to(torch.bfloat16), b), half[3:4])


def test_norm_activations_and_softcap_equal_torch_and_are_row_invariant() -> None:
    x, w = _randn(9, 1500, seed=4, scale=3.0), _randn(1500, seed=5)
    y = rows.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(y, F.rms_norm(x, (1500,), w, 1e-6), atol=1e-5, rtol=1e-5)
    assert torch.equal(rows.rms_norm(x[4:5], w, 1e-6), y[4:5])
    gu = _randn(7, 2 * 37, seed=6, scale=4.0)
    for gelu in (False, True):
        out = rows.gated(gu, gelu)
        gate, up = gu[:, :37], gu[:, 37:]
        ref = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(rows.gated(gu[2:3], gelu), out[2:3])
    big = _randn(5, 301, seed=7, scale=100.0)
    capped = rows.softcap(big, 30.0)
    torch.testing.assert_close(capped, torch.tanh(big / 30.0) * 30.0, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d, nq, nkv", [(64, 4, 2), (96, 4, 2), (64, 14, 2)])
def test_rope_and_the_cache_write_equal_torch(d: int, nq: int, nkv: int) -> None:
    """A token's heads in blocks of rows (18 heads: a block of 16 and one of 2, the rest
    masked): the queries and keys rotated as torch rotates them, the keys and values at their
    slots and nowhere else."""
    t, slots = 6, 40
    qkv = _randn(t, (nq + 2 * nkv) * d, seed=8)
    cos, sin = _randn(50, d, seed=9), _randn(50, d, seed=10)
    positions = torch.tensor([0, 7, 8, 9, 31, 49], device=DEVICE)
    slots_at = torch.tensor([3, 17, 18, 2, 39, 0], device=DEVICE)
    kc = torch.zeros(slots, nkv, d, device=DEVICE)
    vc = torch.zeros(slots, nkv, d, device=DEVICE)
    q = rows.rope_cache(qkv, (nq, nkv, d), cos, sin, positions, slots_at, kc, vc)

    def rot(x: torch.Tensor) -> torch.Tensor:
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        return x * c + torch.cat((-x[..., half:], x[..., :half]), -1) * s

    torch.testing.assert_close(q, rot(qkv[:, : nq * d].view(t, nq, d)), atol=1e-6, rtol=1e-6)
    k_ref = rot(qkv[:, nq * d : (nq + nkv) * d].view(t, nkv, d))
    torch.testing.assert_close(kc[slots_at], k_ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(vc[slots_at], qkv[:, (nq + nkv) * d :].view(t, nkv, d))
    untouched = [s for s in range(slots) if s not in slots_at.tolist()]
    assert not kc[untouched].any() and not vc[untouched].any()


@pytest.mark.parametrize("nq, d", [(4, 64), (6, 40)])
@pytest.mark.parametrize("window, softcap, sinks", [
    (None, None, False), (5, None, False), (9, 7.5, False), (None, None, True),
])  # fmt: skip
def test_paged_attention_equals_eager_and_is_row_invariant(
    nq: int, d: int, window: int | None, softcap: float | None, sinks: bool
) -> None:
    nkv, bs, slots = 2, 4, 64
    kc, vc = _randn(slots, nkv, d, seed=11), _randn(slots, nkv, d, seed=12)
    tables = torch.tensor([[3, 9, 1, 12, 5, 6, 7, 8, 10, 11], [2, 7, 14, 0, 0, 0, 0, 0, 0, 0]],
                          device=DEVICE)  # fmt: skip
    seq = torch.tensor([0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1], device=DEVICE)
    lengths = torch.tensor([1, 9, 17, 6, 33, 34, 35, 36, 37, 38, 39, 11], device=DEVICE)
    q = _randn(len(seq), nq, d, seed=13)
    sink = _randn(nq, seed=14) if sinks else None
    args = (bs, window, softcap, sink)
    out = attention_kernel.attention(q, kc, vc, 0.125, tables, seq, lengths, *args)
    for t in range(len(seq)):
        length = int(lengths[t])
        pos = torch.arange(max(0, length - window) if window else 0, length, device=DEVICE)
        keys_at = tables[seq[t], pos // bs] * bs + pos % bs
        k = kc[keys_at].transpose(0, 1).repeat_interleave(nq // nkv, 0).double()
        v = vc[keys_at].transpose(0, 1).repeat_interleave(nq // nkv, 0).double()
        scores = (q[t].double().unsqueeze(1) @ k.transpose(1, 2)).squeeze(1) * 0.125
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if sink is not None:
            scores = torch.cat([scores, sink.double().unsqueeze(1)], dim=1)
        p = torch.softmax(scores, dim=-1)[:, : len(pos)]  # the sink's share attends to nothing
        ref = (p.unsqueeze(1) @ v).reshape(-1).float()
        torch.testing.assert_close(out[t], ref, atol=2e-5, rtol=1e-5)
        alone = attention_kernel.attention(q[t : t + 1], kc, vc, 0.125, tables, seq[t : t + 1],
                                           lengths[t : t + 1], *args)  # fmt: skip
        assert torch.equal(alone[0], out[t])


def test_the_ops_hold_weights_once_on_the_device_in_the_precision() -> None:
    ops = TritonKernels(DEVICE, "bf16")
    w = torch.randn(12, 8)
    packed = ops.pack(w, torch.ones(12))
    assert packed.panels.dtype == torch.bfloat16 and packed.panels.device.type == DEVICE.type
    assert ops.place(w) is ops.place(w)  # a host tensor is copied once
    ids, weights = ops.route(torch.tensor([[1.0, 3.0, 3.0, 0.0]]), 2, True)
    assert ids.tolist() == [[1, 2]]  # a tie goes to the lower id
    torch.testing.assert_close(weights.sum(), torch.tensor(1.0, device=weights.device))


def _vocab_rows() -> torch.Tensor:
    """Rows of logits with the cases a vocabulary row meets: ties at the top and at the k-th
    place, a row all alike, masked (-inf) entries, a near-certain row (an entropy of ~2e-18
    nats), rows past one block."""
    x = _randn(8, 2500, seed=11, scale=4.0)
    x[1, 300:340] = 20.0  # 40 tied best entries: top-20 takes the lowest ids
    x[2] = 0.5
    x[3, 7:] = float("-inf")  # 7 allowed tokens: the rest come in id order at -inf
    x[4, 1234] = 60.0  # near-certain: its tiny entropy keeps its digits
    return x


def test_vocabulary_reductions_are_exact_ordered_and_row_invariant() -> None:
    from probserve.engine.core.row_math import entropy_float64
    from probserve.kernels.gpu import vocab

    x = _vocab_rows()
    targets = torch.tensor([0, 301, 5, 6, 1234, 2499, 17, 1000], device=DEVICE)
    lp = vocab.log_softmax(x)
    ref = torch.log_softmax(x.double(), dim=1)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(lp), finite)
    # (to float32's rounding of each value: ~4e-6 at the near-certain row's -60)
    torch.testing.assert_close(lp.double()[finite], ref[finite], rtol=2e-7, atol=2e-6)
    chosen, rank, vals, ids = vocab.score(x, targets, 20)
    # the same bits as gather, count and a (value, id) ordered top-k on log_softmax's output
    assert torch.equal(chosen, lp.gather(1, targets.view(-1, 1)).view(-1))
    assert torch.equal(rank, (lp > chosen.view(-1, 1)).sum(dim=1) + 1)
    order = torch.sort(lp, dim=1, descending=True, stable=True).indices[:, :20]
    assert torch.equal(ids, order) and torch.equal(vals, lp.gather(1, order))
    assert ids[1].tolist() == list(range(300, 320)) and ids[3, 7:].tolist() == list(range(7, 20))
    raw_vals, raw_ids = vocab.topk(x, 64)  # the logits' own top-k: the same order
    assert torch.equal(raw_ids, torch.sort(x, dim=1, descending=True, stable=True).indices[:, :64])
    assert torch.equal(raw_vals, x.gather(1, raw_ids))
    h = vocab.entropy(lp)
    # the host's float64 entropy of the same rows (-sum p log p written out loses the
    # near-certain row: its best entry's lp, -2.5e-18, is 0 in a float64 log-softmax)
    exact = entropy_float64(lp.cpu()).to(DEVICE)
    torch.testing.assert_close(h, exact, rtol=1e-6, atol=0.0)
    assert 0 < float(h[4]) < 1e-15
    for rows_at in ([4], [1, 2], [0, 3, 5, 7], list(range(1, 8))):
        part = vocab.score(x[rows_at], targets[rows_at], 20)
        for got, whole in zip(part, (chosen, rank, vals, ids), strict=True):
            assert torch.equal(got, whole[rows_at]), rows_at
        assert torch.equal(vocab.log_softmax(x[rows_at]), lp[rows_at])
        assert torch.equal(vocab.entropy(lp[rows_at]), h[rows_at])
    with pytest.raises(IndexError):
        vocab.score(x[:1], torch.tensor([2500], device=DEVICE), 3)


def test_device_row_math_goes_past_the_kernels_top_k_in_the_same_order() -> None:
    from probserve.engine.core.row_math import DeviceRowMath
    from probserve.kernels.gpu import vocab

    math = DeviceRowMath(DEVICE)
    x = _vocab_rows()
    k = vocab.MAX_K + 36
    lp = math.log_softmax(x)
    vals, ids = math.topk(lp, k)
    order = torch.sort(lp, dim=1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(ids, order) and torch.equal(vals, lp.gather(1, order))
    targets = torch.arange(8)  # on the host: the rows' device is where the work runs
    chosen, _, _, wide_ids = math.score(x.cpu(), targets, k)
    assert chosen.device == DEVICE and torch.equal(wide_ids, ids)
    assert torch.equal(math.score(x, targets, 20)[0], chosen)


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_experts_equal_each_expert_alone_and_are_row_invariant(bias: bool) -> None:
    """A mixture of experts' feed-forward in grouped products (kernels/gpu/experts.py): each
    token the float64 sum over its experts, in ascending id, of weight * down(silu(gate) * up),
    and its bits the same alone as among others (tiles of one expert's pairs, padded)."""
    from probserve.kernels.gpu.experts import TILE_M, GroupedExperts, layout

    e, h, i, k, t = 6, 40, 24, 3, 37
    parts = [
        (
            _randn(2 * i, h, seed=20 + x, scale=0.2), _randn(2 * i, seed=40 + x) if bias else None,
            _randn(h, i, seed=60 + x, scale=0.2), _randn(h, seed=80 + x) if bias else None,
        )
        for x in range(e)
    ]  # fmt: skip
    grouped = GroupedExperts.stack(iter(parts), e)
    x = _randn(t, h, seed=9)
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(DEVICE)
    ids[:20] = torch.tensor([5, 0, 2], device=DEVICE)  # 20 tokens on one expert: two tiles
    weights = torch.softmax(_randn(t, k, seed=10), dim=1)
    act = lambda gu: rows.gated(gu, gelu=False)  # noqa: E731
    out = grouped(x, ids, weights, act)
    ref = torch.zeros(t, h, dtype=torch.float64)
    for r in range(t):
        for j in sorted(range(k), key=lambda j: int(ids[r, j])):
            gw, gb, dw, db = (p.double().cpu() if p is not None else None for p in parts[ids[r, j]])
            gu = gw @ x[r].double().cpu() + (gb if gb is not None else 0)
            a = F.silu(gu[:i]) * gu[i:]
            ref[r] += float(weights[r, j]) * (dw @ a + (db if db is not None else 0))
    torch.testing.assert_close(out.double().cpu(), ref, atol=1e-4, rtol=1e-5)
    for rows_at in ([7], [0, 19, 20], list(range(5, 30))):
        part = grouped(x[rows_at], ids[rows_at], weights[rows_at], act)
        assert torch.equal(part, out[rows_at]), rows_at
    half = GroupedExperts.stack(  # bf16 weights: bf16 product inputs, float32 sums
        ((gw.bfloat16(), gb, dw.bfloat16(), db) for gw, gb, dw, db in parts), e
    )
    out_half = half(x, ids, weights, act)
    # (bf16 keeps 8 bits; the interpreter truncates to it: within a few % of the largest)
    assert 0 < float((out_half - out).abs().max() / out.abs().max()) < 0.03
    assert torch.equal(half(x[[7, 30]], ids[[7, 30]], weights[[7, 30]], act), out_half[[7, 30]])
    if bias:  # biases for every expert or for none
        with pytest.raises(ValueError, match="expert 2"):
            GroupedExperts.stack(iter([*parts[:2], (*parts[2][:3], None)]), 3)
    pair, tile_expert = layout(ids, e)
    assert pair.numel() == tile_expert.numel() * TILE_M
    assert sorted(int(p) for p in pair if p >= 0) == list(range(t * k))


def test_the_delta_rule_is_the_torch_rule_and_ignores_chunks_and_neighbours() -> None:
    """gpu/delta.py's recurrence (through TritonKernels.gated_delta) against delta_rule.py's
    torch rule (GQA, a value width past one program's block of columns, states saved mid-span),
    and bitwise the same outputs, states and saved states for a sequence alone in chunks of 3, 1
    and 4 rows as beside another sequence in one call."""
    from probserve.kernels.delta_rule import DeltaLayer, DeltaSpan, torch_gated_delta

    nk, nv, dk, dv, k = 2, 4, 8, 40, 4
    c = 2 * nk * dk + nv * dv
    layer = DeltaLayer(_randn(k, c, seed=20, scale=0.5), -torch.rand(nv).to(DEVICE) - 0.1,
                       _randn(nv, seed=21), nk, nv, dk, dv)  # fmt: skip
    proj = _randn(13, c + nv * dv + 2 * nv, seed=22)
    start = [(_randn(k - 1, c, seed=23 + i), _randn(nv, dk, dv, seed=25 + i, scale=0.1))
             for i in range(2)]  # fmt: skip
    ops = TritonKernels(DEVICE)

    def both(rule: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        states = [(conv.clone(), delta.clone()) for conv, delta in start]
        saved = [(torch.empty_like(start[0][0]), torch.empty_like(start[0][1])) for _ in range(3)]
        spans = [
            DeltaSpan(0, 5, *states[0], ((1, *saved[0]), (3, *saved[1]))),
            DeltaSpan(5, 13, *states[1], ((6, *saved[2]),)),
        ]
        out = rule(proj, layer, spans)
        return out, [t for pair in states + saved for t in pair]

    triton_out, held = both(ops.gated_delta)
    torch_out, torch_held = both(lambda p, lay, sp: torch_gated_delta(F.silu, p, lay, sp))
    torch.testing.assert_close(triton_out, torch_out, atol=1e-5, rtol=1e-5)
    for a, b in zip(held, torch_held, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # the second sequence alone, in chunks
    conv, state = start[1][0].clone(), start[1][1].clone()
    saved_conv, saved_delta = torch.empty_like(conv), torch.empty_like(state)
    outs = []
    for a, b in ((0, 3), (3, 4), (4, 8)):
        saves = ((6 - a, saved_conv, saved_delta),) if a <= 6 < b else ()
        span = DeltaSpan(0, b - a, conv, state, saves)
        outs.append(ops.gated_delta(proj[5 + a : 5 + b], layer, [span]))
    assert torch.equal(torch.cat(outs), triton_out[5:])
    assert torch.equal(conv, held[2]) and torch.equal(state, held[3])
    assert torch.equal(saved_conv, held[8]) and torch.equal(saved_delta, held[9])
