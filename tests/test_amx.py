"""The integer limbs on AMX tiles (kernels/limbs_amx.h, tiles.h): on any CPU the AMX kernels'
code runs through the tiles' exact emulation (on a CPU without AVX-512 VNNI, in the build whose
AVX-512 limb path runs on SIMDe's emulation: PROBSERVE_KERNEL_ISA=avx512-emulated) and must give
the vpdpbusd path's bytes, and this CPU's own limbs' bytes, for every format and row count; on a
CPU with AMX-INT8 the instructions must give the emulation's
bytes; the automatic choice (tiles from ps_limb_tile_rows(fmt) rows) is what the library says
(/health's kernel_isa) and what PROBSERVE_LIMB_TILES asks; and `--products auto`
(engine/core/products.py) resolves per format as its table says on each simulated CPU, with
batch-invariant bits where a model's formats split between float and limbs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import run_core
from test_deterministic import _bits, _canary, _others
from test_quantized import LIMB_FORMATS, SHAPES, kmix, random_blocks, tiny256  # noqa: F401

from probserve.engine import EngineConfig, EngineCore, EngineRequest, LogprobsSpec, SamplingParams
from probserve.kernels.build import ISA_ENV, KernelBuildError, isa_path, load
from probserve.kernels.invariant import InvariantKernels
from probserve.kernels.weights import QuantizedWeight

VNNI, AMX, EMULATED = 0, 1, 2  # limbs.cpp's LimbTiles


@pytest.fixture(scope="module")
def limbs() -> InvariantKernels:
    kernels = InvariantKernels(limbs=True)
    if not kernels.limb_types:
        pytest.skip("no AVX2 here: limbs.cpp multiplies no format")
    return kernels


@pytest.fixture(scope="module")
def tiled(limbs: InvariantKernels) -> InvariantKernels:
    """Kernels whose limbs have the tile path: this CPU's own (the AVX-512 VNNI build), else the
    build whose AVX-512 limb path, the same source, runs on SIMDe's emulation of its intrinsics
    (its tiles on tiles.h's emulation: the AMX kernels' code on a CPU with AVX2 alone)."""
    if int(limbs.lib.ps_limbs_isa()) == 512:
        return limbs
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ISA_ENV, "avx512-emulated")
        try:
            kernels = InvariantKernels(limbs=True)
        except KernelBuildError as exc:  # no SIMDe headers: `make simde` installs them
            pytest.skip(str(exc).splitlines()[0])
    assert isa_path(kernels.lib) == isa_path(limbs.lib) + "+avx512-vnni-emulated"
    return kernels


def test_the_emulated_build_says_what_it_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """PROBSERVE_KERNEL_ISA=avx512-emulated without SIMDe's headers: one line naming them and
    how to install them, before any compiler runs."""
    from probserve.kernels import build

    monkeypatch.setenv(ISA_ENV, "avx512-emulated")
    monkeypatch.setattr(build, "simde_version", lambda: None)
    monkeypatch.setattr(build, "compiler", lambda: pytest.fail("the compiler was asked"))
    with pytest.raises(KernelBuildError, match=r"needs SIMDe's headers .*libsimde-dev"):
        load()


def _case(
    limbs: InvariantKernels, qtype: gguf.GGMLQuantizationType, seed: int
) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random weight of 37 columns (a panel and a part of one; 33 for the K-quants, over two
    super-blocks) with a bias, and 40 rows of x with a span of tiny values (a block of 32, a
    K-quant's super-block: its own exponent), a row of zeros, an outlier and a NaN."""
    qk = gguf.GGML_QUANT_SIZES[qtype][0]
    n, k = SHAPES[qk][0] if qk == 32 else SHAPES[qk][4]
    rng = np.random.default_rng(seed + qtype.value)
    raw = random_blocks(qtype, n, k, rng)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    x = torch.from_numpy(rng.standard_normal((40, k)).astype(np.float32))
    x[3, :qk] *= 1e-30
    x[5, :] = 0.0
    x[17, 7] *= 3e5
    x[22, 40] = float("nan")
    return limbs.qpack(raw, qtype.value, bias), x


def _bytes(t: torch.Tensor | None) -> bytes:
    assert t is not None
    return t.numpy().tobytes()


@pytest.mark.parametrize("qtype", LIMB_FORMATS, ids=lambda q: q.name)
def test_emulated_tiles_give_the_vpdpbusd_bits_at_every_row_count(limbs, tiled, qtype):
    """Rows 1..40 (one tile pass, part of one, several) through the emulated AMX kernel: the
    bytes of the vpdpbusd path's product, which is row-invariant (tests/test_quantized.py), and
    of this CPU's own limbs (its AVX2 path where the AVX-512 one is emulated)."""
    packed, x = _case(limbs, qtype, 64)  # (one layout for every ISA path: pack_limbs')
    want = _bytes(tiled.limb_product(x, packed, VNNI))
    assert _bytes(limbs.limb_product(x, packed, VNNI)) == want
    row = len(want) // 40
    for rows in range(1, 41):
        got = _bytes(tiled.limb_product(x[:rows], packed, EMULATED))
        assert got == want[: rows * row], (qtype.name, rows)


KQUANTS = [q for q in LIMB_FORMATS if gguf.GGML_QUANT_SIZES[q][0] == 256]


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda q: q.name)
def test_the_k_quants_rows_in_blocks_give_the_same_bits(limbs, tiled, qtype):
    """A K-quant's tile path takes its rows in blocks whose limbs stay in a core's L2 (1 MiB:
    32 rows at K = 8192), every panel through one block, then the next: 40 rows (a block and a
    part of a pass), emulated and on the real tiles where there are some, give the vpdpbusd
    path's bytes (and this CPU's own limbs'), row for row."""
    rng = np.random.default_rng(7 + qtype.value)
    n, k = 33, 8192
    packed = limbs.qpack(random_blocks(qtype, n, k, rng), qtype.value, None)
    x = torch.from_numpy(rng.standard_normal((40, k)).astype(np.float32))
    x[35, 300:560] *= 1e-20  # a super-block of tiny values in the second block
    want = _bytes(tiled.limb_product(x, packed, VNNI))
    assert _bytes(limbs.limb_product(x, packed, VNNI)) == want
    assert _bytes(tiled.limb_product(x, packed, EMULATED)) == want
    if _has_amx(tiled):
        assert _bytes(tiled.limb_product(x, packed, AMX)) == want


def _has_amx(limbs: InvariantKernels) -> bool:
    packed, x = _case(limbs, LIMB_FORMATS[0], 1)
    return limbs.limb_product(x[:1], packed, AMX) is not None


@pytest.mark.parametrize("qtype", LIMB_FORMATS, ids=lambda q: q.name)
def test_amx_instructions_give_the_emulations_bits(limbs, qtype):
    """The real tdpbsud, tileloadd and tilestored against their emulation, byte for byte."""
    if not _has_amx(limbs):
        pytest.skip("this CPU has no AMX-INT8, or Linux refused this process the tile state")
    packed, x = _case(limbs, qtype, 65)
    for rows in (1, 15, 16, 17, 40):
        want = _bytes(limbs.limb_product(x[:rows], packed, EMULATED))
        assert _bytes(limbs.limb_product(x[:rows], packed, AMX)) == want, (qtype.name, rows)


def test_the_choice_is_reported_and_needs_amx(limbs):
    """The library's automatic choice: AMX exactly where this CPU can run it (kernel_isa says
    "+amx"), and batches from the row threshold on take it with the vpdpbusd path's bits."""
    lib = limbs.lib
    # the K-quants' passes (one join a super-block) pay from 8 rows, the blocks of 32's from 10
    assert [int(lib.ps_limb_tile_rows(f)) for f in range(8)] == [10, 10, 10, 10, 10, 8, 8, 8]
    if os.environ.get("PROBSERVE_LIMB_TILES") in (None, "", "auto"):
        assert int(lib.ps_limb_tiles()) == (AMX if _has_amx(limbs) else VNNI)
    assert isa_path(lib, limbs=True).endswith("+amx") == (int(lib.ps_limb_tiles()) == AMX)
    assert "amx" not in isa_path(lib)  # float products: no tiles
    packed, x = _case(limbs, LIMB_FORMATS[0], 66)
    assert _bytes(limbs.qlinear(x, packed)) == _bytes(limbs.limb_product(x, packed, VNNI))


EMULATE = """
import sys, numpy as np, torch
from probserve.kernels.build import isa_path
from probserve.kernels.invariant import InvariantKernels
from probserve.kernels.weights import QuantizedWeight
kernels = InvariantKernels(limbs=True)
data = np.load(sys.argv[1])
w = QuantizedWeight(torch.from_numpy(data["data"]), torch.from_numpy(data["bias"]),
                    int(data["fmt"]), int(data["n"]), int(data["k"]))
out = kernels.qlinear(torch.from_numpy(data["x"]), w).numpy()
np.savez(sys.argv[2], isa=np.array(isa_path(kernels.lib, limbs=True)), out=out)
"""


@pytest.mark.slow
def test_emulate_in_the_environment_takes_every_batch_to_the_emulation(
    limbs, tiled, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """PROBSERVE_LIMB_TILES=emulate: a process's batches of 10 rows or more run the emulated
    tiles (as the engine's do: kernel_isa says so) with the bytes this process computes; a value
    that is not a choice is refused when the library loads."""
    packed, x = _case(limbs, LIMB_FORMATS[0], 67)
    assert packed.bias is not None
    np.savez(
        tmp_path / "in.npz", data=packed.data.numpy(), bias=packed.bias.numpy(), fmt=packed.fmt,
        n=packed.n, k=packed.k, x=x.numpy(),
    )  # fmt: skip
    env = {**os.environ, "PROBSERVE_LIMB_TILES": "emulate", "OMP_NUM_THREADS": "2"}
    if tiled is not limbs:  # the AVX-512 limb path on SIMDe's emulation
        env[ISA_ENV] = "avx512-emulated"
    args = [sys.executable, "-c", EMULATE, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    assert str(got["isa"]).endswith("+amx-emulated")
    assert got["out"].tobytes() == _bytes(limbs.limb_product(x, packed, VNNI))
    monkeypatch.setenv("PROBSERVE_LIMB_TILES", "sometimes")
    with pytest.raises(KernelBuildError, match="PROBSERVE_LIMB_TILES='sometimes'"):
        load()


# ---- --products auto: the measured choice per format -----------------------------------------
class _Lib:
    """A kernels library's two answers limb_isa reads, as a CPU of each kind gives them."""

    def __init__(self, tiles: int, isa: int) -> None:
        self.tiles, self.isa = tiles, isa

    def ps_limb_tiles(self) -> int:
        return self.tiles

    def ps_limbs_isa(self) -> int:
        return self.isa


def test_auto_resolves_per_isa_as_the_table_says():
    """Each simulated CPU's limb path (AMX, VNNI without AMX or with the tiles emulated, AVX2,
    none) gets the formats its table measured faster in limbs (one row's and 16 rows' speed-ups
    weighed alike), float for the rest and for formats it did not measure; float and limbs as
    asked whatever the CPU."""
    from probserve.engine.core.products import MEASURED, auto_limbs, chosen_limbs, limb_isa

    assert limb_isa(_Lib(AMX, 512)) == "amx"
    assert limb_isa(_Lib(VNNI, 512)) == limb_isa(_Lib(EMULATED, 512)) == "avx512-vnni"
    assert limb_isa(_Lib(VNNI, 256)) == "avx2" and limb_isa(_Lib(VNNI, 0)) is None
    every = [q.name for q in LIMB_FORMATS]
    for isa, table in MEASURED.items():
        want = {f for f, m in table.items() if m.one_row * m.rows16 >= 1.0}
        assert auto_limbs(isa, every) == want, isa
        assert chosen_limbs("auto", isa, every, [*every, "MXFP4"]) == want
    assert auto_limbs("avx2", every) == frozenset()  # float wins everywhere there
    # the K-quants' one join a super-block wins on the tiles (Q6_K too); on VNNI alone Q6_K's
    # 16 rows did not pay (measured before it)
    assert {"Q4_0", "Q8_0", "Q4_K", "Q6_K"} <= auto_limbs("amx", every)
    on_vnni = auto_limbs("avx512-vnni", every)
    assert "Q4_K" in on_vnni and "Q6_K" not in on_vnni
    assert auto_limbs(None, every) == frozenset()
    assert chosen_limbs("limbs", "avx2", every, ["Q4_K", "Q6_K", "MXFP4"]) == {"Q4_K", "Q6_K"}
    assert chosen_limbs("float", "amx", every, every) == frozenset()


def test_describe_says_each_formats_choice_where_they_split():
    from probserve.engine.core.products import describe

    every = ["Q4_K", "Q5_K", "Q6_K"]
    assert describe([], every, ["Q4_K", "Q6_K"]) == "float"
    assert describe(["Q4_K", "Q6_K"], every, ["Q4_K", "Q6_K", "MXFP4"]) == "limbs"
    assert describe(["Q4_K"], every, ["Q6_K", "Q4_K", "MXFP4"]) == "Q4_K=limbs,Q6_K=float"


def test_auto_splits_a_model_by_format_and_stays_batch_invariant(request, limbs, monkeypatch):
    """The K-quant mix (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1) served with --products auto on a simulated
    AVX-512 VNNI CPU: /health and the fingerprint say each format's choice (Q4_K in limbs,
    Q6_K float),
    the numbers differ from both uniform choices', and a request among others (the batch's
    rows taking the tiles or vpdpbusd by count) is the same bits as alone."""
    from probserve.engine.core import products

    blocks, _, _ = request.getfixturevalue("kmix")  # test_quantized's
    monkeypatch.setattr(products, "limb_isa", lambda lib: "avx512-vnni")
    config = EngineConfig(kv_cache_gib=0.05, block_size=4, products="auto")
    core = EngineCore(blocks, config)
    said = dict(part.split("=") for part in core.info.products.split(","))
    assert said["Q4_K"] == "limbs" and said["Q6_K"] == "float", said
    want = products.auto_limbs("avx512-vnni", said)
    assert {f for f, v in said.items() if v == "limbs"} == want
    fingerprint = core.info.fingerprint
    assert fingerprint is not None and fingerprint.products == core.info.products
    ids = tuple(blocks.tokenizer("The quick brown fox jumps over the lazy dog because").input_ids)
    req = EngineRequest("p", ids, SamplingParams(max_tokens=1), LogprobsSpec(prompt_top_k=1))

    def prompt(c: EngineCore) -> bytes:
        out = next(o.prompt_logprobs for o in run_core(c, [req])["p"] if o.prompt_logprobs)
        return np.asarray(out.logprobs).tobytes()

    mine = prompt(core)
    for other in ("float", "limbs"):
        uniform = EngineCore(blocks, EngineConfig(kv_cache_gib=0.05, block_size=4, products=other))
        assert uniform.info.products == other
        assert uniform.info.system_fingerprint != core.info.system_fingerprint
        assert prompt(uniform) != mine, other
    alone = run_core(core, [_canary(blocks, seeded=True)])["canary"]
    crowd = _others(blocks, 20, seed=3)
    mixed = run_core(core, [*crowd[:10], _canary(blocks, seeded=True), *crowd[10:]])
    assert _bits(mixed["canary"]) == _bits(alone)
