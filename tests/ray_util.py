"""A local Ray cluster for the tests: a head node started by this process (`ray.init`) and a
second node on this machine (`ray start --block`, stopped by its PID, never `ray stop`), each
with one `engine` resource so that a two-replica deployment puts one replica on each. Token
authentication stays on, with a token made for the run (conftest.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

OBJECT_STORE = 150 * 2**20  # two nodes share this host's /dev/shm


@contextmanager
def ray_cluster() -> Iterator[None]:
    import ray

    assert os.environ.get("RAY_AUTH_MODE") == "token"  # set by conftest.py before Ray loads
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: socket paths have a limit
    ray.init(
        num_cpus=3,
        resources={"engine": 1},
        include_dashboard=False,
        object_store_memory=OBJECT_STORE,
        _temp_dir=temp,
        log_to_driver=False,
    )
    address = ray.get_runtime_context().gcs_address
    ray_cli = str(Path(sys.executable).parent / "ray")
    node = subprocess.Popen(
        [ray_cli, "start", "--address", address, "--num-cpus", "2",
         "--resources", '{"engine": 1}', "--object-store-memory", str(OBJECT_STORE), "--block"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while sum(n["Alive"] for n in ray.nodes()) < 2:
            assert time.monotonic() < deadline and node.poll() is None, "the second node"
            time.sleep(0.5)
        yield
    finally:
        from ray import serve

        serve.shutdown()
        os.killpg(node.pid, 15)
        try:
            node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, 9)
            node.wait()
        ray.shutdown()
        if not os.environ.get("PROBSERVE_KEEP_RAY_LOGS"):
            shutil.rmtree(temp, ignore_errors=True)


@contextmanager
def running_app(config: dict[str, Any], *flags: str) -> Iterator[str]:
    """The probserve Serve application for `config` (a cluster configuration) with the serve
    `flags`, on a free loopback port: yields its base URL."""
    from ray import serve
    from server_util import free_port, serve_settings

    from probserve.cluster.app import build_app
    from probserve.cluster.config import ClusterConfig

    settings = serve_settings("--ray", *flags)
    cluster = ClusterConfig.model_validate(config)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app(cluster, settings.engine, settings.server)
    serve.run(app, name=cluster.app_name, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.delete(cluster.app_name)


def replicas(app: str, deployment: str) -> list[dict[str, Any]]:
    """What each running replica of `deployment` says of itself (EngineReplica.describe)."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app)
    found = handle.broadcast("describe").results(timeout_s=30, return_exceptions=True)
    return [r for r in found if isinstance(r, dict)]
