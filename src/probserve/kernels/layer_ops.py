"""LayerOps: every operation the paged forward calls (models/llama.py, its linear layers and its
experts), as one interface with three backends: torch's own operations (kernels/torch_ops.py:
MKL's or oneDNN's products and SDPA attention, not batch-invariant), the CPU's row-invariant
kernels (kernels/invariant.py, which also multiply GGUF blocks in place and chain the layers in
one native call) and the GPU path's Triton kernels (kernels/gpu/ops.py). The forward holds one
and never asks which: what differs between them is here, declared."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from probserve.kernels.attention_plan import AttentionPlan, LayerAttention, LayerKV, Rope
from probserve.kernels.delta_rule import DeltaLayer, DeltaSpan
from probserve.kernels.experts import Activation, Expert
from probserve.kernels.layers import LayerWeights, NativeLayers, Shape
from probserve.kernels.weights import Packed, Source


class Experts(Protocol):
    """A layer's experts as a backend holds them: rows x [T, H] routed to experts ids [T, k]
    with weights [T, k] -> each token's weighted sum of its experts' outputs."""

    def __call__(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, act: Activation
    ) -> torch.Tensor: ...


class LayerOps(Protocol):
    @property
    def kernel(self) -> str:
        """Its matrix kernel: "invariant", "dense" (MKL), "onednn", "triton"."""
        ...

    @property
    def keeps_blocks(self) -> bool:
        """GGUF blocks are multiplied as the file holds them (else dequantized by `pack`)."""
        ...

    @property
    def reads_rows(self) -> bool:
        """`rows` reads a packed weight (a tied embedding from the head's copy)."""
        ...

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor the forward keeps, where the operations run (copied once)."""
        ...

    def pack(self, weight: Source, bias: torch.Tensor | None = None) -> Packed:
        """A weight (float32, or a file's blocks) held in the form `linear` multiplies: a copy,
        so the source (perhaps memory-mapped from a file) may be released."""
        ...

    def linear(self, x: torch.Tensor, w: Packed) -> torch.Tensor: ...

    def rows(self, w: Packed, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a packed weight, float32 (an embedding lookup)."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def gpt_oss_glu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor: ...

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor: ...

    def route(
        self, logits: torch.Tensor, k: int, norm: bool
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rotate(
        self, qkv: torch.Tensor, heads: tuple[int, int, int], rope: Rope, slots: torch.Tensor,
        kv: LayerKV,
    ) -> torch.Tensor:  # fmt: skip
        """RoPE on qkv [T, (nq + 2 nkv) d] (`heads`: nq, nkv, d), k and v written into the
        layer's cache at `slots`; the rotated q [T, nq, d]."""
        ...

    def attend(
        self, q: torch.Tensor, kv: LayerKV, plan: AttentionPlan, layer: LayerAttention
    ) -> torch.Tensor:
        """Causal attention of q [T, nq, d] over a layer's paged cache, as `plan` lays out the
        step: [T, nq * d]."""
        ...

    def gated_delta(
        self, proj: torch.Tensor, layer: DeltaLayer, spans: Sequence[DeltaSpan]
    ) -> torch.Tensor:
        """A Gated DeltaNet layer's conv + SiLU and gated delta rule (kernels/delta_rule.py)
        over the step's projected rows [T, C + nv dv + 2 nv] ([q k v | z | b | a]), each span
        continuing its sequence's state: o [T, nv dv], one order per token on every path."""
        ...

    def experts(self, experts: Iterable[Expert], count: int) -> Experts:
        """A layer's `count` experts held as this backend runs them (taken one at a time)."""
        ...

    def chain(self, shape: Shape, layers: Sequence[LayerWeights]) -> NativeLayers | None:
        """Every decoder layer in one native call a step where this backend has one (the CPU's
        library), else None: the forward calls the operations one by one."""
        ...
