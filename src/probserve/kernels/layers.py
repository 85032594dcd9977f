"""A model's decoder layers as one native call a step (the C++ side: layer.cpp).

`NativeLayers` holds ctypes descriptions of every layer's weights (pointers into the tensors the
forward already holds: packed panels or GGUF blocks, norms, biases), built once, and runs all
the layers over a step's tokens with one call into the library, which releases the GIL. The work
buffers are kept per power-of-two bucket of token counts, allocated when a bucket is first
used, never per step.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from probserve.kernels.experts import EachExpert
from probserve.kernels.native_experts import NativeExperts, describe_experts
from probserve.kernels.native_structs import (
    PsLayer,
    PsModel,
    PsMoE,
    PsProj,
    PsStep,
    check_struct_sizes,
    describe_proj,
    ptr,
)
from probserve.kernels.weights import Packed, row_ids


@dataclass
class MoEWeights:
    """A mixture of experts as the native call reads it: the router's parts and the experts as
    the host's backends hold them (kernels/experts.py: each expert's [gate | up] and down as
    parts); `index`: its place among the model's MoE layers."""

    router: Sequence[Packed]
    experts: object  # the layer's `Experts` (kernels/layer_ops.py): the host's
    top_k: int
    norm: bool
    index: int


@dataclass
class LayerWeights:
    """One layer as the native call reads it: each projection as its parts (one, or several
    in different block formats whose output columns sit side by side)."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: Sequence[Packed]
    o: Sequence[Packed]
    gate_up: Sequence[Packed]  # empty for a mixture of experts
    down: Sequence[Packed]
    pre_ff: torch.Tensor | None = None
    post_ff: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    window: int = 0
    rope: int = 0  # which RoPE table
    moe: MoEWeights | None = None  # in place of gate_up and down
    sinks: torch.Tensor | None = None  # each head's sink logit (gpt-oss)


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # the widest feed-forward: the dense MLP's, or an expert's
    eps: float
    scale: float
    softcap: float = 0.0
    sandwich: bool = False
    gelu: bool = False
    swiglu_alpha: float = 1.0  # the experts' clamped SwiGLU (gpt-oss)
    swiglu_limit: float = 0.0  # 0: the family's activation
    qk_full: bool = False  # q/k norms over the whole projections (OLMoE)


class NativeLayers:
    """Every decoder layer of a model, run over a step's tokens by one `ps_layers` call."""

    def __init__(self, lib: ctypes.CDLL, shape: Shape, layers: Sequence[LayerWeights]):
        """`lib`: the kernels' library (kernels/build.py); `layers`: their tensors must outlive
        this object (the forward holds them)."""
        self.lib = lib
        check_struct_sizes(self.lib)
        self.shape = shape
        self._weights = list(layers)  # the tensors the pointers point into
        for lw in layers:
            if shape.sandwich and (lw.pre_ff is None or lw.post_ff is None):
                raise ValueError("a sandwich layer needs its pre- and post-feedforward norms")
            if (lw.q_norm is None) != (lw.k_norm is None):
                raise ValueError("q and k norms come together")
        self._keep: list[object] = []  # the ctypes arrays the layers point into
        self._layers = (PsLayer * len(layers))(*(self._layer(lw) for lw in layers))
        self.moe_layers = sum(lw.moe is not None for lw in layers)
        self.top_k = max((lw.moe.top_k for lw in layers if lw.moe), default=0)
        self._model = PsModel(
            len(layers), shape.hidden, shape.heads, shape.kv_heads, shape.head_dim,
            shape.intermediate, shape.eps, shape.scale, shape.softcap, shape.swiglu_alpha,
            shape.swiglu_limit, int(shape.sandwich), int(shape.gelu), int(shape.qk_full),
            self._layers,
        )  # fmt: skip
        self._scratch: dict[int, torch.Tensor] = {}

    def _layer(self, lw: LayerWeights) -> PsLayer:
        s = self.shape
        qkv, o = describe_proj(lw.qkv), describe_proj(lw.o)
        if qkv.n != (s.heads + 2 * s.kv_heads) * s.head_dim or o.n != s.hidden:
            raise ValueError("a layer's projections do not agree with the model's shape")
        if lw.sinks is not None and (
            lw.sinks.dtype != torch.float32 or lw.sinks.numel() != s.heads
        ):
            raise ValueError("a layer's sinks are one float32 per query head")
        moe = None
        gu = down = PsProj()
        if lw.moe is not None:
            moe = ctypes.pointer(self._moe(lw.moe))
            self._keep.append(moe)
        else:
            gu, down = describe_proj(lw.gate_up), describe_proj(lw.down)
            if gu.n % 2 or gu.n > 2 * s.intermediate or down.n != s.hidden:
                raise ValueError("a layer's projections do not agree with the model's shape")
        return PsLayer(
            ptr(lw.ln1), ptr(lw.ln2), ptr(lw.pre_ff), ptr(lw.post_ff), ptr(lw.q_norm),
            ptr(lw.k_norm), qkv, o, gu, down, lw.window, lw.rope, moe, ptr(lw.sinks),
        )  # fmt: skip

    def _moe(self, mw: MoEWeights) -> PsMoE:
        s = self.shape
        if isinstance(mw.experts, NativeExperts):
            described = mw.experts.described
        elif isinstance(mw.experts, EachExpert):
            described = describe_experts(mw.experts.experts)
        else:
            raise ValueError("the native layers read the host's experts (kernels/experts.py)")
        gate_up, down, inter = described.gate_up, described.down, described.inter
        experts = len(gate_up)
        router = describe_proj(mw.router)
        self._keep.append(described)
        if (
            router.n != experts
            or not 0 < mw.top_k <= experts
            or not 0 < inter <= s.intermediate
            or described.hidden != s.hidden
        ):
            raise ValueError("a mixture of experts does not agree with the model's shape")
        return PsMoE(router, experts, mw.top_k, int(mw.norm), inter, gate_up, down, mw.index)

    def _buffer(self, tokens: int) -> torch.Tensor:
        bucket = 1 << max(0, tokens - 1).bit_length()
        if bucket not in self._scratch:
            size = int(self.lib.ps_layers_scratch(ctypes.byref(self._model), bucket))
            self._scratch[bucket] = torch.empty(size, dtype=torch.float32)
        return self._scratch[bucket]

    def run(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        seq: torch.Tensor,
        lengths: torch.Tensor,
        block_size: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rope: Sequence[tuple[torch.Tensor, torch.Tensor]],
        routed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """All layers over h [T, hidden] (the embedded tokens), in place; returns h. Token t is
        at positions[t], writes its K/V at cache slot slots[t] of every layer (k_cache, v_cache
        [layers, slots, nkv, d]) and attends through block table tables[seq[t]] to its first
        lengths[t] positions. `rope`: the (cos, sin) tables [P, d] by table index. `routed`:
        where a mixture of experts keeps each slot's routing (experts int16 and weights
        float32, [slots, moe_layers, top_k])."""
        s = self.shape
        if h.dtype != torch.float32 or not h.is_contiguous() or h.shape[1:] != (s.hidden,):
            raise ValueError("layers: h must be contiguous float32 [T, hidden]")
        for cache in (k_cache, v_cache):
            if (
                cache.dtype != torch.float32
                or not cache.is_contiguous()
                or cache.shape[0] != len(self._weights)
                or cache.shape[2:] != (s.kv_heads, s.head_dim)
            ):
                raise ValueError("layers: the cache must be contiguous float32 [L, slots, nkv, d]")
        t = h.shape[0]
        rows = min(c.shape[0] for c, _ in rope)
        positions = row_ids(positions, rows)
        slots = row_ids(slots, k_cache.shape[1])
        tables = row_ids(tables, k_cache.shape[1] // block_size)
        seq = row_ids(seq, tables.shape[0])
        lengths = lengths.to(torch.int64).contiguous()
        if t and not bool(((lengths >= 1) & (lengths <= tables.shape[1] * block_size)).all()):
            raise IndexError("layers: a token's key count is outside its block table")
        for c, sn in rope:
            if c.dtype != torch.float32 or not c.is_contiguous() or c.shape != sn.shape:
                raise ValueError("layers: RoPE tables must be contiguous float32 pairs")
        cos = (ctypes.c_void_p * len(rope))(*(c.data_ptr() for c, _ in rope))
        sin = (ctypes.c_void_p * len(rope))(*(sn.data_ptr() for _, sn in rope))
        ids = weights = None
        if routed is not None:
            ids, weights = routed
            want = (k_cache.shape[1], self.moe_layers, self.top_k)
            if (
                ids.dtype != torch.int16 or weights.dtype != torch.float32
                or ids.shape != want or weights.shape != want
                or not (ids.is_contiguous() and weights.is_contiguous())
            ):  # fmt: skip
                raise ValueError(f"layers: routing is kept as contiguous {list(want)} arrays")
        elif self.moe_layers:
            raise ValueError("layers: a mixture of experts needs its routing arrays")
        step = PsStep(
            t, positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1],
            block_size, seq.data_ptr(), lengths.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), k_cache.shape[1], cos, sin, ptr(ids), ptr(weights),
            self.moe_layers, self.top_k,
        )  # fmt: skip
        if t:
            scratch = self._buffer(t)
            self.lib.ps_layers(
                ctypes.byref(self._model), ctypes.byref(step), h.data_ptr(), scratch.data_ptr()
            )
        return h
