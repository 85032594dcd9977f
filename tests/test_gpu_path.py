"""The GPU path (`--device cuda`: the paged forward op by op on the Triton kernels, the KV cache
on the device) run whole, through the engine, for tiny random models of the families it serves:
under Triton's interpreter on CPU tensors here (CI has no GPU), on the GPU where there is one
(scripts/gpu_check.sh). Its logprobs are within 1e-4 of transformers' float32 forward, and a
request's numbers are the same bits alone, among others with a 7-token step budget (its prompt
in chunks) and from the prefix cache, on the exact path and on the bf16 path, and the same
with decode steps replayed in their batch-size buckets (runners/decode_graphs.py: under the
interpreter the padded buckets run again eagerly; a GPU captures them) as run eagerly."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
import triton  # noqa: F401  (a dev dependency: without it these tests fail, they never skip)
from conftest import run_core
from reference import full_logprobs
from test_families import _config, _numbers

from probserve.engine import EngineConfig, EngineCore, EngineRequest, LogprobsSpec, SamplingParams
from probserve.engine.core.backend import DeviceError, gpu_path
from probserve.models import LoadedModel

VOCAB = 256  # a small head: the interpreter runs every program of every kernel in Python
KINDS = ["qwen3", "gemma2", "mistral", "gpt_oss"]


def _model(kind: str, smol: LoadedModel) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(11)
    config = _config(kind, VOCAB)
    config._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.requires_grad_(False)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                centre = 0.0 if "gemma" in kind else 1.0
                param.copy_(torch.randn_like(param) * 0.3 + centre)
            else:
                param.normal_(0.0, 0.08)
    return LoadedModel(
        model=hf, tokenizer=smol.tokenizer, name=f"tiny-{kind}",
        eos_token_ids=frozenset({2}), context_length=256, vocab_size=VOCAB,
    )  # fmt: skip


@pytest.fixture(scope="module", params=KINDS)
def model(request: pytest.FixtureRequest, smol: LoadedModel) -> LoadedModel:
    return _model(request.param, smol)


def _prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, VOCAB, size=n)]


def _request(ids: list[int], rid: str, max_tokens: int = 6) -> EngineRequest:
    return EngineRequest(
        rid, tuple(ids), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        LogprobsSpec(top_k=3, prompt_top_k=2, entropy=True),
    )  # fmt: skip


def _gpu(**config: Any) -> EngineConfig:
    return EngineConfig(device="cuda", kv_cache_gib=0.01, block_size=4, **config)


def test_the_gpu_path_equals_transformers(model: LoadedModel) -> None:
    core = EngineCore(model, _gpu())
    core.warmup()  # as a server starts it (a GPU captures its decode graphs here)
    assert core.info.runner == "PagedRunner" and core.info.deterministic
    assert core.info.device == ("cuda" if torch.cuda.is_available() else "interpreted")
    ids = _prompt(1, 23)
    outs = run_core(core, [_request(ids, "r")])["r"]
    gen = [t for o in outs for t in o.new_token_ids]
    ref = full_logprobs(model.model, ids + gen).double()
    prompt = next(o.prompt_logprobs for o in outs if o.prompt_logprobs is not None)
    want = ref[np.arange(len(ids) - 1), ids[1:]].numpy()
    assert np.abs(np.asarray(prompt.logprobs, np.float64) - want).max() < 1e-4
    got = np.concatenate([np.asarray(o.logprobs.logprobs, np.float64) for o in outs
                          if o.logprobs is not None])  # fmt: skip
    rows = np.arange(len(ids) - 1, len(ids) - 1 + len(gen))
    assert np.abs(got - ref[rows, gen].numpy()).max() < 1e-4
    assert gen == [int(ref[r].argmax()) for r in rows]  # greedy: transformers' choice


def test_a_request_is_bitwise_the_same_among_others_and_in_chunks(model: LoadedModel) -> None:
    _check_invariance(model, "exact")


def test_the_bf16_path_is_as_invariant_and_measured_from_the_cpu(smol: LoadedModel) -> None:
    """One family (Qwen3) on the bf16 path: its interpreted kernels cost as much as the exact
    path's, and its invariance rests on the same code."""
    _check_invariance(_model("qwen3", smol), "bf16")


def _check_invariance(model: LoadedModel, precision: str) -> None:
    canary = _prompt(2, 19)
    fresh = _gpu(precision=precision, prefix_caching=False)
    alone_core = EngineCore(model, fresh)
    alone = run_core(alone_core, [_request(canary, "c")])["c"]
    core = EngineCore(model, _gpu(precision=precision, max_num_batched_tokens=7))
    others = [_request(_prompt(10 + i, 5 + 4 * i), f"o{i}", 3 + i) for i in range(4)]
    mixed = run_core(core, [*others[:2], _request(canary, "c"), *others[2:]])["c"]
    again = run_core(core, [_request(canary, "again")])["again"]  # from the prefix cache
    assert _numbers(mixed) == _numbers(alone) == _numbers(again)
    # the five decoded together, every step eager: the decode graphs' padded buckets change no
    # bit of any of them
    batch = [*others, _request(canary, "c")]
    replayed_core = EngineCore(model, fresh)
    replayed = run_core(replayed_core, batch)
    eager = run_core(EngineCore(model, dataclasses.replace(fresh, cuda_graphs=False)), batch)
    assert all(_numbers(replayed[r]) == _numbers(eager[r]) for r in eager)
    assert _numbers(eager["c"]) == _numbers(alone)
    graphs = getattr(replayed_core.runner, "graphs", None)
    assert getattr(alone_core.runner, "graphs", None).steps == {1: 5}
    assert graphs is not None and 8 in graphs.steps and len(graphs.steps) >= 2, graphs.steps
    if precision == "bf16":  # a measured distance, not the exact path's
        cpu = run_core(EngineCore(model, EngineConfig(kv_cache_gib=0.01)), [_request(canary, "c")])
        a = np.asarray(next(o.prompt_logprobs for o in alone if o.prompt_logprobs).logprobs)
        b = np.asarray(next(o.prompt_logprobs for o in cpu["c"] if o.prompt_logprobs).logprobs)
        assert 0 < np.abs(a - b).max() < 0.05


def test_the_device_flag_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gpu_path("cpu") is None
    if torch.cuda.is_available():
        return
    assert gpu_path("auto") is None  # no GPU: the CPU path
    assert gpu_path("cuda") == torch.device("cpu")  # interpreted: the GPU code path on the host
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(DeviceError, match="torch sees no GPU"):
        gpu_path("cuda")


@pytest.mark.parametrize("arch", ["gpt-oss", "llama"])
def test_a_gguf_file_runs_from_its_blocks_dequantized_on_the_device(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """A GGUF file transformers' loader misreads (gpt-oss: MXFP4 experts with biases, sinks,
    windows; Mixtral, arch llama with experts) on the GPU path: its blocks read as the CPU's
    native path reads them and dequantized a matrix at a time onto the device; its numbers
    those of the CPU engine serving the same blocks (itself within 1e-4 of transformers:
    test_moe), and `/health`'s weights the dtype they are held in."""
    from gguf_util import write_moe_gguf

    from probserve.kernels.build import build
    from probserve.models import load_model

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernels").symlink_to(build().parent, target_is_directory=True)
    monkeypatch.setenv("PROBSERVE_CACHE_DIR", str(cache))
    path = write_moe_gguf(
        tmp_path / "moe.gguf", arch=arch, hidden=64, layers=2, experts=8, used=3, expert_ffn=32
    )
    config = _gpu()
    assert config.weights_to_load() == "native"
    loaded = load_model(str(path), config.weights_to_load())
    assert loaded.weights is not None and "Q8_0" in loaded.weights_format
    gpu = EngineCore(loaded, config)
    assert (gpu.info.weights, gpu.info.weights_in_blocks, gpu.info.products) == (
        "float32",
        0,
        "float",
    )
    cpu = EngineCore(loaded, EngineConfig(kv_cache_gib=0.01, block_size=4))
    assert cpu.info.weights_in_blocks > 0.9
    ids = [int(t) for t in np.random.default_rng(5).integers(10, 4000, size=17)]
    ours = run_core(gpu, [_request(ids, "g", 3)])["g"]
    theirs = run_core(cpu, [_request(ids, "c", 3)])["c"]
    joined = [[t for o in outs for t in o.new_token_ids] for outs in (ours, theirs)]
    assert joined[0] == joined[1]  # (the CPU engine's prompt lookup may group them)
    a, b = (
        np.concatenate(
            [np.asarray(o.prompt_logprobs.logprobs) for o in outs if o.prompt_logprobs]
            + [np.asarray(o.logprobs.logprobs) for o in outs if o.logprobs]
        )
        for outs in (ours, theirs)
    )
    assert len(a) == len(b) == 16 + 3 and np.abs(a - b).max() < 1e-5
