"""Models on demand without a worker: the keep_alive values (Ollama's meaning), a models
folder's listing, and the load/evict/unload bookkeeping of api/server/on_demand.py over a
stand-in for a model's start and stop."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from probserve.api.errors import APIError
from probserve.api.server.keep_alive import FOREVER, keep_alive_seconds
from probserve.api.server.on_demand import OnDemand
from probserve.models.models_dir import models_in_dir


@pytest.mark.parametrize(
    ("given", "seconds"),
    [(None, None), (0, 0.0), (30, 30.0), (2.5, 2.5), ("5m", 300.0), ("1h30m", 5400.0),
     ("90s", 90.0), ("1.5h", 5400.0), ("500ms", 0.5), ("0", 0.0), (-1, FOREVER),
     ("-1m", FOREVER), ("-0s", 0.0), ("30", 30.0), ("-1", FOREVER)],
)  # fmt: skip
def test_keep_alive_values(given: object, seconds: float | None):
    assert keep_alive_seconds(given) == seconds


@pytest.mark.parametrize(
    "given",
    ["abc", "5x", "5 m", "--1", "1m-1s", "m", "", "1d", True, [1], {"s": 1}, math.inf, 10**400,
     "9" * 65],
)  # fmt: skip
def test_keep_alive_refused_naming_the_field(given: object):
    with pytest.raises(APIError) as err:
        keep_alive_seconds(given)
    assert err.value.status == 400 and err.value.param == "keep_alive"


def test_a_models_dir_lists_gguf_files_and_model_folders(tmp_path: Path):
    (tmp_path / "a.gguf").write_bytes(b"x")
    (tmp_path / "big-00001-of-00002.gguf").write_bytes(b"x")
    (tmp_path / "big-00002-of-00002.gguf").write_bytes(b"x")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / ".hidden.gguf").write_bytes(b"x")
    found = models_in_dir(str(tmp_path))
    assert found == {
        "a": str(tmp_path / "a.gguf"),
        "big-00001-of-00002": str(tmp_path / "big-00001-of-00002.gguf"),
        "hf": str(tmp_path / "hf"),
    }


class Stand:
    """Starts and stops of stand-in models (a failure where `failing` names the model)."""

    def __init__(self) -> None:
        self.running: set[str] = set()
        self.starts: list[str] = []
        self.failing: set[str] = set()

    def load(self, name: str, spec: str) -> Any:
        self.starts.append(name)
        if name in self.failing:
            raise RuntimeError(f"{spec} is broken")
        self.running.add(name)
        return Model(name)

    def unload(self, model: Any) -> None:
        self.running.discard(model.name)


class Model:
    def __init__(self, name: str) -> None:
        self.name = name
        self.dead = False

    def health(self) -> tuple[str, str | None]:
        return ("dead", "killed") if self.dead else ("ok", None)


def manager(stand: Stand, max_loaded: int = 1, idle: float = 0.0) -> OnDemand:
    return OnDemand({"a": "/m/a", "b": "/m/b"}, stand.load, stand.unload, max_loaded, idle)


def test_at_most_max_loaded_and_the_least_recently_used_idle_one_goes():
    async def run() -> None:
        stand = Stand()
        od = manager(stand)
        for name in ("a", "b", "a"):
            model, release = await od.acquire(name, None)
            assert model.name == name and stand.running == {name}
            release()
            release()  # a second release changes nothing
        assert stand.starts == ["a", "b", "a"]
        assert od.entries["b"].state == "unloaded" and "evicted" in str(od.entries["b"].reason)

    asyncio.run(run())


def test_a_model_in_use_is_not_evicted_until_its_request_ends():
    async def run() -> None:
        stand = Stand()
        od = manager(stand)
        _, release_a = await od.acquire("a", None)
        want_b = asyncio.ensure_future(od.acquire("b", None))
        await asyncio.sleep(0.05)
        assert not want_b.done() and stand.running == {"a"}  # a's request still runs
        assert od.entries["b"].state == "loading"
        release_a()
        model, release_b = await want_b
        assert model.name == "b" and stand.running == {"b"}
        release_b()

    asyncio.run(run())


def test_a_failed_load_answers_every_waiter_and_the_next_request_tries_again():
    async def run() -> None:
        stand = Stand()
        stand.failing.add("a")
        od = manager(stand)
        results = await asyncio.gather(
            od.acquire("a", None), od.acquire("a", None), return_exceptions=True
        )
        assert all(isinstance(r, APIError) and r.status == 503 for r in results)
        assert stand.starts == ["a"]  # one load for both
        assert od.entries["a"].state == "failed" and "broken" in str(od.entries["a"].reason)
        assert not od.entries["a"].holds_slot
        stand.failing.clear()
        model, release = await od.acquire("a", None)
        assert model.name == "a" and od.entries["a"].state == "loaded"
        release()

    asyncio.run(run())


def test_keep_alive_zero_unloads_after_the_request_and_idle_time_unloads():
    async def run() -> None:
        stand = Stand()
        od = manager(stand, max_loaded=0, idle=0.05)
        _, release = await od.acquire("a", 0.0)
        release()
        await asyncio.sleep(0.05)
        assert od.entries["a"].state == "unloaded" and stand.running == set()
        _, release = await od.acquire("b", None)  # --idle-unload's 0.05 s
        release()
        _, release = await od.acquire("a", FOREVER)  # a negative keep_alive: kept
        release()
        await asyncio.sleep(0.3)
        assert od.entries["b"].state == "unloaded" and od.entries["a"].state == "loaded"

    asyncio.run(run())


def test_unload_waits_for_the_request_in_flight():
    async def run() -> None:
        stand = Stand()
        od = manager(stand)
        _, release = await od.acquire("a", None)
        unloading = asyncio.ensure_future(od.unload("a"))
        await asyncio.sleep(0.05)
        assert not unloading.done() and stand.running == {"a"}
        assert od.entries["a"].state == "unloading"
        release()
        entry = await unloading
        assert entry.state == "unloaded" and stand.running == set()

    asyncio.run(run())


def test_models_on_demand_from_a_config_file_and_no_default_model(tmp_path: Path):
    from probserve.cli import build_parser, with_presets
    from probserve.models import ModelLoadError
    from probserve.serving import on_demand_specs
    from probserve.settings import ServeSettings

    def serve_settings(*argv: str) -> ServeSettings:  # as `probserve serve` parses them
        parser = build_parser()
        return ServeSettings.of(parser.parse_args(with_presets(parser, ["serve", *argv], {})))

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x.gguf").write_bytes(b"x")
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"models-dir: {tmp_path / 'm'}\non-demand-model: [org/repo:Q4_K_M, /a/b.gguf]\n"
        "models-max: 2\nidle-unload: 30\n"
    )
    settings = serve_settings("--config", str(config))
    assert settings.models == ()  # none pinned: nothing loads at start
    assert settings.flags.models_max == 2 and settings.flags.idle_unload == 30
    assert on_demand_specs(settings) == {
        "x": str(tmp_path / "m" / "x.gguf"),
        "org/repo:Q4_K_M": "org/repo:Q4_K_M",
        "/a/b.gguf": "/a/b.gguf",
    }
    assert [m.spec for m in serve_settings("--model", "a", "--config", str(config)).models] == ["a"]
    for bad in (("--worker", "inline"), ("--models-max", "-1"), ("--idle-unload", "-2")):
        with pytest.raises(ModelLoadError):
            serve_settings("--config", str(config), *bad)


def test_a_loaded_model_whose_engine_died_for_good_loads_again():
    async def run() -> None:
        stand = Stand()
        od = manager(stand)
        model, release = await od.acquire("a", None)
        release()
        model.dead = True  # its worker's restarts spent
        again, release = await od.acquire("a", None)
        assert again is not model and not again.dead and stand.starts == ["a", "a"]
        release()

    asyncio.run(run())


def test_a_server_with_only_models_on_demand():
    from probserve.api.server.config import ServerConfig
    from probserve.api.server.state import ServerState

    stand = Stand()
    state = ServerState([], ServerConfig(), manager(stand))
    assert state.default_name == "a" and stand.starts == []
    with pytest.raises(APIError) as err:
        state.serving(None)  # not loaded: a route that cannot wait for it says so
    assert err.value.status == 503 and err.value.code == "model_not_loaded"
    with pytest.raises(APIError) as err:
        state.serving("/m/a")  # a spec is no name
    assert err.value.status == 404
    # the token histograms reach past any model's context (none is known at start)
    state.metrics.request_prompt.labels("a").observe(500_000)
    assert 'vllm:request_prompt_tokens_bucket{le="500000.0",model_name="a"} 1.0' in (
        state.metrics.render().decode()
    )


def test_load_and_unload_routes_are_behind_the_key_and_know_only_configured_names():
    from fastapi.testclient import TestClient

    from probserve.api.app import create_app
    from probserve.api.server.config import ServerConfig
    from probserve.api.server.state import ServerState

    stand = Stand()
    state = ServerState([], ServerConfig(api_keys=("k",)), manager(stand))
    key = {"Authorization": "Bearer k"}
    with TestClient(create_app(state)) as client:
        r = client.post("/models/load", json={"model": "a"})
        assert r.status_code == 401 and stand.starts == []
        r = client.post("/models/load", json={"model": "/m/a"}, headers=key)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        r = client.post("/models/load", json={"model": "a"}, headers=key)
        assert r.status_code == 200 and r.json()["state"] == "loaded"
        assert stand.running == {"a"}
        r = client.post("/models/unload", json={"model": "a"}, headers=key)
        assert r.status_code == 200 and r.json()["state"] == "unloaded"
        assert stand.running == set()
        r = client.post("/models/unload", json={"model": "a", "x": 1}, headers=key)
        assert r.status_code == 200 and r.headers["x-ignored-fields"] == "x"
