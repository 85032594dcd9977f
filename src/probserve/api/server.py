"""`probserve serve`: start the engine (a worker process by default), build the app, run uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from probserve.api.app import create_app
from probserve.api.connections import guarded_protocol
from probserve.api.limits import Limits
from probserve.api.state import ServerConfig, ServerState
from probserve.engine import (
    AsyncEngine,
    EngineClient,
    EngineConfig,
    EngineCore,
    LogprobsMode,
    WorkerEngine,
)
from probserve.engine.runner import weights_for
from probserve.flags import from_args
from probserve.models import LoadedModel, load_model, load_tokenizer, resolve_model

log = logging.getLogger(__name__)

API_KEY_ENV = "PROBSERVE_API_KEY"


def api_keys(flag: str | None, key_file: str | None = None) -> tuple[str, ...]:
    """Keys from --api-key (comma-separated), else PROBSERVE_API_KEY, plus one per line of
    --api-key-file (blank lines and # comments skipped)."""
    raw = flag if flag is not None else os.environ.get(API_KEY_ENV, "")
    keys = [k.strip() for k in raw.split(",") if k.strip()]
    if key_file:
        with open(key_file, encoding="utf-8") as f:
            keys += [ln.strip() for ln in f if ln.strip() and not ln.strip().startswith("#")]
    return tuple(keys)


def start_engine(
    args: argparse.Namespace, loaded: LoadedModel | None = None
) -> tuple[EngineClient, LoadedModel]:
    """The engine the flags ask for, started, and the model as the API process holds it.

    `--worker process` (the default): the engine runs in a worker process that loads the
    weights (converting a GGUF file once: models/cache.py); this process then loads the
    tokenizer alone (or reuses `loaded`'s) and learns the model's figures from the Hello.
    `--worker inline`: the engine runs on a thread here, over `loaded` (loaded now if not
    given)."""
    config = from_args(EngineConfig, args)
    limits = from_args(Limits, args)
    if config.worker == "inline":
        loaded = loaded or load_model(args.model, weights_for(config))
        inline = AsyncEngine(
            EngineCore(loaded, config),
            max_pending=limits.max_queued,
            stall_timeout=limits.engine_stall_timeout,
        )
        inline.start()
        return inline, loaded
    source = loaded.source if loaded and loaded.source else resolve_model(args.model)
    engine = WorkerEngine(
        source.spec,
        config,
        max_pending=limits.max_queued,
        stall_timeout=limits.engine_stall_timeout,
        log_level=args.log_level,
    )
    try:
        engine.start()
        if loaded is None:  # the worker converted a GGUF file: its directory loads fastest
            source = dataclasses.replace(
                resolve_model(engine.loaded_spec), served_name=source.served_name
            )
        tokenizer = loaded.tokenizer if loaded else load_tokenizer(source)
    except BaseException:
        engine.stop()
        raise
    info = engine.info
    served = LoadedModel(
        model=None,
        tokenizer=tokenizer,
        name=loaded.name if loaded else source.served_name or source.name_or_path,
        eos_token_ids=frozenset(info.eos_token_ids),
        context_length=info.context_length,
        vocab_size=info.vocab_size,
        chat_template=getattr(tokenizer, "chat_template", None),
        source=source,
    )
    return engine, served


def build_state(args: argparse.Namespace, loaded: LoadedModel | None = None) -> ServerState:
    """The engine started (start_engine) and the server's state around it."""
    engine, loaded = start_engine(args, loaded)
    names = (args.served_model_name or loaded.name,)
    if loaded.name not in names:
        names = (*names, loaded.name)
    config = ServerConfig(
        served_model_names=names,
        max_logprobs=args.max_logprobs,
        max_top_logprobs=args.max_top_logprobs,
        logprobs_mode=LogprobsMode(args.logprobs_mode),
        api_keys=api_keys(args.api_key, args.api_key_file),
        open_metrics=args.open_metrics,
        limits=from_args(Limits, args),
    )
    return ServerState(loaded, engine, config)


def uvicorn_config(app: FastAPI, limits: Limits, host: str, port: int) -> uvicorn.Config:
    """uvicorn for probserve: header deadline, bounded connections, our own access log."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_protocol(limits.header_timeout),
        limit_concurrency=limits.max_connections,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=max(1, int(limits.drain_timeout)),
    )


class DrainingServer(uvicorn.Server):
    """On SIGTERM (or Ctrl-C): stop accepting connections, let every response in flight finish
    (streams included) for up to `drain_timeout` seconds, then shut down as uvicorn does (the
    app's lifespan stops the engine). uvicorn's own shutdown tells open connections to close,
    which cuts streams short; draining first keeps them whole."""

    def __init__(self, config: uvicorn.Config, drain_timeout: float) -> None:
        super().__init__(config)
        self.drain_timeout = drain_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises a captured signal once it has shut down; a drained SIGTERM is a
        # clean, intended exit, so the process ends with status 0 instead
        if sig == signal.SIGTERM and self._captured_signals[-1:] == [sig]:
            self._captured_signals.pop()

    def _busy(self) -> bool:
        return any(
            getattr(conn, "cycle", None) is not None and not conn.cycle.response_complete
            for conn in self.server_state.connections
        )

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        while self._busy() and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        if self._busy():
            log.warning("drain timeout (%gs) passed with responses in flight", self.drain_timeout)
        await super().shutdown(sockets)


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGTERM (exit 0), or until the engine dies (exit 1, so a supervisor restarts
    the server: never a live socket in front of a dead engine)."""
    state = build_state(args)
    if isinstance(state.engine, WorkerEngine):
        # the model runs in the worker: torch here only ever does small work, and a second
        # pool of threads would compete with the worker's for the cores
        import torch

        torch.set_num_threads(1)
    app = create_app(state)
    log.info("serving %s on http://%s:%d/v1", state.loaded.name, args.host, args.port)
    server = DrainingServer(
        uvicorn_config(app, state.config.limits, args.host, args.port), args.drain_timeout
    )

    def engine_died(reason: str) -> None:
        log.critical("shutting down: %s", reason)
        server.should_exit = True

    state.engine.on_fatal = engine_died
    server.run()
    return 1 if state.engine.health()[0] == "dead" else 0
