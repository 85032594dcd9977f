"""The block-quantized matrix product alone, this tree's kernels against another commit's, in one
process: each tree's kernels/*.cpp built with the same flags into a library of its own, then
`ps_qlinear` on the same packed blocks and rows, the libraries alternated round by round (so
the machine's drift falls on both), the median of each reported. `--block-sums` adds this tree's
block-sum product as a third contender.

    .venv/bin/python bench/kernel_race.py --before HEAD~1 --shape 5632 2048 --rows 1 16 --block-sums

Run alone on the machine (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
KERNELS = "src/probserve/kernels"


def build_tree(commit: str | None, out: Path) -> ctypes.CDLL:
    """The kernels of `commit` (None: the working tree), compiled as the server compiles them."""
    from probserve.kernels.build import FLAGS, SIGNATURES, compiler

    out.mkdir(parents=True)
    src = ROOT / KERNELS
    if commit is not None:
        src = out / "src"
        src.mkdir(parents=True)
        names = subprocess.run(
            ["git", "ls-tree", "--name-only", f"{commit}:{KERNELS}"],
            cwd=ROOT, check=True, capture_output=True, text=True,
        ).stdout.split()  # fmt: skip
        for name in names:
            if name.endswith((".cpp", ".h")):
                text = subprocess.run(
                    ["git", "show", f"{commit}:{KERNELS}/{name}"],
                    cwd=ROOT, check=True, capture_output=True,
                ).stdout  # fmt: skip
                (src / name).write_bytes(text)
    lib = out / "kernels.so"
    sources = sorted(str(p) for p in src.glob("*.cpp"))
    subprocess.run([compiler(), *FLAGS, "-o", str(lib), *sources], check=True)
    cdll = ctypes.CDLL(str(lib))
    for name, (res, args) in SIGNATURES.items():
        if hasattr(cdll, name):
            getattr(cdll, name).restype = res
            getattr(cdll, name).argtypes = args
    return cdll


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--before", default="HEAD", help="the commit to race against")
    ap.add_argument("--shape", type=int, nargs=2, default=[5632, 2048], metavar=("N", "K"))
    ap.add_argument("--format", default="Q4_0", help="a GGUF block format (Q4_0, Q4_1, Q4_K...)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=0.5, help="of products per round")
    ap.add_argument("--block-sums", action="store_true")
    args = ap.parse_args()

    import gguf

    from probserve.kernels.qlayout import FORMATS, pack_blocks

    qtype = gguf.GGMLQuantizationType[args.format]
    n, k = args.shape
    rng = np.random.default_rng(0)
    blocks = gguf.quants.quantize(rng.standard_normal((n, k), dtype=np.float32) * 0.02, qtype)
    fmt = FORMATS[qtype.value].fmt
    with tempfile.TemporaryDirectory() as tmp:
        libs = {
            "now": build_tree(None, Path(tmp) / "now"),
            "before": build_tree(args.before, Path(tmp) / "before"),
        }
        contenders = [(name, lib, fmt) for name, lib in libs.items()]
        if args.block_sums:
            flag = int(libs["now"].ps_block_sums_flag())
            contenders.append(("now --block-sums", libs["now"], fmt + flag))
        panel = int(libs["now"].ps_panel_width())
        packed = np.ascontiguousarray(pack_blocks(blocks, qtype.value, panel))
        for rows in args.rows:
            x = rng.standard_normal((rows, k), dtype=np.float32)
            times: dict[str, list[float]] = {name: [] for name, _, _ in contenders}
            outs = {}
            for r in range(args.rounds):
                order = contenders if r % 2 == 0 else contenders[::-1]
                for name, lib, f in order:
                    out = np.empty((rows, n), dtype=np.float32)
                    call = (f, x.ctypes.data, rows, k, packed.ctypes.data, n, None, out.ctypes.data)
                    lib.ps_qlinear(*call)  # warm
                    count, start = 0, time.perf_counter()
                    while time.perf_counter() - start < args.seconds:
                        lib.ps_qlinear(*call)
                        count += 1
                    times[name].append((time.perf_counter() - start) / count)
                    outs[name] = out
            same = outs["now"].tobytes() == outs["before"].tobytes()
            base = statistics.median(times["before"])
            for name, series in times.items():
                med = statistics.median(series)
                print(json.dumps({
                    "format": args.format, "shape": [n, k], "rows": rows, "kernels": name,
                    "ms": round(1e3 * med, 3), "gweights_s": round(n * k / med / 1e9, 2),
                    "vs_before": round(base / med, 3), "bits_equal_before": same,
                }))  # fmt: skip


if __name__ == "__main__":
    main()
