"""Attention alone (kernels/invariant.cpp `ps_attention`, through `InvariantKernels.attention`) as
a step calls it: a prompt's prefill in chunks over a paged KV cache, or a decode step of many
sequences, on random q, K and V (seeded: the same inputs every run). Prints each round's time and
a digest of the outputs, so two trees compare by speed and by bits (the same digest: the same
bits): run it with each tree's sources first on PYTHONPATH, alternated.

    .venv/bin/python bench/attention_bench.py --prefill 4000 --head-dim 256 --heads 16 4
    .venv/bin/python bench/attention_bench.py --decode 16 2000 --head-dim 128 --heads 32 8
    PYTHONPATH=/tmp/before/src .venv/bin/python bench/attention_bench.py --prefill 4000

Run alone on the machine (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prefill", type=int, metavar="TOKENS", help="one prompt, in chunks")
    mode.add_argument("--decode", type=int, nargs=2, metavar=("SEQUENCES", "KEYS"))
    ap.add_argument("--chunk", type=int, default=512, help="prefill tokens a step")
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--heads", type=int, nargs=2, default=[16, 4], metavar=("NQ", "NKV"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from probserve.engine.core.host import configure_threads
    from probserve.kernels.invariant import InvariantKernels

    configure_threads(0)
    kernels = InvariantKernels(False)
    nq, nkv, d, bs = args.heads[0], args.heads[1], args.head_dim, 16
    g = torch.Generator().manual_seed(0)
    seqs, keys = (1, args.prefill) if args.prefill else args.decode
    per = (keys + bs - 1) // bs
    kc = torch.randn(seqs * per * bs, nkv, d, generator=g)
    vc = torch.randn(seqs * per * bs, nkv, d, generator=g)
    tables = torch.randperm(seqs * per, generator=g).view(seqs, per)
    if args.prefill:
        q = torch.randn(keys, nq, d, generator=g)
        calls = [
            (q[a : a + args.chunk], torch.zeros(len(q[a : a + args.chunk]), dtype=torch.int64),
             torch.arange(a + 1, min(keys, a + args.chunk) + 1))
            for a in range(0, keys, args.chunk)
        ]  # fmt: skip
    else:
        q = torch.randn(seqs, nq, d, generator=g)
        calls = [(q, torch.arange(seqs), torch.full((seqs,), keys) - torch.arange(seqs))]
    for r in range(args.rounds):
        digest, seconds = hashlib.sha256(), 0.0
        for qs, seq, lengths in calls:
            start = time.perf_counter()
            out = kernels.attention(qs, kc, vc, d**-0.5, tables, seq, lengths, bs)
            seconds += time.perf_counter() - start
            digest.update(out.numpy().tobytes())
        print(json.dumps({
            "mode": "prefill" if args.prefill else "decode", "sequences": seqs, "keys": keys,
            "head_dim": d, "heads": [nq, nkv], "round": r, "ms": round(seconds * 1e3, 2),
            "digest": digest.hexdigest()[:16],
        }))  # fmt: skip


if __name__ == "__main__":
    main()
