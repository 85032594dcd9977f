"""Row-invariant kernels as torch functions (the C++ side: invariant.cpp).

Each function takes and returns contiguous float32 CPU tensors and calls the library once; the
library releases the GIL (ctypes) and threads over rows, panels or heads with OpenMP. A result
row is a function of its own input row only: the guarantee `--deterministic` rests on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from probserve.kernels.attention_plan import FlatKernels
from probserve.kernels.build import header_constant, load
from probserve.kernels.delta_rule import DeltaLayer, DeltaSpan
from probserve.kernels.experts import Activation, Expert
from probserve.kernels.layers import LayerWeights, NativeLayers, Shape
from probserve.kernels.native_experts import NativeExperts
from probserve.kernels.qlayout import (
    FORMATS,
    LIMB_PANEL,
    LIMB_TYPES,
    BlockRows,
    pack_blocks,
    pack_limbs,
)
from probserve.kernels.weights import Packed, PackedWeight, QuantizedWeight, Source, row_ids

PS_LIMBS = header_constant("PS_LIMBS")  # probserve.h's: added to a format id in limbs.cpp's layout


SCORE_MAX_K = 64  # the most alternatives ps_score keeps (ps_topk sorts past it)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).contiguous()


def limb_types(lib: Any) -> frozenset[int]:
    """The GGML types `lib` multiplies in integer limbs (limbs.cpp: every native format but MXFP4
    where it was built with AVX-512 VNNI or AVX2; none elsewhere)."""
    return frozenset(t for t in LIMB_TYPES if lib.ps_limb_block_bytes(FORMATS[t].fmt) > 0)


class InvariantKernels(FlatKernels):
    """The library's kernels. `block_sums`: the products on GGUF blocks apply each sub-block's
    scale to its sum (quantized.cpp, --block-sums): row-invariant and within float32 rounding of
    the dequantized product, but not its bits. `limbs`: the formats limbs.cpp multiplies in
    integer limbs are packed for it (True: every one; or the GGML types given, as --products
    chose them; not with block_sums): row-invariant and
    closer to a float64 product than the float32 path. The weights packed by `qpack` carry the
    choice. As the forward's `LayerOps` (kernels/layer_ops.py) they run every operation on
    the host, keep GGUF blocks as the file holds them, and chain the layers in one native call
    (`chain`)."""

    kernel = "invariant"
    keeps_blocks = True  # GGUF blocks are multiplied as the file holds them (qpack)
    reads_rows = True

    def __init__(self, block_sums: bool = False, limbs: bool | frozenset[int] = False) -> None:
        self.lib = load()
        self.panel = int(self.lib.ps_panel_width())
        self.block_sums = block_sums
        chosen: frozenset[int] = frozenset()
        if not block_sums and limbs is not False:
            chosen = limb_types(self.lib) if limbs is True else limb_types(self.lib) & limbs
        self.limb_types = chosen

    def place(self, t: torch.Tensor) -> torch.Tensor:
        return t  # the host is where they run

    def pack(self, weight: Source, bias: torch.Tensor | None = None) -> Packed:
        """A float32 weight packed into panels, or a file's blocks into quantized.cpp's
        (`qpack`)."""
        if not isinstance(weight, torch.Tensor):
            return self.qpack(weight.block_rows, weight.ggml_type, bias)
        n, k = weight.shape
        p = self.panel
        padded = -(-n // p) * p
        w = torch.zeros((padded, k), dtype=torch.float32)
        w[:n] = weight.detach().float()
        panels = w.view(padded // p, p, k).transpose(1, 2).contiguous()
        return PackedWeight(panels, self._bias(bias, n), int(n), int(k))

    def _bias(self, bias: torch.Tensor | None, n: int, panel: int = 0) -> torch.Tensor | None:
        if bias is None:
            return None
        panel = panel or self.panel
        padded = torch.zeros(-(-n // panel) * panel, dtype=torch.float32)
        padded[:n] = bias.detach().float()
        return padded

    def qpack(
        self, blocks: np.ndarray | BlockRows, ggml_type: int, bias: torch.Tensor | None = None
    ) -> QuantizedWeight:
        """Rows of GGUF blocks, uint8 [N, K / block length * block bytes] as the file holds them,
        packed into quantized.cpp's panels (the values are untouched: only their places change)."""
        f = FORMATS[ggml_type]
        n = int(blocks.shape[0])
        if ggml_type in self.limb_types:
            data = pack_limbs(blocks, ggml_type, LIMB_PANEL)  # its own panels, whatever the ISA
            assert data.shape[-1] == self.lib.ps_limb_block_bytes(f.fmt)
            k = int(data.shape[1] * f.qk)
            fmt = f.fmt + PS_LIMBS
            limb_bias = self._bias(bias, n, LIMB_PANEL)
            return QuantizedWeight(torch.from_numpy(data), limb_bias, fmt, n, k)
        data = pack_blocks(blocks, ggml_type, self.panel)
        assert data.shape[-1] == self.lib.ps_qblock_bytes(f.fmt)
        assert self.lib.ps_qblock_len(f.fmt) == f.qk
        fmt = f.fmt + (int(self.lib.ps_block_sums_flag()) if self.block_sums else 0)
        return QuantizedWeight(
            torch.from_numpy(data), self._bias(bias, n), fmt, n, int(data.shape[1] * f.qk)
        )

    def qlinear(self, x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        """x [..., K] times a quantized weight: the same bits as `linear` on its dequantized
        float32 copy (with `block_sums`: row-invariant, within float32 rounding of them; in
        limbs: row-invariant, closer to the float64 product)."""
        return self._product(x, w, lambda *a: self.lib.ps_qlinear(w.fmt, *a))

    def limb_product(self, x: torch.Tensor, w: QuantizedWeight, tiles: int) -> torch.Tensor | None:
        """x [..., K] times a weight in the limb layout on the path `tiles` names whatever the
        row count (limbs.cpp's LimbTiles: 0 vpdpbusd or AVX2, 1 AMX, 2 AMX's emulation), or
        None where this library or CPU has no such path; `qlinear` chooses by row count."""
        done: list[int] = []

        def call(*args: Any) -> None:
            done.append(int(self.lib.ps_limb_linear_on(tiles, w.fmt - PS_LIMBS, *args)))

        out = self._product(x, w, call)
        return out if done == [0] else None

    def qrows(self, w: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a quantized weight, dequantized (an embedding lookup)."""
        ids = row_ids(ids, w.n)
        out = torch.empty((ids.numel(), w.k), dtype=torch.float32)
        n = ids.numel()
        self.lib.ps_qrows(w.fmt, w.data.data_ptr(), w.k, ids.data_ptr(), n, out.data_ptr())
        return out

    def linear(self, x: torch.Tensor, w: Packed) -> torch.Tensor:
        if isinstance(w, QuantizedWeight):
            return self.qlinear(x, w)
        return self._product(x, w, self.lib.ps_linear)

    @staticmethod
    def _product(
        x: torch.Tensor, w: PackedWeight | QuantizedWeight, call: Callable[..., None]
    ) -> torch.Tensor:
        """x [..., K] times a packed weight: `call(x, M, K, weight, N, bias, out)` on the
        library's pointers."""
        x = _f32(x)
        lead = x.shape[:-1]
        x = x.reshape(-1, w.k)
        out = torch.empty((x.shape[0], w.n), dtype=torch.float32)
        data = w.panels if isinstance(w, PackedWeight) else w.data
        bias = None if w.bias is None else w.bias.data_ptr()
        call(x.data_ptr(), x.shape[0], w.k, data.data_ptr(), w.n, bias, out.data_ptr())
        return out.view(*lead, w.n)

    def rows(self, w: Packed, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the packed weight, [len(ids), K] (an embedding lookup)."""
        if isinstance(w, QuantizedWeight):
            return self.qrows(w, ids)
        ids = row_ids(ids, w.n)
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
        return self._glu(self.lib.ps_silu_mul, gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up for rows [gate | up] of 2I (Gemma's GeGLU): rows of I."""
        return self._glu(self.lib.ps_gelu_tanh_mul, gate_up)

    def gpt_oss_glu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """gpt-oss's clamped SwiGLU of rows [gate | up] of 2I: (clamp(up, -limit, limit) + 1)
        * g * sigmoid(alpha * g), g = min(gate, limit); rows of I."""
        return self._glu(self.lib.ps_gpt_oss_glu, gate_up, alpha, limit)

    @staticmethod
    def _glu(fn: Callable[..., None], gate_up: torch.Tensor, *extra: float) -> torch.Tensor:
        gu = _f32(gate_up)
        m, two_i = gu.shape
        out = torch.empty((m, two_i // 2), dtype=torch.float32)
        fn(gu.data_ptr(), m, two_i // 2, out.data_ptr(), *extra)
        return out

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        """tanh(x / cap) * cap, per element (a new tensor)."""
        out = _f32(x).clone()
        self.lib.ps_softcap(out.data_ptr(), out.numel(), cap)
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

    def score(
        self, logits: torch.Tensor, targets: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """From rows of logits, without writing their log-softmax: each target's logprob [m],
        its rank [m] and the k <= SCORE_MAX_K best (logprobs, ids) [m, k], the same bits as
        `log_softmax`, then gather, count and `topk` on its output."""
        x = _f32(logits)
        m, v = x.shape
        assert 0 <= k <= min(SCORE_MAX_K, v)
        t = targets.to(torch.int64).contiguous()
        if m and not bool(((t >= 0) & (t < v)).all()):
            raise IndexError("a target id is outside the row")
        lp = torch.empty(m, dtype=torch.float32)
        rank = torch.empty(m, dtype=torch.int64)
        vals = torch.empty((m, k), dtype=torch.float32)
        ids = torch.empty((m, k), dtype=torch.int64)
        if m:
            self.lib.ps_score(
                x.data_ptr(), m, v, t.data_ptr(), k,
                lp.data_ptr(), rank.data_ptr(), vals.data_ptr(), ids.data_ptr(),
            )  # fmt: skip
        return lp, rank, vals, ids

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

    def route(self, logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A router's choice for each row of logits [m, E]: the k experts of highest softmax
        probability (ties by id ascending) [m, k] and their weights [m, k] (renormalised to sum
        to 1 with `norm`), from the row alone (kernels/route.cpp)."""
        x = _f32(logits)
        m, e = x.shape
        if not 0 < k <= e:
            raise ValueError(f"cannot route to {k} of {e} experts")
        ids = torch.empty((m, k), dtype=torch.int64)
        weights = torch.empty((m, k), dtype=torch.float32)
        if m:
            self.lib.ps_route(x.data_ptr(), m, e, k, int(norm), ids.data_ptr(), weights.data_ptr())
        return ids, weights

    def gated_delta(
        self, proj: torch.Tensor, layer: DeltaLayer, spans: Sequence[DeltaSpan]
    ) -> torch.Tensor:
        """The conv + SiLU and gated delta rule in one call (kernels/deltanet.cpp): threads over
        each span's channel blocks, then its value heads; one order per token and head."""
        x = _f32(proj)
        t, c, vd = x.shape[0], layer.channels, layer.v_heads * layer.v_dim
        width = c + vd + 2 * layer.v_heads
        if x.shape[1] != width:
            raise ValueError(f"gated delta rows of {x.shape[1]} columns, expected {width}")
        out = torch.empty((t, vd), dtype=torch.float32)
        if not spans or not t:
            return out
        rows: list[tuple[int, ...]] = []
        saves: list[tuple[int, int, int]] = []
        for span in spans:
            held = (span.conv, span.delta, *(d for _, cv, dl in span.saves for d in (cv, dl)))
            if any(h.dtype != torch.float32 or not h.is_contiguous() for h in held):
                raise ValueError("recurrent states must be contiguous float32 tensors")
            rows.append((span.start, span.end, span.conv.data_ptr(), span.delta.data_ptr(),
                         len(saves), len(span.saves)))  # fmt: skip
            saves += [(row, cv.data_ptr(), dl.data_ptr()) for row, cv, dl in span.saves]
        table = torch.tensor(rows, dtype=torch.int64)
        saved = torch.tensor(saves or [(0, 0, 0)], dtype=torch.int64)
        dims = torch.tensor(
            [c, layer.kernel, layer.k_heads, layer.v_heads, layer.k_dim, layer.v_dim],
            dtype=torch.int64,
        )
        mixed = torch.empty((t, c), dtype=torch.float32)
        self.lib.ps_gated_delta(
            x.data_ptr(), t, x.shape[1], dims.data_ptr(), layer.conv.data_ptr(),
            layer.rate.data_ptr(), layer.dt_bias.data_ptr(), table.data_ptr(), len(rows),
            saved.data_ptr(), mixed.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        return out

    def rope_cache(
        self,
        qkv: torch.Tensor,
        heads: tuple[int, int, int],
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """One layer's RoPE and cache write: qkv [T, (nq + 2 nkv) d] (`heads` = nq, nkv, d),
        tokens at `positions` (rows of the cos and sin tables [P, d]) into cache `slots`
        (k_cache, v_cache [slots, nkv, d], written in place). Returns the rotated q [T, nq, d];
        the same bits as torch's x * cos + rotate_half(x) * sin and index_copy_."""
        nq, nkv, d = heads
        qkv = _f32(qkv)
        t = qkv.shape[0]
        if qkv.shape[1] != (nq + 2 * nkv) * d or cos.shape != sin.shape or cos.shape[1] != d:
            raise ValueError("rope_cache: shapes do not agree")
        for cache in (k_cache, v_cache):
            if (
                cache.dtype != torch.float32
                or not cache.is_contiguous()
                or cache.shape[1:] != (nkv, d)
            ):
                raise ValueError("rope_cache: the cache must be contiguous float32 [slots, nkv, d]")
        positions = row_ids(positions, cos.shape[0])
        slots = row_ids(slots, k_cache.shape[0])
        cos, sin = _f32(cos), _f32(sin)
        q = torch.empty((t, nq, d), dtype=torch.float32)
        if t:
            self.lib.ps_rope_cache(
                qkv.data_ptr(), t, nq, nkv, d, cos.data_ptr(), sin.data_ptr(),
                positions.data_ptr(), slots.data_ptr(),
                q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            )  # fmt: skip
        return q

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
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of q [T, nq, d] over a paged cache [slots, nkv, d] read in place:
        token t attends to the first lengths[t] positions of the sequence whose block table is
        tables[seq[t]] (with a sliding `window`, the last `window` of them), its scores soft-capped
        by `softcap` where given; `sinks` [nq] (gpt-oss): each head's one more logit in the
        softmax, attending to nothing. Returns [T, nq * d]."""
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
            int(window or 0),
            float(softcap or 0.0),
            sinks.data_ptr() if sinks is not None else None,
        )
        return out

    def experts(self, experts: Iterable[Expert], count: int) -> NativeExperts:
        return NativeExperts(self.lib, tuple(experts), self.native_activation)

    def native_activation(self, act: Activation) -> tuple[float, float, int] | None:
        """One of this backend's gated activations as ps_experts takes it, (alpha, limit,
        gelu): SwiGLU, GeGLU or gpt-oss's clamped SwiGLU (a partial of gpt_oss_glu with its
        alpha and limit); None for any other callable."""
        if act == self.silu_mul:
            return (1.0, 0.0, 0)
        if act == self.gelu_tanh_mul:
            return (1.0, 0.0, 1)
        if (
            isinstance(act, partial)
            and act.func == self.gpt_oss_glu
            and not act.args
            and set(act.keywords) == {"alpha", "limit"}
            and float(act.keywords["limit"]) > 0.0
        ):
            return (float(act.keywords["alpha"]), float(act.keywords["limit"]), 0)
        return None

    def chain(self, shape: Shape, layers: Sequence[LayerWeights]) -> NativeLayers:
        return NativeLayers(self.lib, shape, layers)
