"""probserve on Ray Serve: a local two-node cluster, the same API through the Serve ingress,
several models, prefix-aware routing, backpressure and failover when a replica is killed."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from probserve.cluster.app import deployment_name

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray", reason="Ray is optional: pip install 'probserve[ray]'")

APP = "probserve"


@pytest.fixture(scope="module")
def app(tiny_dir: Path) -> Iterator[str]:
    """One application: the embedded model twice (two replicas pinned one per node, and one
    replica alone, to compare prefix-cache hit rates) and a tiny model with a queue of one."""
    from ray_util import ray_cluster, running_app

    if os.environ.get("PROBSERVE_TEST_SERVER") == "ray":
        pytest.skip("the session's own cluster is up: this module starts its own")
    config = {
        "models": [
            {"served_model_name": "smol", "num_replicas": 2, "num_cpus": 0.5,
             "resources": {"engine": 1}},
            {"served_model_name": "smol-single", "num_cpus": 0.3},
            {"model": str(tiny_dir), "served_model_name": "tiny", "num_cpus": 0.2,
             "max_ongoing_requests": 1, "max_queued_requests": 1},
        ],
        "ingress": {"num_cpus": 0.1},
    }  # fmt: skip
    with ray_cluster(), running_app(config, "--kv-cache-gib", "0.1") as url:
        yield url


def _post(url: str, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=timeout)


def test_probserve_serve_ray_runs_and_stops(tmp_path: Path):
    """The command as a user runs it: it starts a Ray instance of its own, serves, and takes
    everything down on SIGTERM (first in this module: before the module's cluster is up)."""
    import subprocess
    import sys

    from server_util import free_port

    config = tmp_path / "cluster.yaml"
    config.write_text(
        "models:\n  - model: smollm2-135m-instruct\n    served_model_name: smol\n"
        "    num_replicas: 1\n    num_cpus: 0.5\n    engine: {kv_cache_gib: 0.1}\n"
    )
    port = free_port()
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: socket paths have a limit
    env = {**os.environ, "RAY_TMPDIR": ray_tmp}
    log = (tmp_path / "serve.log").open("wb")
    cmd = [sys.executable, "-m", "probserve.cli", "serve", "--ray", "--cluster-config", str(config)]
    proc = subprocess.Popen([*cmd, "--port", str(port)], env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        r = _post(url, "/v1/completions", {"model": "smol", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "smol", r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _serve_ray(tmp_path: Path, config_text: str | None, *extra: str):  # type: ignore[no-untyped-def]
    """`probserve serve --ray` started as a user starts it (a Ray instance of its own)."""
    import subprocess
    import sys

    from server_util import free_port

    cmd = [sys.executable, "-m", "probserve.cli", "serve", "--ray", "--port", str(free_port())]
    if config_text is not None:
        config = tmp_path / "cluster.yaml"
        config.write_text(config_text)
        cmd += ["--cluster-config", str(config)]
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*cmd, *extra], env={**os.environ, "RAY_TMPDIR": ray_tmp}, stdout=out, stderr=out
        )
    return proc, log, ray_tmp


def test_deployments_that_cannot_fit_are_refused_in_one_line(tmp_path: Path):
    """More CPUs asked than the cluster has: Serve would wait forever (the ingress last, so
    requests hang with no answer); the command says so in one line and exits 2."""
    proc, log, ray_tmp = _serve_ray(
        tmp_path,
        "models:\n  - model: smollm2-135m-instruct\n    num_replicas: 2\n    num_cpus: 512\n",
    )
    try:
        assert proc.wait(timeout=180) == 2, log.read_text()[-3000:]
        text = log.read_text()
        assert "ask for 1024.1 CPUs" in text and "the Ray cluster has" in text, text[-3000:]
        assert "Traceback" not in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_an_application_that_never_runs_ends_the_command(tmp_path: Path):
    """A replica no node can take (a custom resource nobody has): past start_timeout the
    command exits 1 with Serve's word on why; a SIGTERM while it waits exits at once."""
    text = (
        "start_timeout: 5\nmodels:\n  - model: smollm2-135m-instruct\n    num_cpus: 0.5\n"
        "    resources: {nowhere: 1}\n"
    )
    proc, log, ray_tmp = _serve_ray(tmp_path, text)
    try:
        assert proc.wait(timeout=240) == 1, log.read_text()[-3000:]
        assert "was not running after 5 s" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    proc, log, ray_tmp = _serve_ray(tmp_path, text.replace("start_timeout: 5", "start_timeout: 0"))
    try:
        deadline = time.monotonic() + 180
        while "deploying" not in log.read_text().lower() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) in (0, 1), log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_replicas_share_the_cores_when_no_file_says_otherwise():
    from probserve.cluster.app import fit_to, misfit
    from probserve.cluster.config import ClusterConfig, ModelDeployment

    cluster = ClusterConfig(models=[ModelDeployment(num_replicas=2)])
    why = misfit(cluster, 2.0)
    assert why is not None and "2.1 CPUs" in why and "has 2" in why
    fitted = fit_to(cluster, 2.0)
    assert [m.num_cpus for m in fitted.models] == [0.95] and misfit(fitted, 2.0) is None
    assert fit_to(cluster, 8.0) == cluster  # it fits: as asked


def test_the_api_answers_as_a_local_server(app: str, base_url: str):
    def cards_now() -> dict[str, dict]:
        return {c["id"]: c for c in httpx.get(f"{app}/v1/models").json()["data"]}

    def settled() -> bool:  # the ingress polls the replicas each second
        cards = cards_now()
        counts = (cards["smol"]["replicas"], cards["smol-single"]["replicas"])
        return counts == (2, 1) and all(c["status"] == "ok" for c in cards.values())

    deadline = time.monotonic() + 60
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.25)
    cards = cards_now()
    names = {n: c["root"] for n, c in cards.items()}
    assert names["smol"] == names["smol-single"] == "smollm2-135m-instruct"
    assert (cards["smol"]["replicas"], cards["smol-single"]["replicas"]) == (2, 1)
    assert all(c["status"] == "ok" for c in cards.values())
    assert "tiny" in names
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
            "logprobs": 3, "echo": True, "return_entropy": True}  # fmt: skip
    local = _post(base_url, "/v1/completions", body).json()
    for model in ("smol", "smol-single"):
        r = _post(app, "/v1/completions", {**body, "model": model})
        assert r.status_code == 200, r.text
        assert r.json()["choices"] == local["choices"]  # the same bits on every replica
    chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 5,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    assert (
        _post(app, "/v1/chat/completions", {**chat, "model": "smol"}).json()["choices"]
        == _post(base_url, "/v1/chat/completions", chat).json()["choices"]
    )
    with httpx.stream("POST", f"{app}/v1/completions", json={**body, "model": "smol",
                      "stream": True, "echo": False}, timeout=120) as s:  # fmt: skip
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    streamed = [json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1]]
    assert lines[-1] == "data: [DONE]"
    whole = _post(app, "/v1/completions", {**body, "model": "smol", "echo": False}).json()
    assert "".join(streamed) == whole["choices"][0]["text"]
    r = _post(app, "/v1/completions", {"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    # the ingress tokenizes and formats: torch (~200 MB) lives in the replicas alone
    ingress, engines = (
        _actor_pids(f"ServeReplica:{APP}:ingress"),
        _actor_pids(f"ServeReplica:{APP}:model-"),
    )
    assert ingress and engines
    assert all("libtorch" not in Path(f"/proc/{pid}/maps").read_text() for pid in ingress)
    assert all("libtorch" in Path(f"/proc/{pid}/maps").read_text() for pid in engines)


def _actor_pids(title: str) -> list[int]:
    """This machine's processes of the Ray actors whose process title starts with
    `ray::title` (Ray names each actor's process so)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(
                f"ray::{title}".encode()
            ):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def _hit_rate(app: str, model: str, bodies: list[dict]) -> tuple[float, list[float]]:
    """The prefix-cache hit rate of the model's replicas over `bodies`, and each replica's
    share of the prompt tokens."""
    from ray_util import replicas

    def per_replica() -> dict[str, dict[str, float]]:  # read from the replicas themselves
        found = replicas(APP, deployment_name(0 if model == "smol" else 1, model))
        return {r["replica"]: r["stats"] for r in found}

    def total(figures: dict[str, dict[str, float]], name: str) -> float:
        return sum(f[name] for f in figures.values())

    before = per_replica()
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(lambda b: _post(app, "/v1/completions", {**b, "model": model}), bodies)
        )
    assert all(a.status_code == 200 for a in answers)
    after = per_replica()
    hits = total(after, "prefix_cache_hits") - total(before, "prefix_cache_hits")
    queries = total(after, "prefix_cache_queries") - total(before, "prefix_cache_queries")
    shares = {r: f["prefix_cache_queries"] for r, f in before.items()}
    now = {r: f["prefix_cache_queries"] for r, f in after.items()}
    spread = [(q - shares.get(r, 0.0)) / queries for r, q in now.items()]
    return hits / queries, spread


def test_metrics_report_the_replicas_memory_cpu_and_steps(app: str):
    """Under Ray the engine's figures are its replicas' records summed (EngineStats.summed):
    every one of them, not only the queue counts (the memory, CPU and step histogram read 0)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = _post(app, "/v1/completions", {"model": "smol", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30

    def figures() -> dict[str, float]:
        out = {}
        for family in text_string_to_metric_families(httpx.get(f"{app}/metrics").text):
            for s in family.samples:
                if s.labels.get("model_name") == "smol" and "le" not in s.labels:
                    out[s.name] = s.value
        return out

    got = figures()
    while got.get("vllm:iteration_tokens_total_count", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.25)  # the ingress polls the replicas each second
        got = figures()
    assert got["probserve:engine_resident_memory_bytes"] > 100e6, got  # two replicas' torch
    assert got["probserve:engine_cpu_seconds_total"] > 0, got
    assert got["vllm:iteration_tokens_total_count"] > 0, got
    assert got["vllm:iteration_tokens_total_sum"] >= got["vllm:iteration_tokens_total_count"]


def test_prefix_aware_routing_keeps_the_hit_rate(app: str):
    """lm-eval multiple choice: 4 continuations scored per context (echo, max_tokens 0)."""
    intro = "Answer the question with the best choice. "
    bodies = []
    for i in range(16):
        context = f"{intro}Question {i}: " + " ".join(f"w{i}x{j}" for j in range(30)) + "\nAnswer:"
        for choice in ("alpha", "beta", "gamma", "delta"):
            bodies.append({"prompt": f"{context} {choice}{i}", "max_tokens": 0, "echo": True,
                           "logprobs": 1})  # fmt: skip
    single, _ = _hit_rate(app, "smol-single", bodies)
    again = [{**b, "prompt": "Again. " + b["prompt"]} for b in bodies]
    two, spread = _hit_rate(app, "smol", again)
    print(
        f"prefix-cache hit rate: one replica {single:.3f}, two replicas {two:.3f} "
        f"({two / single:.3f} of one); the two replicas' shares of the prompt tokens: "
        + ", ".join(f"{s:.2f}" for s in spread)
    )
    assert single > 0.5
    assert two >= 0.9 * single, (single, two)
    assert len(spread) == 2 and min(spread) > 0.2, spread  # the load is spread, not piled up


def test_a_full_queue_is_a_429_in_openai_shape(app: str):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 150, "ignore_eos": True}
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: _post(app, "/v1/completions", body), range(6)))
    codes = sorted(a.status_code for a in answers)
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
    busy = next(a for a in answers if a.status_code == 429)
    assert busy.headers.get("Retry-After")
    err = busy.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "overloaded"
    assert _post(app, "/v1/completions", {**body, "max_tokens": 2}).status_code == 200


def _stream(app: str, body: dict) -> dict:
    """A streamed completion read whole: its text, and how it ended."""
    text, events, last = [], [], ""
    with httpx.stream("POST", f"{app}/v1/completions", json=body, timeout=180) as s:
        status = s.status_code
        for line in s.iter_lines():
            if line.startswith("data: "):
                last = line
                if line != "data: [DONE]":
                    event = json.loads(line[6:])
                    events.append(event)
                    if "choices" in event:
                        text.append(event["choices"][0]["text"])
    errors = [e for e in events if "error" in e]
    finished = any(e.get("choices", [{}])[0].get("finish_reason") for e in events if "choices" in e)
    return {"status": status, "text": "".join(text), "done": last == "data: [DONE]",
            "error": bool(errors), "finished": finished}  # fmt: skip


def test_a_killed_replica_loses_no_request(app: str):
    deployment = deployment_name(0, "smol")
    from ray_util import replicas

    before = replicas(APP, deployment)
    assert len(before) == 2 and len({r["node"] for r in before}) == 2  # one on each node
    prompts = [f"Story {i}: once upon a time" for i in range(24)]
    base = {"model": "smol", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    # every third request follows a grammar: its replay starts its matcher again, same tokens
    grammar = {"structured_outputs": {"regex": "( [a-z]{1,9}){8,40}\\."}}

    def body_of(i: int) -> dict:
        return {**base, "prompt": prompts[i], **(grammar if i % 3 == 0 else {})}

    expected = {
        prompts[i]: _post(app, "/v1/completions", body_of(i)).json()["choices"][0]["text"]
        for i in range(4)
    }

    def one(i: int) -> dict:
        body = body_of(i)
        if i % 2:
            return {"i": i, "stream": True, **_stream(app, {**body, "stream": True})}
        r = _post(app, "/v1/completions", body, timeout=180)
        text = r.json()["choices"][0]["text"] if r.status_code == 200 else None
        return {"i": i, "stream": False, "status": r.status_code, "text": text}

    killed: list[float] = []
    replaced: list[float] = []

    def kill_and_watch() -> None:
        """Kill one replica 2 s into the load, then time its replacement's first answer."""
        time.sleep(2.0)
        os.kill(before[0]["pid"], signal.SIGKILL)
        killed.append(time.monotonic())
        while time.monotonic() < killed[0] + 120:
            now = replicas(APP, deployment)
            if len(now) == 2 and before[0]["pid"] not in {r["pid"] for r in now}:
                replaced.append(time.monotonic())
                return
            time.sleep(0.25)

    watcher = threading.Thread(target=kill_and_watch)
    with ThreadPoolExecutor(8) as pool:
        watcher.start()
        results = list(pool.map(one, range(len(prompts))))
    watcher.join()
    # a clean answer for every request: non-streamed ones whole, streams whole or ended with
    # an error event and [DONE]
    unclean = [
        r for r in results
        if r["status"] != 200
        or (not r["stream"] and r["text"] is None)
        or (r["stream"] and not (r["done"] and (r["finished"] or r["error"])))
    ]  # fmt: skip
    assert unclean == [], unclean
    assert all(len(r["text"]) > 0 for r in results if not r["stream"])
    # answers replayed on the other replica are the same text as undisturbed ones
    for r in results:
        if r["i"] < 4 and not r.get("error"):
            assert r["text"] == expected[prompts[r["i"]]]
        if r["i"] % 3 == 0 and not r["stream"]:
            assert re.fullmatch(r"( [a-z]{1,9}){8,40}\.", r["text"]), r["text"]
    health = httpx.get(f"{app}/health").json()["models"]["smol"]
    assert replaced, "no replacement replica answered within 120 s"
    back = replaced[0] - killed[0]
    print(f"replacement: answering {back:.1f} s after the kill")  # a figure, not a limit
    errors = sum(r.get("error", False) for r in results)
    moved = health["failovers"]
    print(
        f"failover: {len(results)} requests, {errors} streams ended with an error event, "
        f"{moved} moved to the other replica, replacement in {back:.1f} s"
    )


def test_the_cluster_file_becomes_deployments(tmp_path: Path):
    """Replicas, autoscaling, placement, queue bounds, the router and per-model engine settings
    reach Serve's deployments as the file says (no cluster needed)."""
    from server_util import serve_settings

    from probserve.cluster.app import build_app
    from probserve.cluster.config import load_cluster_config

    path = tmp_path / "cluster.yaml"
    path.write_text(
        "retries: 2\n"
        "models:\n"
        "  - served_model_name: a\n"
        "    autoscaling: {min_replicas: 1, max_replicas: 3, target_ongoing_requests: 4}\n"
        "    max_queued_requests: 7\n"
        "    num_cpus: 2\n"
        "    resources: {engine: 1}\n"
        "    engine: {kv_cache_gib: 0.3}\n"
        "  - model: smollm2-135m-instruct\n"
        "    served_model_name: b\n"
        "    num_replicas: 2\n"
    )
    settings = serve_settings("--ray", "--cluster-config", str(path), "--max-num-seqs", "8")
    app = build_app(load_cluster_config(settings), settings.engine, settings.server)
    ingress = app._bound_deployment
    entries, _, retries = ingress.init_args
    assert retries == 2 and [e.names for e in entries] == [
        ("a", "smollm2-135m-instruct"),
        ("b", "smollm2-135m-instruct"),
    ]
    a, b = (e.handle._bound_deployment for e in entries)
    auto = a._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 3, 4)
    assert a._deployment_config.max_queued_requests == 7
    assert a.ray_actor_options == {"num_cpus": 2.0, "resources": {"engine": 1.0}}
    router = a._deployment_config.request_router_config
    assert router.request_router_class.endswith("PrefixAffinityRouter")
    engine_a, engine_b = a.init_args[1], b.init_args[1]
    assert (engine_a.kv_cache_gib, engine_a.threads, engine_a.max_num_seqs) == (0.3, 2, 8)
    assert (engine_b.kv_cache_gib, engine_b.threads) == (2.0, 1)
    assert b._deployment_config.num_replicas == 2

    path.write_text("models:\n  - served_model_name: a\n    replicas: 2\n")  # a typo
    with pytest.raises(ValueError, match="replicas"):
        load_cluster_config(settings)


def test_a_replay_gives_only_what_is_new_and_checks_the_rest():
    """Failover's bookkeeping (cluster/ray_engine.py): a replayed request's outputs, less what
    the client already has; a replay that differs is an error."""
    import dataclasses

    import numpy as np

    from probserve.cluster.ray_engine import _Progress
    from probserve.engine import EngineOutput, FinishReason, TokenLogprobs

    def lp(ids: list[int]) -> TokenLogprobs:
        n = len(ids)
        return TokenLogprobs(
            token_ids=np.array(ids),
            logprobs=-np.arange(1, n + 1, dtype=np.float32),
            ranks=np.ones(n, dtype=np.int64),
            top_ids=np.array([[i] for i in ids]),
            top_logprobs=np.zeros((n, 1), dtype=np.float32),
        )

    def out(ids: list[int], prompt: bool = False, done: bool = False) -> EngineOutput:
        return EngineOutput(
            "r", tuple(ids), lp(ids), lp([0, 1]) if prompt else None,
            FinishReason.LENGTH if done else None,
        )  # fmt: skip

    given = _Progress()
    assert given.fresh(out([5], prompt=True)).new_token_ids == (5,)
    assert given.fresh(out([6])).new_token_ids == (6,)
    # the replica dies; the replay on another starts over
    given.replayed = 0
    assert given.fresh(out([5], prompt=True)) is None  # nothing new: the prompt is not resent
    both = given.fresh(out([6, 7]))  # crosses what was given: only 7 goes on, with its row
    assert both.new_token_ids == (7,) and both.prompt_logprobs is None
    assert both.logprobs.token_ids.tolist() == [7] and both.logprobs.logprobs.tolist() == [-2.0]
    last = given.fresh(out([8], done=True))
    assert last.new_token_ids == (8,) and last.finished
    assert given.token_ids == [5, 6, 7, 8]

    # routing (return_routed_experts) is given once too: the prompt's, and each token's row
    from probserve.engine import RoutedExperts

    def routed(n: int, first: int) -> RoutedExperts:
        experts = np.arange(first, first + 2 * n, dtype=np.int16).reshape(n, 1, 2)
        return RoutedExperts(experts, np.ones((n, 1, 2), np.float32))

    moe = _Progress()
    start = dataclasses.replace(out([5]), routed=routed(1, 0), prompt_routed=routed(1, 50))
    assert moe.fresh(start).prompt_routed is not None
    moe.replayed = 0
    again = moe.fresh(
        dataclasses.replace(out([5, 6]), routed=routed(2, 0), prompt_routed=routed(1, 50))
    )
    assert again.prompt_routed is None and again.routed.experts.tolist() == [[[2, 3]]]

    differs = _Progress(token_ids=[5, 6])
    bad = differs.fresh(out([5, 9]))
    assert bad.finished and bad.error and "differs" in bad.error
