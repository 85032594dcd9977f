"""GET /metrics: Prometheus text under vLLM's names, counters checked against known requests."""

from __future__ import annotations

import json
from collections.abc import Iterator

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
    http = "http_requests_total"
    post = (("handler", "/v1/completions"), ("method", "POST"))
    assert s[(http, (*post, ("status", "200")))] == 4
    assert s[(http, (*post, ("status", "400")))] == 1
    assert s[("http_request_duration_seconds_count", post)] == 5
    # per-request token histograms: one prompt figure a request, one generation figure a
    # sequence, the request's longest sequence once a request
    requests = len(bodies) + 1
    assert _get(s, "vllm:request_prompt_tokens_count") == requests
    assert _get(s, "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert _get(s, "vllm:request_generation_tokens_count") == candidates
    assert _get(s, "vllm:request_generation_tokens_sum") == completion_tokens
    assert _get(s, "vllm:request_max_num_generation_tokens_count") == requests
    assert _get(s, "vllm:request_max_num_generation_tokens_sum") == 5 + 3 + 0 + 4 + 5
    # prefill / decode / inference time: one each a scheduled sequence (decode: a producing one)
    assert _get(s, "vllm:request_prefill_time_seconds_count") == candidates
    assert _get(s, "vllm:request_inference_time_seconds_count") == candidates
    assert _get(s, "vllm:request_decode_time_seconds_count") == producing
    assert _get(s, "vllm:time_per_output_token_seconds_count") == itl
    # every step counted, each with at least one token
    steps = _get(s, "vllm:iteration_tokens_total_count")
    assert steps >= completion_tokens - producing
    assert _get(s, "vllm:iteration_tokens_total_sum") >= steps
    assert _get(s, "vllm:iteration_tokens_total_bucket", le="+Inf") == steps
    assert _get(s, "vllm:iteration_tokens_total_bucket", le="1.0") <= steps
    # the cache's configuration, the engine worker's process and this one's
    info = [k for k in s if k[0] == "vllm:cache_config_info"]
    assert len(info) == 1 and dict(info[0][1])["block_size"] == "16", info
    assert _get(s, "probserve:engine_resident_memory_bytes") > 100e6  # torch and the weights
    assert _get(s, "probserve:engine_cpu_seconds_total") > 0
    assert s[("process_resident_memory_bytes", ())] > 10e6
    assert _get(s, "vllm:gpu_cache_usage_perc") == _get(s, "vllm:kv_cache_usage_perc")


# the series vLLM's Grafana dashboard reads (examples/online_serving/prometheus_grafana)
DASHBOARD = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum", "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)  # fmt: skip


@pytest.fixture(scope="module")
def url(smol: LoadedModel) -> Iterator[str]:
    """One server for the tests that need no fresh counters."""
    with running_server(smol, "--kv-cache-gib", "0.25") as url:
        yield url


def test_every_series_of_vllms_grafana_dashboard_is_there(url: str):
    body = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200
    s = _samples(httpx.get(f"{url}/metrics").text)
    names = {name for name, labels in s if dict(labels).get("model_name") == MODEL}
    missing = [n for n in DASHBOARD if n not in names]
    assert not missing, missing


def test_cached_tokens_are_the_prefix_caches_on_every_route(url: str):
    long_prompt = " ".join(f"c{i}" for i in range(120))
    with httpx.Client(base_url=url, timeout=120) as c:

        def cached(path: str, body: dict, field: str = "prompt_tokens_details") -> int:
            r = c.post(path, json=body)
            assert r.status_code == 200, r.text
            return int(r.json()["usage"][field]["cached_tokens"])

        first = cached("/v1/completions", {"prompt": long_prompt, "max_tokens": 1})
        again = cached("/v1/completions", {"prompt": long_prompt, "max_tokens": 1})
        assert first == 0 and again >= 96, (first, again)  # whole blocks of 16 found again
        scored = cached("/v1/completions", {"prompt": long_prompt, "max_tokens": 0, "echo": True,
                                             "logprobs": 0})  # fmt: skip
        assert scored == again
        chat = {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 1}
        assert cached("/v1/chat/completions", chat) == 0
        assert cached("/v1/chat/completions", chat) >= 96
        inputs = {"input": long_prompt, "max_output_tokens": 1}
        assert cached("/v1/responses", inputs, "input_tokens_details") >= 0
        assert cached("/v1/responses", inputs, "input_tokens_details") >= 96
        # n candidates of one prompt: the prompt counted once, as it is billed once
        fresh = {"prompt": long_prompt + " more words here", "max_tokens": 1, "n": 3}
        assert cached("/v1/completions", fresh) == again


def test_metrics_behind_the_key_unless_opened(smol: LoadedModel):
    with running_server(smol, "--api-key", "k1", "--worker", "inline") as url:
        assert httpx.get(f"{url}/metrics").status_code == 401
        auth = {"Authorization": "Bearer k1"}
        assert httpx.get(f"{url}/metrics", headers=auth).status_code == 200
    with running_server(smol, "--api-key", "k1", "--open-metrics", "--worker", "inline") as url:
        assert httpx.get(f"{url}/metrics").status_code == 200
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x"}).status_code == 401
