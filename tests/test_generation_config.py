"""--generation-config: a model's generation_config.json gives the sampling defaults of the
fields a request leaves out (as vLLM), never overriding what a request sets."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from server_util import serve_settings

from probserve.api.plans.sampling import sampling_params
from probserve.api.protocol import CompletionRequest
from probserve.engine import SamplingParams
from probserve.models import LoadedModel, ModelLoadError, ModelSource, load_model
from probserve.models.generation_config import SamplingDefaults, sampling_defaults


def _dir(tmp_path: Path, values: dict[str, object]) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, **values}))
    return tmp_path


def test_the_files_sampling_values(tmp_path: Path) -> None:
    d = _dir(tmp_path, {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True})
    want = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    assert sampling_defaults(ModelSource(str(d)), "auto") == want
    assert sampling_defaults(None, str(d)) == want  # a directory named by the flag
    assert sampling_defaults(ModelSource(str(d)), "none") == SamplingDefaults()
    assert sampling_defaults(ModelSource(str(d)), "vllm") == SamplingDefaults()
    gguf = ModelSource(str(d), gguf_file="model.gguf")  # a file read in place: its own metadata
    assert sampling_defaults(gguf, "auto") == SamplingDefaults()
    with pytest.raises(ModelLoadError, match=r"no generation_config\.json"):
        sampling_defaults(None, str(tmp_path / "nowhere"))
    assert sampling_defaults(ModelSource(str(tmp_path / "empty")), "auto") == SamplingDefaults()


def _values(p: SamplingParams) -> tuple[float, ...]:
    return (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty)


def test_a_request_keeps_what_it_sets() -> None:
    defaults = SamplingDefaults(
        temperature=0.0, top_p=0.5, top_k=7, min_p=0.1, repetition_penalty=1.2
    )
    left_out = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    assert _values(sampling_params(left_out, 4, 100, None, defaults)) == (0.0, 0.5, 7, 0.1, 1.2)
    given = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
         "repetition_penalty": 1.0}
    )  # fmt: skip
    assert _values(sampling_params(given, 4, 100, None, defaults)) == (1.0, 1.0, 0, 0.0, 1.0)
    assert _values(sampling_params(left_out, 4, 100, None)) == (1.0, 1.0, 0, 0.0, 1.0)


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_served_defaults(tiny_dir: Path, tmp_path: Path, choice: str) -> None:
    from server_util import running_server

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_dir, model_dir)
    _dir(model_dir, {"temperature": 0.0})  # greedy unless a request says otherwise
    loaded = load_model(str(model_dir))
    args = ("--worker", "inline", "--generation-config", choice)
    with running_server(loaded, *args) as url:

        def text(**extra: object) -> str:
            body = {"model": loaded.name, "prompt": "Once upon a time", "max_tokens": 8,
                    "ignore_eos": True, **extra}  # fmt: skip
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["text"])

        greedy = text(temperature=0.0)
        seeded = {text(seed=s) for s in range(4)}
        if choice == "auto":
            assert seeded == {greedy}  # the file's temperature 0
            assert len({text(seed=s, temperature=1.0) for s in range(4)}) > 1
        else:
            assert len(seeded) > 1  # OpenAI's temperature 1


# ---- the budget of a request that sets none (--max-tokens-default, max_new_tokens) -------------


def test_the_files_max_new_tokens_is_the_default_budget(tmp_path: Path) -> None:
    d = _dir(tmp_path, {"max_new_tokens": 3, "max_length": 50})  # max_length: prompt included
    assert sampling_defaults(ModelSource(str(d)), "auto") == SamplingDefaults(max_new_tokens=3)
    assert sampling_defaults(ModelSource(str(d)), "none") == SamplingDefaults()
    assert serve_settings().server.limits.max_tokens_default == 2048  # the documented default


def _tokens(r: httpx.Response) -> tuple[int, str]:
    """(generated tokens, finish) of a chat, completions or Responses answer."""
    assert r.status_code == 200, r.text
    a = r.json()
    if "choices" in a:
        return a["usage"]["completion_tokens"], a["choices"][0]["finish_reason"]
    return a["usage"]["output_tokens"], (a["incomplete_details"] or {}).get("reason", a["status"])


@pytest.mark.slow
def test_a_request_without_a_budget_stops_at_the_default(tiny: LoadedModel) -> None:
    """chat without max_tokens, Responses without max_output_tokens (inspect-ai's probe, with
    `reasoning`), completions with max_tokens null: each stops at --max-tokens-default with
    finish_reason length (Responses: incomplete, max_output_tokens), or where the context ends
    first; a budget the request sets is kept, below or above the default; the default is on the
    model cards and /health; 0 is none (up to the context)."""
    from server_util import running_server

    hi = [{"role": "user", "content": "Hi"}]
    base = {"model": tiny.name, "ignore_eos": True}
    with (
        running_server(tiny, "--max-tokens-default", "5") as url,
        httpx.Client(base_url=url, timeout=120) as c,
    ):
        assert c.get("/v1/models").json()["data"][0]["max_tokens_default"] == 5
        health = c.get("/health").json()
        assert (
            health["max_tokens_default"] == health["models"][tiny.name]["max_tokens_default"] == 5
        )
        chat = {**base, "messages": hi}
        probe = {**base, "input": "Please say 'hello, world'",
                 "reasoning": {"effort": "low", "summary": "auto"}}  # fmt: skip
        completion = {**base, "prompt": "Once upon a time", "max_tokens": None}
        assert _tokens(c.post("/v1/chat/completions", json=chat)) == (5, "length")
        assert _tokens(c.post("/v1/responses", json=probe)) == (5, "max_output_tokens")
        assert _tokens(c.post("/v1/completions", json=completion)) == (5, "length")
        near_the_end = {**completion, "prompt": [504] * (tiny.context_length - 3)}
        assert _tokens(c.post("/v1/completions", json=near_the_end)) == (3, "length")
        # set budgets are kept: below the default, above it, and completions' own default (16)
        assert _tokens(c.post("/v1/chat/completions", json={**chat, "max_tokens": 2}))[0] == 2
        assert _tokens(c.post("/v1/chat/completions", json={**chat, "max_tokens": 9}))[0] == 9
        assert _tokens(c.post("/v1/responses", json={**probe, "max_output_tokens": 7}))[0] == 7
        omitted = {k: v for k, v in completion.items() if k != "max_tokens"}
        assert _tokens(c.post("/v1/completions", json=omitted))[0] == 16
        streamed = {**chat, "stream": True, "stream_options": {"include_usage": True}}
        with c.stream("POST", "/v1/chat/completions", json=streamed) as s:
            events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
        assert events[-1]["usage"]["completion_tokens"] == 5
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    with (
        running_server(tiny, "--max-tokens-default", "0") as url,
        httpx.Client(base_url=url, timeout=120) as c,
    ):
        assert c.get("/v1/models").json()["data"][0]["max_tokens_default"] is None
        long = {**completion, "prompt": [504] * (tiny.context_length - 40)}
        assert _tokens(c.post("/v1/completions", json=long)) == (40, "length")


@pytest.mark.slow
def test_the_models_max_new_tokens_is_its_default_budget(tiny_dir: Path, tmp_path: Path) -> None:
    """A generation_config.json's max_new_tokens is the budget of a request that sets none (as
    vLLM), over the flag; --generation-config none leaves the flag's."""
    from server_util import running_server

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_dir, model_dir)
    _dir(model_dir, {"max_new_tokens": 3})
    loaded = load_model(str(model_dir))
    chat = {"model": loaded.name, "messages": [{"role": "user", "content": "Hi"}],
            "ignore_eos": True}  # fmt: skip
    for choice, budget in (("auto", 3), ("none", 6)):
        args = ("--worker", "inline", "--generation-config", choice, "--max-tokens-default", "6")
        with running_server(loaded, *args) as url:
            card = httpx.get(f"{url}/v1/models").json()["data"][0]
            assert card["max_tokens_default"] == budget
            r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120)
            assert _tokens(r) == (budget, "length")
