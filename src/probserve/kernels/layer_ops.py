"""LayerOps: the operations the deterministic forward calls one by one (models/llama.py, its
linear layers and experts), as one interface: the CPU's row-invariant kernels
(kernels/invariant.py, which also multiply GGUF blocks in place) and the GPU path's Triton
kernels (kernels/gpu/ops.py) both provide it."""

from __future__ import annotations

from typing import Protocol

import torch

from probserve.kernels.invariant import PackedWeight


class LayerOps(Protocol):
    keeps_blocks: bool  # GGUF blocks stay as the file holds them (else: dequantized first)

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight: ...

    def linear(self, x: torch.Tensor, w: PackedWeight) -> torch.Tensor: ...

    def rows(self, w: PackedWeight, ids: torch.Tensor) -> torch.Tensor: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def gpt_oss_glu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor: ...

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor: ...

    def route(
        self, logits: torch.Tensor, k: int, norm: bool
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

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
    ) -> torch.Tensor: ...

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
    ) -> torch.Tensor: ...
