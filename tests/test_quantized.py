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
from test_deterministic import _bits, _canary

from probserve.engine import EngineConfig, EngineCore
from probserve.kernels.invariant import InvariantKernels
from probserve.models import LoadedModel, load_model
from probserve.models.gguf_blocks import QuantizedTensor, load_weights, read_weights
from probserve.models.llama import LlamaForward

FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q8_0]


@pytest.fixture(scope="module")
def kernels() -> InvariantKernels:
    return InvariantKernels()


@pytest.fixture(scope="module")
def native() -> LoadedModel:
    """The embedded model with its GGUF blocks as the file holds them."""
    return load_model(None, "native")


def random_blocks(qtype: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """n rows of k // 32 blocks: random quants, and scales drawn from every finite float16
    (subnormals and the largest included: the in-register arithmetic must match for all)."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(n, k // 32, size), dtype=np.uint8)
    for at in (0, 2) if qtype == Q.Q4_1 else (0,):
        halves = rng.integers(0, 1 << 16, size=(n, k // 32), dtype=np.uint16)
        halves[(halves & 0x7C00) == 0x7C00] &= 0x3FFF  # no inf or NaN: a finite exponent
        raw[..., at : at + 2] = halves.view(np.uint8).reshape(n, k // 32, 2)
    return raw.reshape(n, -1)


def dequantized(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    """gguf's own dequantization (what transformers loads), as float32 [n, k]."""
    values = gguf.dequantize(raw, qtype).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(values).reshape(raw.shape[0], -1))


# ---- the kernel -------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(37, 96), (576, 576), (1, 32), (100, 1536), (33, 64)])
def test_quantized_linear_equals_the_dequantized_product(kernels, qtype: Q, shape):
    n, k = shape
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
    for rows in range(1, 41):
        start = random.Random(rows).randrange(0, 41 - rows)
        part = kernels.qlinear(x[start : start + rows], packed_q)
        assert part.numpy().tobytes() == full[start : start + rows].numpy().tobytes()
    ids = torch.tensor([0, n - 1, n // 2, 0])
    assert torch.equal(kernels.qrows(packed_q, ids), weight[ids])
    with pytest.raises(IndexError):
        kernels.qrows(packed_q, torch.tensor([n]))


def test_quantized_weights_are_held_at_their_size(kernels):
    rng = np.random.default_rng(5)
    raw = random_blocks(Q.Q4_1, 64, 576, rng)
    packed = kernels.qpack(raw, Q.Q4_1.value)
    assert packed.data.numel() == raw.nbytes  # the same bytes, only moved: 5 bits a weight


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
    # the cache lies beside the converted HF directory: that one keeps the HF model's files
    # alone (vLLM, transformers and lm-eval's hf backend read every safetensors file in it)
    directory = Path(smol.source.name_or_path)
    assert [f.name for f in directory.glob("*.safetensors")] == ["model.safetensors"]
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
    forward = LlamaForward(native.model, "auto", kernels, native.weights)
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
    fw = LlamaForward(twin, "auto", kernels, weights)
    assert fw.layers[0].qkv.quantized is None and fw.layers[0].o.quantized is not None
    assert fw.embed is not None and not isinstance(fw.embed, torch.Tensor)
    outs = {}
    for name, model in (("blocks", blocks), ("floats", floats)):
        core = EngineCore(model, EngineConfig(kv_cache_gib=0.05, block_size=4))
        outs[name] = run_core(core, [_canary(model), _canary(model, "s", seeded=True)])
    for rid in outs["blocks"]:
        assert _bits(outs["blocks"][rid]) == _bits(outs["floats"][rid]), rid


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
