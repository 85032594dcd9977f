"""Starting an engine where it will run (the worker process, a Ray replica): the model loaded as
the configuration asks, its `EngineCore` built and warmed up on the thread that steps it, and
the source weights released once the runner holds its own copy. One place, so every host
starts an engine the same way."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from probserve.engine.config import EngineConfig
from probserve.engine.core.engine import EngineCore
from probserve.models.loader import ModelSource, load_source, prepared_source, tokenizer_class

log = logging.getLogger(__name__)


@dataclass
class StartedEngine:
    core: EngineCore
    source: ModelSource  # what was loaded (a GGUF file: its metadata directory)
    tokenizer_class: str  # loader.tokenizer_class: the API side loads the same class
    seconds: float  # from the call to ready


def start_engine(
    spec: str | None, config: EngineConfig, warm: Callable[[EngineCore], None] = EngineCore.warmup
) -> StartedEngine:
    """Load `spec`, build its engine, `warm` it (build the runner and run a first request: on
    the thread that will step it; an AsyncEngine's start does it on its own thread), then drop
    the transformers model and the file's blocks: the runner holds what it needs."""
    started = time.monotonic()
    source = prepared_source(spec)
    loaded = load_source(source, config.weights_to_load())
    core = EngineCore(loaded, config)
    log.info("warming up")
    warm(core)
    core.runner.release_source_weights()
    tokenizer = tokenizer_class(loaded.tokenizer)
    loaded.model = loaded.weights = None
    return StartedEngine(core, source, tokenizer, time.monotonic() - started)
