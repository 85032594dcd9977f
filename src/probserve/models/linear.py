"""The packed forward's linear layers, and the choice of matrix kernel for this machine.

Three kernels compute y = x W^T + b in float32, equal to ~1e-5:
- "dense": `F.linear` on a contiguous weight (MKL's sgemm/sgemv);
- "onednn": oneDNN's matmul on a weight reordered once into its blocked layout
  (`mkldnn._reorder_linear_weight`, `mkldnn._linear_pointwise`);
- "invariant": probserve's own (kernels/invariant.cpp) on a weight packed once into panels:
  each output accumulates over K in order, so a row's result is the same bits whatever the
  other rows (what `--deterministic` needs; MKL and oneDNN block K differently by row count).
Which one is faster depends on the machine and the row count: on one 2-core CI machine
(AVX-512, no VNNI) oneDNN took 21 vs 33 ms for SmolLM2's matrix chain at 1 row and 48 vs 87 ms
at 32 rows (MKL re-packed the weight on every call); on another (Intel Xeon with AVX-512
bf16/VNNI, 2026-11-30), for a 3072x576 matrix, MKL took 177-186 us at 1 row against oneDNN's
234-243, and 667 us at 32 rows against 542 (443 vs 283 at 8). So `choose_kernel` times both once
at start on one of the model's own matrices, at 1 and 32 rows, and the weights are then held in
the faster form only (never both).
"""

from __future__ import annotations

import logging
import time
from typing import Literal

import torch
import torch.nn.functional as F

from probserve.kernels.invariant import InvariantKernels, PackedWeight, QuantizedWeight
from probserve.kernels.layer_ops import LayerOps
from probserve.models.gguf_blocks import QuantizedTensor, Weight

log = logging.getLogger(__name__)

Kernel = Literal["dense", "onednn", "invariant"]
PACK_ROWS = 32  # the row count oneDNN's weight layout is chosen for


class Linear:
    """y = x W^T + b with the weight held in the form its kernel wants (a private copy: the
    source, perhaps memory-mapped from a file, may then be released). A weight in GGUF blocks
    stays in them with the "invariant" kernel (kernels/quantized.cpp: the same bits as on its
    float32 copy); the other kernels take it dequantized."""

    def __init__(
        self,
        weight: Weight,
        bias: torch.Tensor | None = None,
        kernel: Kernel = "dense",
        kernels: LayerOps | None = None,
    ) -> None:
        """`kernels`: the deterministic operations, for the "invariant" kernel (the CPU's
        library, which keeps GGUF blocks; or the GPU path's, which takes them dequantized)."""
        self.kernel: Kernel = kernel
        if kernel == "onednn" and not onednn_available():
            self.kernel = "dense"
        self.kernels = kernels
        self.packed: PackedWeight | None = None
        self.quantized: QuantizedWeight | None = None
        if isinstance(weight, QuantizedTensor):
            self.out_features, self.in_features = weight.n, weight.k
            if self.kernel == "invariant" and isinstance(kernels, InvariantKernels):
                self.quantized = kernels.qpack(weight.blocks, weight.ggml_type, bias)
                self.w = self.quantized.data
                self.b = self.quantized.bias
                return
            weight = weight.dequantize()
        weight = weight.detach().float()
        self.out_features, self.in_features = (int(d) for d in weight.shape)
        if self.kernel == "invariant":
            if kernels is None:
                raise ValueError("the invariant kernel needs its library (InvariantKernels)")
            self.packed = kernels.pack(weight, bias)
            self.w = self.packed.panels
            self.b = self.packed.bias
        elif self.kernel == "onednn":
            # reordered once for oneDNN's matmul (blocked for ~32 rows, right for any count)
            self.w = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)
            self.b = None if bias is None else bias.detach().float().clone()
        else:
            self.w = weight.clone(memory_format=torch.contiguous_format)
            self.b = None if bias is None else bias.detach().float().clone()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            assert isinstance(self.kernels, InvariantKernels)
            return self.kernels.qlinear(x, self.quantized)
        if self.packed is not None:
            return self.kernels.linear(x, self.packed)  # type: ignore[union-attr]
        if self.kernel == "onednn":
            x = x.contiguous()
            return torch.ops.mkldnn._linear_pointwise(x, self.w, self.b, "none", [], "")
        return F.linear(x, self.w, self.b)


class Joined:
    """Several weights' rows side by side as one layer (a fused QKV or gate/up whose parts are in
    different block formats, as a Q4_K_M file's Q4_K q/k and Q6_K v): each part multiplied in
    its own form, the outputs joined. Every output column is its own row's product, so the
    result is the same bits as the one fused weight (the invariant kernels' results do not
    depend on the rows beside a row), and no part is ever dequantized."""

    def __init__(self, parts: list[Linear]) -> None:
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def _time(layer: Linear, rows: int, repeats: int = 5) -> float:
    x = torch.randn(rows, layer.in_features)
    layer(x)  # warm: first calls pick kernels and allocate
    start = time.perf_counter()
    for _ in range(repeats):
        layer(x)
    return (time.perf_counter() - start) / repeats


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def choose_kernel(weight: torch.Tensor) -> Kernel:
    """The faster kernel for `weight` on this machine, timed at 1 and 32 rows (a decode step
    and a batch); the sum decides."""
    if not onednn_available():
        return "dense"
    with torch.inference_mode():
        cost = {
            kernel: sum(_time(Linear(weight, None, kernel), rows) for rows in (1, 32))
            for kernel in ("dense", "onednn")
        }
    best: Kernel = "dense" if cost["dense"] <= cost["onednn"] else "onednn"
    log.info(
        "linear kernel: %s (dense %.2f ms, onednn %.2f ms at 1 + 32 rows)",
        best,
        cost["dense"] * 1e3,
        cost["onednn"] * 1e3,
    )
    return best
