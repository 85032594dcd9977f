"""Engine settings (`EngineConfig`: how the engine runs; `ClientLimits`: what its client in the
API process enforces): each field is a `probserve serve` flag of the same name
(probserve.flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from probserve.engine.stats import SPEC_POSITIONS
from probserve.flags import setting


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = setting(64, "sequences decoded together in one batch")
    max_num_batched_tokens: int = setting(
        512, "tokens per engine step (prefill chunks + decode tokens)"
    )
    block_size: int = setting(16, "tokens per KV block")
    max_model_len: int = setting(
        0,
        "the most tokens one sequence may hold, prompt and output (0: the model's context; "
        "more than the model's context is refused)",
    )
    kv_cache_gib: float = setting(
        2.0,
        "the most memory the KV cache may take, in GiB (reserved; pages become resident as "
        "requests first need them)",
    )
    prefix_caching: bool = setting(
        True, "reuse the KV of shared prompt prefixes", aliases=("--enable-prefix-caching",)
    )
    prefix_cache_gib: float = setting(
        0.25,
        "memory the prefix cache may keep resident for finished requests' blocks beyond what "
        "requests in flight use, in GiB (within --kv-cache-gib; more keeps more prefixes)",
    )
    prefix_cache_dir: str | None = setting(
        None,
        "a directory where full prefix-cache blocks are kept on disk as memory evicts them and "
        "at shutdown, read back after a restart (the same bits; only by an engine with the same "
        "numerics fingerprint; docs/operations.md)",
        metavar="DIR",
    )
    prefix_cache_disk_gib: float = setting(
        8.0,
        "the most the --prefix-cache-dir blocks may take on disk, in GiB (every fingerprint's; "
        "the least recently used deleted past it)",
    )
    runner: Literal["auto", "paged", "hf"] = setting(
        "auto", "auto: the paged runner where it applies (models/family.py), else transformers'"
    )
    linear: Literal["auto", "dense", "onednn"] = setting(
        "auto",
        "matrix kernel of the paged runner without --deterministic: dense (MKL), onednn "
        "(packed), auto (timed at start)",
    )
    device: Literal["cpu", "cuda", "auto"] = setting(
        "cpu",
        "where the forward runs: cpu; cuda (the GPU path: Triton kernels whose bits do not "
        "depend on the batch, float32 activations); auto (the GPU where torch sees one)",
    )
    precision: Literal["exact", "bf16"] = setting(
        "exact",
        "the GPU path's weights: exact (float32 weights and products, within 1e-4 of a float32 "
        "reference) or bf16 (bfloat16 weights and product inputs, float32 sums; faster, further "
        "from the reference); the CPU path is always exact",
    )
    cuda_graphs: bool = setting(
        True,
        "the GPU path's decode steps replayed from a CUDA graph per batch-size bucket (the same "
        "numbers, a fraction of the launch cost); --no-cuda-graphs runs every step eagerly",
    )
    worker: Literal["process", "inline"] = setting(
        "process",
        "process: the engine runs in a worker process of its own; inline: in a thread of the "
        "server process",
    )
    threads: int = setting(0, "torch threads of the engine (0: one per core)")
    weights: Literal["native", "float32"] = setting(
        "native",
        "native: a GGUF file's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K/MXFP4 blocks stay as the "
        "file holds them and are "
        "multiplied in place, exactly (the float32 path's numbers, a fraction of the memory; "
        "needs --deterministic and the paged runner, else float32; the GPU path reads the "
        "blocks and dequantizes them onto the device a matrix at a time); float32: dequantized",
    )
    products: Literal["auto", "float", "limbs"] = setting(
        "float",
        "how GGUF blocks are multiplied on the exact path: float (each weight dequantized, "
        "float32 FMAs), limbs (every GGUF block format but MXFP4; AMX tiles for batches where "
        "the CPU has AMX-INT8, else AVX-512 VNNI, else AVX2: each activation as four integer "
        "bytes, exact integer products summed in float64, rounded once: closer to a float64 "
        "forward; faster than float at one row with VNNI, about even at 16 rows on AMX, slower "
        "at 16 rows without it, slower throughout on AVX2), or auto (per weight format, float "
        "or limbs as measured on this CPU's instruction path: a fixed table, never a timing, so "
        "the same bits at every restart; /health's products says the choice: "
        "docs/benchmarks.md); all bitwise batch-invariant",
    )
    block_sums: bool = setting(
        False,
        "GGUF blocks multiplied with each sub-block's scale applied to its sum, not to every "
        "weight: one operation fewer a weight (measure it: bench/kernel_race.py; not faster on "
        "an AVX2 EPYC); still bitwise batch-invariant and within float32 rounding of the exact "
        "path, but not its bits (docs/logprobs.md); with --weights native only",
    )
    deterministic: bool = setting(
        True,
        "bitwise batch-invariant logprobs: a request's numbers are the same bits whatever else "
        "is batched (the paged runner's row-invariant kernels, --linear then ignored; off where "
        "they cannot run)",
    )

    speculative: Literal["auto", "off", "ngram", "draft"] = setting(
        "auto",
        "speculative decoding: ngram proposes the tokens that followed the latest earlier "
        "occurrence of the text's last 2-4 tokens (prompt lookup); draft a smaller model's "
        "greedy guesses (--draft-model, the same tokenizer); off none; auto (the default) ngram "
        "on the CPU engine for models without a recurrent state, proposing for requests that did "
        "not ask only while at most 2 sequences run (from 4 streams it cost more than 3 percent "
        "on text that does not repeat: docs/benchmarks.md), off on the GPU path and "
        "for hybrid models (not measured); checked in the step as extra rows: every token and "
        "logprob the same bits as without it (paged runner)",
    )
    speculative_tokens: int = setting(
        4, "the most tokens proposed a step (adapting to how many were accepted)"
    )

    def __post_init__(self) -> None:
        if self.speculative not in ("auto", "off", "ngram", "draft"):
            mode = self.speculative
            raise ValueError(f"--speculative must be auto, off, ngram or draft (got {mode!r})")
        if not 1 <= self.speculative_tokens <= SPEC_POSITIONS:
            most, got = SPEC_POSITIONS, self.speculative_tokens
            raise ValueError(f"--speculative-tokens must be 1 to {most} (got {got})")

    def weights_to_load(self) -> Literal["native", "float32"]:
        """The weights to load: native blocks run on the paged runner's deterministic kernels
        (models/loader.py falls back to float32 where the model or machine can't). The GPU
        path (always deterministic; `--device cuda` or `auto`) reads a GGUF file's blocks too,
        and dequantizes them one matrix at a time onto the device: no float32 copy of the whole
        model on the host, and the files transformers' GGUF loader misreads (Mixtral's,
        gpt-oss's) are served (where `auto` finds no GPU, the host dequantizes them the same
        way). Decided from the flags alone: the engine's face imports no torch."""
        if self.runner == "hf" or not (self.deterministic or self.device != "cpu"):
            return "float32"
        return self.weights


@dataclass(frozen=True)
class ClientLimits:
    """Enforced by the engine's client (a worker's, an inline engine's, a Ray replica's)."""

    max_queued: int = setting(1024, "engine requests queued or running; past it new ones get 429")
    engine_stall_timeout: float = setting(
        120.0, "seconds one engine step may run before /health reports the engine stuck (503)"
    )
