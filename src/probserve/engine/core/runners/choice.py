"""The runner contract: scheduled chunks in, the logits rows the step needs out, and what a
runner can do (speculate, keep hidden states, warm up); and the choice of runner for a model,
with its backend (core/backend.py) and KV cache.

`PagedRunner` (paged.py) serves the families of models/family.py with one packed forward
per step over a paged KV cache (`RecurrentRunner`, recurrent.py, the hybrid ones whose
sequences also carry a recurrent state); `HFRunner` (hf.py) any other causal LM through
transformers' own forward.
Each runner sizes its own KV cache (`kv_bytes_per_token`), from which the engine counts blocks,
after reserving `max_num_seqs` sequences' recurrent state (`state_bytes_per_sequence`) and the
prefix cache's state snapshots (recurrent.py's `snapshot_count`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from probserve.engine.core.backend import Backend, resolve
from probserve.engine.core.block_pool import BlockPool
from probserve.engine.core.row_math import RowMath
from probserve.engine.fingerprint import NumericsFingerprint, numerics_code_digest
from probserve.engine.info import EngineInfo

log = logging.getLogger("probserve.engine.core.engine")  # the engine's lines, as before

if TYPE_CHECKING:
    import torch

    from probserve.engine.config import EngineConfig
    from probserve.engine.core.sequence import Sequence
    from probserve.engine.core.step import Chunk, RunOutput
    from probserve.engine.types import RoutedExperts
    from probserve.models.loader import LoadedModel


class Runner(Protocol):
    prefix_caching: bool
    speculates: bool  # runs proposed tokens as extra rows (core/speculation.py)
    keeps_hidden: bool  # keeps each position's final hidden state (`hidden`)
    row_math: RowMath  # the vocabulary reductions its logprobs go through

    def run(self, chunks: list[Chunk]) -> RunOutput: ...

    def warm(self) -> None:
        """Prepare before the first request, on the thread that steps it (the GPU path
        captures its decode graphs)."""
        ...

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
    """A runner's class: what it can do, known before it is built."""

    prefix_caching: bool
    speculates: bool
    keeps_hidden: bool

    @staticmethod
    def kv_bytes_per_token(config: Any) -> int: ...

    @staticmethod
    def state_bytes_per_sequence(config: Any) -> int:
        """The recurrent state one sequence holds beside its KV blocks (0: none)."""
        ...

    @staticmethod
    def routing_shape(config: Any) -> tuple[tuple[int, ...], int]:
        """(the MoE layers whose routing a request may ask for, experts a token); ((), 0):
        this runner returns no routing for this model."""
        ...

    def __call__(
        self, loaded: LoadedModel, num_blocks: int, config: EngineConfig, backend: Backend
    ) -> Runner: ...


def runner_class(
    loaded: LoadedModel, config: EngineConfig, supported: bool, blocker: str | None
) -> RunnerClass:
    """The paged runner for the families it runs (`supported`, unless told otherwise), else
    transformers'; `blocker`: why the paged forward cannot run it deterministically."""
    from probserve.engine.core.runners.hf import HFRunner
    from probserve.engine.core.runners.paged import PagedRunner
    from probserve.engine.core.runners.recurrent import RecurrentRunner
    from probserve.models import ModelLoadError
    from probserve.models.family import SUPPORTED_TYPES, family

    if config.runner == "paged" and not supported:
        kind = getattr(getattr(loaded.model, "config", None), "model_type", "this model")
        raise ModelLoadError(
            f"--runner paged cannot run {loaded.name} ({kind}): "
            f"{blocker}; the paged forward serves "
            f"{', '.join(sorted(SUPPORTED_TYPES))}; use --runner auto or hf"
        )
    if config.runner == "paged" or (config.runner == "auto" and supported):
        return RecurrentRunner if family(loaded.model.config).hybrid else PagedRunner
    from probserve.models.llama import paged_only

    if config.runner == "auto" and paged_only(loaded.model):
        raise ModelLoadError(f"{loaded.name} cannot be served: {blocker}")
    return HFRunner


@dataclass(frozen=True)
class RunnerChoice:
    """The runner an engine runs, decided once: its class, the configuration, the backend its
    forward runs on (core/backend.py), and its KV cache in blocks."""

    cls: RunnerClass
    config: EngineConfig
    backend: Backend
    num_blocks: int  # blocks of the KV cache (block 0 the null block: at least 2)
    retain_blocks: int  # released blocks the prefix cache keeps (--prefix-cache-gib)
    state_bytes: int = 0  # the recurrent state a sequence holds (a hybrid model's; 0: none)
    snapshots: int = 0  # the prefix cache's state snapshots at most (a hybrid model's)
    max_seqs: int = 0  # sequences run together: max_num_seqs, or fewer whose states fit (0: it)

    @property
    def name(self) -> str:
        return self.cls.__name__  # type: ignore[attr-defined]

    @property
    def num_seqs(self) -> int:
        """Sequences run together: --max-num-seqs, or fewer whose recurrent states fit."""
        return self.max_seqs or self.config.max_num_seqs

    @property
    def token_capacity(self) -> int:
        return (self.num_blocks - 1) * self.config.block_size

    def block_pool(self) -> BlockPool:
        """Its KV cache's blocks, the prefix cache on where asked and the runner keeps one."""
        caching = self.config.prefix_caching and self.cls.prefix_caching
        caching = caching and not self.prefix_caching_off
        return BlockPool(
            self.num_blocks, self.config.block_size, caching, retain_blocks=self.retain_blocks
        )

    def log_built(self, prefix_caching: bool, info: EngineInfo) -> None:
        """What the engine logs once its runner is built: the runner, its KV cache and its
        backend, and a hybrid model's recurrent state and its reservation."""
        c = self.config
        log.info(
            "engine: %s, %d KV blocks of %d tokens (%d tokens), prefix caching %s, "
            "deterministic %s, weights %s",
            self.name, self.num_blocks, c.block_size, self.token_capacity,
            "on" if prefix_caching else "off", "on" if info.deterministic else "off",
            info.weights,
        )  # fmt: skip
        if info.prefix_caching_off:
            log.info("engine: prefix caching off: %s", info.prefix_caching_off)
        if not self.state_bytes:
            return
        log.info(
            "engine: recurrent state %d bytes a sequence, reserved for %d sequences (%d states "
            "each: its own and those kept for proposals) and %d prefix-cache snapshots",
            self.state_bytes, self.max_seqs, 2 + c.speculative_tokens, self.snapshots,
        )  # fmt: skip
        if self.max_seqs < c.max_num_seqs:
            log.warning(
                "engine: %d sequences at once, not --max-num-seqs %d: half of --kv-cache-gib "
                "holds no more recurrent states", self.max_seqs, c.max_num_seqs,
            )  # fmt: skip

    def build(self, loaded: LoadedModel) -> Runner:
        return self.cls(loaded, self.num_blocks, self.config, self.backend)

    def info(self, loaded: LoadedModel, prefix_caching: bool, speculative: str) -> EngineInfo:
        """What an engine on this runner tells its clients (engine/info.py): the model's
        figures, the runner's, its KV cache's and its backend's."""
        model = getattr(loaded.model, "config", None)
        moe_layers, experts_per_token = self.cls.routing_shape(loaded.model.config)
        context = self.config.max_model_len or loaded.context_length
        return EngineInfo(
            vocab_size=loaded.vocab_size, context_length=context,
            max_context=min(context, self.token_capacity),
            eos_token_ids=tuple(sorted(loaded.eos_token_ids)), runner=self.name,
            kv_cache_tokens=self.token_capacity, prefix_caching=prefix_caching,
            architecture=str(getattr(model, "model_type", "")), speculative=speculative,
            embeddings=self.cls.keeps_hidden,
            hidden_size=int(getattr(model, "hidden_size", 0) or 0),
            block_size=self.config.block_size, moe_layers=moe_layers,
            experts_per_token=experts_per_token, fingerprint=self.fingerprint(loaded),
            state_bytes_per_sequence=self.state_bytes, prefix_caching_off=self.prefix_caching_off,
            **self.backend.facts(),
        )  # fmt: skip

    def fingerprint(self, loaded: LoadedModel) -> NumericsFingerprint:
        """What this engine's numbers depend on (engine/fingerprint.py): the weights' digest
        (hashed once per file, models/digest.py), the runner, its backend and the block size."""
        from probserve.models.digest import model_digest

        facts = self.backend.facts()
        deterministic = bool(facts["deterministic"])
        return NumericsFingerprint(
            model_digest=model_digest(loaded), runner=self.name, device=str(facts["device"]),
            kernel_isa=str(facts["kernel_isa"]), products=str(facts["products"]),
            block_sums=bool(facts["block_sums"]), precision=str(facts["precision"]),
            weights=str(facts["weights"]), block_size=self.config.block_size,
            deterministic=deterministic, linear="" if deterministic else self.backend.linear,
            code=numerics_code_digest(),
        )  # fmt: skip

    @property
    def prefix_caching_off(self) -> str:
        """Why the prefix cache is off though asked for ("" where it is on or not asked)."""
        from probserve.engine.core.runners.recurrent import NO_SNAPSHOTS

        if not self.config.prefix_caching:
            return ""
        if not self.cls.prefix_caching:
            return f"{self.name} has none"
        return NO_SNAPSHOTS if self.state_bytes and not self.snapshots else ""


def choose_runner(loaded: LoadedModel, config: EngineConfig) -> RunnerChoice:
    from probserve.engine.core.runners.paged import PagedRunner
    from probserve.engine.core.runners.recurrent import RecurrentRunner, snapshot_count

    if not 0 <= config.max_model_len <= loaded.context_length:
        raise ValueError(
            f"--max-model-len {config.max_model_len} is not within the model's context "
            f"({loaded.context_length} tokens)"
        )
    from probserve.models import llama

    supported, blocker = llama.fit(loaded.model)  # read once
    cls = runner_class(loaded, config, supported, blocker)
    backend = resolve(loaded, config, cls in (PagedRunner, RecurrentRunner), blocker)
    per_block = cls.kv_bytes_per_token(loaded.model.config) * config.block_size
    state = cls.state_bytes_per_sequence(loaded.model.config)
    # every running sequence's recurrent state with those a step verifying its proposals keeps
    # (as many sequences as half the budget holds, at most max_num_seqs), and the prefix
    # cache's snapshots (at most a quarter of it)
    per_seq = state * (2 + config.speculative_tokens)
    seqs = config.max_num_seqs
    if state:
        seqs = min(seqs, int(config.kv_cache_gib * 2**30) // 2 // per_seq)
        if seqs < 1:
            raise ValueError(
                f"--kv-cache-gib {config.kv_cache_gib:g}: half of it does not hold one "
                f"sequence's recurrent state ({per_seq / 2**30:.3f} GiB, with the states kept "
                f"for {config.speculative_tokens} proposals)"
            )
    snapshots = snapshot_count(config, state)
    reserved = per_seq * seqs + state * snapshots

    def blocks_in(gib: float, less: int = 0) -> int:
        return (int(gib * 2**30) - less) // per_block

    return RunnerChoice(
        cls, config, backend, max(2, blocks_in(config.kv_cache_gib, reserved)),
        blocks_in(config.prefix_cache_gib), state, snapshots, seqs,
    )  # fmt: skip


def build_runner(loaded: LoadedModel, config: EngineConfig) -> Runner:
    return choose_runner(loaded, config).build(loaded)
