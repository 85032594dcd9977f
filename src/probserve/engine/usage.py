"""Usage figures the engine reports beside its queues (EngineCore.stats): how many tokens each
step computed (vLLM's `iteration_tokens_total` histogram, as cumulative bucket counts) and what
the engine's process holds and has used (resident memory, CPU seconds). They travel in the
engine's `EngineStats` like every engine figure, so a worker's or a Ray replica's process is
seen too. Torch-free, in engine/'s face."""

from __future__ import annotations

import bisect
import resource
import time
from pathlib import Path

from probserve.engine.stats import ITERATION_BUCKETS


class IterationTokens:
    def __init__(self) -> None:
        self.counts = [0] * (len(ITERATION_BUCKETS) + 1)  # the last: past every bucket
        self.total = 0
        self.steps = 0

    def observe(self, tokens: int) -> None:
        self.counts[bisect.bisect_left(ITERATION_BUCKETS, tokens)] += 1
        self.total += tokens
        self.steps += 1

    def cumulative(self) -> tuple[int, ...]:
        """For each bucket, the steps that computed at most its bound of tokens."""
        out, running = [], 0
        for n in self.counts[: len(ITERATION_BUCKETS)]:
            running += n
            out.append(running)
        return tuple(out)


def process_usage() -> tuple[float, float]:
    """This process's resident memory now (bytes) and CPU time so far (user + system, s)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    rss = 0.0
    try:  # the resident pages now (getrusage gives only the peak)
        rss = float(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        rss = float(ru.ru_maxrss) * 1024  # Linux reports KiB; where /proc is absent: the peak
    return rss, ru.ru_utime + ru.ru_stime


class ProcessUsage:
    """`process_usage()` read at most once every `every` seconds: the stats go out with every
    step, and two system calls a step would be work on the step's path for a figure scraped
    every few seconds."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self._read_at = -float("inf")
        self._last = (0.0, 0.0)

    def stats(self) -> tuple[float, float]:
        now = time.monotonic()
        if now - self._read_at >= self.every:
            self._read_at, self._last = now, process_usage()
        return self._last
