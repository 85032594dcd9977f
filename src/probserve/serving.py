"""The composition root of `probserve serve`: the flags become started engines (a worker
process per model by default), the server's state and supervisor, the app and its HTTP server.
The local path and Ray's ingress (cluster/) both build from here: one model record
(`ServedModel`), one naming rule (`served_names`)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from probserve.api.app import create_app
from probserve.api.http_server import DrainingServer, uvicorn_config
from probserve.api.limits import Limits
from probserve.api.state import ServedModel, ServerConfig, ServerState
from probserve.api.supervisor import Supervisor
from probserve.engine import EngineClient, EngineConfig, LogprobsMode, WorkerEngine
from probserve.flags import from_args
from probserve.models import (
    DEFAULT_MODEL,
    LoadedModel,
    ModelLoadError,
    load_model,
    load_tokenizer,
    resolve_model,
)

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


def chat_template_flag(args: argparse.Namespace, index: int) -> str | None:
    """The text of the `--chat-template` file given for model `index` (in `--model` order), or
    None; a missing file or a template Jinja cannot compile is a ModelLoadError."""
    files = getattr(args, "chat_template", None) or []
    if len(files) > len(model_flags(args)):
        raise ModelLoadError(
            f"{len(files)} --chat-template flags for {len(model_flags(args))} models"
        )
    if index >= len(files):
        return None
    try:
        text = Path(files[index]).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read the chat template {files[index]}: {exc}") from exc
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:  # compiled as the tokenizer will (its sandbox, extensions and filters)
        _compile_jinja_template(text)
    except TemplateError as exc:
        raise ModelLoadError(f"the chat template {files[index]} is not valid Jinja: {exc}") from exc
    return text


def with_chat_template(loaded: LoadedModel, template: str) -> LoadedModel:
    """`loaded` rendering chats with `template`: its tokenizer is copied (the one given may be
    shared: an inline engine's model, or a caller's), the copy given the template."""
    tokenizer = copy.copy(loaded.tokenizer)
    tokenizer.chat_template = template
    return dataclasses.replace(loaded, tokenizer=tokenizer, chat_template=template)


def model_flags(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(model spec, served name or None) for each `--model` (the embedded model when none is
    given), paired in order with the `--served-model-name` flags."""
    specs = args.model if isinstance(args.model, list) else [args.model] if args.model else []
    specs = specs or [DEFAULT_MODEL]
    names = args.served_model_name or []
    names = names if isinstance(names, list) else [names]
    if len(names) > len(specs):
        raise ModelLoadError(f"{len(names)} --served-model-name flags for {len(specs)} models")
    return [(spec, names[i] if i < len(names) else None) for i, spec in enumerate(specs)]


def engine_factory(
    args: argparse.Namespace, spec: str, loaded: LoadedModel | None
) -> Callable[[], EngineClient]:
    """What builds (unstarted) engines for the model `spec` as the flags ask: a worker process
    (the default), or an engine on a thread of this process over `loaded` (`--worker inline`)."""
    config = from_args(EngineConfig, args)
    limits = from_args(Limits, args)

    def make() -> EngineClient:
        if config.worker == "inline":
            from probserve.engine import AsyncEngine, EngineCore

            assert loaded is not None
            return AsyncEngine(
                EngineCore(loaded, config),
                max_pending=limits.max_queued,
                stall_timeout=limits.engine_stall_timeout,
            )
        return WorkerEngine(
            spec,
            config,
            max_pending=limits.max_queued,
            stall_timeout=limits.engine_stall_timeout,
            log_level=args.log_level,
        )

    return make


def start_model(
    args: argparse.Namespace, spec: str, served_name: str | None, loaded: LoadedModel | None
) -> tuple[ServedModel, Callable[[], EngineClient]]:
    """One model started as the flags ask, with the factory its restarts use.

    A worker engine loads the weights in its own process (converting a GGUF file once:
    models/cache.py); this process then loads the tokenizer alone (or reuses `loaded`'s) and
    learns the model's figures from the worker's Hello. An inline engine runs over `loaded`
    (loaded here if not given)."""
    inline = from_args(EngineConfig, args).worker == "inline"
    if inline and loaded is None:
        loaded = load_model(spec, from_args(EngineConfig, args).weights_to_load())
    source = loaded.source if loaded and loaded.source else resolve_model(spec)
    make = engine_factory(args, source.spec, loaded)
    engine = make()
    try:
        engine.start()
        if loaded is None:  # the worker converted a GGUF file: its directory loads fastest
            assert isinstance(engine, WorkerEngine) and engine.loaded_spec is not None
            converted = resolve_model(engine.loaded_spec)
            source = dataclasses.replace(converted, served_name=source.served_name)
            tokenizer = load_tokenizer(source, engine.tokenizer_class)
            name = source.served_name or source.name_or_path
        else:
            tokenizer, name = loaded.tokenizer, loaded.name
    except BaseException:
        engine.stop()
        raise
    if inline:
        assert loaded is not None
        return ServedModel(served_names(served_name, loaded.name), loaded, engine), make
    info = engine.info  # the model as this process holds it: tokenizer and the worker's figures
    served = LoadedModel(
        model=None,
        tokenizer=tokenizer,
        name=name,
        eos_token_ids=frozenset(info.eos_token_ids),
        context_length=info.context_length,
        vocab_size=info.vocab_size,
        chat_template=getattr(tokenizer, "chat_template", None),
        source=source,
    )
    return ServedModel(served_names(served_name, name), served, engine), make


def served_names(served_name: str | None, own: str) -> tuple[str, ...]:
    """A model answers to its served name (if given) and to its own."""
    return (served_name, own) if served_name and served_name != own else (own,)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The API's settings from the serve flags (every model's server, Ray's ingress too)."""
    return ServerConfig(
        max_logprobs=args.max_logprobs,
        max_top_logprobs=args.max_top_logprobs,
        logprobs_mode=LogprobsMode(args.logprobs_mode),
        api_keys=api_keys(args.api_key, args.api_key_file),
        open_metrics=args.open_metrics,
        limits=from_args(Limits, args),
    )


def build_state(
    args: argparse.Namespace, loaded: LoadedModel | None = None
) -> tuple[ServerState, Supervisor]:
    """Every model started (`loaded`, if given, is the first one), the server's state around
    them and the supervisor that restarts their engines."""
    models: list[ServedModel] = []
    factories: dict[str, Callable[[], EngineClient]] = {}
    try:
        for i, (spec, name) in enumerate(model_flags(args)):
            template = chat_template_flag(args, i)
            model, make = start_model(args, spec, name, loaded if i == 0 else None)
            if template is not None:  # the operator's template, over the model's own or none
                model.loaded = with_chat_template(model.loaded, template)
            models.append(model)
            factories[model.name] = make
        config = server_config(args)
        state = ServerState(models, config)
    except BaseException:
        for m in models:
            m.engine.stop()
        raise
    supervisor = Supervisor(state, lambda m: factories[m.name](), args.worker_restarts)
    return state, supervisor


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGTERM (exit 0), or until the engine dies (exit 1, so a supervisor restarts
    the server: never a live socket in front of a dead engine)."""
    state, supervisor = build_state(args)
    if "torch" in sys.modules and all(isinstance(m.engine, WorkerEngine) for m in state.models):
        # the models run in workers, so this process should not have loaded torch (see
        # probserve.engine); where a library did, its threads must not compete with theirs
        import torch

        torch.set_num_threads(1)
    app = create_app(state)
    names = ", ".join(m.name for m in state.models)
    log.info("serving %s on http://%s:%d/v1", names, args.host, args.port)
    server = DrainingServer(
        uvicorn_config(app, state.config.limits, args.host, args.port),
        args.drain_timeout,
        on_exit=supervisor.stop,
    )

    def every_engine_died(reason: str) -> None:
        log.critical("shutting down: no model can serve (%s)", reason)
        server.should_exit = True

    supervisor.on_gone = every_engine_died
    try:
        server.run()
    finally:
        supervisor.close()
    return 1 if all(m.health()[0] == "dead" for m in state.models) else 0
