"""Errors, auth, models and tokenizer routes, disconnects."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from server_util import running_server

from probserve.models import LoadedModel

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"


def _envelope(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_validation_errors_are_400_with_param(http):
    err = _envelope(http.post("/v1/completions", json={"prompt": "x", "temperature": "hot"}), 400)
    assert err["param"] == "temperature"
    err = _envelope(http.post("/v1/completions", json={"max_tokens": 3}), 400)
    assert err["param"] == "prompt"
    err = _envelope(http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}), 400)
    assert err["param"] == "max_tokens"
    err = _envelope(
        http.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}),
        400,
    )
    assert err["param"].startswith("messages[0]")
    _envelope(
        http.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        ),
        400,
    )
    err = _envelope(http.post("/v1/completions", json={"prompt": [], "max_tokens": 1}), 400)
    assert err["param"] == "prompt"
    err = _envelope(http.post("/v1/completions", json={"prompt": "x", "logit_bias": {"a": 1}}), 400)
    assert err["param"] == "logit_bias"


def test_unknown_model_and_route(client: openai.OpenAI, http):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert err.value.body["code"] == "model_not_found"
    _envelope(http.get("/v1/nowhere"), 404)


def test_models_and_tokenizer_routes(http, smol: LoadedModel):
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    toks = http.post("/tokenize", json={"prompt": "<|im_end|>", "add_special_tokens": False})
    assert toks.json()["tokens"] == [2]
    ids = http.post("/tokenize", json={"prompt": "héllo wörld"}).json()["tokens"]
    assert ids == smol.tokenizer("héllo wörld").input_ids
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "héllo wörld"
    _envelope(http.post("/detokenize", json={"tokens": [10**8]}), 400)
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert chat.json()["count"] > 5


def test_auth(smol: LoadedModel):
    with running_server(smol, "--api-key", "k1,k2", "--worker", "inline") as url:
        assert httpx.get(f"{url}/health").status_code == 200  # health stays open
        err = _envelope(httpx.get(f"{url}/v1/models"), 401)
        assert err["type"] == "authentication_error"
        _envelope(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}), 401)
        ok = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k2"})
        assert ok.status_code == 200
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="k1", max_retries=0)
        r = good.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
        assert r.choices[0].text


def _wait_idle(http, timeout: float = 60) -> dict:  # type: ignore[no-untyped-def]
    """/health once nothing is queued, running or held (or after `timeout` s)."""
    deadline = time.monotonic() + timeout
    while True:
        h = http.get("/health").json()
        idle = h["running"] == h["waiting"] == h["held_caches"] == h["streams"] == 0
        if idle or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def test_stream_disconnect_aborts(base_url: str, http):
    body = {
        "model": MODEL,
        "prompt": "Count to one thousand:",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    assert _wait_idle(http)["running"] == 0  # nothing of an earlier test's left running
    with (
        httpx.Client(base_url=base_url, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert http.get("/health").json()["running"] == 1
        # the client is gone: the request is aborted and its cache freed
    h = _wait_idle(http)
    assert h["running"] == 0 and h["held_caches"] == 0 and h["streams"] == 0


def test_non_stream_disconnect_aborts(base_url: str, http):
    body = {
        "model": MODEL,
        "prompt": "Count to one thousand:",
        "max_tokens": 2000,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=1.0)
    h = _wait_idle(http)
    assert h["running"] == 0 and h["held_caches"] == 0
