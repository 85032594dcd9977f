"""The Ray Serve application: the same FastAPI app as ingress, one deployment of EngineReplicas
per model, routed by PrefixAffinityRouter, and `probserve serve --ray` to run it.

The ingress builds the server's state as `probserve serve` does, with one RayEngine per model
(the model's deployment handle) in place of a worker: every route, limit, error envelope and
logprobs feature is the same code. The ingress loads each model's tokenizer; the replicas load
the weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import signal
import threading
from typing import Any

from probserve.api.state import ServedModel, ServerConfig, ServerState
from probserve.cluster.config import ClusterConfig, ModelDeployment, load_cluster_config
from probserve.cluster.ray_engine import RayEngine
from probserve.cluster.replica import EngineReplica
from probserve.cluster.router import PrefixAffinityRouter
from probserve.engine import EngineConfig
from probserve.flags import from_args
from probserve.models import LoadedModel, load_tokenizer, resolve_model

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """What the ingress needs of one model: its names, its spec and its deployment's handle."""

    names: tuple[str, ...]
    own_name: str
    spec: str
    handle: Any  # a DeploymentHandle of EngineReplica (a bound deployment until deployed)


class Ingress:
    """The ingress deployment: the FastAPI app over a RayEngine per model."""

    async def __init__(self, models: list[ModelEntry], config: ServerConfig, retries: int) -> None:
        from probserve.models.loader import prepared_source

        served = []
        limits = config.limits
        for entry in models:
            info = await entry.handle.info.remote()
            source = prepared_source(entry.spec)  # a GGUF file: its converted directory
            tokenizer = load_tokenizer(source, await entry.handle.tokenizer.remote())
            loaded = LoadedModel(
                model=None,
                tokenizer=tokenizer,
                name=entry.own_name,
                eos_token_ids=frozenset(info.eos_token_ids),
                context_length=info.context_length,
                vocab_size=info.vocab_size,
                chat_template=getattr(tokenizer, "chat_template", None),
                source=source,
            )
            engine = RayEngine(
                entry.handle, info, limits.max_queued, limits.engine_stall_timeout, retries
            )
            served.append(ServedModel(entry.names, loaded, engine))
        self.state = ServerState(served, config)

    def __serve_build_asgi_app__(self) -> Any:
        from probserve.api.app import create_app

        return create_app(self.state)


def deployment_name(index: int, name: str) -> str:
    return f"model-{index}-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", name)[-60:]


def _names(m: ModelDeployment) -> tuple[str, ...]:
    """The model's served name (if given), then its own."""
    own = resolve_model(m.model).served_name or m.model
    return (m.served_model_name, own) if m.served_model_name not in (None, own) else (own,)


def build_app(cluster: ClusterConfig, engine: EngineConfig, server: ServerConfig) -> Any:
    """The Serve application (not yet running)."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    entries = []
    for i, m in enumerate(cluster.models):
        config = dataclasses.replace(engine, **{"worker": "inline", **m.engine})
        if not config.threads:  # the replica's share of the cores, not every core
            config = dataclasses.replace(config, threads=max(1, int(m.num_cpus)))
        options: dict[str, Any] = {
            "name": deployment_name(i, m.served_model_name or m.model),
            "max_ongoing_requests": m.max_ongoing_requests,
            "max_queued_requests": m.max_queued_requests,
            "ray_actor_options": {"num_cpus": m.num_cpus, "resources": m.resources},
            "request_router_config": RequestRouterConfig(
                request_router_class=PrefixAffinityRouter,
                request_router_kwargs={"block_size": config.block_size},
            ),
            "health_check_period_s": 2,
            "graceful_shutdown_timeout_s": 5,
        }
        if m.autoscaling is not None:
            a = m.autoscaling
            options["autoscaling_config"] = AutoscalingConfig(
                min_replicas=a.min_replicas,
                max_replicas=a.max_replicas,
                target_ongoing_requests=a.target_ongoing_requests,
            )
        else:
            options["num_replicas"] = m.num_replicas
        replica = serve.deployment(EngineReplica).options(**options)
        bound = replica.bind(m.model, config, max(m.max_ongoing_requests, server.limits.max_queued))
        names = _names(m)
        entries.append(ModelEntry(names, names[-1], m.model, bound))
    ingress = serve.deployment(serve.ingress()(Ingress)).options(
        name="ingress",
        num_replicas=cluster.ingress.num_replicas,
        max_ongoing_requests=server.limits.max_connections,
        ray_actor_options={
            "num_cpus": cluster.ingress.num_cpus,
            "resources": cluster.ingress.resources,
        },
    )
    return ingress.bind(entries, server, cluster.retries)


def run_cluster(args: argparse.Namespace) -> int:
    """`probserve serve --ray`: deploy the application on a Ray cluster (joined, or started
    here), serve HTTP on --host/--port through Serve's proxy until SIGTERM or Ctrl-C, then take
    the application down."""
    import ray
    from ray import serve

    from probserve.api.server import server_config

    cluster = load_cluster_config(args)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    # after ray.init (its own SIGTERM handler dies at once) and before the deployment (a signal
    # while the replicas load still takes everything down)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = build_app(cluster, from_args(EngineConfig, args), server_config(args))
        serve.run(app, name=cluster.app_name, route_prefix="/")
        names = ", ".join(n for m in cluster.models for n in _names(m)[:1])
        log.info("serving %s on http://%s:%d/v1 (Ray Serve)", names, args.host, args.port)
        stop.wait()
    finally:
        log.info("taking the application down")
        serve.delete(cluster.app_name)
        if cluster.address is None:  # the Ray instance is this process's own: it goes too
            serve.shutdown()
        ray.shutdown()
    return 0
