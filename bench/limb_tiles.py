"""The integer-limb product (--products limbs) on vpdpbusd against AMX tiles, in one process on
one thread: the same packed weight and rows through `ps_limb_linear_on` on each path, the paths
alternated round by round, each timed by the calling thread's CPU time (on a machine others
share, the time the thread ran, not the time it waited: run it with OMP_NUM_THREADS=1) and the
fastest round kept. Prints one JSON line a row count, with whether the two paths gave the same
bytes (they must: limbs_amx.h).

    OMP_NUM_THREADS=1 .venv/bin/python bench/limb_tiles.py --format Q4_0 --shape 2048 2048 \
        --rows 1 8 10 12 16 32
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

VNNI, AMX = 0, 1  # limbs.cpp's LimbTiles


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=2, default=[2048, 2048], metavar=("N", "K"))
    ap.add_argument("--format", default="Q4_0", help="a GGUF block format (Q4_0, Q8_0, Q4_K...)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=3, help="products a round")
    args = ap.parse_args()

    import gguf
    from kernel_race import weight_blocks

    from probserve.kernels.invariant import InvariantKernels

    kernels = InvariantKernels(limbs=True)
    qtype = gguf.GGMLQuantizationType[args.format]
    n, k = args.shape
    rng = np.random.default_rng(0)
    packed = kernels.qpack(weight_blocks(gguf, qtype, n, k, rng), qtype.value)
    x0 = torch.from_numpy(rng.standard_normal((1, k), dtype=np.float32))
    if kernels.limb_product(x0, packed, AMX) is None:
        raise SystemExit("no AMX-INT8 here (or Linux refused the tile state), or no limbs")
    for rows in args.rows:
        x = torch.from_numpy(rng.standard_normal((rows, k), dtype=np.float32))
        best = {VNNI: float("inf"), AMX: float("inf")}
        outs: dict[int, bytes] = {}
        for r in range(args.rounds):
            for path in (VNNI, AMX) if r % 2 == 0 else (AMX, VNNI):
                out = kernels.limb_product(x, packed, path)  # warm
                assert out is not None
                outs[path] = out.numpy().tobytes()
                start = time.thread_time()
                for _ in range(args.calls):
                    kernels.limb_product(x, packed, path)
                best[path] = min(best[path], (time.thread_time() - start) / args.calls)
        print(json.dumps({
            "format": args.format, "shape": [n, k], "rows": rows,
            "vpdpbusd_ms": round(1e3 * best[VNNI], 3), "amx_ms": round(1e3 * best[AMX], 3),
            "amx_speedup": round(best[VNNI] / best[AMX], 2), "same_bytes": outs[VNNI] == outs[AMX],
        }))  # fmt: skip


if __name__ == "__main__":
    main()
