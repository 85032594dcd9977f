"""Where the engine's forward runs: `--device cpu` (the C++ kernels or torch on the host),
`cuda` (the GPU path: the Triton kernels on the GPU), `auto` (the GPU where torch sees one).
Under Triton's interpreter (TRITON_INTERPRET=1) the GPU path runs on CPU tensors: how it is
tested on machines without a GPU."""

from __future__ import annotations

import os
from typing import Literal

import torch

from probserve.models.errors import ModelLoadError

Device = Literal["cpu", "cuda", "auto"]


class DeviceError(ModelLoadError):
    """The device asked for is not there; one line."""


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def gpu_path(device: Device) -> torch.device | None:
    """The torch device of the GPU path, or None for the CPU's."""
    if device == "cpu":
        return None
    if torch.cuda.is_available():
        return torch.device("cuda")
    if device == "auto":
        return None
    if interpreted():
        return torch.device("cpu")  # the GPU code path, its kernels interpreted
    raise DeviceError(
        "--device cuda: torch sees no GPU (a CPU build of torch, or no CUDA device); use "
        "--device cpu or auto"
    )
