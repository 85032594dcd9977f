"""`EngineStats`: the engine's figures as one typed record, from the core that counts them to the
clients, the worker's wire, the Ray replicas and the API's /health and /metrics (one home for
their names: a figure added here reaches every reader, under --ray too).

The core fills the engine's own figures (`EngineCore.stats`); an `EngineClient` adds its open
streams; the Ray client adds its replicas and failovers and sums its replicas' records
(`summed`: counts and totals added, fractions averaged, the step histogram added bucket by
bucket). Torch-free, in engine/'s face."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

# vLLM's buckets for tokens a step (vllm/v1/metrics/loggers.py: capture sizes and the budget)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

SPEC_POSITIONS = 16  # the most proposals a sequence's step checks (engine/core: FORCED_MOST)

# the fractions of a record: averaged over replicas, never added
_FRACTIONS = ("kv_cache_usage", "kv_cache_resident")


@dataclass(frozen=True)
class EngineStats:
    waiting: int = 0  # sequences waiting to run (and those their grammar's set-up holds)
    running: int = 0  # sequences in the running batch
    held_caches: int = 0  # sequences holding KV blocks or runner state (0 when idle)
    kv_cache_usage: float = 0.0  # 0..1
    kv_cache_resident: float = 0.0  # the part of the pool ever written, so resident: 0..1
    prefix_cache_queries: int = 0  # prompt tokens looked up (a total since start)
    prefix_cache_hits: int = 0  # prompt tokens found
    preemptions: int = 0  # sequences preempted (recomputed later)
    # the prefix cache on disk (--prefix-cache-dir; engine/core/disk_cache.py): blocks read back,
    # written, files skipped (torn, truncated, foreign: never served), deleted for the budget,
    # dropped (the writer behind, or a write failed), and the bytes its directory holds
    prefix_cache_disk_hits: int = 0
    prefix_cache_disk_writes: int = 0
    prefix_cache_disk_skipped: int = 0
    prefix_cache_disk_evictions: int = 0
    prefix_cache_disk_dropped: int = 0
    prefix_cache_disk_bytes: int = 0
    spec_draft_tokens: int = 0  # speculative tokens proposed and checked (a total)
    spec_accepted_tokens: int = 0  # of those, the ones kept
    # the ones kept by their place among a step's proposals (0: the first proposed)
    spec_accepted_per_position: tuple[int, ...] = (0,) * SPEC_POSITIONS
    # tokens each step computed: for each of ITERATION_BUCKETS, the steps with at most that many
    # (cumulative, as a Prometheus histogram), their sum and count
    iteration_tokens: tuple[int, ...] = (0,) * len(ITERATION_BUCKETS)
    iteration_tokens_sum: int = 0
    iteration_tokens_count: int = 0
    process_resident_memory_bytes: float = 0.0  # the engine's process
    # a hybrid model's: the recurrent states its sequences hold now (bytes; None: it has none)
    recurrent_state_bytes: int | None = None
    process_cpu_seconds: float = 0.0
    # the client's (not the engine's): requests with an open stream
    streams: int = 0
    # the Ray client's: replicas answering, and requests moved to another replica
    replicas: int | None = None
    failovers: int | None = None

    @classmethod
    def summed(cls, parts: Sequence[EngineStats]) -> EngineStats:
        """One record for several engines (a model's Ray replicas)."""
        if not parts:
            return cls()
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            got = [getattr(p, f.name) for p in parts]
            if f.name in ("iteration_tokens", "spec_accepted_per_position"):
                values[f.name] = tuple(sum(col) for col in zip(*got, strict=True))
            elif f.name in _FRACTIONS:
                values[f.name] = sum(got) / len(got)
            elif any(v is None for v in got):
                values[f.name] = None
            else:
                values[f.name] = sum(got)
        return cls(**values)  # type: ignore[arg-type]

    def figures(self) -> dict[str, object]:
        """The record as /health shows it: every figure, the Ray client's only under Ray."""
        out = dataclasses.asdict(self)
        out["iteration_tokens"] = list(self.iteration_tokens)
        out["spec_accepted_per_position"] = list(self.spec_accepted_per_position)
        return {k: v for k, v in out.items() if v is not None}
