"""The numerics fingerprint: everything the bits of a logprob depend on besides the request.

The model's weights (their files' digest, models/digest.py), the runner and where it runs, the
kernels' instruction path and products, the precision and the weights' form, the KV block size,
deterministic mode (and, without it, torch's matrix kernel), probserve's version and a digest of
the code that computes the numbers (`numerics_code_digest`: a change to a kernel or a forward
changes the fingerprint though the version stays). Two
engines with the same fingerprint compute the same bits for the same tokens (with deterministic
mode on); a block of KV kept on disk (engine/core/disk_cache.py) is only read back by an engine
with the fingerprint that wrote it. Answers carry its `id` as OpenAI's `system_fingerprint`.
Computed once, where the engine is built (core/runners/choice.py); torch-free, in engine/'s face.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from probserve import __version__


@dataclass(frozen=True)
class NumericsFingerprint:
    model_digest: str  # SHA-256 of the weights' files (or tensors)
    runner: str  # the runner's class ("PagedRunner", "HFRunner")
    device: str  # "cpu", "cuda", "interpreted"
    kernel_isa: str  # the C++ kernels' instruction path ("" where none runs)
    products: str  # "float" or "limbs"
    block_sums: bool
    precision: str  # "exact" or "bf16"
    weights: str  # what the weights are held as ("float32", "Q4_1+Q8_0", "bfloat16")
    block_size: int  # tokens a KV block holds
    deterministic: bool
    linear: str  # torch's matrix kernel without deterministic mode ("" with it)
    code: str = ""  # numerics_code_digest()
    version: str = __version__  # probserve's

    @property
    def id(self) -> str:
        """`fp_` and 16 hex digits of SHA-256 over every field: the answers' system_fingerprint
        and the disk cache's key."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return "fp_" + hashlib.sha256(text.encode()).hexdigest()[:16]


# the parts of the package whose code the numbers come from (the forward, its kernels, the
# engine's sampler and logprobs), relative to the package's folder
NUMERICS_CODE = ("models", "kernels", "engine/core")
CODE_SUFFIXES = (".py", ".cpp", ".h")


def numerics_code_digest() -> str:
    """16 hex digits of SHA-256 over the source files of `NUMERICS_CODE`, names and contents in
    a fixed order: the same for every process of one checkout or install."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for part in NUMERICS_CODE:
        for path in sorted((root / part).rglob("*")):
            if path.suffix in CODE_SUFFIXES and path.is_file():
                digest.update(path.relative_to(root).as_posix().encode() + b"\0")
                digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
