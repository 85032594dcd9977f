"""Limits, backpressure, deadlines, cancellation, fault isolation, auth keys, shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import run
from server_util import free_port, running_server

from probserve.engine import EngineRequest, FinishReason, LogprobsSpec, SamplingParams
from probserve.engine.core import sampler as sampler_module
from probserve.models import LoadedModel
from probserve.settings import api_keys

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
LONG = {"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 4000, "ignore_eos": True}
# a client on a loaded (shared CI) machine: a hundred connections opened at once may wait
# seconds to be accepted, so only reading the answer is held to a short limit, where asked
LOADED = httpx.Timeout(120)
GIVE_UP = httpx.Timeout(120, read=0.5)


def _err(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    return err


def _idle(url: str, timeout: float = 60) -> dict:
    """/health once nothing is queued, running or held (asserted within `timeout` s)."""
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(f"{url}/health", timeout=LOADED).json()
        if h["running"] == h["waiting"] == h["held_caches"] == h["streams"] == 0:
            return h
        assert time.monotonic() < deadline, f"not idle after {timeout:g} s: {h}"
        time.sleep(0.05)


def test_limits(smol: LoadedModel):
    with running_server(
        smol,
        "--max-body-bytes",
        "4000",
        "--max-messages",
        "3",
        "--max-sequences",
        "8",
        "--max-logit-bias",
        "4",
        "--max-stop-strings",
        "2",
        "--max-stop-chars",
        "10",
    ) as url:
        c = httpx.Client(base_url=url, timeout=60)
        _err(c.post("/v1/completions", json={"prompt": "x" * 5000}), 413)
        chunked = iter([b'{"prompt": "', b"y" * 5000, b'"}'])
        _err(
            c.post(
                "/v1/completions", content=chunked, headers={"content-type": "application/json"}
            ),
            413,
        )
        _err(c.post("/v1/completions", json={"prompt": "x", "n": 9}), 400, "n")
        _err(c.post("/v1/completions", json={"prompt": ["a"] * 3, "best_of": 3}), 400, "prompt")
        _err(c.post("/v1/completions", json={"prompt": "x", "stop": ["a", "b", "c"]}), 400, "stop")
        _err(c.post("/v1/completions", json={"prompt": "x", "stop": "x" * 11}), 400, "stop")
        bias = {str(i): 1.0 for i in range(5)}
        _err(c.post("/v1/completions", json={"prompt": "x", "logit_bias": bias}), 400, "logit_bias")
        _err(
            c.post("/v1/completions", json={"prompt": "x", "logit_bias": {"5": 101}}),
            400,
            "logit_bias",
        )
        msgs = [{"role": "user", "content": "hi"}] * 4
        _err(c.post("/v1/chat/completions", json={"messages": msgs}), 400, "messages")
        _err(
            c.post("/v1/chat/completions", json={"messages": msgs[:1], "max_tokens": 10**6}),
            400,
            "max_tokens",
        )
        ok = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200


def test_backpressure_429(smol: LoadedModel):
    with running_server(smol, "--max-queued", "2") as url:

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                body = {**LONG, "stream": True}
                async with (
                    c.stream("POST", "/v1/completions", json=body) as r1,
                    c.stream("POST", "/v1/completions", json=body) as r2,
                ):
                    assert r1.status_code == r2.status_code == 200
                    r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                    err = _err(r, 429)
                    assert r.headers["retry-after"] == "1" and err["code"] == "overloaded"

        run(scenario())
        _idle(url)
        assert (
            httpx.post(
                f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60
            ).status_code
            == 200
        )


def test_request_deadline(smol: LoadedModel):
    with running_server(smol, "--request-timeout", "1") as url:
        err = _err(httpx.post(f"{url}/v1/completions", json=LONG, timeout=60), 408)
        assert err["code"] == "timeout"
        with httpx.stream(
            "POST",
            f"{url}/v1/chat/completions",
            timeout=60,
            json={
                "messages": [{"role": "user", "content": "Write a long story."}],
                "max_tokens": 4000,
                "ignore_eos": True,
                "stream": True,
            },
        ) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["code"] == "timeout"
        assert _idle(url)["held_caches"] == 0


def test_hundred_cancelled_requests_free_everything(base_url: str):
    async def one(c: httpx.AsyncClient, i: int) -> None:
        body = {**LONG, "stream": i % 2 == 0, "prompt": f"Story number {i}:"}
        if body["stream"]:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    break  # the first bytes arrived: go away mid-stream
        else:  # gives up waiting for the answer after 0.5 s (connecting may take long)
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/v1/completions", json=body, timeout=GIVE_UP)

    async def scenario() -> None:
        async with httpx.AsyncClient(
            base_url=base_url, timeout=LOADED, limits=httpx.Limits(max_connections=200)
        ) as c:
            await asyncio.gather(*(one(c, i) for i in range(100)))

    run(scenario())
    h = _idle(base_url)
    assert h["running"] == h["waiting"] == h["held_caches"] == h["streams"] == 0, h


def test_faults_fail_one_request_alone(tiny: LoadedModel, engine_for, monkeypatch):
    eng = engine_for(tiny)
    real_process = sampler_module.process_row

    def flaky_process(logits, row):  # type: ignore[no-untyped-def]
        if 7 in row.params.logit_bias:
            raise RuntimeError("processor bug")
        return real_process(logits, row)

    monkeypatch.setattr(sampler_module, "process_row", flaky_process)
    runner = eng.core.runner
    real_run = runner.run

    def nan_run(chunks):  # type: ignore[no-untyped-def]
        out = real_run(chunks)
        sampling = [ch for ch in chunks if ch.samples]
        for i, ch in enumerate(sampling):
            if ch.seq.request_id == "nan":
                with torch.inference_mode():
                    out.sample_logits[i, :] = float("nan")
        return out

    monkeypatch.setattr(runner, "run", nan_run)

    def req(rid: str, **kw: object) -> EngineRequest:
        return EngineRequest(
            rid,
            (1, 2, 3, 4),
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **kw),
            LogprobsSpec(top_k=2),
        )  # type: ignore[arg-type]

    async def scenario() -> list:
        return await asyncio.gather(
            eng.generate(req("good")),
            eng.generate(req("bug", logit_bias={7: 1.0})),
            eng.generate(req("nan")),
            eng.generate(req("good2")),
        )

    good, bug, nan, good2 = run(scenario())
    assert bug[-1].finish_reason == FinishReason.ERROR and "processor bug" in bug[-1].error
    assert nan[-1].finish_reason == FinishReason.ERROR and "NaN" in nan[-1].error
    for outs in (good, good2):
        assert outs[-1].finish_reason == FinishReason.LENGTH
        assert sum(len(o.new_token_ids) for o in outs) == 6
    assert eng.stats().held_caches == 0


class _FlakyTokenizer:
    def __init__(self, inner: object) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def __call__(self, text: str, *a: object, **kw: object) -> object:
        if "BOOM" in text:
            raise RuntimeError("tokenizer crashed")
        return self._inner(text, *a, **kw)  # type: ignore[operator]


def test_tokenizer_failure_is_a_500_for_that_request_only(smol: LoadedModel):
    flaky = dataclasses.replace(smol, tokenizer=_FlakyTokenizer(smol.tokenizer))
    with running_server(flaky) as url:

        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                return await asyncio.gather(
                    c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5}),
                    c.post("/v1/completions", json={"prompt": "BOOM", "max_tokens": 5}),
                    c.post("/v1/completions", json={"prompt": "World", "max_tokens": 5}),
                )

        ok1, boom, ok2 = run(scenario())
        err = _err(boom, 500)
        assert err["type"] == "internal_server_error"
        assert ok1.status_code == ok2.status_code == 200


def test_api_keys_from_flag_env_and_file(tmp_path: Path, monkeypatch):
    f = tmp_path / "keys"
    f.write_text("# team keys\nalpha\n\nbeta\n")
    assert api_keys("x,y", str(f)) == ("x", "y", "alpha", "beta")
    monkeypatch.setenv("PROBSERVE_API_KEY", "env1,env2")
    assert api_keys(None) == ("env1", "env2")


def test_sigterm_drains_in_flight_stream():
    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "probserve")
    proc = subprocess.Popen(
        [exe, "serve", "--port", str(port), "--kv-cache-gib", "0.25"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.25)
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 60,
            "ignore_eos": True,
            "stream": True,
            "logprobs": 0,
        }
        tokens = 0
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    tokens += len(json.loads(line[6:])["choices"][0]["logprobs"]["tokens"])
                    proc.send_signal(signal.SIGTERM)  # mid-stream
                    break
            last = ""
            for line in lines:
                if line.startswith("data: {"):
                    tokens += len(json.loads(line[6:])["choices"][0]["logprobs"]["tokens"])
                if line.startswith("data: "):
                    last = line
        assert last == "data: [DONE]" and tokens == 60  # the stream was not cut
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(f"{url}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_load_script_loses_nothing(base_url: str):
    """bench/load_test.py with a small bound: random parameters, random disconnects."""
    script = Path(__file__).resolve().parent.parent / "bench" / "load_test.py"
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            "--url",
            base_url,
            "--requests",
            "120",
            "--concurrency",
            "40",
            "--seconds",
            "300",
            "--seed",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=script.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["lost"] == 0 and report["completed"] > 30
    assert report["cancelled"] > 5 and report["errored"] > 0


# the script's cases that tests/test_hostile_routes.py runs itself, with more requests each
COVERED_BY_HOSTILE_ROUTES = [
    "big_logprobs_answers",
    "big_distributions",
    "slow_distribution_readers",
]


def test_hostile_script_runs_clean():
    """bench/hostile.py with its own server: every hostile case, each followed by the canary
    (but those test_hostile_routes.py runs, the same requests and more, on its own server)."""
    script = Path(__file__).resolve().parent.parent / "bench" / "hostile.py"
    skip = [arg for case in COVERED_BY_HOSTILE_ROUTES for arg in ("--skip", case)]
    start = ["--start", "--port", str(free_port()), "--health-bound", "2", *skip]
    proc = subprocess.run(
        [sys.executable, str(script), *start],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=script.parent,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0, "\n".join(lines) + proc.stderr[-3000:]
    summary = json.loads(lines[-1])
    assert summary["failed"] == 0 and summary["cases"] >= 14
    assert not {json.loads(ln)["case"] for ln in lines[:-1]} & set(COVERED_BY_HOSTILE_ROUTES)
    assert all(json.loads(ln)["ok"] for ln in lines[:-1])
