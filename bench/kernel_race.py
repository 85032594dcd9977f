"""The block-quantized matrix product alone, this tree's kernels against another commit's, in one
process: each tree's kernels/*.cpp built with the same flags into a library of its own, then
`ps_qlinear` on the same packed blocks and rows, the libraries alternated round by round (so
the machine's drift falls on both), the median of each reported. `--block-sums` adds this tree's
block-sum product as a third contender and `--limbs` its integer-limb product (limbs.cpp, on the
layout `pack_limbs` makes; every format, AVX-512 VNNI or AVX2), as the server chooses it (AMX tiles
from 10 rows where the CPU has them) and, where that differs, forced to vpdpbusd; `--copies N`
runs each round over N copies of the weight in turn, so that with more bytes than the L3 holds
every product reads its blocks from memory.

    .venv/bin/python bench/kernel_race.py --before HEAD~1 --shape 5632 2048 --rows 1 16 --block-sums
    .venv/bin/python bench/kernel_race.py --format Q4_1 --shape 576 576 --rows 1 --copies 300
    .venv/bin/python bench/kernel_race.py --before HEAD --shape 5632 2048 --rows 1 4 16 256 --limbs
    .venv/bin/python bench/kernel_race.py --before HEAD --shape 2048 2048 --rows 8 16 32 --limbs

Run alone on the machine (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
KERNELS = "src/probserve/kernels"


def build_tree(commit: str | None, out: Path) -> tuple[ctypes.CDLL, Callable[..., np.ndarray]]:
    """The kernels of `commit` (None: the working tree), compiled as the server compiles them,
    and that tree's `pack_blocks` (kernels/qlayout.py: the panels its kernels read)."""
    from probserve.kernels.build import compiler, flags, header_signatures

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
            if name.endswith((".cpp", ".h", ".py")):
                text = subprocess.run(
                    ["git", "show", f"{commit}:{KERNELS}/{name}"],
                    cwd=ROOT, check=True, capture_output=True,
                ).stdout  # fmt: skip
                (src / name).write_bytes(text)
    lib = out / "kernels.so"
    sources = sorted(str(p) for p in src.glob("*.cpp"))
    subprocess.run([compiler(), *flags(), "-o", str(lib), *sources], check=True)
    cdll = ctypes.CDLL(str(lib))
    for name, (res, args) in header_signatures().items():
        if hasattr(cdll, name):
            getattr(cdll, name).restype = res
            getattr(cdll, name).argtypes = args
    spec = importlib.util.spec_from_file_location(f"qlayout_{out.name}", src / "qlayout.py")
    assert spec is not None and spec.loader is not None
    layout = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = layout  # its dataclasses look their module up
    spec.loader.exec_module(layout)
    return cdll, layout.pack_blocks


# the float16 fields of the K-quants' blocks (d first, then dmin), by byte offset
K_HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def weight_blocks(gguf: Any, qtype: Any, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """An [n, k] weight in `qtype`'s blocks: gguf's quantization of random normals, or for the
    K-quants (which gguf's Python package does not quantize) random quants and sub-block scales
    with small float16 fields."""
    if qtype.name not in K_HALVES:
        return gguf.quants.quantize(rng.standard_normal((n, k), dtype=np.float32) * 0.02, qtype)
    qk, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // qk, size), dtype=np.uint8)
    for at in K_HALVES[qtype.name]:
        half = (rng.random((n, k // qk)) * 1e-3).astype(np.float16)
        raw[..., at : at + 2] = half.view(np.uint8).reshape(n, k // qk, 2)
    return raw.reshape(n, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--before", default="HEAD", help="the commit to race against")
    ap.add_argument("--shape", type=int, nargs=2, default=[5632, 2048], metavar=("N", "K"))
    ap.add_argument("--format", default="Q4_0", help="a GGUF block format (Q4_0, Q4_1, Q4_K...)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=0.5, help="of products per round")
    ap.add_argument("--block-sums", action="store_true")
    ap.add_argument("--limbs", action="store_true", help="this tree's integer-limb product too")
    ap.add_argument(
        "--copies", type=int, default=1,
        help="products over this many copies of the weight in turn (more than the L3 holds: "
        "each read from memory, as a model's layers are)",
    )  # fmt: skip
    args = ap.parse_args()

    import gguf

    from probserve.kernels.qlayout import FORMATS

    qtype = gguf.GGMLQuantizationType[args.format]
    n, k = args.shape
    rng = np.random.default_rng(0)
    blocks = weight_blocks(gguf, qtype, n, k, rng)
    fmt = FORMATS[qtype.value].fmt
    with tempfile.TemporaryDirectory() as tmp:
        trees = {
            "now": build_tree(None, Path(tmp) / "now"),
            "before": build_tree(args.before, Path(tmp) / "before"),
        }
        panel = int(trees["now"][0].ps_panel_width())
        # each tree's kernels on its own packing of the same blocks
        packs = {
            name: [np.ascontiguousarray(pack(blocks, qtype.value, panel))]
            for name, (_, pack) in trees.items()
        }
        for copies in packs.values():
            copies += [copies[0].copy() for _ in range(args.copies - 1)]
        # (name, the product's function, its format argument, the weight's copies)
        contenders: list[tuple[str, Callable[..., Any], int, list[np.ndarray]]] = [
            (name, lib.ps_qlinear, fmt, packs[name]) for name, (lib, _) in trees.items()
        ]
        if args.block_sums:
            now = trees["now"][0]
            flag = int(now.ps_block_sums_flag())
            contenders.append(("now --block-sums", now.ps_qlinear, fmt + flag, packs["now"]))
        if args.limbs:
            from probserve.kernels.build import header_constant
            from probserve.kernels.qlayout import LIMB_PANEL, pack_limbs

            now = trees["now"][0]
            limb = np.ascontiguousarray(pack_limbs(blocks, qtype.value, LIMB_PANEL))
            limb_copies = [limb] + [limb.copy() for _ in range(args.copies - 1)]
            limb_fmt = fmt + header_constant("PS_LIMBS")
            contenders.append(("now --products limbs", now.ps_qlinear, limb_fmt, limb_copies))
            if int(now.ps_limb_tiles()):  # the server's choice: tiles from 10 rows; vpdpbusd too
                vnni = functools.partial(now.ps_limb_linear_on, 0)
                contenders.append(("now --products limbs on vpdpbusd", vnni, fmt, limb_copies))
        for rows in args.rows:
            x = rng.standard_normal((rows, k), dtype=np.float32)
            times: dict[str, list[float]] = {name: [] for name, *_ in contenders}
            outs = {}
            for r in range(args.rounds):
                order = contenders if r % 2 == 0 else contenders[::-1]
                for name, product, f, copies in order:
                    out = np.empty((rows, n), dtype=np.float32)
                    calls = [
                        (f, x.ctypes.data, rows, k, c.ctypes.data, n, None, out.ctypes.data)
                        for c in copies
                    ]
                    for call in calls:  # warm
                        product(*call)
                    count, start = 0, time.perf_counter()
                    while time.perf_counter() - start < args.seconds:
                        for call in calls:
                            product(*call)
                        count += len(calls)
                    times[name].append((time.perf_counter() - start) / count)
                    outs[name] = out
            same = outs["now"].tobytes() == outs["before"].tobytes()
            limbs_same = {
                o.tobytes() for name, o in outs.items() if name.startswith("now --products limbs")
            }
            base = statistics.median(times["before"])
            for name, series in times.items():
                med = statistics.median(series)
                print(json.dumps({
                    "format": args.format, "shape": [n, k], "rows": rows, "kernels": name,
                    "copies": args.copies, "ms": round(1e3 * med, 3),
                    "gweights_s": round(n * k / med / 1e9, 2),
                    "vs_before": round(base / med, 3), "bits_equal_before": same,
                    "limb_paths_bits_equal": len(limbs_same) <= 1,
                }))  # fmt: skip


if __name__ == "__main__":
    main()
