"""Models on demand, end to end: a server with one pinned model (the canary) and the embedded
model's file under other names in a models folder, loaded when a request names one, at most one
at a time (--models-max 1). Worker starts are few: each costs seconds."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_util import InFlight, finish_reason, running_state

from probserve.api.server.state import ServerState
from probserve.models import LoadedModel
from probserve.models.sources import embedded_gguf_path

pytestmark = pytest.mark.slow  # each model's engine is a worker process

BODY = {"prompt": "The sky is", "max_tokens": 3, "temperature": 0, "logprobs": 3, "echo": True}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model's file as `second` and `third` (links: one conversion serves all),
    and `broken`, a file that is no GGUF."""
    path = tmp_path_factory.mktemp("models")
    for name in ("second", "third"):
        (path / f"{name}.gguf").symlink_to(embedded_gguf_path())
    (path / "broken.gguf").write_bytes(b"not a model at all" * 8)
    return path


@pytest.fixture(scope="module")
def served(smol: LoadedModel, models_dir: Path) -> Iterator[tuple[str, ServerState]]:
    flags = ("--model", "smollm2-135m-instruct", "--served-model-name", "pinned")
    flags += ("--models-dir", str(models_dir), "--models-max", "1")
    with running_state(smol, *flags, "--kv-cache-gib", "0.05") as s:
        yield s


def _complete(url: str, model: str, **extra: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={**BODY, "model": model, **extra}, timeout=300)


def _states(url: str) -> dict[str, str]:
    return {c["id"]: c["state"] for c in httpx.get(f"{url}/v1/models").json()["data"]}


def _logprobs(r: httpx.Response) -> object:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]


def test_first_request_loads_and_two_models_alternate_with_the_canarys_bits(served):
    url, state = served
    assert _states(url) == {
        "pinned": "loaded", "smollm2-135m-instruct": "loaded",
        "broken": "unloaded", "second": "unloaded", "third": "unloaded",
    }  # fmt: skip
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json()["models"]["second"]["state"] == "unloaded"
    canary = _logprobs(_complete(url, "pinned"))

    first = _complete(url, "second")
    assert first.json()["model"] == "second"
    assert _logprobs(first) == canary  # the same weights: the same bits
    assert _states(url)["second"] == "loaded"
    assert _logprobs(_complete(url, "third")) == canary
    cards = {c["id"]: c for c in httpx.get(f"{url}/v1/models").json()["data"]}
    assert cards["third"]["state"] == "loaded" and cards["second"]["state"] == "unloaded"
    assert "evicted" in cards["second"]["reason"]

    # both at once, streamed and not: each waits for its turn, none fails or is cut short
    answers: dict[str, object] = {}
    streams = {name: InFlight(url, {**BODY, "model": name}) for name in ("second", "third")}

    def ask(name: str) -> None:
        answers[name] = _logprobs(_complete(url, name))

    threads = [threading.Thread(target=ask, args=(n,)) for n in ("third", "second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert answers == {"second": canary, "third": canary}
    for stream in streams.values():
        status, events, done = stream.join(300)
        assert status == 200 and done and finish_reason(events) == "length"
        assert "error" not in "".join(events)
    assert _logprobs(_complete(url, "pinned")) == canary
    held = sum(s == "loaded" for n, s in _states(url).items() if n in ("second", "third"))
    assert held == 1  # --models-max 1
    assert sum(m.name in ("second", "third") for m in state.models) == 1


def test_unload_lets_the_request_in_flight_finish(served):
    url, _ = served
    assert _complete(url, "third").status_code == 200  # loaded (or already so)
    long = {**BODY, "model": "third", "max_tokens": 48, "ignore_eos": True}
    stream = InFlight(url, long)
    assert stream.started.wait(120)
    r = httpx.post(f"{url}/models/unload", json={"model": "third"}, timeout=300)
    assert r.status_code == 200 and r.json() == {
        "success": True, "model": "third", "state": "unloaded", "pinned": False,
    }  # fmt: skip
    status, events, done = stream.join(300)
    assert status == 200 and done and finish_reason(events) == "length"
    assert _states(url)["third"] == "unloaded"
    r = httpx.post(f"{url}/models/unload", json={"model": "pinned"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_keep_alive_zero_unloads_and_bad_values_are_400(served):
    url, _ = served
    for bad in ("soon", True, "1d", [1]):
        r = _complete(url, "second", keep_alive=bad)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "keep_alive"
    overflow = '{"model": "second", "prompt": "x", "max_tokens": 1, "keep_alive": 1e999}'
    r = httpx.post(
        f"{url}/v1/completions", content=overflow, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"
    # a pinned model is never unloaded: its keep_alive is named back as ignored
    r = _complete(url, "pinned", keep_alive="5m")
    assert r.status_code == 200 and "keep_alive" in r.headers["x-ignored-fields"]
    r = _complete(url, "second", keep_alive=0)
    assert r.status_code == 200 and "x-ignored-fields" not in r.headers
    deadline = time.monotonic() + 60
    while _states(url)["second"] != "unloaded" and time.monotonic() < deadline:
        time.sleep(0.1)
    card = httpx.get(f"{url}/v1/models/second").json()
    assert card["state"] == "unloaded" and card["reason"] == "keep_alive 0"


def test_a_failed_load_is_one_clear_error_and_the_next_request_tries_again(served):
    url, _ = served
    for _ in range(2):  # each request tries again
        r = _complete(url, "broken")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
        assert "broken.gguf" in r.json()["error"]["message"]
    health = httpx.get(f"{url}/health").json()
    assert health["models"]["broken"]["state"] == "failed"
    assert health["models"]["broken"]["loads"] == 2 and health["models"]["broken"]["reason"]


def _worker_of(path: str) -> int | None:
    """The pid of this process's engine worker for the model file `path`, if one runs."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        ours = parent == os.getpid() and b"probserve.engine.worker" in cmdline
        if ours and path.encode() in cmdline:
            return int(entry.name)
    return None


def test_a_worker_killed_mid_load_leaves_the_model_failed_then_loadable(served, models_dir):
    url, _ = served
    answer: list[httpx.Response] = []
    loading = threading.Thread(
        target=lambda: answer.append(
            httpx.post(f"{url}/models/load", json={"model": "third"}, timeout=300)
        )
    )
    loading.start()
    pid = None
    deadline = time.monotonic() + 120
    while pid is None and time.monotonic() < deadline:
        pid = _worker_of(str(models_dir / "third.gguf"))
        time.sleep(0.01)
    assert pid is not None
    assert _states(url)["third"] == "loading"
    os.kill(pid, signal.SIGKILL)
    loading.join(300)
    assert answer[0].status_code == 503, answer[0].text
    assert answer[0].json()["error"]["code"] == "model_load_failed"
    card = httpx.get(f"{url}/v1/models/third").json()
    assert card["state"] == "failed" and card["reason"]
    r = httpx.post(f"{url}/models/load", json={"model": "third"}, timeout=300)
    assert r.status_code == 200 and r.json()["state"] == "loaded"
    assert _complete(url, "third").status_code == 200


def test_names_outside_the_configured_models_are_404_and_nothing_is_read(served, tmp_path):
    url, _ = served
    fifo = tmp_path / "pipe.gguf"  # reading it would block: a 404 says nothing opened it
    os.mkfifo(fifo)
    for name in (str(fifo), "../second", str(embedded_gguf_path()), "second.gguf"):
        for path in ("/models/load", "/models/unload"):
            r = httpx.post(f"{url}{path}", json={"model": name}, timeout=30)
            assert r.status_code == 404, (name, path, r.text)
            assert r.json()["error"]["param"] == "model"
        r = _complete(url, name)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{url}/models/load", content=json.dumps({"model": 5}))
    assert r.status_code == 400
