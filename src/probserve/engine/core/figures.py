"""An engine's figures (engine/stats.py: `EngineStats`) read from its parts: the scheduler's
queues and prefix-cache counts, the KV pool, speculation's and the disk cache's totals, the
steps' tokens and its process's memory and CPU."""

from __future__ import annotations

from typing import Any

from probserve.engine.core.block_pool import BlockPool
from probserve.engine.core.scheduler import Scheduler
from probserve.engine.core.sequence import Sequence
from probserve.engine.stats import EngineStats
from probserve.engine.usage import IterationTokens, ProcessUsage
from probserve.models.deltanet import RecurrentState


def engine_stats(
    sched: Scheduler, pool: BlockPool, deferred: int, usage: ProcessUsage,
    steps: IterationTokens, totals: dict[str, Any], states: bool = False,
) -> EngineStats:  # fmt: skip
    """The engine's figures (engine/stats.py): its queues (`deferred`: those a grammar's set-up
    holds), the KV pool, the prefix cache, the steps' tokens, its process's memory and CPU, and
    `totals` (speculation's, the disk cache's); with `states` (a hybrid model's), the recurrent
    states held now, those kept for proposals included."""
    usable = max(1, pool.num_blocks - 1)
    seqs = (*sched.running, *sched.waiting)
    rss, cpu = usage.stats()
    return EngineStats(
        waiting=len(sched.waiting) + deferred,
        running=len(sched.running),
        held_caches=sum(1 for s in seqs if s.block_table or s.runner_state is not None),
        kv_cache_usage=pool.num_in_use() / usable,
        kv_cache_resident=(pool.num_touched() - 1) / usable,
        prefix_cache_queries=sched.prefix_query_tokens,
        prefix_cache_hits=sched.prefix_hit_tokens,
        preemptions=sched.num_preemptions,
        iteration_tokens=steps.cumulative(),
        iteration_tokens_sum=steps.total,
        iteration_tokens_count=steps.steps,
        process_resident_memory_bytes=rss,
        process_cpu_seconds=cpu,
        recurrent_state_bytes=_state_bytes(seqs) if states else None,
        **totals,
    )


def _state_bytes(seqs: tuple[Sequence, ...]) -> int:
    held = (s.runner_state for s in seqs)
    return sum(state.nbytes for state in held if isinstance(state, RecurrentState))
