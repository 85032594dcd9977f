"""The GPU path's Triton kernels (kernels/gpu/) under Triton's interpreter on CPU tensors (CI has
no GPU; scripts/gpu_check.sh runs this file on one): each against a torch reference, and each
row's bits the same alone as among others (products at any number of rows, attention for a
token alone or in a chunk, whatever its neighbours)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from probserve.kernels.gpu import attention as attention_kernel  # noqa: E402
from probserve.kernels.gpu import rows  # noqa: E402
from probserve.kernels.gpu.matmul import matmul  # noqa: E402
from probserve.kernels.gpu.ops import TritonKernels  # noqa: E402

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


@pytest.mark.parametrize("d", [64, 96])
def test_rope_and_the_cache_write_equal_torch(d: int) -> None:
    nq, nkv, t, slots = 4, 2, 6, 40
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
