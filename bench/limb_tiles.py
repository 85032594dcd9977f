"""The integer-limb product (--products limbs) on vpdpbusd and on AMX tiles against the float32
product (--products float) of the same blocks, in one process on one thread: the same weight and
rows through `ps_limb_linear_on` on each limb path and through `qlinear` on the float path, the
paths alternated round by round, each timed by the calling thread's CPU time (on a machine others
share, the time the thread ran, not the time it waited: run it with OMP_NUM_THREADS=1) and the
fastest round kept. Prints one JSON line a format and row count, with whether the two limb paths
gave the same bytes (they must: limbs_amx.h). Without AMX (or with PROBSERVE_LIMB_TILES=off) the
tile path is left out.

    OMP_NUM_THREADS=1 .venv/bin/python bench/limb_tiles.py --format Q4_0 Q4_K --shape 2048 2048 \
        --rows 1 8 10 12 16 32
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable

import numpy as np
import torch

VNNI, AMX, FLOAT = 0, 1, -1  # limbs.cpp's LimbTiles, and the float32 product


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=2, default=[2048, 2048], metavar=("N", "K"))
    ap.add_argument(
        "--format", nargs="+", default=["Q4_0"], help="GGUF block formats (Q4_0, Q8_0, Q4_K...)"
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=3, help="products a round")
    args = ap.parse_args()

    import gguf
    from kernel_race import weight_blocks

    from probserve.kernels.invariant import InvariantKernels

    kernels = InvariantKernels(limbs=True)
    floats = InvariantKernels()
    n, k = args.shape
    for name in args.format:
        qtype = gguf.GGMLQuantizationType[name]
        rng = np.random.default_rng(0)
        blocks = weight_blocks(gguf, qtype, n, k, rng)
        packed = kernels.qpack(blocks, qtype.value)
        fpacked = floats.qpack(blocks, qtype.value)
        x0 = torch.from_numpy(rng.standard_normal((1, k), dtype=np.float32))
        paths = [FLOAT, VNNI]
        if kernels.limb_product(x0, packed, AMX) is not None:
            paths.append(AMX)
        for rows in args.rows:
            x = torch.from_numpy(rng.standard_normal((rows, k), dtype=np.float32))
            run: dict[int, Callable[[], torch.Tensor | None]] = {
                FLOAT: functools.partial(floats.qlinear, x, fpacked),
                VNNI: functools.partial(kernels.limb_product, x, packed, VNNI),
                AMX: functools.partial(kernels.limb_product, x, packed, AMX),
            }
            best = dict.fromkeys(paths, float("inf"))
            outs: dict[int, bytes] = {}
            for r in range(args.rounds):
                for path in paths if r % 2 == 0 else paths[::-1]:
                    out = run[path]()  # warm
                    assert out is not None
                    outs[path] = out.numpy().tobytes()
                    start = time.thread_time()
                    for _ in range(args.calls):
                        run[path]()
                    best[path] = min(best[path], (time.thread_time() - start) / args.calls)
            line = {
                "format": name, "shape": [n, k], "rows": rows,
                "float_ms": round(1e3 * best[FLOAT], 3), "vpdpbusd_ms": round(1e3 * best[VNNI], 3),
                "vpdpbusd_vs_float": round(best[FLOAT] / best[VNNI], 2),
            }  # fmt: skip
            if AMX in paths:
                line.update({
                    "amx_ms": round(1e3 * best[AMX], 3),
                    "amx_vs_float": round(best[FLOAT] / best[AMX], 2),
                    "amx_vs_vpdpbusd": round(best[VNNI] / best[AMX], 2),
                    "same_bytes": outs[VNNI] == outs[AMX],
                })  # fmt: skip
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
