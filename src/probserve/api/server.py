"""`probserve serve`: load the model, build the engine and the app, run uvicorn."""

from __future__ import annotations

import argparse
import logging
import os

from probserve.api.app import create_app
from probserve.api.state import ServerConfig, ServerState
from probserve.engine import AsyncEngine, EngineConfig, EngineCore, LogprobsMode
from probserve.models import LoadedModel, load_model

log = logging.getLogger(__name__)

API_KEY_ENV = "PROBSERVE_API_KEY"


def api_keys(flag: str | None) -> tuple[str, ...]:
    raw = flag if flag is not None else os.environ.get(API_KEY_ENV, "")
    return tuple(k.strip() for k in raw.split(",") if k.strip())


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_gib=args.kv_cache_gib,
        prefix_caching=not args.no_prefix_caching,
        runner=args.runner,
    )


def build_state(loaded: LoadedModel, args: argparse.Namespace) -> ServerState:
    names = (args.served_model_name or loaded.name,)
    if loaded.name not in names:
        names = (*names, loaded.name)
    config = ServerConfig(
        served_model_names=names,
        max_logprobs=args.max_logprobs,
        max_top_logprobs=args.max_top_logprobs,
        logprobs_mode=LogprobsMode(args.logprobs_mode),
        api_keys=api_keys(args.api_key),
    )
    engine = AsyncEngine(EngineCore(loaded, engine_config(args)))
    return ServerState(loaded, engine, config)


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    loaded = load_model(args.model)
    app = create_app(build_state(loaded, args))
    log.info("serving %s on http://%s:%d/v1", loaded.name, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0
