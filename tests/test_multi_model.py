"""Several models behind one server: each in its own engine worker, routed by `model`, every
logprobs feature the same for each, and one model's death or overload leaving the other alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from server_util import running_state

from probserve.api.server.state import ServerState
from probserve.models import LoadedModel

pytestmark = pytest.mark.slow  # each model's engine is a worker process


@pytest.fixture(scope="module")
def two(smol: LoadedModel, tiny_dir: Path) -> Iterator[tuple[str, ServerState]]:
    flags = ("--model", "smollm2-135m-instruct", "--served-model-name", "smol")
    flags += ("--model", str(tiny_dir), "--served-model-name", "tiny")
    with running_state(smol, *flags, "--kv-cache-gib", "0.05", "--max-queued", "4") as served:
        yield served


def _complete(url: str, model: str, **extra: object) -> dict:
    body = {"model": model, "prompt": "The sky is", "max_tokens": 3, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_models_are_listed_and_routed_by_name(two, base_url: str, tiny_dir: Path):
    url, state = two
    cards = httpx.get(f"{url}/v1/models").json()["data"]
    roots = {c["id"]: c["root"] for c in cards}
    assert roots == {
        "smol": "smollm2-135m-instruct",
        "smollm2-135m-instruct": "smollm2-135m-instruct",
        "tiny": tiny_dir.name,
        tiny_dir.name: tiny_dir.name,
    }
    assert all(c["status"] == "ok" for c in cards)
    assert httpx.get(f"{url}/v1/models/tiny").json()["max_model_len"] == 256
    pids = {m.name: m.engine.pid for m in state.models}  # type: ignore[attr-defined]
    assert len(set(pids.values())) == 2  # one worker process per model

    feats = {"logprobs": 3, "echo": True, "logprob_token_ids": [11, 12], "return_entropy": True}
    smol_answer = _complete(url, "smol", **feats)
    assert smol_answer["model"] == "smol"
    # the same bits as the single-model server of the session
    alone = httpx.post(
        f"{base_url}/v1/completions",
        json={"prompt": "The sky is", "max_tokens": 3, "temperature": 0, **feats},
        timeout=120,
    ).json()
    assert smol_answer["choices"] == alone["choices"]
    tiny_answer = _complete(url, "tiny", **feats)
    assert tiny_answer["model"] == "tiny"
    assert tiny_answer["choices"][0]["logprobs"] != smol_answer["choices"][0]["logprobs"]
    assert _complete(url, tiny_dir.name)["choices"] == _complete(url, "tiny")["choices"]

    r = httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    tok = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": "The sky"}).json()
    assert tok["max_model_len"] == 256


def test_each_model_scores_exactly(two, tiny_dir: Path, smol: LoadedModel):
    """Prompt logprobs of the tiny model against transformers' own forward of its directory."""
    from transformers import AutoModelForCausalLM

    url, _ = two
    text = "Paris is the capital of France"
    lp = _complete(url, "tiny", prompt=text, max_tokens=0, echo=True, logprobs=1)["choices"][0]
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    ids = smol.tokenizer(text)["input_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
    expected = [float(ref[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    np.testing.assert_allclose(lp["logprobs"]["token_logprobs"][1:], expected, atol=1e-4)


def test_one_models_overload_leaves_the_other_alone(two):
    import os
    import signal

    url, state = two
    tiny = next(m for m in state.models if m.name == "tiny")
    pid = tiny.engine.pid  # type: ignore[attr-defined]
    body = {"model": "tiny", "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=120) as c:
        # the tiny worker holds still, so its 4 streams stay queued however fast it would run
        os.kill(pid, signal.SIGSTOP)
        streams = [c.stream("POST", "/v1/completions", json=body) for _ in range(4)]
        try:
            opened = [s.__enter__() for s in streams]
            assert all(r.status_code == 200 for r in opened)
            busy = c.post("/v1/completions", json={**body, "stream": False, "max_tokens": 1})
            assert busy.status_code == 429 and "Retry-After" in busy.headers, busy.text
            assert _complete(url, "smol")["choices"][0]["finish_reason"] == "length"
        finally:
            os.kill(pid, signal.SIGCONT)
            for s in streams:
                s.__exit__(None, None, None)
        deadline = time.monotonic() + 30
        while c.get("/health").json()["models"]["tiny"]["streams"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.get("/health").json()["models"]["tiny"]["streams"] == 0


def test_one_models_crash_leaves_the_other_alone(two):
    import os
    import signal

    url, state = two
    canary = _complete(url, "tiny")["choices"]
    tiny = next(m for m in state.models if m.name == "tiny")
    pid = tiny.engine.pid  # type: ignore[attr-defined]
    long = {"model": "smol", "prompt": "Count:", "max_tokens": 60, "ignore_eos": True}
    answers: list[httpx.Response] = []
    t = threading.Thread(
        target=lambda: answers.append(httpx.post(f"{url}/v1/completions", json=long, timeout=120))
    )
    t.start()
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    statuses = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        h = httpx.get(f"{url}/health", timeout=5)
        statuses.add(
            (
                h.status_code,
                h.json()["status"],
                h.json()["models"]["smol"]["status"],
            )
        )
        if h.json()["status"] == "ok" and tiny.engine.pid != pid:  # type: ignore[attr-defined]
            break
        time.sleep(0.1)
    t.join()
    assert answers[0].status_code == 200, answers[0].text  # the other model's request finished
    assert answers[0].json()["usage"]["completion_tokens"] == 60
    assert (200, "degraded", "ok") in statuses, statuses  # the truth while tiny restarted
    assert _complete(url, "tiny")["choices"] == canary  # tiny is back, answering as before
