"""--weights native: GGUF blocks multiplied in place (kernels/quantized.cpp), checked bit for bit
against dequantize-then-multiply, and whole requests against the float32 path."""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import run_core
from gguf import GGMLQuantizationType as Q
from native_util import assert_native_equals_op_by_op
from test_deterministic import _bits, _canary

from probserve.engine import EngineConfig, EngineCore
from probserve.kernels.build import isa_path
from probserve.kernels.invariant import InvariantKernels
from probserve.models import LoadedModel, load_model
from probserve.models.gguf_blocks import QuantizedTensor, load_weights, read_weights
from probserve.models.linear import Joined
from probserve.models.llama import LlamaForward

FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4]
# the float16 fields of each format's block (d first; then m or dmin), by byte offset
HALVES = {
    Q.Q4_1: (0, 2), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.MXFP4: (),
}  # fmt: skip
# shapes [N, K] per block length along K (K a multiple of it)
SHAPES = {
    32: [(37, 96), (576, 576), (1, 32), (100, 1536), (33, 64), (20, 64)],
    256: [(37, 256), (576, 768), (1, 256), (100, 1536), (33, 512), (20, 512)],
}


@pytest.fixture(scope="module")
def kernels() -> InvariantKernels:
    return InvariantKernels()


@pytest.fixture(scope="module")
def native() -> LoadedModel:
    """The embedded model with its GGUF blocks as the file holds them."""
    return load_model(None, "native")


def random_blocks(
    qtype: Q, n: int, k: int, rng: np.random.Generator, halves: np.ndarray | None = None
) -> np.ndarray:
    """n rows of blocks: random quants and sub-block scales (every bit pattern), and float16
    fields drawn from every finite float16 (subnormals and the largest included: the in-register
    arithmetic must match for all), or from `halves` (float16 values to draw from)."""
    qk, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // qk, size), dtype=np.uint8)
    for at in HALVES.get(qtype, (0,)):
        if halves is None:
            bits = rng.integers(0, 1 << 16, size=(n, k // qk), dtype=np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] &= 0x3FFF  # no inf or NaN: a finite exponent
        else:
            bits = rng.choice(halves.astype(np.float16), size=(n, k // qk)).view(np.uint16)
        raw[..., at : at + 2] = bits.view(np.uint8).reshape(n, k // qk, 2)
    if qtype == Q.MXFP4:  # its E8M0 scale 2^(e - 128): subnormal (e < 2) to 2^72, products finite
        raw[..., 0] = rng.integers(0, 201, size=(n, k // qk), dtype=np.uint8)
    return raw.reshape(n, -1)


def dequantized(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    """gguf's own dequantization (what transformers loads), as float32 [n, k]."""
    values = gguf.dequantize(raw, qtype).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(values).reshape(raw.shape[0], -1))


def assert_row_invariant(kernels: InvariantKernels, x: torch.Tensor, packed, full: torch.Tensor):
    """Every row count from 1 to 40 (registers, then a buffered panel or a shared limb buffer)
    gives each row the bits it has in the full product."""
    for rows in range(1, 41):
        start = random.Random(rows).randrange(0, 41 - rows)
        part = kernels.qlinear(x[start : start + rows], packed)
        assert part.numpy().tobytes() == full[start : start + rows].numpy().tobytes()


# ---- the kernel -------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", range(6))
def test_quantized_linear_equals_the_dequantized_product(kernels, qtype: Q, shape: int):
    n, k = SHAPES[gguf.GGML_QUANT_SIZES[qtype][0]][shape]
    rng = np.random.default_rng(n * k + qtype.value)
    raw = random_blocks(qtype, n, k, rng)
    weight = dequantized(raw, qtype)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    packed_q = kernels.qpack(raw, qtype.value, bias)
    packed_f = kernels.pack(weight, bias)
    x = torch.from_numpy(rng.standard_normal((40, k)).astype(np.float32))
    full = kernels.qlinear(x, packed_q)
    # bit for bit against the float32 kernel on gguf's dequantized weight...
    assert full.numpy().tobytes() == kernels.linear(x, packed_f).numpy().tobytes()
    # float32 rounding against float64, bounded by the terms' magnitudes (scales span float16)
    reference = F.linear(x.double(), weight.double(), bias.double())
    scale = F.linear(x.double().abs(), weight.double().abs(), bias.double().abs())
    finite = torch.isfinite(full)
    error = (full.double() - reference).abs()[finite]
    assert (error <= 1e-5 * scale[finite] + 1e-30).all()
    # ... and row-invariant: every row count (registers up to 12 rows, a buffered panel beyond)
    assert_row_invariant(kernels, x, packed_q, full)
    ids = torch.tensor([0, n - 1, n // 2, 0])
    assert torch.equal(kernels.qrows(packed_q, ids), weight[ids])
    with pytest.raises(IndexError):
        kernels.qrows(packed_q, torch.tensor([n]))


# the quant bytes of a block, for the formats whose weights carry an offset term (w = s q + o)
QUANT_BYTES = {Q.Q4_1: (4, 20), Q.Q5_1: (4, 24), Q.Q4_K: (16, 144), Q.Q5_K: (16, 176)}


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [0, 3, 4])
def test_block_sums_are_row_invariant_and_within_float32_rounding(kernels, qtype: Q, shape: int):
    """--block-sums: each sub-block's scale (and offset) applied once to its sums. Not the
    dequantized product's bits, but within float32 rounding of the exact value (bounded by the
    magnitudes of the terms it adds: s * q and the offset), and row-invariant for every row
    count (registers up to 3 rows on AVX2, a panel's quants buffered beyond)."""
    sums = InvariantKernels(block_sums=True)
    n, k = SHAPES[gguf.GGML_QUANT_SIZES[qtype][0]][shape]
    rng = np.random.default_rng(n * k + qtype.value + 1)
    raw = random_blocks(qtype, n, k, rng)
    weight = dequantized(raw, qtype)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    packed = sums.qpack(raw, qtype.value, bias)
    x = torch.from_numpy(rng.standard_normal((40, k)).astype(np.float32))
    full = sums.qlinear(x, packed)
    exact = kernels.qlinear(x, kernels.qpack(raw, qtype.value, bias))
    assert packed.fmt != kernels.qpack(raw[:1], qtype.value).fmt
    assert k < 64 or full.numpy().tobytes() != exact.numpy().tobytes()  # another arithmetic
    offset = torch.zeros_like(weight)
    if qtype in QUANT_BYTES:  # the offset alone: every quant zero
        a, b = QUANT_BYTES[qtype]
        size = gguf.GGML_QUANT_SIZES[qtype][1]
        zero = raw.reshape(n, -1, size).copy()
        zero[..., a:b] = 0
        offset = dequantized(zero.reshape(n, -1), qtype)
    magnitude = (weight.double() - offset.double()).abs() + offset.double().abs()
    reference = F.linear(x.double(), weight.double(), bias.double())
    scale = F.linear(x.double().abs(), magnitude, bias.double().abs())
    finite = torch.isfinite(full)
    assert finite.float().mean() > 0.99
    error = (full.double() - reference).abs()[finite]
    assert (error <= 1e-5 * scale[finite] + 1e-30).all()
    assert_row_invariant(sums, x, packed, full)
    ids = torch.tensor([0, n - 1, n // 2, 0])
    assert torch.equal(sums.qrows(packed, ids), weight[ids])  # lookups stay the exact values


# ---- integer limbs (limbs.cpp, --products limbs) ----------------------------------------------
LIMB_FORMATS = [q for q in FORMATS if q != Q.MXFP4]
# the bytes of each format's quants in the file's block (d, m and scales elsewhere), for the
# formats whose weight is s u + o
QUANT_BYTES = {Q.Q4_1: (4, 20), Q.Q5_1: (4, 24), Q.Q4_K: (16, 144), Q.Q5_K: (16, 176)}


@pytest.fixture(scope="module")
def limbs() -> InvariantKernels:
    kernels = InvariantKernels(limbs=True)
    if not kernels.limb_types:
        pytest.skip("no AVX2 here: limbs.cpp multiplies no format")
    assert kernels.limb_types == {q.value for q in LIMB_FORMATS}
    return kernels


def _offsets(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    """Each weight's o of w = s u + o (Q4_1, Q5_1: m; Q4_K, Q5_K: -dmin mn): the weight gguf
    dequantizes with every quant 0."""
    lo, hi = QUANT_BYTES[qtype]
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    zeroed = raw.reshape(raw.shape[0], -1, size).copy()
    zeroed[..., lo:hi] = 0
    return dequantized(zeroed.reshape(raw.shape[0], -1), qtype)


def _limb_bound(x: torch.Tensor, raw: np.ndarray, qtype: Q) -> torch.Tensor:
    """limbs.cpp's error bound: each x off by less than its span's largest |x| / XMAX (times
    |w|; a span is a block of 32 k's, a K-quant's super-block of 256: limbs_super.h), the
    float64 roundings (at most 2^-51 of sum |x| (|s u| + |o|) a block of 32), and for the formats
    with an o the weights' own rounding (s u + o is exact in the limbs, rounded once in gguf's
    float32 copy); the result's float32 rounding is the caller's."""
    k = x.shape[1]
    weight = dequantized(raw, qtype).double()
    span = gguf.GGML_QUANT_SIZES[qtype][0]  # 32, or the K-quants' 256
    top = x.double().abs().reshape(x.shape[0], k // span, span).amax(-1).repeat_interleave(span, -1)
    w = weight.abs()
    magnitude = F.linear(x.double().abs(), w)
    parts = magnitude
    if qtype in QUANT_BYTES:  # |s u| + |o| <= |w| + 2 |o|
        parts = F.linear(x.double().abs(), w + 2 * _offsets(raw, qtype).double().abs())
    bound = F.linear(top, w) / (127 * 16843009) + parts * (k // 32) * 2.0**-51  # top / XMAX
    if qtype in QUANT_BYTES:
        bound += magnitude * 2.0**-24
    return bound


@pytest.mark.parametrize("qtype", LIMB_FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", range(6))
def test_limb_products_are_within_their_bound_and_row_invariant(limbs, qtype: Q, shape: int):
    """Every float16 field (subnormals to 65504), every quant and sub-block scale: within the
    bound of the file's head comment, bitwise the same for every row count, and the lookups
    gguf's exact values."""
    qk, size = gguf.GGML_QUANT_SIZES[qtype]
    n, k = SHAPES[qk][shape]
    rng = np.random.default_rng(n * k + qtype.value + 7)
    raw = random_blocks(qtype, n, k, rng)
    weight = dequantized(raw, qtype)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    packed = limbs.qpack(raw, qtype.value, bias)
    # the file's bytes, moved (padded to 32 columns); Q4_K and Q5_K's 6-bit scales a byte each
    unpacked = 4 if qtype in (Q.Q4_K, Q.Q5_K) else 0
    assert packed.data.numel() == -(-n // 32) * 32 * (k // qk) * (size + unpacked)
    x = torch.from_numpy(rng.standard_normal((40, k)).astype(np.float32))
    # a span of tiny values (a block of 32, a K-quant's super-block): its own exponent
    x[3, :qk] *= 1e-30
    x[5, :] = 0.0
    full = limbs.qlinear(x, packed)
    reference = F.linear(x.double(), weight.double())
    finite = torch.isfinite(full) & (reference.abs() < 1e38)
    assert finite.float().mean() > 0.99
    # the bias is added in float32 after the product's one rounding: a second rounding
    product = full.double() - bias.double()
    slack = (full.double().abs() + bias.double().abs()) * 2.0**-23
    error = (product - reference).abs()
    assert (error <= _limb_bound(x, raw, qtype) + slack + 1e-38)[finite].all()
    assert torch.equal(full[5], bias)  # zeros: exactly the bias
    assert_row_invariant(limbs, x, packed, full)
    ids = torch.tensor([0, n - 1, n // 2, 0])
    assert torch.equal(limbs.qrows(packed, ids), weight[ids])


AVX2_LIMBS = """
import sys, numpy as np, torch
from probserve.kernels.build import isa_path
from probserve.kernels.build import isa_path
from probserve.kernels.invariant import InvariantKernels
kernels = InvariantKernels(limbs=True)
data = np.load(sys.argv[1])
out = {"isa": np.array(isa_path(kernels.lib))}
for name in data.files:
    if name.startswith("raw_"):
        qtype = int(name[4:])
        packed = kernels.qpack(data[name], qtype)
        x = torch.from_numpy(data["x_" + str(qtype)])
        parts = [kernels.qlinear(x[:r], packed).numpy() for r in (1, 5, 40)]
        out[str(qtype)] = np.concatenate(parts)
np.savez(sys.argv[2], **out)
"""


@pytest.mark.slow
def test_limbs_on_the_avx2_path_are_the_same_bits(limbs, tmp_path: Path):
    """The AVX2 path (PROBSERVE_KERNEL_ISA=avx2: vpmaddubsw runs summed in int16, Q8_0's quants
    as two nibbles) computes the same exact sums: every format's products, at 1, 5 and 40 rows,
    the same bits as this CPU's limbs, and within their bound (the kernel tests above run on
    whichever path a CPU has)."""
    import os
    import subprocess
    import sys

    if " avx512_vnni" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU's limbs are the AVX2 path")
    rng = np.random.default_rng(48)
    arrays, want = {}, {}
    for qtype in LIMB_FORMATS:
        qk = gguf.GGML_QUANT_SIZES[qtype][0]
        n, k = SHAPES[qk][3]
        raw = random_blocks(qtype, n, k, rng)
        x = torch.from_numpy(rng.standard_normal((40, k)).astype(np.float32))
        x[2, 5] *= 300.0
        arrays[f"raw_{qtype.value}"], arrays[f"x_{qtype.value}"] = raw, x.numpy()
        packed = limbs.qpack(raw, qtype.value)
        want[qtype] = np.concatenate([limbs.qlinear(x[:r], packed).numpy() for r in (1, 5, 40)])
    np.savez(tmp_path / "in.npz", **arrays)
    env = {**os.environ, "PROBSERVE_KERNEL_ISA": "avx2", "OMP_NUM_THREADS": "2"}
    args = [sys.executable, "-c", AVX2_LIMBS, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    # the override was taken: the library the subprocess ran says it is the AVX2 build, and
    # this process's says it is not (else the two could be one build, compared with itself)
    assert str(got["isa"]) == "avx2"
    assert isa_path(limbs.lib) == "avx512-vnni"
    for qtype in LIMB_FORMATS:
        assert got[str(qtype.value)].tobytes() == want[qtype].tobytes(), qtype.name


def _model_like(qtype: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A weight as models hold them: gguf's quantization of normals (x 0.02), or for the
    K-quants (gguf-py has no quantizer for them) `model_blocks`."""
    if gguf.GGML_QUANT_SIZES[qtype][0] == 32:
        return gguf.quants.quantize(rng.standard_normal((n, k), dtype=np.float32) * 0.02, qtype)
    return model_blocks(qtype, n, k, rng)


@pytest.mark.parametrize("qtype", LIMB_FORMATS, ids=lambda q: q.name)
def test_limb_products_are_closer_to_float64_than_float32(limbs, kernels, qtype: Q):
    """A weight as models hold them, rows with outliers: the limbs' error against the float64
    product is smaller than the float32 path's, at its largest and on average; a non-finite
    activation gives NaN, as in float32."""
    rng = np.random.default_rng(qtype.value)
    n, k = 512, 2048
    raw = _model_like(qtype, n, k, rng)
    weight = dequantized(raw, qtype)
    x = torch.from_numpy(rng.standard_normal((24, k)).astype(np.float32))
    x[:, 7] *= 50.0  # a massive-activation channel, as LLMs have
    truth = F.linear(x.double(), weight.double())
    ours = limbs.qlinear(x, limbs.qpack(raw, qtype.value)).double()
    float32 = kernels.qlinear(x, kernels.qpack(raw, qtype.value)).double()
    err, err32 = (ours - truth).abs(), (float32 - truth).abs()
    assert err.max() < err32.max(), (float(err.max()), float(err32.max()))
    assert err.pow(2).mean() < err32.pow(2).mean()
    x[2, 100] = float("nan")
    x[4, 0] = float("inf")
    bad = limbs.qlinear(x, limbs.qpack(raw, qtype.value))
    assert torch.isnan(bad[2]).all() and torch.isnan(bad[4]).all()
    assert torch.isfinite(bad[[0, 1, 3]]).all()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_packing_in_chunks_gives_the_same_panels(monkeypatch, qtype: Q):
    """A matrix is packed PACK_ROWS rows at a time (its transients a chunk's): the same panels as
    packed whole, a partial last chunk and a partial last panel included."""
    from probserve.kernels import qlayout

    qk = gguf.GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(qtype, 150, 2 * qk, np.random.default_rng(9))
    whole = [qlayout.pack_blocks(raw, qtype.value, 16), qlayout.pack_limbs(raw, qtype.value, 32)]
    monkeypatch.setattr(qlayout, "PACK_ROWS", 64)
    chunked = [qlayout.pack_blocks(raw, qtype.value, 16), qlayout.pack_limbs(raw, qtype.value, 32)]
    for a, b in zip(whole, chunked, strict=True):
        assert a.shape == b.shape and np.array_equal(a, b)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_a_matrix_in_a_file_is_packed_a_chunk_at_a_time(monkeypatch, tmp_path, qtype: Q):
    """A matrix held as rows in a file (the blocks cache's FileRows) is read PACK_ROWS rows at
    a time as it is packed, never whole (a tied Q6_K head of 248k rows is 521 MB: read whole
    beside its panels, it doubled the load's peak): the same panels as packed from memory."""
    from probserve.kernels import qlayout
    from probserve.models.gguf_blocks import FileRows

    qk = gguf.GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(qtype, 150, 2 * qk, np.random.default_rng(11))
    raw = raw.reshape(150, -1)
    path = tmp_path / "rows.bin"
    path.write_bytes(b"\0" * 24 + raw.tobytes())
    held = QuantizedTensor(FileRows(str(path), 24, raw.shape, "uint8"), qtype.value, 2 * qk)
    monkeypatch.setattr(qlayout, "PACK_ROWS", 64)
    reads: list[int] = []
    fromfile = np.fromfile

    def counted(*args, **kwargs):
        out = fromfile(*args, **kwargs)
        reads.append(out.size // raw.shape[1])
        return out

    monkeypatch.setattr(np, "fromfile", counted)
    for ops in (InvariantKernels(), InvariantKernels(limbs=True)):
        reads.clear()
        packed = ops.pack(held)
        assert reads and max(reads) <= 64 and sum(reads) == 150
        assert torch.equal(packed.data, ops.qpack(raw, qtype.value).data)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_quantized_weights_are_held_at_their_size(kernels, qtype: Q):
    rng = np.random.default_rng(5)
    raw = random_blocks(qtype, 64, 768, rng)
    packed = kernels.qpack(raw, qtype.value)
    assert packed.data.numel() == raw.nbytes  # the same bytes, only moved (Q4_K: 4.5 bits)
    assert packed.k == 768 and packed.n == 64


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_extreme_scales_decode_exactly(kernels, qtype: Q):
    """The float16 fields at their extremes (the largest, the smallest subnormal, both signs,
    zeros) with every quant and every 6-bit scale and min: the products the kernels form are
    exact at both ends of the range, so the weights are gguf's bit for bit."""
    rng = np.random.default_rng(qtype.value)
    extremes = np.array([65504.0, -65504.0, 2.0**-24, -(2.0**-24), 0.0, -0.0, 1.0, 6.1e-5])
    raw = random_blocks(qtype, 64, 512, rng, halves=extremes)
    weight = dequantized(raw, qtype)
    packed = kernels.qpack(raw, qtype.value)
    ids = torch.arange(64)
    assert kernels.qrows(packed, ids).numpy().tobytes() == weight.numpy().tobytes()
    x = torch.from_numpy(rng.standard_normal((13, 512)).astype(np.float32))
    want = kernels.linear(x, kernels.pack(weight))
    for rows in (1, 5, 13):  # registers, and a buffered panel (MR_MAX < 13)
        got = kernels.qlinear(x[:rows], packed)
        assert got.numpy().tobytes() == want[:rows].numpy().tobytes()


# ---- the embedded model -----------------------------------------------------------------------
def test_native_weights_are_the_float32_models_bit_for_bit(native: LoadedModel, smol):
    """Every tensor the GGUF reader gives, dequantized, equals the float32 model's (names, the
    q/k row permutation and tied weights as transformers loads them)."""
    assert native.weights_format == "Q4_1+Q8_0"
    assert native.weights is not None
    float_params = dict(smol.model.named_parameters(remove_duplicate=False))
    assert set(native.weights) == set(float_params)
    for name, value in native.weights.items():
        if isinstance(value, QuantizedTensor):
            value = value.dequantize()
        assert torch.equal(value, float_params[name]), name
    assert native.weights["lm_head.weight"] is native.weights["model.embed_tokens.weight"]


def test_the_blocks_cache_reads_back_what_the_file_holds(native: LoadedModel, smol):
    path = smol.source.quantized_file
    cached = load_weights(path, native.model)
    # the cache lies beside the metadata directory (which holds no weights) and its float32
    # copy (which holds the HF model's files alone: vLLM, transformers and lm-eval's hf backend
    # read every safetensors file in it)
    directory = Path(smol.source.name_or_path)
    assert list(directory.glob("*.safetensors")) == []
    float32 = directory.with_name(directory.name + ".float32")
    assert [f.name for f in float32.glob("*.safetensors")] == ["model.safetensors"]
    assert directory.with_name(f"{directory.name}.blocks.safetensors").is_file()
    fresh = read_weights(path, native.model)
    assert set(cached) == set(fresh)
    for name, value in fresh.items():
        other = cached[name]
        if isinstance(value, QuantizedTensor):
            assert isinstance(other, QuantizedTensor)
            assert (other.ggml_type, other.k) == (value.ggml_type, value.k)
            assert np.array_equal(other.blocks, value.blocks), name
        else:
            assert torch.equal(other, value), name


def test_native_forward_holds_blocks_only(native: LoadedModel, kernels):
    forward = LlamaForward(native.model, kernels, native.weights)
    linears = [forward.lm_head] + [
        lin for layer in forward.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    assert all(lin.quantized is not None and lin.packed is None for lin in linears)
    assert forward.tied and forward.embed is None  # the embedding is read from the head's blocks
    held = sum(lin.w.numel() * lin.w.element_size() for lin in linears)
    float32 = sum(lin.in_features * lin.out_features * 4 for lin in linears)
    assert held < 0.2 * float32


def test_native_requests_equal_float32_requests_bit_for_bit(native: LoadedModel, smol):
    """The same numbers from the blocks as from the dequantized float32 weights: generated and
    prompt logprobs, top-k, targets, entropy, greedy and seeded sampling."""
    outs = {}
    for name, model in (("native", native), ("float32", smol)):
        core = EngineCore(model, EngineConfig(kv_cache_gib=0.1))
        assert core.info.weights == model.weights_format
        reqs = [_canary(model), _canary(model, "seeded", seeded=True)]
        outs[name] = run_core(core, reqs)
    for rid, got in outs["native"].items():
        assert _bits(got) == _bits(outs["float32"][rid]), rid


def test_native_logits_match_transformers(native: LoadedModel, smol):
    """Prompt logprobs from the blocks against transformers' float32 forward of the same GGUF."""
    from probserve.engine import EngineRequest, LogprobsSpec, SamplingParams

    text = "The quick brown fox jumps over the lazy dog because it was"
    ids = smol.tokenizer(text).input_ids
    with torch.no_grad():
        ref = torch.log_softmax(smol.model(torch.tensor([ids])).logits[0].double(), -1)
    core = EngineCore(native, EngineConfig(kv_cache_gib=0.1))
    req = EngineRequest("p", tuple(ids), SamplingParams(max_tokens=1), LogprobsSpec(prompt_top_k=1))
    prompt = next(o.prompt_logprobs for o in run_core(core, [req])["p"] if o.prompt_logprobs)
    expected = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    np.testing.assert_allclose(prompt.logprobs, expected, atol=1e-4)
    assert (prompt.top_ids[:, 0] == ref[:-1].argmax(-1).numpy()).all()


def test_block_sum_requests_are_within_1e4_and_batch_invariant(native: LoadedModel, smol):
    """The embedded model served with --block-sums: prompt logprobs within 1e-4 of
    transformers' float32 forward of the same file, /health's facts say so, and a request
    among others is the same bits as alone."""
    from test_deterministic import _others

    from probserve.engine import EngineRequest, LogprobsSpec, SamplingParams

    text = "The quick brown fox jumps over the lazy dog because it was"
    ids = smol.tokenizer(text).input_ids
    with torch.no_grad():
        ref = torch.log_softmax(smol.model(torch.tensor([ids])).logits[0].double(), -1)
    core = EngineCore(native, EngineConfig(kv_cache_gib=0.1, block_sums=True, max_num_seqs=32))
    assert core.info.block_sums and core.info.weights == native.weights_format
    req = EngineRequest("p", tuple(ids), SamplingParams(max_tokens=1), LogprobsSpec(prompt_top_k=1))
    prompt = next(o.prompt_logprobs for o in run_core(core, [req])["p"] if o.prompt_logprobs)
    expected = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    np.testing.assert_allclose(prompt.logprobs, expected, atol=1e-4)
    for seeded in (False, True):
        alone = run_core(core, [_canary(native, seeded=seeded)])["canary"]
        crowd = _others(native, 20, seed=7)
        mixed = run_core(core, [*crowd[:10], _canary(native, seeded=seeded), *crowd[10:]])
        assert _bits(mixed["canary"]) == _bits(alone)
    exact = EngineCore(native, EngineConfig(kv_cache_gib=0.1))
    assert not exact.info.block_sums
    floats = EngineCore(smol, EngineConfig(kv_cache_gib=0.1, block_sums=True))
    assert not floats.info.block_sums  # no blocks: nothing to apply it to


def test_limb_requests_are_within_1e4_and_batch_invariant(native: LoadedModel, smol, limbs):
    """The embedded model (Q4_1 and Q8_0) served with --products limbs: /health's facts say so,
    prompt logprobs within 1e-4 of transformers' float32 forward of the same file, other
    numbers than the float path's, and a request among others the same bits as alone."""
    from test_deterministic import _others

    from probserve.engine import EngineRequest, LogprobsSpec, SamplingParams

    text = "The quick brown fox jumps over the lazy dog because it was"
    ids = smol.tokenizer(text).input_ids
    with torch.no_grad():
        ref = torch.log_softmax(smol.model(torch.tensor([ids])).logits[0].double(), -1)
    core = EngineCore(native, EngineConfig(kv_cache_gib=0.1, products="limbs", max_num_seqs=32))
    assert core.info.products == "limbs"
    req = EngineRequest("p", tuple(ids), SamplingParams(max_tokens=1), LogprobsSpec(prompt_top_k=1))
    prompt = next(o.prompt_logprobs for o in run_core(core, [req])["p"] if o.prompt_logprobs)
    expected = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    np.testing.assert_allclose(prompt.logprobs, expected, atol=1e-4)
    floats = EngineCore(native, EngineConfig(kv_cache_gib=0.1))
    assert floats.info.products == "float"
    other = next(o.prompt_logprobs for o in run_core(floats, [req])["p"] if o.prompt_logprobs)
    assert np.asarray(other.logprobs).tobytes() != np.asarray(prompt.logprobs).tobytes()
    for seeded in (False, True):
        alone = run_core(core, [_canary(native, seeded=seeded)])["canary"]
        crowd = _others(native, 20, seed=7)
        mixed = run_core(core, [*crowd[:10], _canary(native, seeded=seeded), *crowd[10:]])
        assert _bits(mixed["canary"]) == _bits(alone)
    sums = EngineCore(native, EngineConfig(kv_cache_gib=0.1, products="limbs", block_sums=True))
    assert sums.info.products == "float" and sums.info.block_sums  # one or the other


# ---- mixed formats on a tiny Llama ------------------------------------------------------------
def quantize_model(model, plan: dict[str, Q]) -> dict:
    """The model's tensors with those `plan` names quantized by gguf; the model's own
    parameters are then set to the dequantized values (the float32 twin)."""
    weights: dict = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, param in params.items():
        qtype = next((q for key, q in plan.items() if key in name), None)
        if qtype is None or param.dim() != 2:
            weights[name] = param.detach().clone()
            continue
        raw = gguf.quants.quantize(param.detach().numpy(), qtype)
        weights[name] = QuantizedTensor(raw, qtype.value, param.shape[1])
        param.copy_(dequantized(raw, qtype))
    return weights


def test_mixed_formats_and_an_untied_embedding(tiny: LoadedModel):
    """Q4_0, Q4_1 and Q8_0 in one model, q/k/v in different formats (fused in float32), an
    untied quantized embedding and head: the same bits as the float32 twin."""
    import copy

    twin = copy.deepcopy(tiny.model)
    plan = {
        "q_proj": Q.Q4_0,
        "k_proj": Q.Q4_0,
        "v_proj": Q.Q8_0,  # differs from q/k: the fused QKV falls back to float32
        "o_proj": Q.Q4_1,
        "gate_proj": Q.Q4_0,
        "up_proj": Q.Q4_0,
        "down_proj": Q.Q8_0,
        "embed_tokens": Q.Q8_0,
        "lm_head": Q.Q4_1,
    }
    with torch.no_grad():
        weights = quantize_model(twin, plan)
    blocks = LoadedModel(**{**tiny.__dict__, "model": twin, "weights": weights,
                            "weights_format": "Q4_0+Q4_1+Q8_0"})  # fmt: skip
    floats = LoadedModel(**{**tiny.__dict__, "model": twin})
    kernels = InvariantKernels()
    fw = LlamaForward(twin, kernels, weights)
    qkv = fw.layers[0].qkv
    assert isinstance(qkv, Joined) and all(p.quantized is not None for p in qkv.parts)
    assert len(qkv.parts) == 3 and qkv.out_features == sum(p.out_features for p in qkv.parts)
    assert fw.layers[0].o.quantized is not None
    assert fw.embed is not None and not isinstance(fw.embed, torch.Tensor)
    assert_same_requests(blocks, floats)
    assert_native_equals_op_by_op(twin, weights)
    assert_native_equals_op_by_op(twin, weights, block_sums=True)


def assert_same_requests(blocks: LoadedModel, floats: LoadedModel) -> None:
    """A greedy and a seeded request on the blocks give the float32 twin's bits."""
    outs = {}
    for name, model in (("blocks", blocks), ("floats", floats)):
        core = EngineCore(model, EngineConfig(kv_cache_gib=0.05, block_size=4))
        outs[name] = run_core(core, [_canary(model), _canary(model, "s", seeded=True)])
    for rid in outs["blocks"]:
        assert _bits(outs["blocks"][rid]) == _bits(outs["floats"][rid]), rid


def model_blocks(qtype: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks whose weights are model-sized (|w| <~ 0.1): random quants and scales, the
    float16 fields scaled down (gguf-py cannot quantize the K-quants; the weights need not be
    a quantizer's, only the file's formats)."""
    raw = random_blocks(qtype, n, k, rng).reshape(n, -1, gguf.GGML_QUANT_SIZES[qtype][1])
    span = {Q.Q4_K: 63 * 15, Q.Q5_K: 63 * 31, Q.Q6_K: 128 * 32, Q.Q5_0: 16, Q.Q5_1: 31}[qtype]
    for i, at in enumerate(HALVES.get(qtype, (0,))):
        d = rng.uniform(0.5, 1.0, size=raw.shape[:2]) * 0.05 / span / (2 if i else 1)
        if i == 0 and qtype != Q.Q6_K:
            d *= rng.choice([-1.0, 1.0], size=d.shape)
        raw[..., at : at + 2] = d.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n, -1)


@pytest.fixture(scope="module")
def tiny256(smol: LoadedModel) -> LoadedModel:
    """A tiny random Llama whose every K is a multiple of 256 (the K-quants' super-block)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(256)
    config = LlamaConfig(
        vocab_size=smol.vocab_size, hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    return LoadedModel(
        model=model, tokenizer=smol.tokenizer, name="tiny-256", eos_token_ids=frozenset({2}),
        context_length=256, vocab_size=smol.vocab_size, chat_template=smol.chat_template,
    )  # fmt: skip


@pytest.fixture(scope="module")
def kmix(tiny256: LoadedModel) -> tuple[LoadedModel, LoadedModel, dict]:
    """tiny256 with Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 blocks (as a Q4_K_M or Q5_K_M file mixes
    them): q/k/v in different formats, a Q6_K embedding, an untied Q5_0 head, the second
    layer's Q4_K tensors in Q5_1. (blocks, its float32 twin, the weights)."""
    import copy

    twin = copy.deepcopy(tiny256.model)
    rng = np.random.default_rng(2025)
    plan = {
        "q_proj": Q.Q4_K, "k_proj": Q.Q4_K, "v_proj": Q.Q6_K, "o_proj": Q.Q5_K,
        "gate_proj": Q.Q4_K, "up_proj": Q.Q4_K, "down_proj": Q.Q6_K,
        "embed_tokens": Q.Q6_K, "lm_head": Q.Q5_0,
    }  # fmt: skip
    weights: dict = {}
    with torch.no_grad():
        for name, param in twin.named_parameters(remove_duplicate=False):
            qtype = next((q for key, q in plan.items() if key in name), None)
            if "layers.1." in name and qtype == Q.Q4_K:
                qtype = Q.Q5_1  # the second layer's Q4_K tensors in Q5_1
            if qtype is None or param.dim() != 2:
                weights[name] = param.detach().clone()
                continue
            raw = model_blocks(qtype, param.shape[0], param.shape[1], rng)
            weights[name] = QuantizedTensor(raw, qtype.value, param.shape[1])
            param.copy_(dequantized(raw, qtype))
    quantized = [w for w in weights.values() if isinstance(w, QuantizedTensor)]
    formats = "+".join(sorted({w.type_name for w in quantized}))
    share = sum(w.n * w.k for w in quantized) / sum(
        w.n * w.k if isinstance(w, QuantizedTensor) else w.numel() for w in weights.values()
    )
    blocks = LoadedModel(**{**tiny256.__dict__, "model": twin, "weights": weights,
                            "weights_format": formats, "weights_in_blocks": share})  # fmt: skip
    floats = LoadedModel(**{**tiny256.__dict__, "model": twin})
    return blocks, floats, weights


def test_k_quants_and_q5_in_one_model(kmix):
    """The K-quants and Q5 mix: each q/k/v part in its own blocks, joined, no matrix held in
    float32; the same bits as the float32 twin, for greedy and seeded requests in one batch."""
    blocks, floats, weights = kmix
    fw = LlamaForward(floats.model, InvariantKernels(), weights)
    qkv = fw.layers[0].qkv
    assert isinstance(qkv, Joined) and all(p.quantized is not None for p in qkv.parts)
    assert len(qkv.parts) == 3 and qkv.out_features == sum(p.out_features for p in qkv.parts)
    assert fw.layers[0].o.quantized is not None
    assert fw.layers[0].gate_up.quantized is not None and fw.layers[0].down.quantized is not None
    assert fw.lm_head.quantized is not None and not isinstance(fw.embed, torch.Tensor)
    assert_same_requests(blocks, floats)
    assert_native_equals_op_by_op(floats.model, weights)
    assert_native_equals_op_by_op(floats.model, weights, block_sums=True)


def test_k_quants_in_limbs_are_within_1e4_and_batch_invariant(kmix, limbs):
    """The same mix served with --products limbs: every format in limbs, prompt logprobs within
    1e-4 of the float32 twin's forward, and a request among others the same bits as alone."""
    from test_deterministic import _others

    from probserve.engine import EngineRequest, LogprobsSpec, SamplingParams

    blocks, floats, _ = kmix
    ids = blocks.tokenizer("The quick brown fox jumps over the lazy dog because").input_ids
    with torch.no_grad():
        ref = torch.log_softmax(floats.model(torch.tensor([ids])).logits[0].double(), -1)
    core = EngineCore(blocks, EngineConfig(kv_cache_gib=0.05, block_size=4, products="limbs"))
    assert core.info.products == "limbs"
    req = EngineRequest("p", tuple(ids), SamplingParams(max_tokens=1), LogprobsSpec(prompt_top_k=1))
    prompt = next(o.prompt_logprobs for o in run_core(core, [req])["p"] if o.prompt_logprobs)
    expected = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    np.testing.assert_allclose(prompt.logprobs, expected, atol=1e-4)
    alone = run_core(core, [_canary(blocks, seeded=True)])["canary"]
    crowd = _others(blocks, 12, seed=3)
    mixed = run_core(core, [*crowd[:6], _canary(blocks, seeded=True), *crowd[6:]])
    assert _bits(mixed["canary"]) == _bits(alone)


# ---- choosing the weights ---------------------------------------------------------------------
def test_native_needs_the_deterministic_paged_runner():
    assert EngineConfig().weights_to_load() == "native"
    assert EngineConfig(weights="float32").weights_to_load() == "float32"
    assert EngineConfig(deterministic=False).weights_to_load() == "float32"
    assert EngineConfig(runner="hf").weights_to_load() == "float32"


def test_native_falls_back_to_float32_without_kernels(monkeypatch, caplog):
    from probserve.kernels import build as build_mod

    def no_compiler() -> None:
        raise build_mod.KernelBuildError("no C++ compiler here")

    monkeypatch.setattr(build_mod, "build", no_compiler)
    loaded = load_model(None, "native")
    assert loaded.weights is None and loaded.weights_format == "float32"
    assert "no C++ compiler here" in caplog.text


@pytest.mark.slow
def test_a_real_q4_k_m_files_tensors_multiply_bit_for_bit(kernels, gemma_gguf: Path):
    """Every format of a real Q4_K_M file (its own scales and quants, not random ones): the
    kernel on its blocks equals the float32 kernel on gguf's dequantization, bit for bit, at 1, 7
    and 40 rows, and its rows gather exactly."""
    rng = np.random.default_rng(0)
    for name, qtype, raw, weight in _first_of_each_format(gemma_gguf):
        packed_q, packed_f = kernels.qpack(raw, qtype.value), kernels.pack(weight)
        x = torch.from_numpy(rng.standard_normal((40, weight.shape[1])).astype(np.float32))
        for rows in (1, 7, 40):
            got = kernels.qlinear(x[:rows], packed_q).numpy().tobytes()
            assert got == kernels.linear(x[:rows], packed_f).numpy().tobytes(), name
        ids = torch.tensor([0, 255, 17])
        assert torch.equal(kernels.qrows(packed_q, ids), weight[ids]), name


def _first_of_each_format(path: Path) -> list[tuple[str, Q, np.ndarray, torch.Tensor]]:
    """A real file's first matrix of each native format: (name, format, 256 output rows of its
    blocks, their gguf dequantization); the Q4_K_M file has Q5_0, Q4_K, Q6_K and Q8_0."""
    reader = gguf.GGUFReader(path)
    found: dict[Q, tuple[str, Q, np.ndarray, torch.Tensor]] = {}
    for tensor in reader.tensors:
        qtype = Q(tensor.tensor_type)
        if qtype not in FORMATS or qtype in found or len(tensor.data.shape) != 2:
            continue
        raw = np.ascontiguousarray(np.asarray(tensor.data)[:256])
        found[qtype] = (tensor.name, qtype, raw, dequantized(raw, qtype))
    assert {Q.Q5_0, Q.Q4_K, Q.Q6_K, Q.Q8_0} <= set(found), set(found)
    return list(found.values())


@pytest.mark.slow
def test_a_real_q4_k_m_files_tensors_in_limbs(limbs, kernels, gemma_gguf: Path):
    """Every format of a real Q4_K_M file in limbs: closer to the float64 product than the
    float32 path, at its largest and on average, the same bits at 1, 7 and 40 rows, and its rows
    gather gguf's values exactly."""
    rng = np.random.default_rng(1)
    for name, qtype, raw, weight in _first_of_each_format(gemma_gguf):
        ours, float32 = limbs.qpack(raw, qtype.value), kernels.qpack(raw, qtype.value)
        x = torch.from_numpy(rng.standard_normal((40, weight.shape[1])).astype(np.float32))
        x[:, 3] *= 50.0
        full = limbs.qlinear(x, ours)
        truth = F.linear(x.double(), weight.double())
        err = (full.double() - truth).abs()
        err32 = (kernels.qlinear(x, float32).double() - truth).abs()
        assert err.max() < err32.max() and err.pow(2).mean() < err32.pow(2).mean(), name
        for rows in (1, 7):
            assert limbs.qlinear(x[:rows], ours).numpy().tobytes() == full[:rows].numpy().tobytes()
        ids = torch.tensor([0, 255, 17])
        assert torch.equal(limbs.qrows(ours, ids), weight[ids]), name
