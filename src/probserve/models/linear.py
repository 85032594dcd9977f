"""The packed forward's linear layers, each weight held in the one form its backend
(kernels/layer_ops.py) multiplies, and the choice of torch's matrix kernel for this machine.

On the host three kernels compute y = x W^T + b in float32, equal to ~1e-5:
- "dense": `F.linear` on a contiguous weight (MKL's sgemm/sgemv; kernels/torch_ops.py);
- "onednn": oneDNN's matmul on a weight reordered once into its blocked layout
  (`mkldnn._reorder_linear_weight`, `mkldnn._linear_pointwise`; kernels/torch_ops.py);
- "invariant": probserve's own (kernels/invariant.cpp) on a weight packed once into panels, or
  on a file's GGUF blocks packed the same way: each output accumulates over K in order, so a
  row's result is the same bits whatever the other rows (what `--deterministic` needs; MKL and
  oneDNN block K differently by row count).
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
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from probserve.kernels.layer_ops import LayerOps
from probserve.kernels.torch_ops import Kernel, TorchOps, onednn_available
from probserve.kernels.weights import Packed, PackedWeight, QuantizedWeight
from probserve.models.gguf_blocks import QuantizedTensor, Weight, stack_rows

log = logging.getLogger(__name__)


class Linear:
    """y = x W^T + b with the weight held as its backend packs it (`LayerOps.pack`: a private
    copy, so the source, perhaps memory-mapped from a file, may then be released). A weight in
    GGUF blocks stays in them where the backend multiplies blocks (the row-invariant kernels:
    the same bits as on its float32 copy); the others take it dequantized."""

    def __init__(self, weight: Weight, bias: torch.Tensor | None, ops: LayerOps) -> None:
        self.ops = ops
        self.held = ops.pack(weight, bias)
        self.out_features, self.in_features = self.held.n, self.held.k

    @property
    def weights(self) -> list[Packed]:
        return [self.held]

    @property
    def quantized(self) -> QuantizedWeight | None:
        """The weight in GGUF blocks (None: held as float values)."""
        return self.held if isinstance(self.held, QuantizedWeight) else None

    @property
    def packed(self) -> PackedWeight | None:
        """The weight as float values (None: in GGUF blocks)."""
        return self.held if isinstance(self.held, PackedWeight) else None

    @property
    def w(self) -> torch.Tensor:
        """The matrix as held: panels, blocks, or torch's dense or reordered copy."""
        return self.held.panels if isinstance(self.held, PackedWeight) else self.held.data

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.held)


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

    @property
    def weights(self) -> list[Packed]:
        return [p.held for p in self.parts]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def _form(weight: Weight) -> int | None:
    """A weight's block format (None: float32)."""
    return weight.ggml_type if isinstance(weight, QuantizedTensor) else None


def projection(
    parts: Sequence[Weight], biases: Sequence[torch.Tensor | None], ops: LayerOps
) -> Linear | Joined:
    """One layer of the weights' rows one after another (a fused QKV or gate/up): one weight,
    or, where the backend keeps blocks and the parts are in different formats, each in its own
    blocks (`Joined`: never a float32 copy)."""
    if ops.keeps_blocks and len({_form(w) for w in parts}) > 1:
        return Joined([Linear(w, b, ops) for w, b in zip(parts, biases, strict=True)])
    present = [b for b in biases if b is not None]
    bias = torch.cat(present) if len(present) == len(biases) else None
    return Linear(stack_rows(parts), bias, ops)


def _time(layer: Linear, rows: int, repeats: int = 5) -> float:
    x = torch.randn(rows, layer.in_features)
    layer(x)  # warm: first calls pick kernels and allocate
    start = time.perf_counter()
    for _ in range(repeats):
        layer(x)
    return (time.perf_counter() - start) / repeats


def choose_kernel(weight: torch.Tensor) -> Kernel:
    """The faster kernel for `weight` on this machine, timed at 1 and 32 rows (a decode step
    and a batch); the sum decides."""
    if not onednn_available():
        return "dense"
    with torch.inference_mode():
        cost = {
            kernel: sum(_time(Linear(weight, None, TorchOps(kernel)), rows) for rows in (1, 32))
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


def torch_ops(linear: Kernel | Literal["auto"], sample: Callable[[], torch.Tensor]) -> TorchOps:
    """Torch's operations with the products `--linear` asks for ("auto": the faster on
    `sample()`, one of the model's own matrices)."""
    return TorchOps(choose_kernel(sample()) if linear == "auto" else linear)
