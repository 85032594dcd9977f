"""The composition root of `probserve serve`: its settings (settings.py: `ServeSettings`,
parsed once by cli) become started engines (a worker process per model by default), the
server's state and supervisor, the app and its HTTP server. The local path and Ray's ingress
(cluster/) both build from here: one model record (`ServedModel`), one naming rule
(`served_names`). The models served on demand (`--models-dir`, `--on-demand-model`) are
started and stopped later by api/server/on_demand.py, with the callables built here
(`on_demand`)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from probserve.api.app import create_app
from probserve.api.edge.loading import LoadingApp
from probserve.api.edge.server import DrainingServer, listening_socket, uvicorn_config
from probserve.api.server.on_demand import OnDemand
from probserve.api.server.served import ServedModel
from probserve.api.server.state import ServerState
from probserve.api.server.supervisor import Supervisor
from probserve.engine import EngineClient, EngineInfo, WorkerEngine
from probserve.models import (
    LoadedModel,
    ModelLoadError,
    ModelRecord,
    ModelSource,
    load_model,
    load_tokenizer,
    resolve_model,
)
from probserve.models.generation_config import sampling_defaults
from probserve.models.models_dir import models_in_dir
from probserve.settings import ModelSetting, ServeSettings

log = logging.getLogger(__name__)

M = TypeVar("M", LoadedModel, ModelRecord)


def chat_template_text(path: str) -> str:
    """The text of a `--chat-template` file; a missing file or a template Jinja cannot compile
    is a ModelLoadError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read the chat template {path}: {exc}") from exc
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:  # compiled as the tokenizer will (its sandbox, extensions and filters)
        _compile_jinja_template(text)
    except TemplateError as exc:
        raise ModelLoadError(f"the chat template {path} is not valid Jinja: {exc}") from exc
    return text


def with_chat_template(loaded: M, template: str) -> M:
    """`loaded` (a `LoadedModel` or a `ModelRecord`) rendering chats with `template`: its
    tokenizer is copied (the one given may be shared: an inline engine's model, or a caller's),
    the copy given the template."""
    tokenizer = copy.copy(loaded.tokenizer)
    tokenizer.chat_template = template
    return dataclasses.replace(loaded, tokenizer=tokenizer, chat_template=template)


def engine_factory(
    settings: ServeSettings,
    spec: str,
    loaded: LoadedModel | None,
    draft: str | None = None,
) -> Callable[[], EngineClient]:
    """What builds (unstarted) engines for the model `spec` (with `draft`, its draft model
    where `--speculative draft`) as the settings ask: a worker process (the default), or an
    engine on a thread of this process over `loaded` (`--worker inline`; the draft model
    loaded here once)."""
    config, limits = settings.engine, settings.server.client
    log_level, log_format = settings.flags.log_level, settings.flags.log_format
    inline = config.worker == "inline"
    inline_draft = load_model(draft, config.weights_to_load()) if inline and draft else None

    def make() -> EngineClient:
        if inline:
            from probserve.engine import AsyncEngine  # torch, in this process: inline only

            assert loaded is not None
            return AsyncEngine.over(loaded, config, limits, inline_draft)
        return WorkerEngine(
            spec,
            config,
            draft=draft,
            max_pending=limits.max_queued,
            stall_timeout=limits.engine_stall_timeout,
            log_level=log_level,
            log_format=log_format,
        )

    return make


def served_record(
    info: EngineInfo, tokenizer: Any, name: str, source: ModelSource | None
) -> ModelRecord:
    """The model as the API process holds it when its engine runs elsewhere (a worker, a Ray
    replica): the tokenizer, and the engine's figures from its `info`."""
    return ModelRecord(
        tokenizer=tokenizer,
        name=name,
        eos_token_ids=frozenset(info.eos_token_ids),
        context_length=info.context_length,
        vocab_size=info.vocab_size,
        chat_template=getattr(tokenizer, "chat_template", None),
        source=source,
    )


def start_model(
    settings: ServeSettings, asked: ModelSetting, loaded: LoadedModel | None
) -> tuple[ServedModel, Callable[[], EngineClient]]:
    """One model started as the flags ask, with the factory its restarts use.

    A worker engine loads the weights in its own process (converting a GGUF file once:
    models/cache.py); this process then loads the tokenizer alone (or reuses `loaded`'s) and
    learns the model's figures from the worker's Hello. An inline engine runs over `loaded`
    (loaded here if not given)."""
    spec, served_name = asked.spec, asked.served_name
    inline = settings.engine.worker == "inline"
    if inline and loaded is None:
        loaded = load_model(spec, settings.engine.weights_to_load())
    source = loaded.source if loaded and loaded.source else resolve_model(spec)
    make = engine_factory(settings, source.spec, loaded, asked.draft)
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
    choice = settings.server.generation_config
    defaults = sampling_defaults(source, choice)
    if inline:
        assert loaded is not None
        names = served_names(served_name, loaded.name)
        return ServedModel(names, ModelRecord.of(loaded), engine, defaults), make
    served = served_record(engine.info, tokenizer, name, source)
    return ServedModel(served_names(served_name, name), served, engine, defaults), make


def served_names(served_name: str | None, own: str) -> tuple[str, ...]:
    """A model answers to its served name (if given) and to its own."""
    return (served_name, own) if served_name and served_name != own else (own,)


def on_demand_specs(settings: ServeSettings) -> dict[str, str]:
    """{name: spec} of the models served on demand: each of --models-dir's by its name
    (models/models_dir.py), each --on-demand-model by its spec. Nothing is read but the
    directory's listing."""
    flags = settings.flags
    specs = models_in_dir(flags.models_dir) if flags.models_dir else {}
    specs.update({spec: spec for spec in flags.on_demand_model})
    return specs


def on_demand(
    settings: ServeSettings,
    factories: dict[str, Callable[[], EngineClient]],
    supervisor: Callable[[], Supervisor],
) -> OnDemand | None:
    """The models served on demand, each started as a pinned model is (`start_model`: its
    worker, the restarts' factory in `factories`, watched by the `supervisor`) and stopped
    again; None where there are none."""
    specs = on_demand_specs(settings)
    if not specs:
        return None

    def load(name: str, spec: str) -> ServedModel:
        model, make = start_model(settings, ModelSetting(spec, served_name=name), None)
        model.names = (name,)  # its own name may be another model's
        factories[name] = make
        supervisor().adopt(model)
        return model

    def unload(model: ServedModel) -> None:
        supervisor().forget(model)
        model.engine.stop()

    flags = settings.flags
    return OnDemand(specs, load, unload, flags.models_max, flags.idle_unload)


def build_state(
    settings: ServeSettings, loaded: LoadedModel | None = None
) -> tuple[ServerState, Supervisor]:
    """Every pinned model started (`loaded`, if given, is the first one), the models on demand
    listed, the server's state around them and the supervisor that restarts their engines."""
    models: list[ServedModel] = []
    factories: dict[str, Callable[[], EngineClient]] = {}
    supervisors: list[Supervisor] = []
    try:
        for i, asked in enumerate(settings.models):
            template = chat_template_text(asked.chat_template) if asked.chat_template else None
            first = loaded if i == 0 else None
            model, make = start_model(settings, asked, first)
            if template is not None:  # the operator's template, over the model's own or none
                model.record = with_chat_template(model.record, template)
            models.append(model)
            factories[model.name] = make
        lazy = on_demand(settings, factories, lambda: supervisors[0])
        state = ServerState(models, settings.server, lazy)
    except BaseException:
        for m in models:
            m.engine.stop()
        raise
    restarts = settings.flags.worker_restarts
    supervisor = Supervisor(state, lambda m: factories[m.name](), restarts)
    supervisors.append(supervisor)
    return state, supervisor


class Loader:
    """The models loaded on a thread of their own while the server already answers (`/health`
    503 "loading": api/edge/loading.py), then the app put in. The thread lives until `close()`: a
    worker process is killed by the kernel when the thread that started it ends
    (PR_SET_PDEATHSIG), so it must outlive the server's drain."""

    def __init__(self, settings: ServeSettings, front: LoadingApp) -> None:
        self.settings, self.front = settings, front
        self.state: ServerState | None = None
        self.supervisor: Supervisor | None = None
        self.error: BaseException | None = None
        self.on_done: Callable[[], None] = lambda: None  # told when the load ends, either way
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="probserve-load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            state, supervisor = build_state(self.settings)
        except BaseException as exc:  # the command's error, raised again once the server stops
            self.error = exc
            self.on_done()
            return
        self.state, self.supervisor = state, supervisor
        if "torch" in sys.modules and all(isinstance(m.engine, WorkerEngine) for m in state.models):
            # the models run in workers, so this process should not have loaded torch (see
            # probserve.engine); where a library did, its threads must not compete with theirs
            import torch

            torch.set_num_threads(1)
        self.front.ready(create_app(state))
        self.on_done()
        self._closed.wait()

    def shutting_down(self) -> None:
        """The server begins to shut down: an engine's exit from now on is no crash."""
        if self.supervisor is not None:
            self.supervisor.stop()

    def close(self) -> None:
        """The engines stopped, then the supervisor and the thread ended."""
        if self.state is not None:
            for m in self.state.models:
                m.engine.stop()
        if self.supervisor is not None:
            self.supervisor.close()
        if self.state is not None and self.state.on_demand is not None:
            self.state.on_demand.close()
        self._closed.set()


def run_server(settings: ServeSettings) -> int:
    """Serve until SIGTERM (exit 0), or until the engine dies (exit 1, so a supervisor restarts
    the server: never a live socket in front of a dead engine). The port is served from the
    start, `/health` saying "loading" until every model has loaded; a load that fails stops
    the server and raises its error."""
    flags, http = settings.flags, settings.server.http
    sock = listening_socket(flags.host, flags.port)  # before the load: a busy port fails now
    front = LoadingApp()
    scheme = "https" if flags.ssl_certfile else "http"
    base = f"{scheme}://{flags.host}:{flags.port}"
    config = uvicorn_config(
        front,
        http,
        flags.host,
        flags.port,
        flags.ssl_keyfile,
        flags.ssl_certfile,
        flags.http_parser,
    )
    loader = Loader(settings, front)
    server = DrainingServer(config, http.drain_timeout, loader.shutting_down)

    def loaded() -> None:
        if loader.error is not None or loader.state is None:
            server.should_exit = True
            return
        state, supervisor = loader.state, loader.supervisor
        assert supervisor is not None
        lazy = list(state.on_demand.entries) if state.on_demand is not None else []
        names = ", ".join([m.name for m in state.models] + [f"{n} (on demand)" for n in lazy])
        log.info("serving %s on %s/v1 (playground: %s/playground)", names, base, base)

        def every_engine_died(reason: str) -> None:
            log.critical("shutting down: no model can serve (%s)", reason)
            server.should_exit = True

        supervisor.on_gone = every_engine_died

    loader.on_done = loaded
    log.info("listening on %s (/health says loading until the models are ready)", base)
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        loader.close()
        sock.close()
    if loader.error is not None:
        raise loader.error
    if loader.state is None:
        log.warning("stopped while the models were loading")
        return 0
    pinned = loader.state.pinned
    return 1 if pinned and all(m.health()[0] == "dead" for m in pinned) else 0
