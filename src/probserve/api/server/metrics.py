"""Prometheus metrics under vLLM's names, so routers and dashboards built for vLLM work as they
are: `GET /metrics` in the text exposition format.

Request-level figures (tokens and tokens per request, finish reasons, time to first token,
inter-token latency, end-to-end, queue, prefill, decode and inference time) are observed by
each `Run` when it ends, from the engine's outputs; engine-level ones (running and waiting
requests, KV cache usage, prefix cache queries and hits, preemptions, tokens per step, the
engine process's memory and CPU, the cache's configuration) are read from the engine's stats
and info at scrape time. Both come from the engine's protocol, so they stay right wherever the
engine runs. HTTP requests are counted and timed under the usual `http_requests_total` and
`http_request_duration_seconds`, and this process's own `process_*` figures are there too.
Each app has its own registry: no module-level state.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from probserve.engine.stats import ITERATION_BUCKETS, EngineStats


class Served(Protocol):
    """A served model as the metrics read it (api/server/state.py's ServedModel)."""

    @property
    def name(self) -> str: ...

    @property
    def engine(self) -> Any: ...  # its EngineClient: `stats()`

    @property
    def info(self) -> Any: ...  # its EngineInfo, None before the engine's hello

    @property
    def context_length(self) -> int: ...


class Finished(Protocol):
    """One finished candidate of a run, as the metrics read it (pipeline/run.py's candidates)."""

    @property
    def finish_reason(self) -> str | None: ...

    @property
    def queue_time(self) -> float | None: ...

    @property
    def token_times(self) -> Sequence[float]: ...

    @property
    def num_tokens(self) -> int: ...


# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                120.0, 300.0)  # fmt: skip

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def token_buckets(most: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 buckets for token counts, up to a model's context (build_1_2_5_buckets)."""
    out: list[float] = []
    for exponent in itertools.count():
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > most:
                return tuple(out)
            out.append(float(value))
    raise AssertionError("unreachable")


GAUGES = (
    ("vllm:num_requests_running", "Sequences in the running batch.", "running"),
    ("vllm:num_requests_waiting", "Sequences waiting to run.", "waiting"),
    ("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", "kv_cache_usage"),
    # the older name, which vLLM's own Grafana dashboard still reads
    ("vllm:gpu_cache_usage_perc", "KV cache usage (1 = full; the older name).", "kv_cache_usage"),
    (
        "probserve:engine_resident_memory_bytes",
        "Resident memory of the engine's process.",
        "process_resident_memory_bytes",
    ),
    (
        "probserve:kv_cache_resident_perc",
        "Part of the KV cache's reserved memory ever written, so resident (1 = all of it).",
        "kv_cache_resident",
    ),
    (
        "probserve:prefix_cache_disk_bytes",
        "Bytes of KV blocks in the --prefix-cache-dir directory (every fingerprint's).",
        "prefix_cache_disk_bytes",
    ),
)
COUNTERS = (
    ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("vllm:num_preemptions", "Sequences preempted (recomputed later).", "preemptions"),
    ("vllm:spec_decode_num_draft_tokens", "Speculative tokens proposed and checked.",
     "spec_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Speculative tokens accepted.",
     "spec_accepted_tokens"),
    ("probserve:engine_cpu_seconds", "CPU time the engine's process has used.",
     "process_cpu_seconds"),
    ("probserve:prefix_cache_disk_hits", "KV blocks read back from the prefix cache on disk.",
     "prefix_cache_disk_hits"),
    ("probserve:prefix_cache_disk_writes", "KV blocks written to the prefix cache on disk.",
     "prefix_cache_disk_writes"),
    ("probserve:prefix_cache_disk_skipped",
     "Files of the prefix cache's directory skipped: torn, truncated, foreign (never served).",
     "prefix_cache_disk_skipped"),
    ("probserve:prefix_cache_disk_evictions",
     "KV block files deleted to keep the directory within --prefix-cache-disk-gib.",
     "prefix_cache_disk_evictions"),
    ("probserve:prefix_cache_disk_dropped",
     "KV blocks not written (the writer behind, or the write failed).",
     "prefix_cache_disk_dropped"),
)  # fmt: skip


class _EngineCollector(Collector):
    """Gauges and counters each model's engine keeps, read at scrape time (an engine replaced
    by a restart is read as it is now)."""

    def __init__(self, models: Sequence[Served]) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        stats: list[tuple[str, EngineStats]] = [(m.name, m.engine.stats()) for m in self.models]
        for kinds, family in ((GAUGES, GaugeMetricFamily), (COUNTERS, CounterMetricFamily)):
            for name, doc, key in kinds:
                metric = family(name, doc, labels=["model_name"])
                for model, s in stats:
                    metric.add_metric([model], float(getattr(s, key)))
                yield metric
        steps = HistogramMetricFamily(
            "vllm:iteration_tokens_total", "Tokens computed per engine step.",
            labels=["model_name"],
        )  # fmt: skip
        for model, s in stats:
            counts = zip(ITERATION_BUCKETS, s.iteration_tokens, strict=True)
            buckets = [(str(float(b)), float(n)) for b, n in counts]
            steps.add_metric(
                [model],
                [*buckets, ("+Inf", float(s.iteration_tokens_count))],
                float(s.iteration_tokens_sum),
            )
        yield steps
        by_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Speculative tokens accepted, by their place among a step's proposals.",
            labels=["model_name", "position"],
        )  # fmt: skip
        for model, s in stats:
            for j, n in enumerate(s.spec_accepted_per_position):
                by_position.add_metric([model, str(j)], float(n))
        yield by_position
        config = GaugeMetricFamily(
            "vllm:cache_config_info", "The KV cache's configuration (the labels; value 1).",
            labels=["model_name", "block_size", "num_gpu_blocks", "num_cpu_blocks", "cache_dtype",
                    "enable_prefix_caching"],
        )  # fmt: skip
        for m in self.models:
            info = m.info
            if info is None:
                continue
            block = info.block_size or 1
            config.add_metric(
                [m.name, str(info.block_size), str(info.kv_cache_tokens // block), "0",
                 "float32", str(info.prefix_caching)],
                1.0,
            )  # fmt: skip
        yield config


class Metrics:
    def __init__(self, models: Sequence[Served], most_tokens: int | None = None) -> None:
        """`most_tokens`: the token histograms' last bucket (default: the models' longest
        context; models on demand load later, so their server gives its own)."""
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        ProcessCollector(registry=r)  # this (the API) process: process_resident_memory_bytes...
        PlatformCollector(registry=r)
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
        most = most_tokens or max((mod.context_length for mod in models), default=1)
        tokens = token_buckets(max(1, most))
        self.request_prompt = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of each request.", tokens
        )
        self.request_generation = histogram(
            "vllm:request_generation_tokens", "Generated tokens of each sequence.", tokens
        )
        self.request_max_generation = histogram(
            "vllm:request_max_num_generation_tokens",
            "The most tokens any sequence of a request generated.", tokens,
        )  # fmt: skip
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Time between tokens (the older name of inter_token_latency).", ITL_BUCKETS,
        )  # fmt: skip
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Each sequence's decode time over its tokens after the first.", ITL_BUCKETS,
        )  # fmt: skip
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "From first scheduled to the first token (the prompt's prefill).", REQUEST_BUCKETS,
        )  # fmt: skip
        self.decode = histogram(
            "vllm:request_decode_time_seconds", "From the first token to the last.",
            REQUEST_BUCKETS,
        )  # fmt: skip
        self.inference = histogram(
            "vllm:request_inference_time_seconds", "From first scheduled to the last token.",
            REQUEST_BUCKETS,
        )  # fmt: skip
        self.http = Counter(
            "http_requests", "HTTP requests by method, route and status.",
            ["method", "handler", "status"], registry=r,
        )  # fmt: skip
        self.http_duration = Histogram(
            "http_request_duration_seconds", "HTTP request latency (to the last byte sent).",
            ["method", "handler"], buckets=HTTP_BUCKETS, registry=r,
        )  # fmt: skip
        self.ignored_fields = Counter(
            "probserve:ignored_fields",
            "Request fields this server does not implement, accepted and named back "
            "(X-Ignored-Fields), by route.",
            ["handler"], registry=r,
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
        now = time.monotonic()
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(completion_tokens)
        self.request_prompt.labels(name).observe(prompt_tokens)
        most = 0
        for cand in candidates:
            reason = cand.finish_reason or "abort"
            self.request_success.labels(name, reason).inc()
            times = cand.token_times
            self.request_generation.labels(name).observe(cand.num_tokens)
            most = max(most, cand.num_tokens)
            if cand.queue_time is not None:
                self.queue.labels(name).observe(cand.queue_time)
                scheduled = started + cand.queue_time
                # a scored prompt (no tokens): its prefill ends with its answer
                first, last = (times[0], times[-1]) if times else (now, now)
                self.prefill.labels(name).observe(max(0.0, first - scheduled))
                self.inference.labels(name).observe(max(0.0, last - scheduled))
            if times:
                self.ttft.labels(name).observe(times[0] - started)
                self.decode.labels(name).observe(times[-1] - times[0])
                if len(times) > 1:
                    per = (times[-1] - times[0]) / (len(times) - 1)
                    self.request_tpot.labels(name).observe(per)
            for a, b in itertools.pairwise(times):
                self.itl.labels(name).observe(b - a)
                self.tpot.labels(name).observe(b - a)
        self.request_max_generation.labels(name).observe(most)
        self.e2e.labels(name).observe(max(0.0, now - started))

    def observe_http(self, method: str, route: str, status: int, seconds: float) -> None:
        self.http.labels(method, route, str(status)).inc()
        self.http_duration.labels(method, route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
