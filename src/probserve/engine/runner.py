"""The runner contract: scheduled chunks in, the logits rows the step needs out; and the choice
of runner for a model.

`PagedRunner` (paged_runner.py) serves the families of models/family.py with one packed forward
per step over a paged KV cache; `HFRunner` (hf_runner.py) any other causal LM through
transformers' own forward.
Each runner sizes its own KV cache (`kv_bytes_per_token`), from which the engine counts blocks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from probserve.engine.row_math import RowMath

if TYPE_CHECKING:
    from probserve.engine.config import EngineConfig
    from probserve.engine.scheduler import Chunk
    from probserve.models.loader import LoadedModel


@dataclass
class ScoreRows:
    """The rows that score a chunk's prompt positions (Chunk.score_range), as hidden states and
    the head that makes them logits, or as logits already (`head` None)."""

    rows: torch.Tensor  # [n, H] hidden states, or [n, V] logits
    head: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def logits(self, start: int, end: int) -> torch.Tensor:
        rows = self.rows[start:end]
        return rows if self.head is None else self.head(rows)


@dataclass
class RunOutput:
    sample_logits: torch.Tensor  # [S, V]: rows of the chunks that sample, in chunk order
    prompt_rows: dict[str, ScoreRows] = field(default_factory=dict)  # request id -> its rows


log = logging.getLogger(__name__)


class Runner(Protocol):
    prefix_caching: bool
    row_math: RowMath  # the vocabulary reductions its logprobs go through

    def run(self, chunks: list[Chunk]) -> RunOutput: ...

    def release_source_weights(self) -> None:
        """Drop the transformers model's weights where the runner holds its own copy, so the
        process holds the weights once."""


class RunnerClass(Protocol):
    prefix_caching: bool

    @staticmethod
    def kv_bytes_per_token(config: Any) -> int: ...

    def __call__(self, loaded: LoadedModel, num_blocks: int, config: EngineConfig) -> Runner: ...


def empty_logits(vocab: int) -> torch.Tensor:
    return torch.empty((0, vocab))


def runner_class(loaded: LoadedModel, config: EngineConfig) -> RunnerClass:
    """The paged runner for the families it runs (unless told otherwise), else transformers'."""
    from probserve.engine.hf_runner import HFRunner
    from probserve.engine.paged_runner import PagedRunner
    from probserve.models import ModelLoadError, llama

    supported = llama.supports(loaded.model)
    if config.runner == "paged" and not supported:
        kind = getattr(getattr(loaded.model, "config", None), "model_type", "this model")
        raise ModelLoadError(
            f"--runner paged cannot run {loaded.name} ({kind}): "
            f"{llama.deterministic_blocker(loaded.model)}; the paged forward serves "
            f"{', '.join(sorted(llama.SUPPORTED_TYPES))}; use --runner auto or hf"
        )
    if config.runner == "paged" or (config.runner == "auto" and supported):
        return PagedRunner  # type: ignore[return-value]
    return HFRunner  # type: ignore[return-value]


def effective_config(loaded: LoadedModel, config: EngineConfig) -> EngineConfig:
    """`config`, with `deterministic` kept only where it can run: the paged runner, a model
    with a static RoPE, and kernels that build on this machine (a warning says why not)."""
    from probserve.engine.paged_runner import PagedRunner
    from probserve.kernels.build import KernelBuildError, build
    from probserve.models import llama

    paged = runner_class(loaded, config) is PagedRunner
    if loaded.weights is not None and not paged:
        raise ValueError("native (quantized) weights run on the paged runner only")
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


def kv_blocks_in(gib: float, loaded: LoadedModel, config: EngineConfig) -> int:
    """Blocks of `config.block_size` tokens of this runner's KV cache that fit in `gib` GiB."""
    per_block = runner_class(loaded, config).kv_bytes_per_token(loaded.model.config)
    return int(gib * 2**30) // (per_block * config.block_size)


def num_kv_blocks(loaded: LoadedModel, config: EngineConfig) -> int:
    """Blocks that fit in `config.kv_cache_gib` (block 0 is the null block: at least 2)."""
    return max(2, kv_blocks_in(config.kv_cache_gib, loaded, config))


def build_runner(loaded: LoadedModel, config: EngineConfig) -> Runner:
    cls = runner_class(loaded, config)
    return cls(loaded, num_kv_blocks(loaded, config), config)
