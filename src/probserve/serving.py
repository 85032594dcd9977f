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
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from probserve.api.app import create_app
from probserve.api.connections import HttpParser
from probserve.api.http_server import DrainingServer, listening_socket, uvicorn_config
from probserve.api.limits import HttpLimits, Limits
from probserve.api.loading import LoadingApp
from probserve.api.state import ServedModel, ServerConfig, ServerState
from probserve.api.supervisor import Supervisor
from probserve.engine import (
    ClientLimits,
    EngineClient,
    EngineConfig,
    EngineInfo,
    WorkerEngine,
)
from probserve.flags import FlagGroups, add_args, from_args, setting
from probserve.logs import LogFormat
from probserve.models import (
    DEFAULT_MODEL,
    MODEL_HELP,
    LoadedModel,
    ModelLoadError,
    ModelSource,
    load_model,
    load_tokenizer,
    resolve_model,
)
from probserve.models.generation_config import sampling_defaults

log = logging.getLogger(__name__)

API_KEY_ENV = "PROBSERVE_API_KEY"


@dataclass(frozen=True)
class ServeFlags:
    """`probserve serve`'s own flags: what to serve, where, and (`ray`...) on what. The rest
    are the API's (ServerConfig and its limits), the engine clients' and the engine's."""

    model: tuple[str, ...] = setting(
        (),
        f"a model to serve (repeat for several, each in its own engine worker; or give the "
        f"first as `probserve serve MODEL`): {MODEL_HELP}",
        group="model",
    )
    served_model_name: tuple[str, ...] = setting(
        (),
        "the name clients use for the model of the same position (it also answers to its own)",
        group="model",
    )
    chat_template: tuple[str, ...] = setting(
        (),
        "a Jinja chat template file for the model of the same position (for a model file that "
        "ships none, or to replace its own); clients can never send one",
        metavar="FILE",
        group="model",
    )
    worker_restarts: int = setting(
        3,
        "restarts of a model's dead engine worker in any 10 minutes before it is given up (the "
        "server exits non-zero once no model can serve)",
        group="server",
    )
    host: str = setting("127.0.0.1", "the address to listen on", group="server")
    port: int = setting(8000, "the port to listen on", group="server")
    api_key: str | None = setting(
        None,
        "require `Authorization: Bearer KEY` (comma-separated; or set PROBSERVE_API_KEY)",
        group="server",
    )
    api_key_file: str | None = setting(
        None, "a file with one API key per line", metavar="FILE", group="server"
    )
    ssl_keyfile: str | None = setting(
        None,
        "serve HTTPS with this private key (PEM; with --ssl-certfile)",
        metavar="FILE",
        group="server",
    )
    ssl_certfile: str | None = setting(
        None,
        "serve HTTPS with this certificate chain (PEM; with --ssl-keyfile)",
        metavar="FILE",
        group="server",
    )
    http_parser: HttpParser = setting(
        "auto",
        "the HTTP/1.1 parser: httptools (C) where it is installed, else h11 (pure Python); "
        "either has the header deadline (--header-timeout)",
        group="server",
    )
    log_level: Literal["debug", "info", "warning", "error", "critical"] = setting(
        "info", "the server's and its workers' log level", group="server"
    )
    log_format: LogFormat = setting(
        "text",
        "log lines as text, or as one JSON object a line (the access line's method, route, "
        "status, model, tokens, latency and request id as fields)",
        group="server",
    )
    config: str | None = setting(
        None,
        "a YAML file of these flags (each key a flag's name, `max-num-seqs: 8`, `model: [a, "
        "b]`); PROBSERVE_<FLAG> variables override it, the command line overrides both",
        metavar="FILE",
        group="server",
    )
    ray: bool = setting(
        False,
        "serve on a Ray Serve cluster: replicas of each model's engine, prefix-aware routing, "
        "failover (pip install 'probserve[ray]'; docs/scale-out.md)",
        group="Ray",
    )
    cluster_config: str | None = setting(
        None, "--ray: the cluster configuration file", metavar="FILE", group="Ray"
    )
    replicas: int = setting(1, "--ray without --cluster-config: replicas per model", group="Ray")
    ray_address: str | None = setting(
        None, "--ray: the Ray cluster to join (default: start one)", group="Ray"
    )


# every setting of `probserve serve`, each class's fields its flags (probserve.flags)
SERVE_SETTINGS: tuple[type, ...] = (
    ServeFlags, ServerConfig, Limits, HttpLimits, ClientLimits, EngineConfig,
)  # fmt: skip


# each settings class's heading in --help (a field's own `group` wins)
SERVE_GROUPS = {ServerConfig: "logprobs", Limits: "limits", HttpLimits: "limits",
                ClientLimits: "limits", EngineConfig: "engine"}  # fmt: skip


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    groups = FlagGroups(parser)
    groups("model").add_argument(
        "model_tag", nargs="?", metavar="MODEL", help="the (first) model to serve: as --model"
    )
    for cls in SERVE_SETTINGS:
        add_args(parser, cls, SERVE_GROUPS.get(cls), groups)


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
    files = from_args(ServeFlags, args).chat_template
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
    """(model spec, served name or None) for each model (`probserve serve MODEL`, then each
    `--model`; the embedded model when none is given), paired in order with the
    `--served-model-name` flags."""
    flags = from_args(ServeFlags, args)
    first = (args.model_tag,) if getattr(args, "model_tag", None) else ()
    specs = (*first, *flags.model) or (DEFAULT_MODEL,)
    names = flags.served_model_name
    if len(names) > len(specs):
        raise ModelLoadError(f"{len(names)} --served-model-name flags for {len(specs)} models")
    return [(spec, names[i] if i < len(names) else None) for i, spec in enumerate(specs)]


def engine_factory(
    args: argparse.Namespace, spec: str, loaded: LoadedModel | None
) -> Callable[[], EngineClient]:
    """What builds (unstarted) engines for the model `spec` as the flags ask: a worker process
    (the default), or an engine on a thread of this process over `loaded` (`--worker inline`)."""
    config = from_args(EngineConfig, args)
    limits = from_args(ClientLimits, args)
    flags = from_args(ServeFlags, args)
    log_level, log_format = flags.log_level, flags.log_format

    def make() -> EngineClient:
        if config.worker == "inline":
            from probserve.engine import AsyncEngine  # torch, in this process: inline only

            assert loaded is not None
            return AsyncEngine.over(loaded, config, limits)
        return WorkerEngine(
            spec,
            config,
            max_pending=limits.max_queued,
            stall_timeout=limits.engine_stall_timeout,
            log_level=log_level,
            log_format=log_format,
        )

    return make


def served_record(
    info: EngineInfo, tokenizer: Any, name: str, source: ModelSource | None
) -> LoadedModel:
    """The model as the API process holds it when its engine runs elsewhere (a worker, a Ray
    replica): the tokenizer, and the engine's figures from its `info`; no weights."""
    return LoadedModel(
        model=None,
        tokenizer=tokenizer,
        name=name,
        eos_token_ids=frozenset(info.eos_token_ids),
        context_length=info.context_length,
        vocab_size=info.vocab_size,
        chat_template=getattr(tokenizer, "chat_template", None),
        source=source,
    )


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
    choice = from_args(ServerConfig, args).generation_config
    defaults = sampling_defaults(source, choice)
    if inline:
        assert loaded is not None
        names = served_names(served_name, loaded.name)
        return ServedModel(names, loaded, engine, defaults), make
    served = served_record(engine.info, tokenizer, name, source)
    return ServedModel(served_names(served_name, name), served, engine, defaults), make


def served_names(served_name: str | None, own: str) -> tuple[str, ...]:
    """A model answers to its served name (if given) and to its own."""
    return (served_name, own) if served_name and served_name != own else (own,)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The API's settings from the serve flags (every model's server, Ray's ingress too)."""
    flags = from_args(ServeFlags, args)
    return from_args(
        ServerConfig,
        args,
        api_keys=api_keys(flags.api_key, flags.api_key_file),
        limits=from_args(Limits, args),
        http=from_args(HttpLimits, args),
        client=from_args(ClientLimits, args),
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
    restarts = from_args(ServeFlags, args).worker_restarts
    supervisor = Supervisor(state, lambda m: factories[m.name](), restarts)
    return state, supervisor


class Loader:
    """The models loaded on a thread of their own while the server already answers (`/health`
    503 "loading": api/loading.py), then the app put in. The thread lives until `close()`: a
    worker process is killed by the kernel when the thread that started it ends
    (PR_SET_PDEATHSIG), so it must outlive the server's drain."""

    def __init__(self, args: argparse.Namespace, front: LoadingApp) -> None:
        self.args, self.front = args, front
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
            state, supervisor = build_state(self.args)
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
        self._closed.set()


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGTERM (exit 0), or until the engine dies (exit 1, so a supervisor restarts
    the server: never a live socket in front of a dead engine). The port is served from the
    start, `/health` saying "loading" until every model has loaded; a load that fails stops
    the server and raises its error."""
    flags = from_args(ServeFlags, args)
    http = from_args(HttpLimits, args)
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
    loader = Loader(args, front)
    server = DrainingServer(config, http.drain_timeout, loader.shutting_down)

    def loaded() -> None:
        if loader.error is not None or loader.state is None:
            server.should_exit = True
            return
        state, supervisor = loader.state, loader.supervisor
        assert supervisor is not None
        names = ", ".join(m.name for m in state.models)
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
    return 1 if all(m.health()[0] == "dead" for m in loader.state.models) else 0
