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

from probserve.kernels.build import KernelBuildError, header_constant
from probserve.kernels.experts import EachExpert
from probserve.kernels.weights import Packed, QuantizedWeight, row_ids

MAX_PARTS = header_constant("PS_MAX_PARTS")  # probserve.h's, as layer.cpp has it
_I = ctypes.c_int64
_P = ctypes.c_void_p
_F = ctypes.c_float


class _Part(ctypes.Structure):
    _fields_ = [("fmt", _I), ("data", _P), ("bias", _P), ("n", _I), ("k", _I)]


class _Proj(ctypes.Structure):
    _fields_ = [("nparts", _I), ("parts", _Part * MAX_PARTS), ("n", _I)]


class _MoE(ctypes.Structure):
    _fields_ = [
        ("router", _Proj),
        *((name, _I) for name in ("experts", "top_k", "norm", "inter")),
        ("gate_up", ctypes.POINTER(_Proj)),
        ("down", ctypes.POINTER(_Proj)),
        ("index", _I),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        *((name, _P) for name in ("ln1", "ln2", "pre_ff", "post_ff", "q_norm", "k_norm")),
        *((name, _Proj) for name in ("qkv", "o", "gate_up", "down")),
        ("window", _I),
        ("rope", _I),
        ("moe", ctypes.POINTER(_MoE)),
        ("sinks", _P),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, _I) for name in ("layers", "hidden", "nq", "nkv", "d", "inter")),
        *((name, _F) for name in ("eps", "scale", "softcap", "alpha", "limit")),
        ("sandwich", _I),
        ("gelu", _I),
        ("qk_full", _I),
        ("layer", ctypes.POINTER(_Layer)),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("tokens", _I),
        ("pos", _P),
        ("slots", _P),
        ("tables", _P),
        ("width", _I),
        ("block_size", _I),
        ("seq", _P),
        ("len", _P),
        ("kc", _P),
        ("vc", _P),
        ("cache_slots", _I),
        ("cos", ctypes.POINTER(_P)),
        ("sin", ctypes.POINTER(_P)),
        ("routed", _P),
        ("routed_w", _P),
        ("moe_layers", _I),
        ("top_k", _I),
    ]


@dataclass
class MoEWeights:
    """A mixture of experts as the native call reads it: the router's parts and the experts as
    the host's backends hold them (kernels/experts.py: each expert's [gate | up] and down as
    parts); `index`: its place among the model's MoE layers."""

    router: Sequence[Packed]
    experts: object  # the layer's `Experts` (kernels/layer_ops.py): an EachExpert here
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


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _proj(parts: Sequence[Packed]) -> _Proj:
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"a projection has 1 to {MAX_PARTS} parts, not {len(parts)}")
    if len({p.k for p in parts}) != 1:
        raise ValueError("a projection's parts must share their input size")
    proj = _Proj(nparts=len(parts), n=sum(p.n for p in parts))
    for i, p in enumerate(parts):
        if isinstance(p, QuantizedWeight):
            proj.parts[i] = _Part(p.fmt, p.data.data_ptr(), _ptr(p.bias), p.n, p.k)
        else:
            proj.parts[i] = _Part(-1, p.panels.data_ptr(), _ptr(p.bias), p.n, p.k)
    return proj


STRUCTS = (_Part, _Proj, _Layer, _Model, _Step, _MoE)  # ps_struct_sizes' order


def check_struct_sizes(lib: ctypes.CDLL) -> None:
    """The library's structs (probserve.h) are the size of their ctypes mirrors here: a field
    added on one side only would pass pointers to the wrong places."""
    sizes = (ctypes.c_int64 * len(STRUCTS))()
    lib.ps_struct_sizes(sizes)
    ours = [ctypes.sizeof(t) for t in STRUCTS]
    if list(sizes) != ours:
        raise KernelBuildError(
            f"the kernels' structs ({list(sizes)} bytes) differ from kernels/layers.py's "
            f"({ours}): probserve.h and its mirrors must change together"
        )


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
        self._layers = (_Layer * len(layers))(*(self._layer(lw) for lw in layers))
        self.moe_layers = sum(lw.moe is not None for lw in layers)
        self.top_k = max((lw.moe.top_k for lw in layers if lw.moe), default=0)
        self._model = _Model(
            len(layers), shape.hidden, shape.heads, shape.kv_heads, shape.head_dim,
            shape.intermediate, shape.eps, shape.scale, shape.softcap, shape.swiglu_alpha,
            shape.swiglu_limit, int(shape.sandwich), int(shape.gelu), int(shape.qk_full),
            self._layers,
        )  # fmt: skip
        self._scratch: dict[int, torch.Tensor] = {}

    def _layer(self, lw: LayerWeights) -> _Layer:
        s = self.shape
        qkv, o = _proj(lw.qkv), _proj(lw.o)
        if qkv.n != (s.heads + 2 * s.kv_heads) * s.head_dim or o.n != s.hidden:
            raise ValueError("a layer's projections do not agree with the model's shape")
        if lw.sinks is not None and (
            lw.sinks.dtype != torch.float32 or lw.sinks.numel() != s.heads
        ):
            raise ValueError("a layer's sinks are one float32 per query head")
        moe = None
        gu = down = _Proj()
        if lw.moe is not None:
            moe = ctypes.pointer(self._moe(lw.moe))
            self._keep.append(moe)
        else:
            gu, down = _proj(lw.gate_up), _proj(lw.down)
            if gu.n % 2 or gu.n > 2 * s.intermediate or down.n != s.hidden:
                raise ValueError("a layer's projections do not agree with the model's shape")
        return _Layer(
            _ptr(lw.ln1), _ptr(lw.ln2), _ptr(lw.pre_ff), _ptr(lw.post_ff), _ptr(lw.q_norm),
            _ptr(lw.k_norm), qkv, o, gu, down, lw.window, lw.rope, moe, _ptr(lw.sinks),
        )  # fmt: skip

    def _moe(self, mw: MoEWeights) -> _MoE:
        s = self.shape
        if not isinstance(mw.experts, EachExpert):
            raise ValueError("the native layers read the host's experts (EachExpert) only")
        each = mw.experts.experts
        experts = len(each)
        router = _proj(mw.router)
        gate_up = (_Proj * experts)(*(_proj(e.gate_up.weights) for e in each))
        down = (_Proj * experts)(*(_proj(e.down.weights) for e in each))
        self._keep += [gate_up, down]
        inter = gate_up[0].n // 2 if experts else 0
        if (
            router.n != experts
            or not 0 < mw.top_k <= experts
            or not 0 < inter <= s.intermediate
            or any(p.n != 2 * inter for p in gate_up)
            or any(p.n != s.hidden for p in down)
        ):
            raise ValueError("a mixture of experts does not agree with the model's shape")
        return _MoE(router, experts, mw.top_k, int(mw.norm), inter, gate_up, down, mw.index)

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
        cos = (_P * len(rope))(*(c.data_ptr() for c, _ in rope))
        sin = (_P * len(rope))(*(sn.data_ptr() for _, sn in rope))
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
        step = _Step(
            t, positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1],
            block_size, seq.data_ptr(), lengths.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), k_cache.shape[1], cos, sin, _ptr(ids), _ptr(weights),
            self.moe_layers, self.top_k,
        )  # fmt: skip
        if t:
            scratch = self._buffer(t)
            self.lib.ps_layers(
                ctypes.byref(self._model), ctypes.byref(step), h.data_ptr(), scratch.data_ptr()
            )
        return h
