"""Engine settings (each one a `probserve serve` flag)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 64  # sequences running at once
    max_num_batched_tokens: int = 512  # tokens per step (prefill chunks + decodes)
    block_size: int = 16  # tokens per KV block
    kv_cache_gib: float = 2.0  # memory for the KV cache (paged runner)
    prefix_caching: bool = True
    runner: Literal["auto", "paged", "hf"] = "auto"  # auto: paged for the Llama family
