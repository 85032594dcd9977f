"""TritonKernels: the deterministic forward's operations (the ones models/llama.py calls one by
one: products, row lookups, norms, RoPE with the cache write, attention, gated activations,
soft-capping, a router's choice) on a torch device, with the Triton kernels of this package.
Weights are held on the device once, as the precision asks: float32 (the exact path) or
bfloat16 (products with bf16 inputs and float32 sums); activations, norms, attention and the
KV cache stay float32. Tensors the forward keeps on the host (norm weights, RoPE tables) are
copied to the device once and reused."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from probserve.kernels.attention_plan import FlatKernels
from probserve.kernels.delta_rule import DeltaLayer, DeltaSpan, conv_rows
from probserve.kernels.experts import Expert
from probserve.kernels.gpu import attention as attention_kernel
from probserve.kernels.gpu import delta, rows
from probserve.kernels.gpu.experts import ExpertParts, GroupedExperts
from probserve.kernels.gpu.matmul import matmul
from probserve.kernels.layers import LayerWeights, Shape
from probserve.kernels.weights import Packed, PackedWeight, Source, whole

Precision = Literal["exact", "bf16"]


@dataclass(frozen=True)
class DeviceWeight(PackedWeight):
    """A [N, K] weight on the device (`panels` is the matrix itself, not in panels), in the
    precision's dtype, and its float32 bias."""


class TritonKernels(FlatKernels):
    kernel = "triton"
    keeps_blocks = False  # GGUF blocks are dequantized by `pack` (the weights' one form)
    reads_rows = True

    def __init__(self, device: torch.device, precision: Precision = "exact") -> None:
        if device.type == "cuda" and device.index is None:  # "cuda" is "cuda:N", the current
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.precision: Precision = precision
        self.weight_dtype = torch.float32 if precision == "exact" else torch.bfloat16
        # host tensor id -> (a weak reference to it, its device copy): a copy lives while its
        # host tensor does (a RoPE table the forward replaces as it grows frees its copy)
        self._copies: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the device (a host tensor the forward keeps: copied once, then reused)."""
        if t.device == self.device:
            return t
        kept = self._copies.get(id(t))
        if kept is not None and kept[0]() is t:
            return kept[1]
        for key in [k for k, (ref, _) in self._copies.items() if ref() is None]:
            del self._copies[key]
        copy = t.detach().to(self.device)
        self._copies[id(t)] = (weakref.ref(t), copy)
        return copy

    def _on(self, t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An activation or index tensor on the device, contiguous, in `dtype`."""
        return t.to(device=self.device, dtype=dtype).contiguous()

    def pack(self, weight: Source, bias: torch.Tensor | None = None) -> DeviceWeight:
        """The weight on the device in the precision's dtype (a file's blocks dequantized on
        the host first, a matrix at a time)."""
        if not isinstance(weight, torch.Tensor):
            weight = weight.dequantize()
        n, k = weight.shape
        w = weight.detach().to(device=self.device, dtype=self.weight_dtype).contiguous()
        b = None if bias is None else bias.detach().to(self.device, torch.float32).contiguous()
        return DeviceWeight(w, b, int(n), int(k))

    def linear(self, x: torch.Tensor, w: Packed) -> torch.Tensor:
        w = whole(w)
        lead = x.shape[:-1]
        y = matmul(self._on(x).reshape(-1, w.k), w.panels, w.bias)
        return y.view(*lead, w.n)

    def rows(self, w: Packed, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight [len(ids), K] (an embedding lookup)."""
        return whole(w).panels.index_select(0, self._on(ids, torch.int64)).float()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rows.rms_norm(self._on(x), self.place(weight), eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return rows.gated(self._on(gate_up), gelu=False)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return rows.gated(self._on(gate_up), gelu=True)

    def gpt_oss_glu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """gpt-oss's clamped SwiGLU, (clamp(up, ±limit) + 1) · g · σ(alpha g) with g = gate
        clamped above at limit, per element (no reduction: the same bits in any batch)."""
        x = self._on(gate_up)
        width = x.shape[1] // 2
        gate, up = x[:, :width].clamp(max=limit), x[:, width:].clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        return rows.softcap(self._on(x), cap)

    def gated_delta(
        self, proj: torch.Tensor, layer: DeltaLayer, spans: Sequence[DeltaSpan]
    ) -> torch.Tensor:
        """The conv in torch (delta_rule.py's `conv_rows`), its SiLU the row kernel's, and the
        recurrence in Triton (gpu/delta.py), every span at once. A state saved mid-span cuts
        the launches there: each launch takes every span on to its next save (or its end), and
        the saves are copied between launches (the state's float32 bits are the same whether
        a program keeps them in registers or another reloads them)."""
        proj = self._on(proj)
        c, vd, nv = layer.channels, layer.v_heads * layer.v_dim, layer.v_heads
        conv = conv_rows(proj, layer, spans)
        x = self.silu_mul(torch.cat([conv, torch.ones_like(conv)], dim=1))
        out = proj.new_empty((proj.shape[0], vd))
        if not spans:
            return out
        states = torch.stack([span.delta for span in spans]).to(self.device, torch.float32)
        heads = (layer.k_heads, nv, layer.k_dim, layer.v_dim)
        rate, dt_bias = self.place(layer.rate), self.place(layer.dt_bias)
        done = [span.start for span in spans]
        for cut in range(max(len(span.saves) for span in spans) + 1):
            ends = [
                span.start + span.saves[cut][0] + 1 if cut < len(span.saves) else span.end
                for span in spans
            ]
            bounds = torch.tensor([done, ends], dtype=torch.int64, device=self.device)
            delta.recurrence(x, proj[:, c + vd :], states, rate, dt_bias, bounds, heads, out)
            for j, span in enumerate(spans):
                if cut < len(span.saves):
                    span.saves[cut][2].copy_(states[j])
            done = ends
        for j, span in enumerate(spans):
            span.delta.copy_(states[j])
        return out

    def experts(self, experts: Iterable[Expert], count: int) -> GroupedExperts:
        """A layer's `count` experts, each as `pack` put it on the device, stacked one at a
        time (its device copies freed before the next is packed) and run together
        (kernels/gpu/experts.py)."""

        def parts(e: Expert) -> ExpertParts:
            (gate_up,), (down,) = e.gate_up.weights, e.down.weights
            gu, dn = whole(gate_up), whole(down)
            return gu.panels, gu.bias, dn.panels, dn.bias

        return GroupedExperts.stack((parts(e) for e in experts), count)

    def chain(self, shape: Shape, layers: Sequence[LayerWeights]) -> None:
        return None  # launched one operation at a time (a CUDA graph holds a step's launches)

    def route(self, logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A router's choice per row: the k experts of highest softmax probability (float64,
        ties to the lower id: a stable sort), their weights (renormalised with `norm`), from the
        row alone."""
        x = self._on(logits).double()
        if not 0 < k <= x.shape[1]:
            raise ValueError(f"cannot route to {k} of {x.shape[1]} experts")
        probs = torch.softmax(x, dim=1)
        order = torch.sort(-probs, dim=1, stable=True).indices[:, :k]
        weights = probs.gather(1, order)
        if norm:
            weights = weights / weights.sum(dim=1, keepdim=True)
        return order, weights.float()

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
        return rows.rope_cache(
            self._on(qkv), heads, self.place(cos), self.place(sin),
            self._on(positions, torch.int64), self._on(slots, torch.int64), k_cache, v_cache,
        )  # fmt: skip

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
        i64 = torch.int64
        return attention_kernel.attention(
            self._on(q), k_cache, v_cache, scale, self._on(tables, i64), self._on(seq, i64),
            self._on(lengths, i64), block_size, window, softcap,
            None if sinks is None else self.place(sinks).float().contiguous(),
        )  # fmt: skip
