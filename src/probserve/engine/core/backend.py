"""The forward's backend, decided once where the runner is chosen (runners/choice.py), from the
flags, the model and the machine: where the forward runs (`--device`: the host, or the GPU
path's device; under Triton's interpreter, TRITON_INTERPRET=1, the GPU path on the host: how it
is tested without a GPU), on which operations (kernels/layer_ops.py: torch's on the host
without --deterministic, the row-invariant C++ kernels with it, the Triton kernels on the GPU
path, which are always batch-invariant), in which precision, the weights' form, the products on
GGUF blocks, the C++ kernels' instruction path, and whether decode steps replay CUDA graphs.
The paged runner builds its forward and its row math from it; `EngineInfo` reports it
(`facts`)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch

from probserve.engine.config import EngineConfig
from probserve.engine.core.row_math import DeviceRowMath, InvariantRowMath, RowMath, TorchRowMath
from probserve.kernels.layer_ops import LayerOps
from probserve.models.errors import ModelLoadError
from probserve.models.loader import LoadedModel

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class Backend:
    """How the forward runs: one record, read by the runner, the forward (its `ops`) and
    `EngineInfo`."""

    device: torch.device  # where the forward, its KV cache and the step's tensors live
    gpu: bool  # the GPU path (the Triton kernels)
    deterministic: bool  # bitwise batch-invariant (the row-invariant kernels, or the GPU's)
    precision: Literal["exact", "bf16"] = "exact"  # the GPU path's weights; the host's: exact
    linear: Literal["auto", "dense", "onednn"] = "auto"  # torch's products (the host's, without
    # --deterministic)
    block_sums: bool = False  # GGUF blocks' scales applied per sub-block sum (in effect)
    products: str = "float"  # the blocks' products: "float", "limbs" (every format that can), or
    # per format where they split ("Q4_K=limbs,Q6_K=float": engine/core/products.py's describe)
    limb_types: frozenset[int] = frozenset()  # the GGML types multiplied in integer limbs
    graphs: bool = False  # decode steps replayed from CUDA graphs
    weights: str = "float32"  # held as: float32, bfloat16 (the GPU path's bf16), or GGUF blocks
    # ("Q4_1+Q8_0")
    weights_in_blocks: float = 0.0  # the fraction of the parameters held in those blocks
    kernel_isa: str = ""  # the C++ kernels' instruction path where the forward runs on them

    def facts(self) -> dict[str, Any]:
        """What `EngineInfo` says of it: where ("cpu", "cuda", or "interpreted": the GPU path
        on the host), the precision, the numbers' invariance, the weights and the products."""
        where = self.device.type
        if self.gpu and where == "cpu" and interpreted():
            where = "interpreted"
        return {
            "device": where, "precision": self.precision, "deterministic": self.deterministic,
            "weights": self.weights, "weights_in_blocks": self.weights_in_blocks,
            "block_sums": self.block_sums, "products": self.products,
            "kernel_isa": self.kernel_isa,
        }  # fmt: skip

    def build(self, loaded: LoadedModel) -> tuple[LayerOps, RowMath]:
        """The forward's operations and the vocabulary rows' reductions, built by the thread
        that runs them (the CPU's library loaded once for both; `--linear auto` timed on one of
        the model's own matrices)."""
        if self.gpu:
            from probserve.kernels.gpu.ops import TritonKernels

            return TritonKernels(self.device, self.precision), DeviceRowMath(self.device)
        if self.deterministic:
            from probserve.kernels.invariant import InvariantKernels

            kernels = InvariantKernels(self.block_sums, self.limb_types)
            return kernels, InvariantRowMath(kernels)
        from probserve.models.linear import torch_ops
        from probserve.models.llama import sample_matrix

        ops = torch_ops(self.linear, lambda: sample_matrix(loaded.model, loaded.weights))
        return ops, TorchRowMath()


def resolve(loaded: LoadedModel, config: EngineConfig, paged: bool, blocker: str | None) -> Backend:
    """`config`'s backend for `loaded` on the runner chosen (`paged`: the paged runner, the only
    one with kernels of its own; `blocker`: why the paged forward cannot run it
    deterministically, None where it can): the GPU path where it is asked and the model runs
    there; else the host, deterministic only where it can run (the paged runner, a model with a
    static RoPE, and kernels that build on this machine; a warning says why not)."""
    if loaded.weights is not None and not paged:
        raise ValueError("native (quantized) weights run on the paged runner only")
    if not paged:
        blocker = "the transformers runner has no row-invariant kernels"
    gpu = gpu_path(config.device)
    if gpu is not None:
        if not blocker:
            held = "bfloat16" if config.precision == "bf16" else "float32"
            return Backend(
                gpu, True, True, config.precision, graphs=config.cuda_graphs, weights=held
            )
        if config.device == "cuda":
            raise ModelLoadError(
                f"--device cuda: the GPU path runs the paged forward, and {loaded.name} cannot "
                f"run there ({blocker}); serve it with --device cpu"
            )
        log.warning("--device auto: %s runs on the CPU (the GPU path: %s)", loaded.name, blocker)
    host = torch.device("cpu")
    if not (config.deterministic and _invariant(blocker)):
        return Backend(host, False, False, linear=config.linear)
    from probserve.kernels.build import isa_path, load

    share = loaded.weights_in_blocks
    products, types = _products(loaded, config)
    return Backend(
        host, False, True, block_sums=config.block_sums and share > 0,
        products=products, limb_types=types, weights=loaded.weights_format,
        weights_in_blocks=round(share, 4), kernel_isa=isa_path(load(), limbs=bool(types)),
    )  # fmt: skip


def _invariant(blocker: str | None) -> bool:
    """Whether the row-invariant kernels run this model here (a warning says why not)."""
    from probserve.kernels.build import KernelBuildError, build

    why = blocker
    if why is None:
        try:
            build()
        except KernelBuildError as exc:
            why = str(exc)
    if why is not None:
        log.warning("deterministic mode is off for this model: %s", why)
    return why is None


def _products(loaded: LoadedModel, config: EngineConfig) -> tuple[str, frozenset[int]]:
    """What the blocks held are multiplied with (products.py: `--products` float, limbs, or the
    measured choice per format on this CPU's limb path for auto; float with --block-sums), as
    /health says it, and the GGML types that run in integer limbs."""
    if config.block_sums or loaded.weights_in_blocks <= 0:
        return "float", frozenset()
    from probserve.engine.core.products import chosen_limbs, describe, limb_isa
    from probserve.kernels.build import load
    from probserve.kernels.invariant import limb_types
    from probserve.kernels.qlayout import FORMATS

    lib = load()
    types = limb_types(lib)
    capable = {FORMATS[t].name for t in types}
    held = set(loaded.weights_format.split("+"))
    limbs = chosen_limbs(config.products, limb_isa(lib), capable, held)
    return describe(limbs, capable, held), frozenset(t for t in types if FORMATS[t].name in limbs)
