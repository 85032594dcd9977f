"""`probserve serve`'s settings, parsed once: `ServeSettings` holds every flag's value (the
serve flags, the API's `ServerConfig` with its limits and keys, the engine's `EngineConfig`)
and the models to serve with their served names and chat-template files. `cli` builds it from
the command line; serving.py and cluster/ take it, never an argparse Namespace."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Literal

from probserve.api.edge.connections import HttpParser
from probserve.api.server.config import ServerConfig
from probserve.api.server.limits import HttpLimits, Limits
from probserve.engine import ClientLimits, EngineConfig
from probserve.flags import FlagGroups, add_args, from_args, setting
from probserve.logs import LogFormat
from probserve.models import DEFAULT_MODEL, MODEL_HELP, ModelLoadError

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
    draft_model: tuple[str, ...] = setting(
        (),
        "`--speculative draft`'s draft model for the model of the same position: a smaller "
        "model with the same tokenizer (any --model spec), loaded beside it",
        group="model",
    )
    models_dir: str | None = setting(
        None,
        "a folder of models served on demand, each loaded when a request names it (a .gguf "
        "file by its name less .gguf, a Hugging Face folder by its name); only its listing is "
        "read at start (docs/operations.md, 'Models on demand')",
        metavar="DIR",
        group="model",
    )
    on_demand_model: tuple[str, ...] = setting(
        (),
        "a model served on demand, by its spec (a path, a .gguf file or org/repo[:QUANT]; "
        "the name clients use): loaded when a request names it (repeat for several; in a "
        "--config file, `on-demand-model: [a, b]`)",
        group="model",
    )
    models_max: int = setting(
        0,
        "models on demand loaded at once (0: no bound): loading one more evicts the least "
        "recently used idle one (the --model models are pinned and not counted)",
        metavar="N",
        group="model",
    )
    idle_unload: float = setting(
        0.0,
        "seconds a model on demand stays loaded after its last request (0: until evicted); "
        "a request's keep_alive sets its own",
        metavar="SECONDS",
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


def engine_worker(args: argparse.Namespace) -> str:
    """Where the engines run, as --worker says."""
    return str(from_args(EngineConfig, args).worker)


@dataclass(frozen=True)
class ModelSetting:
    """One model to serve: its --model spec, the name clients use for it (or None: its own)
    and the --chat-template file given for it (or None)."""

    spec: str
    served_name: str | None = None
    chat_template: str | None = None
    draft: str | None = None  # --draft-model's, for --speculative draft


@dataclass(frozen=True)
class ServeSettings:
    """Every setting of `probserve serve`, parsed once (`of`)."""

    flags: ServeFlags
    server: ServerConfig  # with its limits, HTTP limits, client limits and API keys
    engine: EngineConfig
    models: tuple[ModelSetting, ...]

    @classmethod
    def of(cls, args: argparse.Namespace) -> ServeSettings:
        """From the parsed command line (`probserve serve MODEL`, then each `--model`; the
        embedded model when none is given and none is served on demand, paired in order with
        `--served-model-name` and `--chat-template`; more of either than models is a
        ModelLoadError)."""
        flags = from_args(ServeFlags, args)
        first = (args.model_tag,) if getattr(args, "model_tag", None) else ()
        lazy = bool(flags.models_dir or flags.on_demand_model)
        specs = (*first, *flags.model) or (() if lazy else (DEFAULT_MODEL,))
        if lazy and (flags.ray or engine_worker(args) == "inline"):
            raise ModelLoadError(
                "models on demand (--models-dir, --on-demand-model) run in engine worker "
                "processes: not with --ray or --worker inline"
            )
        if flags.models_max < 0 or not 0 <= flags.idle_unload < float("inf"):
            raise ModelLoadError("--models-max and --idle-unload take a number >= 0")
        names, templates = flags.served_model_name, flags.chat_template
        drafts, engine = flags.draft_model, from_args(EngineConfig, args)
        for given, what in (
            (names, "--served-model-name"), (templates, "--chat-template"),
            (drafts, "--draft-model"),
        ):  # fmt: skip
            if len(given) > len(specs):
                raise ModelLoadError(f"{len(given)} {what} flags for {len(specs)} models")
        if (engine.speculative == "draft") != (bool(specs) and len(drafts) == len(specs)) or (
            drafts and engine.speculative != "draft"
        ):
            raise ModelLoadError(
                f"--speculative draft takes one --draft-model per model ({len(specs)}); "
                f"got {len(drafts)} with --speculative {engine.speculative}"
            )
        models = tuple(
            ModelSetting(
                spec,
                names[i] if i < len(names) else None,
                templates[i] if i < len(templates) else None,
                drafts[i] if i < len(drafts) else None,
            )
            for i, spec in enumerate(specs)
        )
        server = from_args(
            ServerConfig,
            args,
            api_keys=api_keys(flags.api_key, flags.api_key_file),
            limits=from_args(Limits, args),
            http=from_args(HttpLimits, args),
            client=from_args(ClientLimits, args),
        )
        return cls(flags, server, engine, models)
