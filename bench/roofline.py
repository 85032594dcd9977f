"""How close the engine's matrix arithmetic runs to what this machine's float32 FMAs allow: the
engine alone (no HTTP), a prefill of `--streams` prompts of `--prompt-tokens` and then their
decode steps, each as multiply-accumulates a second over the model's matrix weights (the layers'
projections and the head: 2 * weights * tokens flops), beside MKL's sgemm on the same threads
at the model's MLP shape (a float32 reference; on AMD CPUs MKL may take a generic path, so the
engine's own rate can exceed it: compare with the FMA units' peak, 2 x 8 lanes x clock a core
on AVX2).

    .venv/bin/python bench/roofline.py --model /tmp/tiny/tinyshape-q4_0.gguf --streams 16
    .venv/bin/python bench/roofline.py --model ... --streams 16 --block-sums

Exact float32 products of GGUF blocks cannot beat float32 FMA throughput, so where a figure is
near sgemm's, a faster path needs fewer or narrower operations (llama.cpp's 8-bit activations),
which exact logprobs rule out. Run alone on the machine (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def matrix_weights(loaded: Any) -> int:
    """Multiply-accumulates one token costs in the model's matrices: every 2-D weight but the
    embedding table (a lookup), the head counted once whether tied or not."""
    config = loaded.model.config
    total = 0
    for name, param in loaded.model.named_parameters():
        if param.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name:
            total += param.numel()
    return total + int(config.vocab_size) * int(config.hidden_size)


def sgemm_rate(rows: int, k: int, n: int, seconds: float = 3.0) -> float:
    """MKL's float32 [rows, k] @ [k, n], multiply-accumulates a second."""
    import torch

    a, b = torch.randn(rows, k), torch.randn(k, n)
    for _ in range(3):
        a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return rows * k * n * count / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--block-sums", action="store_true", help="the block-sum products")
    args = ap.parse_args()

    from probserve.engine import EngineConfig, EngineCore, EngineRequest, SamplingParams
    from probserve.engine.core.host import configure_threads
    from probserve.models import load_model

    threads = configure_threads(0)
    loaded = load_model(args.model, "native")
    macs = matrix_weights(loaded)
    config = loaded.model.config
    core = EngineCore(loaded, EngineConfig(kv_cache_gib=2.0, block_sums=args.block_sums))
    core.warmup()
    sampling = SamplingParams(temperature=0, max_tokens=args.decode_steps + 1, ignore_eos=True)
    for i in range(args.streams):
        prompt = tuple(1000 + (7 * i + j) % 30000 for j in range(args.prompt_tokens))
        core.add_request(EngineRequest(f"r{i}", prompt, sampling))
    prefill = decode = 0.0
    decode_steps = 0
    first: set[str] = set()  # the requests that have their first token: prefilled
    while core.has_work():
        decoding = len(first) == args.streams
        start = time.perf_counter()
        outs = core.step()
        took = time.perf_counter() - start
        first.update(o.request_id for o in outs if o.new_token_ids)
        if decoding:
            decode += took
            decode_steps += 1
        else:
            prefill += took
    prefill_rate = macs * args.streams * args.prompt_tokens / prefill
    decode_rate = macs * args.streams * decode_steps / decode if decode else 0.0
    ffn = int(getattr(config, "intermediate_size", config.hidden_size))
    peak = sgemm_rate(args.streams * args.prompt_tokens, int(config.hidden_size), ffn)
    step_ms = 1e3 * decode / max(decode_steps, 1)
    figures = {
        "model": args.model or "embedded",
        "threads": threads,
        "matrix_weights": macs,
        "block_sums": core.info.block_sums,
        "prefill_s": round(prefill, 3),
        "decode_ms_a_step": round(step_ms, 2),
        "prefill_gmac_s": round(prefill_rate / 1e9, 1),
        "decode_gmac_s": round(decode_rate / 1e9, 1),
        "sgemm_gmac_s": round(peak / 1e9, 1),
        "prefill_of_sgemm": round(prefill_rate / peak, 3),
        "decode_of_sgemm": round(decode_rate / peak, 3),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
