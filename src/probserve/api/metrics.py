"""Prometheus metrics under vLLM's names, so routers and dashboards built for vLLM work as they
are: `GET /metrics` in the text exposition format.

Request-level figures (tokens, finish reasons, time to first token, inter-token latency,
end-to-end latency, queue time) are observed by each `Run` when it ends, from the engine's
outputs; engine-level ones (running and waiting requests, KV cache usage, prefix cache queries
and hits, preemptions) are read from the engine's stats at scrape time. Both come from the
engine's protocol, so they stay right wherever the engine runs. Each app has its own registry:
no module-level state.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class Served(Protocol):
    """A served model as the metrics read it (api/state.py's ServedModel)."""

    @property
    def name(self) -> str: ...

    @property
    def engine(self) -> Any: ...  # its EngineClient: `stats()`


class Finished(Protocol):
    """One finished candidate of a run, as the metrics read it (api/run.py's candidates)."""

    @property
    def finish_reason(self) -> str | None: ...

    @property
    def queue_time(self) -> float | None: ...

    @property
    def token_times(self) -> Sequence[float]: ...


# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


GAUGES = (
    ("vllm:num_requests_running", "Sequences in the running batch.", "running"),
    ("vllm:num_requests_waiting", "Sequences waiting to run.", "waiting"),
    ("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", "kv_cache_usage"),
    (
        "probserve:kv_cache_resident_perc",
        "Part of the KV cache's reserved memory ever written, so resident (1 = all of it).",
        "kv_cache_resident",
    ),
)
COUNTERS = (
    ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("vllm:num_preemptions", "Sequences preempted (recomputed later).", "preemptions"),
)  # fmt: skip


class _EngineCollector(Collector):
    """Gauges and counters each model's engine keeps, read at scrape time (an engine replaced
    by a restart is read as it is now)."""

    def __init__(self, models: Sequence[Served]) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        stats = [(m.name, m.engine.stats()) for m in self.models]
        for kinds, family in ((GAUGES, GaugeMetricFamily), (COUNTERS, CounterMetricFamily)):
            for name, doc, key in kinds:
                metric = family(name, doc, labels=["model_name"])
                for model, s in stats:
                    metric.add_metric([model], float(s[key]))
                yield metric


class Metrics:
    def __init__(self, models: Sequence[Served]) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens.", m, registry=r)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens.", m, registry=r
        )
        self.request_success = Counter(
            "vllm:request_success", "Finished sequences.", [*m, "finished_reason"], registry=r
        )

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=r)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Request latency, end to end.", REQUEST_BUCKETS
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds", "Time before first scheduled.", REQUEST_BUCKETS
        )
        self.http = Counter(
            "probserve:http_requests", "HTTP requests by route and status.",
            ["route", "status"], registry=r,
        )  # fmt: skip
        self.registry.register(_EngineCollector(models))

    def observe_run(
        self,
        name: str,
        prompt_tokens: int,
        completion_tokens: int,
        candidates: Iterable[Finished],
        started: float,
    ) -> None:
        """A request's run, when it ends (`started`: its time.monotonic() at arrival)."""
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(completion_tokens)
        for cand in candidates:
            reason = cand.finish_reason or "abort"
            self.request_success.labels(name, reason).inc()
            if cand.queue_time is not None:
                self.queue.labels(name).observe(cand.queue_time)
            times = cand.token_times
            if times:
                self.ttft.labels(name).observe(times[0] - started)
            for a, b in itertools.pairwise(times):
                self.itl.labels(name).observe(b - a)
        self.e2e.labels(name).observe(max(0.0, time.monotonic() - started))

    def observe_http(self, route: str, status: int) -> None:
        self.http.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
