"""Starting an engine in a process of its own (the worker process, a Ray replica): the torch
threads fixed, the model loaded as the configuration asks, its `EngineCore` built and warmed up
on the thread that steps it, and the source weights released once the runner holds its own
copy (and the tokenizer, which only the API's process uses: the engine keeps what a grammar is
built from). One place, so both hosts start an engine the same way (an engine inside the server's
process, over a model its caller holds: `AsyncEngine.over`), and `engine_over`, the one place an
engine is built over a loaded model, with its draft model's engine where one is asked (the
draft model is its caller's to load, beside the served one)."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from probserve.engine.config import EngineConfig
from probserve.engine.core.engine import EngineCore
from probserve.engine.core.speculation import DraftProposer
from probserve.models.loader import (
    LoadedModel,
    ModelSource,
    loaded_source,
    tokenizer_class,
)
from probserve.progress import Stage

log = logging.getLogger(__name__)


@dataclass
class StartedEngine:
    core: EngineCore
    source: ModelSource  # what was loaded (a GGUF file: its metadata directory)
    tokenizer_class: str  # loader.tokenizer_class: the API side loads the same class
    threads: int  # torch threads of this process
    seconds: float  # from the call to ready


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask on Linux; the machine's count where
    the OS has no affinity call, as macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def configure_threads(threads: int) -> int:
    """The engine's torch threads, fixed for the life of the process (0: one per usable core)."""
    import torch

    n = threads or usable_cores()
    torch.set_num_threads(n)
    return n


def start_engine(
    spec: str | None,
    config: EngineConfig,
    warm: Callable[[EngineCore], None] = EngineCore.warmup,
    draft: str | None = None,
) -> StartedEngine:
    """Load `spec` (and `draft`, the draft model `--speculative draft` guesses with), build its
    engine, `warm` it (build the runner and run a first request: on the thread that will step
    it; an AsyncEngine's start does it on its own thread), then drop the transformers model and
    the file's blocks: the runner holds what it needs."""
    started = time.monotonic()
    threads = configure_threads(config.threads)
    weights = config.weights_to_load()
    source, loaded = loaded_source(spec, weights)
    drafts = loaded_source(draft, weights)[1] if draft else None  # loaded beside it, alike
    core = engine_over(loaded, config, drafts)
    with Stage(log, "warming up (the runner's buffers and a first request, each start)"):
        warm(core)
    core.runner.release_source_weights()
    tokenizer = tokenizer_class(loaded.tokenizer)
    # the tokenizer is the API process's to use: the engine keeps what a grammar needs of it
    core.grammars.release_tokenizer()
    loaded.model = loaded.weights = loaded.tokenizer = None
    release_freed_memory()
    return StartedEngine(core, source, tokenizer, threads, time.monotonic() - started)


def release_freed_memory() -> None:
    """Hand the pages of what the start freed (the tokenizer's many small allocations, the
    load's buffers) back to the OS: glibc keeps freed memory inside its heaps until trimmed."""
    import contextlib
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: it returns memory its way
        ctypes.CDLL(None).malloc_trim(0)


def engine_over(
    loaded: LoadedModel, config: EngineConfig, draft: LoadedModel | None = None
) -> EngineCore:
    """The engine over `loaded`, its speculator built first where `--speculative draft` asks
    and the runner checks proposals: the draft model (its caller loaded it: the same
    tokenizer, else refused) given an engine of its own."""
    if (config.speculative == "draft") != (draft is not None):
        raise ValueError(
            "--speculative draft needs a draft model (--draft-model), and a draft model needs "
            f"--speculative draft (got --speculative {config.speculative})"
        )
    if draft is None:
        return EngineCore(loaded, config)
    if draft.vocab_size != loaded.vocab_size or (
        draft.tokenizer.get_vocab() != loaded.tokenizer.get_vocab()
    ):
        raise ValueError(
            f"the draft model {draft.name} has another tokenizer than {loaded.name}: its "
            "guesses would be other tokens"
        )
    own = dataclasses.replace(
        config, speculative="off", kv_cache_gib=max(0.05, config.kv_cache_gib / 4),
        max_model_len=0,
    )  # fmt: skip
    return EngineCore(loaded, config, lambda: DraftProposer(EngineCore(draft, own)))
