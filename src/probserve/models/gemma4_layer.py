"""What Gemma 4 (text)'s layer does beyond the forward's others (models/llama.py runs the rest;
models/gemma4.py reads its configuration), on the forward's operations (kernels/layer_ops.py):

- its attention's inputs: the query heads RMS-normed and rotated; a layer that writes its K/V
  RMS-norms each key head (times w) and each value head (no weight), rotates the keys and
  writes both into its own cache layer (its values are its raw keys where attention_k_eq_v); a
  shared layer rotates its queries alone and reads its source layer's cache;
- the per-layer inputs: each token's row of the per-layer embedding table (kept as the
  checkpoint stores it, a GGUF file's blocks too, gathered per token, times sqrt(width)),
  plus the RMS-normed projection of the scaled embedding (times hidden^-0.5), times 2^-0.5;
  after each layer's MLP, h + norm(proj(gelu_tanh(gate(h)) * its slice)), then the layer's scalar;
- a mixture of experts beside each layer's dense MLP (`enable_moe_block`, 26B-A4B), both read
  the residual h after attention: the dense branch post_feedforward_layernorm_1(mlp(
  pre_feedforward_layernorm(h))), the experts' post_feedforward_layernorm_2(sum of their
  GeGLUs of pre_feedforward_layernorm_2(h)), summed, then post_feedforward_layernorm as for
  any layer; the router (models/moe.py) reads rms_norm(h) * router.scale * hidden^-0.5 (its
  own norm, without a weight of its own), takes the renormalised top k of its softmax and
  scales each chosen weight by router.per_expert_scale of its expert.

A layer's rows never mix: every step is a product, a norm or an elementwise operation of the
backend's, or an exact gather, so the row-invariant kernels keep a token's bits whatever else
the step holds."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from probserve.kernels.attention_plan import LayerKV, Rope
from probserve.kernels.layer_ops import LayerOps
from probserve.models.gemma4 import Gemma4Layout
from probserve.models.gguf_blocks import QuantizedTensor, Weight, as_float
from probserve.models.linear import Joined, Linear

Layers = torch.Tensor | list[torch.Tensor]  # a KV cache's K or V, by cache layer


class _Attending(Protocol):
    """The parts of a forward's layer (models/llama.py) its attention's inputs take."""

    @property
    def qkv(self) -> Linear | Joined | None: ...
    @property
    def q_norm(self) -> torch.Tensor | None: ...
    @property
    def k_norm(self) -> torch.Tensor | None: ...


def _vector(weight: Weight) -> torch.Tensor:
    """A float32 copy (the source may be memory-mapped from the checkpoint)."""
    return as_float(weight).detach().float().clone()


def _rotated(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """RoPE on x [T, n, d] at the rows' positions (x cos + rotate_half(x) sin, as transformers)."""
    cos, sin, rows = rope
    c, s = cos.index_select(0, rows).unsqueeze(1), sin.index_select(0, rows).unsqueeze(1)
    half = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s


@dataclass(frozen=True)
class _Branches:
    """A layer's norms around its two feed-forward branches, and its router's scale [H]."""

    post_dense: torch.Tensor
    pre_experts: torch.Tensor
    post_experts: torch.Tensor
    router: torch.Tensor

    @classmethod
    def of(cls, weights: Mapping[str, Weight], i: int) -> _Branches:
        at = f"model.layers.{i}."

        def norm(name: str) -> torch.Tensor:
            return _vector(weights[f"{at}{name}.weight"])

        return cls(
            post_dense=norm("post_feedforward_layernorm_1"),
            pre_experts=norm("pre_feedforward_layernorm_2"),
            post_experts=norm("post_feedforward_layernorm_2"),
            router=_vector(weights[f"{at}router.scale"]),
        )


class Gemma4Layers:
    def __init__(
        self,
        weights: Mapping[str, Weight],
        shape: Gemma4Layout,
        heads: int,
        hidden: int,
        eps: float,
        ops: LayerOps,
        experts: bool = False,
    ) -> None:
        """Its constants and tensors from `weights` by transformers' names (`experts`: each
        layer's mixture of experts' norms and router scale too)."""
        self.shape, self.heads, self.hidden, self.eps, self.ops = shape, heads, hidden, eps, ops
        n = len(shape.head_dims)
        self.ones = {d: ops.place(torch.ones(d)) for d in set(shape.head_dims)}  # v's norm
        self.scalars = [
            ops.place(_vector(weights[f"model.layers.{i}.layer_scalar"])) for i in range(n)
        ]
        self.branches = [_Branches.of(weights, i) for i in range(n)] if experts else []
        self.width = shape.per_layer_input
        if not self.width:
            return
        # the table as the checkpoint stores it: a GGUF file's blocks (any format, rows
        # dequantized per token), else a private copy (the source may be mapped)
        table = weights["model.embed_tokens_per_layer.weight"]
        self.table: torch.Tensor | QuantizedTensor = (
            table if isinstance(table, QuantizedTensor) else ops.place(table.detach().clone())
        )
        self.table_scale = ops.place(torch.tensor(float(self.width) ** 0.5))
        self.projection = Linear(weights["model.per_layer_model_projection.weight"], None, ops)
        self.projection_norm = _vector(weights["model.per_layer_projection_norm.weight"])
        at = [f"model.layers.{i}." for i in range(n)]
        self.gates = [Linear(weights[a + "per_layer_input_gate.weight"], None, ops) for a in at]
        self.outs = [Linear(weights[a + "per_layer_projection.weight"], None, ops) for a in at]
        self.out_norms = [_vector(weights[a + "post_per_layer_input_norm.weight"]) for a in at]

    def kv(self, li: int, k: Layers, v: Layers, block_size: int) -> LayerKV:
        """Layer li's cache: its own, or (a shared layer) its source's."""
        at = self.shape.cache_layer[li]
        return LayerKV(k[at], v[at], block_size)

    def queries(
        self, x: torch.Tensor, li: int, layer: _Attending, rope: Rope, slots: torch.Tensor,
        kv: LayerKV,
    ) -> torch.Tensor:  # fmt: skip
        """Layer li's rotated queries [T, nq, d] from its normed input x, its K/V (where it
        computes them) normed, rotated and written at `slots`."""
        t, nq = x.shape[0], self.heads
        d, nkv = self.shape.head_dims[li], self.shape.kv_heads[li]
        assert layer.q_norm is not None and layer.qkv is not None
        proj = layer.qkv(x)
        q = self._heads(proj[:, : nq * d], nq, d, layer.q_norm)
        if not self.shape.writes[li]:
            return _rotated(q.view(t, nq, d), rope)
        assert layer.k_norm is not None
        k_raw = proj[:, nq * d : (nq + nkv) * d]
        v_raw = k_raw if self.shape.k_eq_v[li] else proj[:, (nq + nkv) * d :]
        k = self._heads(k_raw, nkv, d, layer.k_norm)
        v = self._heads(v_raw, nkv, d, self.ones[d])
        return self.ops.rotate(torch.cat([q, k, v], dim=1), (nq, nkv, d), rope, slots, kv)

    def _heads(self, x: torch.Tensor, n: int, d: int, weight: torch.Tensor) -> torch.Tensor:
        """x [T, n d] RMS-normed over each head's d, times `weight`."""
        t = x.shape[0]
        return self.ops.rms_norm(x.reshape(t * n, d), weight, self.eps).view(t, n * d)

    def inputs(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor | None:
        """Each token's per-layer inputs [T, layers * width] from its ids and its scaled
        embedding h (None where the model has none)."""
        if not self.width:
            return None
        t, w = h.shape[0], self.width
        if isinstance(self.table, QuantizedTensor):
            rows = self.table.rows(ids.cpu().numpy()).to(h.device)
        else:
            rows = F.embedding(ids, self.table).float()
        token = rows * self.table_scale
        proj = self.projection(h) * (float(self.hidden) ** -0.5)
        normed = self.ops.rms_norm(proj.reshape(-1, w).contiguous(), self.projection_norm, self.eps)
        return (normed.view(t, -1) + token) * (2.0**-0.5)

    def expert_rows(self, h: torch.Tensor, li: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer li's experts' rows and its router's from the residual h (after attention)."""
        b = self.branches[li]
        routed = self.ops.rms_norm(h, b.router, self.eps) * (float(self.hidden) ** -0.5)
        return self.ops.rms_norm(h, b.pre_experts, self.eps), routed

    def beside(self, dense: torch.Tensor, experts: torch.Tensor, li: int) -> torch.Tensor:
        """Layer li's feed-forward: its dense MLP's output and its experts' (before
        post_feedforward_layernorm), each normed, summed."""
        b = self.branches[li]
        dense = self.ops.rms_norm(dense, b.post_dense, self.eps)
        return dense + self.ops.rms_norm(experts, b.post_experts, self.eps)

    def after(self, h: torch.Tensor, li: int, per_layer: torch.Tensor | None) -> torch.Tensor:
        """What ends layer li: its per-layer input's residual, then its scalar."""
        if per_layer is not None:
            w = self.width
            own = per_layer[:, li * w : (li + 1) * w]
            gated = self.ops.gelu_tanh_mul(torch.cat([self.gates[li](h), own], dim=1))
            out = self.outs[li](gated)
            h = h + self.ops.rms_norm(out, self.out_norms[li], self.eps)
        return h * self.scalars[li]
