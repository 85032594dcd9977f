"""Exactness against the truth: prompt logprobs of the embedded model (its native Q4_1/Q8_0
weights, the deterministic kernels) against a float64 forward of the same dequantized weights,
on every kernel ISA path this CPU can run (the narrower forced with PROBSERVE_KERNEL_ISA=avx2)
and with each product (--products float, and limbs: in integer limbs on AVX-512 VNNI or AVX2,
which the test checks /health's fact says; batches of many rows on AMX tiles where the CPU has
them, and also through the tiles' emulation, PROBSERVE_LIMB_TILES=emulate: on a CPU without
AVX-512 VNNI in the build whose AVX-512 limb path runs on SIMDe, PROBSERVE_KERNEL_ISA=
avx512-emulated).
probserve must be at most 2x as far from float64 as transformers' float32 forward is (its worst
over the summation orders its BLAS takes at 1, 2 and 4 threads), 1.5x over every token's error
pooled (root-mean-square), and within 1e-4 of that float32 reference (docs/logprobs.md,
"Exactness"); the kernels must report the ISA path the test forced (/health's `kernel_isa`).
The same rule for the newer families, on tiny random models of transformers' classes (Qwen3.5
dense and MoE, Qwen3-Next, Gemma 4 text), in process on the native ISA path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from float64_truth import compare, truth_everywhere
from test_gemma4 import _config as gemma4_config
from test_gemma4 import _saved
from test_qwen35 import KINDS, _prompt, tiny_hybrid

from probserve.engine import EngineConfig, EngineCore
from probserve.kernels.build import simde_version
from probserve.models import LoadedModel
from probserve.models.loader import load_model

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


def _flags() -> str:
    return Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""


def _paths() -> list[tuple[str, str]]:
    """(ISA path, products): each path's float products and its limbs (limbs.cpp: AVX-512 VNNI
    where the CPU has it, else AVX2)."""
    paths = [("native", "float"), ("native", "limbs")]
    if " avx512f" in _flags():
        paths += [("avx2", "float"), ("avx2", "limbs")]
    if " avx512_vnni" in _flags():
        paths += [("emulate", "limbs")]  # the AMX kernels' code on the tiles' emulation
    elif simde_version() is not None:  # ... and the AVX-512 path's on SIMDe's emulation
        paths += [("avx512-emulated", "limbs")]
    return paths


def _truth(isa: str, products: str) -> list[dict]:
    env = {**os.environ, "PROBSERVE_KERNEL_ISA": isa, "OMP_NUM_THREADS": "2"}
    if isa == "emulate":
        env.update(PROBSERVE_KERNEL_ISA="native", PROBSERVE_LIMB_TILES="emulate")
    if isa == "avx512-emulated":
        env.update(PROBSERVE_LIMB_TILES="emulate")
    done = subprocess.run(
        [sys.executable, str(HERE / "float64_truth.py"), products],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 4, done.stdout
    return rows


def _isa_path(isa: str, products: str) -> set[str]:
    """What the kernels must report for a forced path: the override taken, never ignored."""
    if isa == "avx2":
        return {"avx2"}
    if isa == "emulate":
        return {"avx512-vnni+amx-emulated"}
    if isa == "avx512-emulated":
        return {f"{base}+avx512-vnni-emulated+amx-emulated" for base in ("avx2", "avx512")}
    if " avx512_vnni" not in _flags():
        return {"avx512", "avx2"}
    # the limbs on AMX where the CPU has it (Linux grants the tile state: limbs.cpp asks)
    amx = products == "limbs" and " amx_int8" in _flags()
    return {"avx512-vnni+amx"} if amx else {"avx512-vnni"}


def _rms(errors: list[float]) -> float:
    return float(sum(e * e for e in errors) / len(errors)) ** 0.5


def _assert_the_rule(rows: list[dict], label: str) -> None:
    """The float64 rule over a set of prompts' rows (float64_truth.compare's): each prompt no
    further from float64 than 2x the float32 reference and within 1e-4 of it, and the whole
    set's token-by-token root-mean-square error at most 1.5x the reference's."""
    for row in rows:
        short = {k: v for k, v in row.items() if not k.endswith("_errors")}
        print(f"\nFIGURES {label} {short}")
        # before the chained sums (2026-12-04): counting 1.20e-4 (AVX-512) and 1.17e-4 (AVX2)
        # against the reference's 4.2e-5. The reference is the worst of its summation orders
        # (float64_truth.REFERENCE_THREADS): on an Intel Xeon its counting error was 9.3e-6 on
        # one thread and 2.4e-5 on two, while the AVX2 path's was 2.5e-5 (2026-12-06)
        assert row["probserve"] <= 2 * row["reference"], short
        assert row["apart"] < 1e-4, short
    # the whole set's root-mean-square error, token by token: the statistic one unlucky token
    # does not move
    ours = _rms([e for row in rows for e in row["probserve_errors"]])
    ref = _rms([e for row in rows for e in row["reference_errors"]])
    print(f"\nFIGURES {label} rms probserve {ours:.3g} reference {ref:.3g}")
    assert ours <= 1.5 * ref, (ours, ref)


@pytest.mark.parametrize(("isa", "products"), _paths())
def test_logprobs_are_as_close_to_float64_as_float32_is(isa: str, products: str) -> None:
    rows = _truth(isa, products)
    for row in rows:
        assert row["products"] == products, row["prompt"]
        assert row["kernel_isa"] in _isa_path(isa, products), row["kernel_isa"]
    _assert_the_rule(rows, f"{isa} {products}")


# Qwen3.5 dense's second prompt: one token (its 8th) 6.5e-6 from float64 where the reference is
# 2.9e-6 at worst (2.2e-6 there): 2.24x. The float32 reference is lucky there, no kernel is off
# (2026-12-06, the test's three prompts): each deterministic operation, on the inputs it met,
# against float64 and against torch's float32 form of it (root-mean-square error): RMSNorm
# 5.90e-8 vs 6.16e-8, SiLU-mul the same bits, products 1.150e-7 vs 1.151e-7 (99.6% the same
# bits), attention 3.56e-8 vs 4.03e-8, the delta rule 8.3e-10 vs 1.0e-9 (delta_rule.py's in
# float32). Over 63 prompts (these three, and 60 of 40 tokens: seeds 10-69): probserve's pooled
# error 1.39e-6, the torch path's 1.60e-6, the reference's 1.64e-6; a prompt past 2x the
# reference's worst token: 4 of 63 for probserve, 3 for the torch path (its own worst 2.64x).
# In float64 one at a time: the body's products (what dominates; the head's alone changes
# nothing) 0 of 63 and 9.4e-7; the norms, the attention, the delta rule or the scoring 1 to 4
# of 63, each moving which prompt is unlucky. Marked where it was measured, the AVX-512 path
# (strict: a pass fails it); the AVX2 path's own order of sums (an AMD EPYC without AVX-512,
# 2026-12-07) passes the rule on the same prompts (its worst token 1.26x, rms 1.12e-6 against
# the reference's 1.61e-6), and must.
OUTLIER = "qwen3_5: one token 2.24x the float32 reference's float64 error, the reference lucky"
NEW_FAMILIES = [
    pytest.param(k, marks=pytest.mark.xfail(" avx512f" in _flags(), strict=True, reason=OUTLIER))
    if k == "qwen3_5"
    else k
    for k in [*KINDS, "gemma4"]
]


@pytest.mark.parametrize("kind", NEW_FAMILIES)
def test_the_new_families_are_as_close_to_float64_as_float32_is(
    kind: str, smol: LoadedModel, tmp_path: Path
) -> None:
    """Qwen3.5 dense and MoE, Qwen3-Next (their recurrence: kernels/deltanet.cpp) and Gemma 4
    text, tiny random models of transformers' classes, on the deterministic kernels: the same
    rule against a float64 forward of the same weights (every float32 cast in their code made
    float64: float64_truth.Float64Everywhere)."""
    if kind == "gemma4":
        where = _saved(gemma4_config("shared", smol.vocab_size), tmp_path, smol.tokenizer)
        loaded = load_model(str(where))
    else:
        loaded = tiny_hybrid(kind, smol)
    core = EngineCore(loaded, EngineConfig(kv_cache_gib=0.02, block_size=4))
    assert core.info.deterministic
    rows = []
    for seed, n in ((1, 23), (2, 40), (3, 64)):
        ids = _prompt(seed, n)
        truth = truth_everywhere(loaded.model, ids)
        rows.append(compare(core, loaded.model, f"{kind}-{n}", ids, truth))
    _assert_the_rule(rows, kind)
