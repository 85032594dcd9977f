"""Row-invariant kernels as torch functions (the C++ side: invariant.cpp).

Each function takes and returns contiguous float32 CPU tensors and calls the library once; the
library releases the GIL (ctypes) and threads over rows, panels or heads with OpenMP. A result
row is a function of its own input row only: the guarantee `--deterministic` rests on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from probserve.kernels.build import load


@dataclass(frozen=True)
class PackedWeight:
    """A [N, K] weight as panels [ceil(N / P), K, P] of P columns (zero padded), and its bias
    padded to a whole panel."""

    panels: torch.Tensor
    bias: torch.Tensor | None
    n: int
    k: int


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).contiguous()


class InvariantKernels:
    def __init__(self) -> None:
        self.lib = load()
        self.panel = int(self.lib.ps_panel_width())

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
        n, k = weight.shape
        p = self.panel
        padded = -(-n // p) * p
        w = torch.zeros((padded, k), dtype=torch.float32)
        w[:n] = weight.detach().float()
        panels = w.view(padded // p, p, k).transpose(1, 2).contiguous()
        b = None
        if bias is not None:
            b = torch.zeros(padded, dtype=torch.float32)
            b[:n] = bias.detach().float()
        return PackedWeight(panels, b, int(n), int(k))

    def linear(self, x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
        x = _f32(x)
        lead = x.shape[:-1]
        x = x.reshape(-1, w.k)
        out = torch.empty((x.shape[0], w.n), dtype=torch.float32)
        bias = None if w.bias is None else w.bias.data_ptr()
        self.lib.ps_linear(
            x.data_ptr(), x.shape[0], w.k, w.panels.data_ptr(), w.n, bias, out.data_ptr()
        )
        return out.view(*lead, w.n)

    def rows(self, w: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the packed weight, [len(ids), K] (an embedding lookup)."""
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < w.n):
            # the engine validates ids first; the kernel reads memory, so it checks again
            raise IndexError(f"token id outside the embedding's {w.n} rows")
        out = torch.empty((ids.numel(), w.k), dtype=torch.float32)
        self.lib.ps_packed_rows(
            w.panels.data_ptr(), w.k, ids.data_ptr(), ids.numel(), out.data_ptr()
        )
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = _f32(x)
        out = torch.empty_like(x)
        h = x.shape[-1]
        self.lib.ps_rms_norm(
            x.data_ptr(), x.numel() // h, h, weight.data_ptr(), eps, out.data_ptr()
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for rows [gate | up] of 2I: rows of I."""
        gu = _f32(gate_up)
        m, two_i = gu.shape
        out = torch.empty((m, two_i // 2), dtype=torch.float32)
        self.lib.ps_silu_mul(gu.data_ptr(), m, two_i // 2, out.data_ptr())
        return out

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        x = _f32(x)
        out = torch.empty_like(x)
        self.lib.ps_log_softmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out

    def entropy(self, logprobs: torch.Tensor) -> torch.Tensor:
        lp = _f32(logprobs)
        out = torch.empty(lp.shape[0], dtype=torch.float32)
        self.lib.ps_entropy(lp.data_ptr(), lp.shape[0], lp.shape[1], out.data_ptr())
        return out

    def topk(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k largest of each row, by value descending then id ascending (one total order:
        ties are resolved the same way in every batch)."""
        x = _f32(x)
        m, v = x.shape
        k = min(k, v)
        vals = torch.empty((m, k), dtype=torch.float32)
        ids = torch.empty((m, k), dtype=torch.int64)
        if k > 0 and m > 0:
            self.lib.ps_topk(x.data_ptr(), m, v, k, vals.data_ptr(), ids.data_ptr())
        return vals, ids

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        tables: torch.Tensor,
        seq: torch.Tensor,
        lengths: torch.Tensor,
        block_size: int,
    ) -> torch.Tensor:
        """Causal attention of q [T, nq, d] over a paged cache [slots, nkv, d] read in place:
        token t attends to the first lengths[t] positions of the sequence whose block table is
        tables[seq[t]]. Returns [T, nq * d]."""
        q = _f32(q)
        t, nq, d = q.shape
        out = torch.empty((t, nq * d), dtype=torch.float32)
        tables, seq, lengths = (a.to(torch.int64).contiguous() for a in (tables, seq, lengths))
        self.lib.ps_attention(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            t,
            nq,
            int(k_cache.shape[1]),
            d,
            scale,
            tables.data_ptr(),
            int(tables.shape[1]),
            block_size,
            seq.data_ptr(),
            lengths.data_ptr(),
        )
        return out
