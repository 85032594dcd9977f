"""Time to first token of a long prompt with its prefix restored from the prefix cache on disk
(--prefix-cache-dir) after a restart, against computing it cold: an engine on the embedded model
(native weights, deterministic, the server's defaults) runs the prompt once (cold), is closed
(its blocks written), and a new engine on the same directory runs it again (restored); the two
answers' numbers are compared bit for bit. The files are read from the page cache (just
written); a disk read from cold storage adds its own time.

    python bench/prefix_disk.py [--tokens 8000] [--model SPEC]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from probserve.engine import EngineRequest, LogprobsSpec, SamplingParams
from probserve.engine.config import EngineConfig
from probserve.engine.core.engine import EngineCore
from probserve.models import load_model


def first_token(core: EngineCore, prompt: tuple[int, ...]) -> tuple[float, list[bytes]]:
    req = EngineRequest(
        "r", prompt, SamplingParams(temperature=0.0, max_tokens=1), LogprobsSpec(top_k=5)
    )
    t = time.perf_counter()
    core.add_request(req)
    outs = []
    while core.has_work():
        outs += core.step()
    elapsed = time.perf_counter() - t
    bits = [np.asarray(o.new_token_ids).tobytes() for o in outs]
    bits += [np.asarray(o.logprobs.top_logprobs).tobytes() for o in outs if o.logprobs]
    return elapsed, bits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    t = time.perf_counter()
    loaded = load_model(args.model, "native")
    print(f"load {time.perf_counter() - t:.1f} s")
    text = "def tool_%d(path: str, mode: str = 'r') -> dict:  # reads a file, returns its stats\n"
    ids: list[int] = []
    i = 0
    while len(ids) < args.tokens:
        ids += loaded.tokenizer(text % i).input_ids
        i += 1
    prompt = tuple(ids[: args.tokens])
    with tempfile.TemporaryDirectory() as directory:
        config = EngineConfig(prefix_cache_dir=directory)
        t = time.perf_counter()
        cold = EngineCore(loaded, config)
        print(
            f"engine (fingerprint {cold.info.system_fingerprint}) {time.perf_counter() - t:.2f} s"
        )
        cold.warmup()
        cold_s, cold_bits = first_token(cold, prompt)
        t = time.perf_counter()
        cold.close()
        written = cold.stats().prefix_cache_disk_bytes / 2**20
        print(f"shutdown write: {time.perf_counter() - t:.2f} s, {written:.0f} MiB")
        warm = EngineCore(loaded, config)
        warm.warmup()
        warm_s, warm_bits = first_token(warm, prompt)
        stats = warm.stats()
        warm.close()
    print(
        f"{len(prompt)} tokens: cold {cold_s:.2f} s, restored {warm_s:.3f} s "
        f"({cold_s / warm_s:.1f}x); {stats.prefix_cache_disk_hits} blocks read back; "
        f"same bits: {cold_bits == warm_bits}"
    )


if __name__ == "__main__":
    main()
