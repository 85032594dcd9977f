"""EngineInfo: what a running engine tells its clients about the model it serves, and the
request checks that need nothing more (run by the API process before anything is queued, and
again by the engine)."""

from __future__ import annotations

from dataclasses import dataclass

from probserve.engine.fingerprint import NumericsFingerprint
from probserve.engine.types import EngineRequest, LogprobsSpec, RequestError

POOLINGS = ("mean", "last", "cls")  # how an embedding pools a prompt's final hidden states


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
    weights_in_blocks: float = 0.0  # the fraction of the parameters held in those blocks
    block_sums: bool = False  # the blocks' products apply scales per sub-block sum (in effect)
    products: str = "float"  # the blocks' products: "limbs" where some run in integer limbs
    architecture: str = ""  # the model's own type (its config's model_type: "llama", "gemma3")
    block_size: int = 0  # tokens a KV cache block holds
    # a mixture of experts on the paged forward: the MoE layers' indices and the experts a token
    # is routed to in each, which RoutingSpec returns (none: routing cannot be returned)
    moe_layers: tuple[int, ...] = ()
    experts_per_token: int = 0
    speculative: str = "off"  # requests' default speculation ("ngram"); "off" where the runner
    # cannot check proposals (the transformers runner)
    embeddings: bool = False  # the runner keeps final hidden states a request may pool
    hidden_size: int = 0  # the model's: an embedding's dimensions
    device: str = "cpu"  # where the forward runs: "cpu", "cuda" (the GPU path), "interpreted"
    # (the GPU path's kernels under Triton's interpreter, on the host)
    precision: str = "exact"  # the GPU path's weights: "exact" (float32) or "bf16"
    # the C++ kernels' instruction path, as the loaded library reports it ("avx512-vnni",
    # "avx512", "avx2"); "" where the forward runs on none (torch's float32, the GPU path)
    kernel_isa: str = ""
    # what the numbers depend on (engine/fingerprint.py); its `id` is every answer's
    # system_fingerprint (None: an engine that reports none)
    fingerprint: NumericsFingerprint | None = None
    # a hybrid model's recurrent state (Qwen3.5's Gated DeltaNet layers): bytes a sequence holds
    # beside its KV blocks; reserved out of --kv-cache-gib for max_num_seqs sequences, with the
    # speculative_tokens + 1 states a step verifying proposals keeps
    state_bytes_per_sequence: int = 0
    prefix_caching_off: str = ""  # why the prefix cache is off though asked for ("": it is not)

    @property
    def system_fingerprint(self) -> str | None:
        return None if self.fingerprint is None else self.fingerprint.id


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
    if n > limit:  # the prompt alone: whatever max_tokens says
        raise RequestError(
            f"this model's maximum context length is {limit} tokens; the prompt has {n} tokens",
            "prompt",
        )
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
    if sp.max_tokens is not None and sp.max_tokens < 0:
        raise RequestError(f"max_tokens must be at least 0 (got {sp.max_tokens})", "max_tokens")
    for tid in sp.stop_token_ids:
        if not 0 <= tid < vocab:
            raise RequestError(f"token id {tid} is outside the vocabulary", "stop_token_ids")
    for tid in sp.logit_bias:
        if not 0 <= tid < vocab:
            raise RequestError(f"token id {tid} is outside the vocabulary", "logit_bias")
    if req.logprobs is not None:
        _validate_logprobs(req.logprobs, n, vocab)
    if req.embed is not None:
        if not info.embeddings:
            raise RequestError(
                f"embeddings need the paged runner; this model runs on {info.runner}", "input"
            )
        if req.embed not in POOLINGS:
            raise RequestError(f"pooling {req.embed!r} is not one of {POOLINGS}", "pooling")
        if sp.max_tokens != 0:
            raise RequestError("an embedding request generates nothing: max_tokens 0", "input")
    if req.routing is not None and not info.moe_layers:
        raise RequestError(
            "return_routed_experts needs a mixture-of-experts model on the paged runner; "
            f"this one ({info.architecture or 'its architecture'}, {info.runner}) routes nothing",
            "return_routed_experts",
        )
    return limit if sp.max_tokens is None else n + sp.max_tokens


def _validate_logprobs(spec: LogprobsSpec, n: int, vocab: int) -> None:
    """Everything the engine indexes rows with: alternatives per row, target ids, full rows."""
    for name, k in (("top_logprobs", spec.top_k), ("prompt_logprobs", spec.prompt_top_k)):
        if k is not None and not 0 <= k <= vocab:
            raise RequestError(f"{name} must be between 0 and {vocab} (got {k})", name)
    bad = next((t for t in spec.target_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(
            f"logprob_token_ids: {bad} is outside the vocabulary (0..{vocab - 1})",
            "logprob_token_ids",
        )
    positions = spec.full_positions
    if positions:
        if not spec.prompt:
            raise RequestError("full rows need the prompt scored (prompt_top_k)", "positions")
        # row p (the distribution after tokens 0..p) exists for p = 0 .. n - 2
        bad = next((p for p in positions if not 0 <= p < n - 1), None)
        if bad is not None:
            raise RequestError(
                f"position {bad} is outside the scored prompt (0..{n - 2})", "positions"
            )
        if list(positions) != sorted(set(positions)):
            raise RequestError("positions must be distinct and increasing", "positions")
