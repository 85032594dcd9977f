"""The products on GGUF blocks, per weight format: float (each weight dequantized, float32 FMAs:
kernels/quantized.cpp) or integer limbs (exact integer products, scaled in float64, rounded once:
kernels/limbs.cpp), as `--products` asks. `auto` chooses per format from the instruction path the
limbs run on here (AMX tiles, AVX-512 VNNI, AVX2), by the table of what was measured (MEASURED),
never by timing at start: the same CPU and library give the same choice, so the same bits, at
every restart. A weight's product never depends on a batch's row count (float and limbs give
different bits); which limb kernel a batch takes (VNNI or AMX tiles: the same bits) may.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

Products = Literal["auto", "float", "limbs"]
LimbIsa = Literal["amx", "avx512-vnni", "avx2"]


@dataclass(frozen=True)
class Measured:
    """The limbs' speed over the float path's on one product (float time / limbs time; above 1
    the limbs are faster) at one row (a decode step of one stream) and at 16 rows (a step of 16
    streams; on "amx" the tiles' pass)."""

    one_row: float
    rows16: float

    @property
    def limbs(self) -> bool:
        """Limbs where they win with one stream's and 16 streams' steps weighed alike: the
        product of the two ratios at least 1 (the geometric mean of the speed-ups)."""
        return self.one_row * self.rows16 >= 1.0


# What was measured, per ISA and format (docs/benchmarks.md: "--products auto"). A format not
# in an ISA's table was not measured there and runs the float path.
#   amx: Intel Xeon family 6 model 207 (AVX-512 + VNNI + AMX-INT8), 2026-12-06, bench/limb_tiles.py
#        --shape 2048 2048 --rows 1 16 (one thread's CPU time, alternated rounds; shared machine):
#        one row on vpdpbusd, 16 rows on the tiles; the K-quants again after their one join a
#        super-block (limbs_super.h), --rounds 7
#   avx512-vnni: AMD EPYC Zen 4 (AVX-512 + VNNI, no AMX), 2026-12-05, bench/kernel_race.py
#        --shape 5632 2048 --limbs --copies 8 (medians of 5 rounds, 2 threads); Q4_0's batched
#        figure is at 4 rows (16 rows were not run)
#   avx2: the same EPYC running the AVX2 build (PROBSERVE_KERNEL_ISA=avx2), 2026-12-05, the
#        same command at 1 and 16 rows: the limbs lose everywhere
MEASURED: dict[LimbIsa, dict[str, Measured]] = {
    "amx": {
        "Q4_0": Measured(1.42, 1.05),
        "Q4_1": Measured(1.43, 0.96),
        "Q5_0": Measured(1.77, 1.04),
        "Q5_1": Measured(1.67, 0.94),
        "Q8_0": Measured(1.40, 1.05),
        "Q4_K": Measured(1.43, 1.38),
        "Q5_K": Measured(2.11, 1.29),
        "Q6_K": Measured(1.77, 1.40),
    },
    "avx512-vnni": {
        "Q4_0": Measured(1.60, 0.95),
        "Q4_K": Measured(1.48, 0.94),
        "Q5_K": Measured(1.49, 0.81),
        "Q6_K": Measured(1.34, 0.72),
    },
    "avx2": {
        "Q4_0": Measured(0.44, 0.44),
        "Q8_0": Measured(0.38, 0.23),
        "Q4_K": Measured(0.39, 0.40),
        "Q6_K": Measured(0.42, 0.22),
    },
}


def limb_isa(lib: Any) -> LimbIsa | None:
    """The path the limbs take in the loaded kernels library `lib`: "amx" where batches go to
    AMX tiles (the instructions, not their emulation: PROBSERVE_LIMB_TILES=emulate measures as
    the vpdpbusd path it replaces), "avx512-vnni", "avx2", or None (no limbs built)."""
    if int(lib.ps_limb_tiles()) == 1:
        return "amx"
    return {512: "avx512-vnni", 256: "avx2"}.get(int(lib.ps_limbs_isa()))  # type: ignore[return-value]


def auto_limbs(isa: LimbIsa | None, formats: Iterable[str]) -> frozenset[str]:
    """The formats of `formats` that `--products auto` multiplies in limbs on `isa`."""
    table = MEASURED.get(isa, {}) if isa is not None else {}
    return frozenset(f for f in formats if f in table and table[f].limbs)


def chosen_limbs(
    products: Products, isa: LimbIsa | None, capable: Iterable[str], held: Iterable[str]
) -> frozenset[str]:
    """The formats held (`held`) that run in limbs: none for "float", every one the library
    multiplies in limbs (`capable`) for "limbs", the table's choice on `isa` for "auto"."""
    formats = set(held) & set(capable)
    if products == "float":
        return frozenset()
    if products == "limbs":
        return frozenset(formats)
    return auto_limbs(isa, formats)


def describe(limbs: Iterable[str], capable: Iterable[str], held: Iterable[str]) -> str:
    """What /health and the fingerprint say: "float" where no format held runs in limbs,
    "limbs" where every one the library could runs in them, else each such format's choice,
    "Q4_K=limbs,Q6_K=float"."""
    chosen = set(limbs)
    could = sorted(set(held) & set(capable))
    if not chosen:
        return "float"
    if chosen == set(could):
        return "limbs"
    return ",".join(f"{f}={'limbs' if f in chosen else 'float'}" for f in could)
