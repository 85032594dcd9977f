"""The runner contract: scheduled chunks in, the logits rows the step needs out; and the choice
of runner for a model.

`PagedRunner` (paged.py) serves the families of models/family.py with one packed forward
per step over a paged KV cache; `HFRunner` (hf.py) any other causal LM through
transformers' own forward.
Each runner sizes its own KV cache (`kv_bytes_per_token`), from which the engine counts blocks.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from probserve.engine.core.row_math import RowMath

if TYPE_CHECKING:
    import torch

    from probserve.engine.config import EngineConfig
    from probserve.engine.core.sequence import Sequence
    from probserve.engine.core.step import Chunk, RunOutput
    from probserve.engine.types import RoutedExperts
    from probserve.models.loader import LoadedModel


log = logging.getLogger(__name__)


class Runner(Protocol):
    prefix_caching: bool
    row_math: RowMath  # the vocabulary reductions its logprobs go through

    def run(self, chunks: list[Chunk]) -> RunOutput: ...

    def hidden(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """The final-norm hidden states [end - start, H] its forward kept for positions
        [start, end) of `seq` (a runner that keeps none is never asked: `keeps_hidden`)."""
        ...

    def routing(self, seq: Sequence, start: int, end: int) -> RoutedExperts:
        """The routing its forward kept for positions [start, end) of `seq` (a runner whose
        `routing_shape` is empty is never asked)."""
        ...

    def release_source_weights(self) -> None:
        """Drop the transformers model's weights where the runner holds its own copy, so the
        process holds the weights once."""


class RunnerClass(Protocol):
    prefix_caching: bool

    @staticmethod
    def kv_bytes_per_token(config: Any) -> int: ...

    @staticmethod
    def routing_shape(config: Any) -> tuple[tuple[int, ...], int]:
        """(the MoE layers whose routing a request may ask for, experts a token); ((), 0):
        this runner returns no routing for this model."""
        ...

    def __call__(self, loaded: LoadedModel, num_blocks: int, config: EngineConfig) -> Runner: ...


def runner_class(loaded: LoadedModel, config: EngineConfig) -> RunnerClass:
    """The paged runner for the families it runs (unless told otherwise), else transformers'."""
    from probserve.engine.core.runners.hf import HFRunner
    from probserve.engine.core.runners.paged import PagedRunner
    from probserve.models import ModelLoadError, llama
    from probserve.models.family import SUPPORTED_TYPES

    supported = llama.supports(loaded.model)
    if config.runner == "paged" and not supported:
        kind = getattr(getattr(loaded.model, "config", None), "model_type", "this model")
        raise ModelLoadError(
            f"--runner paged cannot run {loaded.name} ({kind}): "
            f"{llama.deterministic_blocker(loaded.model)}; the paged forward serves "
            f"{', '.join(sorted(SUPPORTED_TYPES))}; use --runner auto or hf"
        )
    if config.runner == "paged" or (config.runner == "auto" and supported):
        return PagedRunner
    return HFRunner


def _effective(loaded: LoadedModel, config: EngineConfig, cls: RunnerClass) -> EngineConfig:
    """`config`, with `deterministic` kept only where it can run: the paged runner, a model
    with a static RoPE, and kernels that build on this machine (a warning says why not)."""
    from probserve.engine.core.runners.paged import PagedRunner
    from probserve.engine.device import gpu_path
    from probserve.kernels.build import KernelBuildError, build
    from probserve.models import ModelLoadError, llama

    paged = cls is PagedRunner
    if loaded.weights is not None and not paged:
        raise ValueError("native (quantized) weights run on the paged runner only")
    if gpu_path(config.device) is not None:  # always batch-invariant, on its own kernels
        blocker = llama.deterministic_blocker(loaded.model) if paged else "not its family"
        if not blocker:
            return dataclasses.replace(config, deterministic=True)
        if config.device == "cuda":
            raise ModelLoadError(
                f"--device cuda: the GPU path runs the paged forward, and {loaded.name} cannot "
                f"run there ({blocker}); serve it with --device cpu"
            )
        log.warning("--device auto: %s runs on the CPU (the GPU path: %s)", loaded.name, blocker)
        config = dataclasses.replace(config, device="cpu")
    if not config.deterministic:
        return config
    why = None
    if not paged:
        why = "the transformers runner has no row-invariant kernels"
    else:
        why = llama.deterministic_blocker(loaded.model)
    if why is None:
        try:
            build()
        except KernelBuildError as exc:
            why = str(exc)
    if why is None:
        return config
    log.warning("deterministic mode is off for this model: %s", why)
    return dataclasses.replace(config, deterministic=False)


@dataclass(frozen=True)
class RunnerChoice:
    """The runner an engine runs, decided once: its class, the configuration it can run
    (`deterministic` only where it can), and its KV cache in blocks."""

    cls: RunnerClass
    config: EngineConfig
    num_blocks: int  # blocks of the KV cache (block 0 the null block: at least 2)
    retain_blocks: int  # released blocks the prefix cache keeps (--prefix-cache-gib)

    @property
    def name(self) -> str:
        return self.cls.__name__  # type: ignore[attr-defined]

    def build(self, loaded: LoadedModel) -> Runner:
        return self.cls(loaded, self.num_blocks, self.config)


def choose_runner(loaded: LoadedModel, config: EngineConfig) -> RunnerChoice:
    cls = runner_class(loaded, config)
    config = _effective(loaded, config, cls)
    per_block = cls.kv_bytes_per_token(loaded.model.config) * config.block_size

    def blocks_in(gib: float) -> int:
        return int(gib * 2**30) // per_block

    return RunnerChoice(
        cls, config, max(2, blocks_in(config.kv_cache_gib)), blocks_in(config.prefix_cache_gib)
    )


def build_runner(loaded: LoadedModel, config: EngineConfig) -> Runner:
    return choose_runner(loaded, config).build(loaded)
