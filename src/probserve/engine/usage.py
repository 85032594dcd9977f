"""Usage figures the engine reports beside its queues (EngineCore.stats): how many tokens each
step computed (vLLM's `iteration_tokens_total` histogram, as cumulative bucket counts) and what
the engine's process holds and has used (resident memory, CPU seconds). They travel in the
stats dict like every engine figure, so a worker's or a Ray replica's process is seen too.
Torch-free, in engine/'s face: api/metrics.py reads the same bucket names."""

from __future__ import annotations

import bisect
import resource
import time
from pathlib import Path

# vLLM's buckets for tokens a step (vllm/v1/metrics/loggers.py: capture sizes and the budget)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BUCKET_KEY = "iteration_tokens_le_"  # + the bucket's upper bound: the steps with at most that


class IterationTokens:
    def __init__(self) -> None:
        self.counts = [0] * (len(ITERATION_BUCKETS) + 1)  # the last: past every bucket
        self.total = 0
        self.steps = 0

    def observe(self, tokens: int) -> None:
        self.counts[bisect.bisect_left(ITERATION_BUCKETS, tokens)] += 1
        self.total += tokens
        self.steps += 1

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        running = 0
        for bound, n in zip(ITERATION_BUCKETS, self.counts, strict=False):
            running += n
            out[f"{BUCKET_KEY}{bound}"] = running
        out["iteration_tokens_sum"] = self.total
        out["iteration_tokens_count"] = self.steps
        return out


def process_usage() -> dict[str, float]:
    """This process's resident memory now (bytes) and CPU time so far (user + system, s)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    rss = 0.0
    try:  # the resident pages now (getrusage gives only the peak)
        rss = float(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        rss = float(ru.ru_maxrss) * 1024  # Linux reports KiB; where /proc is absent: the peak
    return {"process_resident_memory_bytes": rss, "process_cpu_seconds": ru.ru_utime + ru.ru_stime}


class ProcessUsage:
    """`process_usage()` read at most once every `every` seconds: the stats go out with every
    step, and two system calls a step would be work on the step's path for a figure scraped
    every few seconds."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self._read_at = -float("inf")
        self._last: dict[str, float] = {}

    def stats(self) -> dict[str, float]:
        now = time.monotonic()
        if now - self._read_at >= self.every:
            self._read_at, self._last = now, process_usage()
        return self._last
