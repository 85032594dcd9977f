"""EngineInfo: what a running engine tells its clients about the model it serves, and the
request checks that need nothing more (run by the API process before anything is queued, and
again by the engine)."""

from __future__ import annotations

from dataclasses import dataclass

from probserve.engine.types import EngineRequest, RequestError


@dataclass(frozen=True)
class EngineInfo:
    vocab_size: int
    context_length: int  # the model's own context
    max_context: int  # tokens one sequence may hold: the context, or the KV cache's if smaller
    eos_token_ids: tuple[int, ...]
    runner: str = ""  # the runner's class name
    kv_cache_tokens: int = 0
    prefix_caching: bool = False
    deterministic: bool = False  # bitwise batch-invariant numbers (--deterministic, in effect)
    weights: str = "float32"  # what the weights are held as: float32, or GGUF blocks "Q4_1+Q8_0"


def validate(req: EngineRequest, info: EngineInfo) -> int:
    """Check a request against the model; returns the max total length it may reach."""
    n = len(req.prompt_token_ids)
    if n == 0:
        raise RequestError("the prompt is empty: at least one token is needed", "prompt")
    vocab = info.vocab_size
    bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(
            f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "prompt"
        )
    sp = req.sampling
    limit = info.max_context
    if sp.max_tokens is not None and n + sp.max_tokens > limit:
        raise RequestError(
            f"this model's maximum context length is {limit} tokens; the prompt has {n} tokens "
            f"and max_tokens is {sp.max_tokens} ({n + sp.max_tokens} in all)",
            "max_tokens",
        )
    if sp.max_tokens is None and n >= limit:
        raise RequestError(
            f"this model's maximum context length is {limit} tokens; the prompt has {n} tokens, "
            "which leaves no room to generate",
            "prompt",
        )
    for tid in (*sp.stop_token_ids, *sp.logit_bias.keys()):
        if not 0 <= tid < vocab:
            raise RequestError(f"token id {tid} is outside the vocabulary", "logit_bias")
    return limit if sp.max_tokens is None else n + sp.max_tokens
