"""GET /metrics: Prometheus text under vLLM's names, counters checked against known requests."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_util import running_server

from probserve.models import LoadedModel

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
    return samples[key]


def test_metrics_count_what_was_served(smol: LoadedModel):
    with (
        running_server(smol, "--kv-cache-gib", "0.25") as url,
        httpx.Client(base_url=url, timeout=120) as c,
    ):
        prompt_tokens = completion_tokens = 0
        long_prompt = " ".join(f"w{i}" for i in range(80))
        bodies = [
            ("/v1/completions", {"prompt": "Hello", "max_tokens": 5, "ignore_eos": True}),
            ("/v1/completions", {"prompt": long_prompt, "max_tokens": 3, "n": 2,
                                 "ignore_eos": True}),
            ("/v1/completions", {"prompt": long_prompt, "max_tokens": 0}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 4, "ignore_eos": True}),
        ]  # fmt: skip
        candidates = 0
        for path, body in bodies:
            r = c.post(path, json=body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            prompt_tokens += usage["prompt_tokens"]
            completion_tokens += usage["completion_tokens"]
            candidates += body.get("n", 1)
        stream = {**bodies[0][1], "stream": True, "stream_options": {"include_usage": True}}
        with c.stream("POST", "/v1/completions", json=stream) as r:
            data = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert data[-1] == "[DONE]"
        usage = json.loads(data[-2])["usage"]
        prompt_tokens += usage["prompt_tokens"]
        completion_tokens += usage["completion_tokens"]
        candidates += 1
        assert c.post("/v1/completions", json={"prompt": "x", "n": 10**6}).status_code == 400

        r = c.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        s = _samples(r.text)

    assert _get(s, "vllm:prompt_tokens_total") == prompt_tokens
    assert _get(s, "vllm:generation_tokens_total") == completion_tokens
    assert _get(s, "vllm:request_success_total", finished_reason="length") == candidates
    # histograms: one TTFT per candidate that produced a token, one e2e per request
    producing = candidates - 1  # the max_tokens=0 scoring request produces none
    assert _get(s, "vllm:time_to_first_token_seconds_count") == producing
    assert _get(s, "vllm:e2e_request_latency_seconds_count") == len(bodies) + 1
    assert _get(s, "vllm:request_queue_time_seconds_count") == candidates
    itl = completion_tokens - producing  # the gaps between a candidate's tokens
    assert _get(s, "vllm:inter_token_latency_seconds_count") == itl
    assert _get(s, "vllm:time_to_first_token_seconds_bucket", le="+Inf") == producing
    # engine gauges and counters
    assert _get(s, "vllm:num_requests_running") == 0
    assert _get(s, "vllm:num_requests_waiting") == 0
    assert 0.0 <= _get(s, "vllm:kv_cache_usage_perc") <= 1.0
    queries = _get(s, "vllm:prefix_cache_queries_total")
    hits = _get(s, "vllm:prefix_cache_hits_total")
    assert queries >= prompt_tokens - 1 and 0 < hits < queries  # the long prompt came back
    assert _get(s, "vllm:num_preemptions_total") == 0
    http = "probserve:http_requests_total"
    assert s[(http, (("route", "/v1/completions"), ("status", "200")))] == 4
    assert s[(http, (("route", "/v1/completions"), ("status", "400")))] == 1


def test_metrics_behind_the_key_unless_opened(smol: LoadedModel):
    with running_server(smol, "--api-key", "k1") as url:
        assert httpx.get(f"{url}/metrics").status_code == 401
        auth = {"Authorization": "Bearer k1"}
        assert httpx.get(f"{url}/metrics", headers=auth).status_code == 200
    with running_server(smol, "--api-key", "k1", "--open-metrics") as url:
        assert httpx.get(f"{url}/metrics").status_code == 200
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x"}).status_code == 401
