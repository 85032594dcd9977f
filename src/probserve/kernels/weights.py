"""The forms a weight is held in for the forward's operations (kernels/layer_ops.py): a matrix in
the form its products read (`PackedWeight`: panels, or the backend's own form of the whole
matrix), a matrix still in its GGUF blocks (`QuantizedWeight`), and what the forward hands over
to be packed (a float32 tensor, or a file's `Blocks`); and `row_ids`, the row ids a kernel reads
through, checked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from probserve.kernels.qlayout import BlockRows


@dataclass(frozen=True)
class PackedWeight:
    """A [N, K] weight as panels [ceil(N / P), K, P] of P columns (zero padded), and its bias
    padded to a whole panel (the row-invariant kernels'); the torch and GPU backends keep the
    whole matrix in `panels` instead, in their own layout."""

    panels: torch.Tensor
    bias: torch.Tensor | None
    n: int
    k: int


@dataclass(frozen=True)
class QuantizedWeight:
    """A [N, K] weight in GGUF blocks, packed for quantized.cpp (kernels/qlayout.py): panels of P
    output columns, in each for every block along K (32 weights, 256 for the K-quants) the
    columns' float16 fields and scale bytes, then one row of P quants per k."""

    data: torch.Tensor  # uint8 [panels, K / block length, block bytes] (P times the file's;
    # limbs.cpp's layout: qlayout.limb_block_bytes)
    bias: torch.Tensor | None
    fmt: int  # quantized.cpp's format id (qlayout.FORMATS), + PS_LIMBS in limbs.cpp's layout
    n: int
    k: int


Packed = PackedWeight | QuantizedWeight  # a weight as a backend holds it


class Blocks(Protocol):
    """A matrix as a GGUF file holds it (models/gguf_blocks.QuantizedTensor): rows of blocks
    of one format, which a backend multiplies in place or dequantizes."""

    @property
    def blocks(self) -> np.ndarray: ...

    @property
    def block_rows(self) -> np.ndarray | BlockRows:
        """The same rows, read a slice at a time where they lie in a file (packing reads them
        so, never the whole matrix at once)."""
        ...

    @property
    def ggml_type(self) -> int: ...

    def dequantize(self) -> torch.Tensor: ...


Source = torch.Tensor | Blocks  # a weight handed to a backend to pack


def whole(w: Packed) -> PackedWeight:
    """`w` as a backend that dequantizes every block holds it: a whole matrix, never blocks."""
    if isinstance(w, QuantizedWeight):
        raise TypeError("GGUF blocks are multiplied by the row-invariant kernels only")
    return w


def row_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """int64 row ids (token ids, positions, cache slots), checked against the table's n rows:
    the engine computes them first, but the kernels read and write memory, so they are checked
    again."""
    ids = ids.to(torch.int64).contiguous()
    if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < n):
        raise IndexError(f"row id outside the table's {n} rows")
    return ids
