"""Start-up that talks: the stage lines of a one-time stage (progress.Stage), the answer while
the models load (api/loading.LoadingApp), and the one-line refusal of a machine the kernels
cannot build on (kernels/build.unsupported_host)."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest
from fastapi import FastAPI

from probserve import progress
from probserve.api.edge.loading import LoadingApp
from probserve.kernels import build
from probserve.progress import Stage


def test_a_stage_logs_what_it_is_its_progress_past_a_few_seconds_and_its_time(monkeypatch, caplog):
    monkeypatch.setattr(progress, "PROGRESS_AFTER", 0.05)
    monkeypatch.setattr(progress, "PROGRESS_EVERY", 0.05)
    log = logging.getLogger("probserve.test.stage")
    with (
        caplog.at_level(logging.INFO, logger=log.name),
        Stage(log, "caching x", once="kept in /c", total=100, unit="MiB") as stage,
    ):
        for _ in range(4):
            stage.advance(25)
            time.sleep(0.08)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "caching x (100 MiB); once: kept in /c"
    bars = [ln for ln in lines if ln.startswith("caching x: [")]
    assert bars, lines
    assert "100%" in bars[-1] and "(100 of 100 MiB" in bars[-1], bars
    assert lines[-1].startswith("caching x: done in ")


def test_a_short_stage_logs_no_progress_and_a_failed_one_says_so(caplog):
    log = logging.getLogger("probserve.test.stage")
    with caplog.at_level(logging.INFO, logger=log.name):
        with Stage(log, "quick"):
            pass
        with pytest.raises(KeyError), Stage(log, "broken"):
            raise KeyError("x")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "quick" and lines[1].startswith("quick: done in ")
    assert lines[2] == "broken" and lines[3].startswith("broken: stopped after ")
    assert lines[3].endswith("(KeyError)") and len(lines) == 4


def test_while_loading_health_is_503_loading_and_routes_503_then_the_app_answers():
    front = LoadingApp()
    ready = FastAPI()

    @ready.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    async def calls() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=front)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            out = [await c.get("/health"), await c.post("/v1/completions", json={"prompt": "x"})]
            front.ready(ready)
            out.append(await c.get("/health"))
            return out

    loading, route, after = asyncio.run(calls())
    assert loading.status_code == 503 and loading.json() == {"status": "loading", "models": {}}
    assert route.status_code == 503 and route.headers["retry-after"] == "5"
    error = route.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "loading"
    assert after.status_code == 200 and after.json() == {"status": "ok"}


@pytest.mark.parametrize(
    ("system", "machine", "flags", "expect"),
    [
        ("darwin", "arm64", "", "x86-64 Linux only (this is Darwin)"),
        ("linux", "aarch64", "", "need an x86-64 CPU (this is aarch64)"),
        ("linux", "x86_64", "flags : sse2 avx fma", "lacks AVX2, F16C"),
        ("linux", "x86_64", "flags : avx2 fma f16c", None),
        ("linux", "x86_64", "flags : avx512f", None),
    ],
)
def test_a_machine_the_kernels_cannot_build_on_gets_one_line(
    monkeypatch, system, machine, flags, expect
):
    monkeypatch.setattr(build.sys, "platform", system)
    monkeypatch.setattr(build.platform, "system", lambda: system.capitalize())
    monkeypatch.setattr(build.platform, "machine", lambda: machine)
    monkeypatch.setattr(build, "_cpu_features", lambda: flags)
    why = build.unsupported_host()
    if expect is None:
        assert why is None
        return
    assert why is not None and expect in why and "\n" not in why
    with pytest.raises(build.KernelBuildError, match=r"probserve's C\+\+ kernels"):
        build.build()
