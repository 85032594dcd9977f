"""TorchOps: the paged forward's operations (kernels/layer_ops.py) in torch's own kernels, the CPU
path without --deterministic: the products on MKL's sgemm ("dense") or oneDNN's matmul on a
weight reordered once ("onednn"; models/linear.py times both at start), SDPA attention over
torch's groups (every decode token in one padded batch, each prefill chunk in its own causal
call), RMSNorm, the gated activations and a router's choice in torch. Every result is within
float32 rounding of the others, but a row's bits may depend on the rest of the batch (MKL and
oneDNN block K by the row count)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import torch
import torch.nn.functional as F

from probserve.kernels.attention_plan import AttentionPlan, LayerAttention, LayerKV, Rope
from probserve.kernels.delta_rule import DeltaLayer, DeltaSpan, torch_gated_delta
from probserve.kernels.experts import EachExpert, Expert
from probserve.kernels.layers import LayerWeights, Shape
from probserve.kernels.weights import Packed, PackedWeight, Source, whole

Kernel = Literal["dense", "onednn"]
PACK_ROWS = 32  # the row count oneDNN's weight layout is chosen for


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchOps:
    keeps_blocks = False  # GGUF blocks are dequantized by `pack`

    def __init__(self, kernel: Kernel = "dense") -> None:
        """`kernel`: the products' ("onednn" falls back to "dense" where torch lacks it)."""
        self.kernel: Kernel = "onednn" if kernel == "onednn" and onednn_available() else "dense"
        self.reads_rows = self.kernel == "dense"  # oneDNN's blocked layout has no rows to read

    def place(self, t: torch.Tensor) -> torch.Tensor:
        return t  # the host is where they run

    def pack(self, weight: Source, bias: torch.Tensor | None = None) -> PackedWeight:
        """A private float32 copy: contiguous (MKL), or reordered once for oneDNN's matmul
        (blocked for ~32 rows, right for any count); never both."""
        w = weight if isinstance(weight, torch.Tensor) else weight.dequantize()
        w = w.detach().float()
        n, k = (int(d) for d in w.shape)
        b = None if bias is None else bias.detach().float().clone()
        if self.kernel == "onednn":
            held = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS)
        else:
            held = w.clone(memory_format=torch.contiguous_format)
        return PackedWeight(held, b, n, k)

    def linear(self, x: torch.Tensor, w: Packed) -> torch.Tensor:
        held = whole(w)
        if self.kernel == "onednn":
            x = x.contiguous()
            return torch.ops.mkldnn._linear_pointwise(x, held.panels, held.bias, "none", [], "")
        return F.linear(x, held.panels, held.bias)

    def rows(self, w: Packed, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, whole(w).panels)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        width = gate_up.shape[1] // 2
        return F.silu(gate_up[:, :width]) * gate_up[:, width:]

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        width = gate_up.shape[1] // 2
        return F.gelu(gate_up[:, :width], approximate="tanh") * gate_up[:, width:]

    def gpt_oss_glu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        width = gate_up.shape[1] // 2
        gate, up = gate_up[:, :width].clamp(max=limit), gate_up[:, width:].clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        return torch.tanh(x / cap) * cap

    def route(self, logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's k experts [T, k] and weights [T, k]: softmax, then torch's top k
        (renormalised with `norm`), as transformers computes them."""
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, k, dim=-1)
        if norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def rotate(
        self, qkv: torch.Tensor, heads: tuple[int, int, int], rope: Rope, slots: torch.Tensor,
        kv: LayerKV,
    ) -> torch.Tensor:  # fmt: skip
        (nq, nkv, d), t = heads, qkv.shape[0]
        cos, sin, positions = rope
        c = cos.index_select(0, positions).unsqueeze(1)
        s = sin.index_select(0, positions).unsqueeze(1)
        q = qkv[:, : nq * d].view(t, nq, d)
        k = qkv[:, nq * d : (nq + nkv) * d].view(t, nkv, d)
        v = qkv[:, (nq + nkv) * d :].view(t, nkv, d)
        kv.k.index_copy_(0, slots, k * c + _rotate_half(k) * s)
        kv.v.index_copy_(0, slots, v)
        return q * c + _rotate_half(q) * s

    def attend(
        self, q: torch.Tensor, kv: LayerKV, plan: AttentionPlan, layer: LayerAttention
    ) -> torch.Tensor:
        """SDPA over the plan's groups: the decode tokens in one padded batch, each prefill
        chunk causal on its own (the groups name every key's slot)."""
        t, nq, d = q.shape
        out = q.new_empty((t, nq * d))
        if plan.decode_rows is not None and plan.decode_keys is not None:
            b, length = plan.decode_keys.shape
            flat = plan.decode_keys.reshape(-1)
            keys = kv.k.index_select(0, flat).view(b, length, -1, d).transpose(1, 2)
            vals = kv.v.index_select(0, flat).view(b, length, -1, d).transpose(1, 2)
            qd = q.index_select(0, plan.decode_rows).unsqueeze(2)  # [B, nq, 1, d]
            o = _sdpa(qd, keys, vals, plan.decode_mask_for(layer.window), False, layer)
            out.index_copy_(0, plan.decode_rows, o.reshape(b, nq * d))
        explicit = bool(layer.window or layer.softcap or layer.sinks is not None)
        for i, group in enumerate(plan.prefills):
            qp = q[group.rows].transpose(0, 1).unsqueeze(0)  # [1, nq, n, d]
            keys = kv.k.index_select(0, group.keys).transpose(0, 1).unsqueeze(0)
            vals = kv.v.index_select(0, group.keys).transpose(0, 1).unsqueeze(0)
            mask, causal = plan.prefill_mask_for(i, layer.window, explicit)
            o = _sdpa(qp, keys, vals, mask, causal, layer)
            out[group.rows] = o[0].transpose(0, 1).reshape(-1, nq * d)
        return out

    def gated_delta(
        self, proj: torch.Tensor, layer: DeltaLayer, spans: Sequence[DeltaSpan]
    ) -> torch.Tensor:
        return torch_gated_delta(F.silu, proj, layer, spans)

    def experts(self, experts: Iterable[Expert], count: int) -> EachExpert:
        return EachExpert(tuple(experts))

    def chain(self, shape: Shape, layers: Sequence[LayerWeights]) -> None:
        return None  # torch's operations are called one by one


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    layer: LayerAttention,
) -> torch.Tensor:
    """Attention [B, nq, n, d] over keys [B, nkv, L, d] (grouped query heads): torch's fused
    kernel, or, with soft-capped scores (Gemma 2) or sinks (gpt-oss: a logit per head beside the
    keys' in the softmax, dropped after it), transformers' eager order of operations."""
    scale, softcap, sinks = layer.scale, layer.softcap, layer.sinks
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs @ v
