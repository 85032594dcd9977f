"""The Ray Serve application: the same FastAPI app as ingress, one deployment of EngineReplicas
per model, routed by PrefixAffinityRouter, and `probserve serve --ray` to run it.

The ingress builds the server's state as `probserve serve` does, with one RayEngine per model
(the model's deployment handle) in place of a worker: every route, limit, error envelope and
logprobs feature is the same code. The ingress loads each model's tokenizer; the replicas load
the weights.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from probserve.api.server.config import ServerConfig
from probserve.api.server.served import ServedModel
from probserve.api.server.state import ServerState
from probserve.cluster.config import ClusterConfig, ModelDeployment, load_cluster_config
from probserve.cluster.ray_engine import RayEngine
from probserve.cluster.replica import EngineReplica
from probserve.cluster.router import PrefixAffinityRouter
from probserve.engine import EngineConfig
from probserve.models import load_tokenizer, resolve_model
from probserve.models.hub import HubName
from probserve.serving import served_names, served_record
from probserve.settings import ServeSettings

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

    # Ray Serve awaits an async constructor, which Python's typing does not allow
    async def __init__(  # type: ignore[misc]
        self, models: list[ModelEntry], config: ServerConfig, retries: int
    ) -> None:
        from probserve.models.generation_config import sampling_defaults
        from probserve.models.loader import prepared_source

        served = []
        limits = config.client
        for entry in models:
            info = await entry.handle.info.remote()
            source = prepared_source(entry.spec)  # a GGUF file: its converted directory
            tokenizer = load_tokenizer(source, await entry.handle.tokenizer.remote())
            loaded = served_record(info, tokenizer, entry.own_name, source)
            engine = RayEngine(
                entry.handle, info, limits.max_queued, limits.engine_stall_timeout, retries
            )
            defaults = sampling_defaults(source, config.generation_config)
            served.append(ServedModel(entry.names, loaded, engine, defaults))
        self.state = ServerState(served, config)

    def __serve_build_asgi_app__(self) -> Any:
        from probserve.api.app import create_app

        return create_app(self.state)


def deployment_name(index: int, name: str) -> str:
    return f"model-{index}-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", name)[-60:]


def _names(m: ModelDeployment) -> tuple[str, ...]:
    """The model's served name (if given), then its own: serving.served_names. A model on the
    hub by name is named so, without pulling it here (each replica pulls it)."""
    hub = HubName.parse(m.model) if m.model else None
    own = str(hub) if hub is not None else resolve_model(m.model).served_name or m.model
    return served_names(m.served_model_name, own)


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
            # ray annotates each keyword of RequestRouterConfig as a dict
            "request_router_config": RequestRouterConfig(
                request_router_class=PrefixAffinityRouter,  # type: ignore[arg-type]
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
        # serve.deployment(cls) is a Deployment; ray types it as the decorator factory
        replica = serve.deployment(EngineReplica).options(**options)  # type: ignore[attr-defined]
        most = max(m.max_ongoing_requests, server.client.max_queued)
        bound = replica.bind(m.model, config, most, m.draft_model)
        names = _names(m)
        entries.append(ModelEntry(names, names[-1], m.model, bound))
    ingress = serve.deployment(serve.ingress()(Ingress)).options(  # type: ignore[attr-defined]
        name="ingress",
        num_replicas=cluster.ingress.num_replicas,
        max_ongoing_requests=server.http.max_connections,
        ray_actor_options={
            "num_cpus": cluster.ingress.num_cpus,
            "resources": cluster.ingress.resources,
        },
    )
    return ingress.bind(entries, server, cluster.retries)


def cpus_asked(cluster: ClusterConfig) -> tuple[float, str]:
    """The CPUs the deployments hold once started (autoscaled ones at their minimum), and how
    they add up."""
    total, parts = 0.0, []
    for m in cluster.models:
        n = m.autoscaling.min_replicas if m.autoscaling is not None else m.num_replicas
        total += n * m.num_cpus
        parts.append(f"{n} x {m.num_cpus:g} ({m.served_model_name or m.model})")
    ingress = cluster.ingress
    total += ingress.num_replicas * ingress.num_cpus
    parts.append(f"{ingress.num_replicas} x {ingress.num_cpus:g} (ingress)")
    return total, " + ".join(parts)


def misfit(cluster: ClusterConfig, cpus: float) -> str | None:
    """Why the deployments can never all be scheduled on a cluster of `cpus` CPUs (Ray would
    wait forever, the ingress last), or None."""
    asked, how = cpus_asked(cluster)
    if asked <= cpus + 1e-6:
        return None
    return (
        f"the deployments ask for {asked:g} CPUs ({how}) and the Ray cluster has {cpus:g}: "
        "lower --replicas, or num_cpus in --cluster-config, or add nodes"
    )


def fit_to(cluster: ClusterConfig, cpus: float) -> ClusterConfig:
    """The flags' deployments (no --cluster-config) on a cluster too small for 1 CPU a replica: the
    replicas share what the ingress leaves, evenly (a 2-core machine: 0.95 each for 2)."""
    replicas = sum(m.num_replicas for m in cluster.models)
    share = (cpus - cluster.ingress.num_replicas * cluster.ingress.num_cpus) / replicas
    if misfit(cluster, cpus) is None or share <= 0:
        return cluster
    share = int(share * 1000) / 1000  # Ray counts CPUs in units of 1e-4: stay below the total
    log.info("%d replicas on %g CPUs: %g CPU each", replicas, cpus, share)
    models = [m.model_copy(update={"num_cpus": share}) for m in cluster.models]
    return cluster.model_copy(update={"models": models})


def _not_running(name: str) -> str:
    """What Serve says of the application `name` and its deployments (why it is not running)."""
    from ray import serve

    try:
        app = serve.status().applications.get(name)
    except Exception as exc:  # the controller itself may be what is wrong
        return f"no status ({type(exc).__name__}: {exc})"
    if app is None:
        return "not deployed"
    said = [f"{d}: {s.status} {s.message}".strip() for d, s in app.deployments.items()]
    return "; ".join([f"{app.status} {app.message}".strip(), *said])


def _deploy(app: Any, cluster: ClusterConfig, stop: threading.Event) -> str | None:
    """Deploy without waiting (`serve.run` waits, however long, for the application to be
    running, deaf to signals), then watch its status here: None once it runs; else why not
    ("" when a signal came first)."""
    from ray import serve

    # serve.run's own body, less its wait (Ray 2.x: `_run` is what `run` calls)
    serve._run(app, _blocking=False, name=cluster.app_name, route_prefix="/")
    limit = cluster.start_timeout
    deadline = time.monotonic() + limit if limit > 0 else None
    while not stop.wait(0.5):
        status = serve.status().applications.get(cluster.app_name)
        state = str(getattr(status, "status", ""))
        if state.endswith("RUNNING"):
            return None
        if state.endswith(("DEPLOY_FAILED", "UNHEALTHY")):
            return f"the deployment failed: {_not_running(cluster.app_name)}"
        if deadline is not None and time.monotonic() > deadline:
            status_text = _not_running(cluster.app_name)
            return f"the application was not running after {limit:g} s: {status_text}"
    return ""


def run_cluster(settings: ServeSettings) -> int:
    """`probserve serve --ray`: deploy the application on a Ray cluster (joined, or started
    here), serve HTTP on --host/--port through Serve's proxy until SIGTERM or Ctrl-C, then take
    the application down."""
    import ray
    from ray import serve

    flags = settings.flags
    cluster = load_cluster_config(settings)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    cpus = float(ray.cluster_resources().get("CPU", 0.0))
    # the flags' deployments: the replicas share the cores if they must
    if not flags.cluster_config:
        cluster = fit_to(cluster, cpus)
    problem = misfit(cluster, cpus)
    if problem is not None and cluster.address is not None:
        # a joined cluster may grow (an autoscaler adds nodes): said, and left to start_timeout
        log.warning("%s (the cluster may grow; waiting up to start_timeout)", problem)
    elif problem is not None:
        log.error("%s", problem)
        ray.shutdown()
        return 2
    # after ray.init (its own SIGTERM handler dies at once) and before the deployment (a signal
    # while the replicas load still takes everything down)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": flags.host, "port": flags.port})
        app = build_app(cluster, settings.engine, settings.server)
        asked, how = cpus_asked(cluster)
        log.info("deploying on Ray Serve: %g of %g CPUs (%s)", asked, cpus, how)
        why = _deploy(app, cluster, stop)
        if why:
            log.error("%s", why)
            return 1
        if why == "":  # a signal while starting
            return 0
        names = ", ".join(n for m in cluster.models for n in _names(m)[:1])
        log.info("serving %s on http://%s:%d/v1 (Ray Serve)", names, flags.host, flags.port)
        stop.wait()
    finally:
        log.info("taking the application down")
        # bounded: a SIGTERM to the whole process group (systemctl stop) has also stopped the
        # Ray instance this process started, and Serve's calls would wait a minute for it
        if not _within(TEARDOWN_S, lambda: serve.delete(cluster.app_name)):
            log.warning("Ray Serve did not answer within %g s: leaving without it", TEARDOWN_S)
        elif cluster.address is None:  # the Ray instance is this process's own: it goes too
            _within(TEARDOWN_S, serve.shutdown)
        ray.shutdown()
    return 0


TEARDOWN_S = 20.0  # seconds each step of taking the application down may take


def _within(seconds: float, step: Callable[[], object]) -> bool:
    """Run `step` on a thread; whether it ended within `seconds`."""
    thread = threading.Thread(target=step, name="serve-teardown", daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()
