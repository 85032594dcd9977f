"""The native kernels' cost per format: one matrix product of SmolLM2's FFN shape ([1536, 576]
and [576, 1536]) and a 1.1B model's ([5632, 2048]) at 1 and 16 rows, for every block format the
kernels hold (random valid blocks), against the same product on float32 weights. Engine-free:
what a decode step's matrix products cost in each format, on this machine.

    .venv/bin/python bench/qformats.py
"""

from __future__ import annotations

import platform
import time

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from probserve.kernels.invariant import InvariantKernels

FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
QK = {f: gguf.GGML_QUANT_SIZES[f][0] for f in FORMATS}
HALVES = {Q.Q4_1: (0, 2), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def blocks(qtype: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    qk, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // qk, size), dtype=np.uint8)
    for at in HALVES.get(qtype, (0,)):
        half = (rng.standard_normal((n, k // qk)) * 0.01).astype(np.float16)
        raw[..., at : at + 2] = half.view(np.uint8).reshape(n, k // qk, 2)
    return raw.reshape(n, -1)


def timed(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - t) / repeat)
    return best * 1e6


def main() -> None:
    kernels = InvariantKernels()
    rng = np.random.default_rng(0)
    with open("/proc/cpuinfo") as f:
        names = [ln.split(":", 1)[1].strip() for ln in f if "model name" in ln]
    cpu = names[0] if names else platform.processor()
    print(f"{time.strftime('%Y-%m-%d')}, {cpu}, torch threads {torch.get_num_threads()}")
    print("| shape [N, K] | rows | float32 µs | " + " | ".join(f.name for f in FORMATS) + " |")
    print("|---|---:|---:|" + "---:|" * len(FORMATS))
    for n, k in ((1536, 576), (576, 1536), (5632, 2048)):
        f32 = kernels.pack(torch.randn(n, k) * 0.01)
        # a K-quant row is whole 256-blocks (llama-quantize writes Q5_0/Q8_0 where it is not)
        packed = {
            f: kernels.qpack(blocks(f, n, k, rng), f.value) if k % QK[f] == 0 else None
            for f in FORMATS
        }
        for rows in (1, 16):
            x = torch.randn(rows, k)
            repeat = 200 if n * k < 2e6 else 30
            base = timed(lambda x=x, f32=f32: kernels.linear(x, f32), repeat)
            cells = [
                "-" if p is None else f"{timed(lambda p=p, x=x: kernels.qlinear(x, p), repeat):.0f}"
                for p in packed.values()
            ]
            print(f"| [{n}, {k}] | {rows} | {base:.0f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
