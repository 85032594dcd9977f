"""Mixture-of-experts routing (kernels/route.cpp, models/moe.py): a token's experts and weights are
a function of its own row (ties by expert id, the same bits alone and in any batch), softmax
and renormalisation as transformers computes them, and the families the paged forward refuses
say in one line what is missing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probserve.kernels.invariant import InvariantKernels
from probserve.models.family import Unsupported, family
from probserve.models.moe import route


@pytest.fixture(scope="module")
def kernels() -> InvariantKernels:
    return InvariantKernels()


def test_routing_matches_transformers_and_breaks_ties_by_id(kernels):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(50, 16, generator=gen) * 3
    for norm in (False, True):
        ids, w = kernels.route(logits, 4, norm)
        ref_ids, ref_w = route(logits, 4, norm, None)  # torch's softmax and topk
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)
        if norm:
            torch.testing.assert_close(w.double().sum(-1), torch.ones(50, dtype=torch.float64))
    tied = torch.tensor([[1.0, 2.0, 2.0, 0.5, 2.0, 2.0]])
    ids, w = kernels.route(tied, 3, False)
    assert ids.tolist() == [[1, 2, 4]] and w[0, 0] == w[0, 1] == w[0, 2]
    with pytest.raises(ValueError):
        kernels.route(tied, 7, False)
    wide = torch.randn(5, 160, generator=gen)  # more than 64 experts chosen
    ids, w = kernels.route(wide, 80, True)
    ref_ids, ref_w = route(wide, 80, True, None)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-7)


def test_a_tokens_route_is_the_same_bits_in_any_batch(kernels):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(37, 128, generator=gen)
    ids, w = kernels.route(logits, 8, True)
    for start, rows in [(0, 1), (5, 1), (3, 7), (11, 26)]:
        part_ids, part_w = kernels.route(logits[start : start + rows], 8, True)
        assert torch.equal(part_ids, ids[start : start + rows])
        assert part_w.numpy().tobytes() == w[start : start + rows].numpy().tobytes()


def test_unbuilt_mixtures_are_refused_naming_what_is_missing():
    from transformers import GptOssConfig, OlmoeConfig

    with pytest.raises(Unsupported, match="attention sinks"):
        family(GptOssConfig(num_hidden_layers=2))
    with pytest.raises(Unsupported, match="clip_qkv"):
        family(OlmoeConfig(num_hidden_layers=2, clip_qkv=8.0))


@pytest.mark.parametrize(
    ("arch", "per_expert"), [("qwen3moe", False), ("llama", False), ("llama", True)]
)
def test_a_moe_gguf_serves_its_experts_in_blocks(
    tmp_path, monkeypatch, arch: str, per_expert: bool
):
    """A Qwen3-MoE or Mixtral GGUF file (arch llama with experts, as llama.cpp writes it; 3-D
    expert tensors in Q8_0, a float32 router): each expert's rows held as the file's blocks (no
    float32 copy), the configuration's experts from the file, prompt logprobs within 1e-4 of
    transformers' forward of the dequantized weights, and a request the same bits among others;
    Mixtral's first files (each expert its own tensors) too. The float32 path: Qwen3-MoE through
    transformers' own GGUF loader with the completed configuration, the same numbers; a Mixtral
    file (transformers would read a dense Llama) refused in one line."""
    from conftest import run_core
    from gguf_util import write_moe_gguf
    from transformers import AutoModelForCausalLM

    from probserve.engine import (
        EngineConfig,
        EngineCore,
        EngineRequest,
        LogprobsSpec,
        SamplingParams,
    )
    from probserve.kernels.build import build
    from probserve.models import ModelLoadError, load_model
    from probserve.models.gguf_blocks import QuantizedTensor, as_float

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernels").symlink_to(build().parent, target_is_directory=True)
    monkeypatch.setenv("PROBSERVE_CACHE_DIR", str(cache))
    path = write_moe_gguf(
        tmp_path / "moe.gguf", arch=arch, hidden=64, layers=2, experts=8, used=3, expert_ffn=32,
        per_expert=per_expert,
    )  # fmt: skip
    loaded = load_model(str(path), "native")
    cfg = loaded.model.config
    fam = family(cfg)
    assert (fam.experts, fam.top_k, fam.expert_intermediate, fam.norm_topk) == (8, 3, 32, True)
    assert cfg.model_type == ("qwen3_moe" if arch == "qwen3moe" else "mixtral")
    weights = loaded.weights
    assert weights is not None and loaded.weights_format == "Q8_0"
    down = weights["model.layers.1.mlp.experts.7.down_proj.weight"]
    assert isinstance(down, QuantizedTensor) and (down.n, down.k) == (64, 32)
    twin = AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)
    state = {}
    for name, param in twin.named_parameters():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            base = name.rsplit(".", 1)[0]
            parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
            state[name] = torch.stack([
                torch.cat([as_float(weights[f"{base}.{e}.{p}.weight"]) for p in parts])
                for e in range(fam.experts)
            ])  # fmt: skip
        else:
            state[name] = as_float(weights[name])
        assert state[name].shape == param.shape, name
    twin.load_state_dict(state, strict=False)
    ids = [
        int(t) for t in torch.randint(10, 4000, (21,), generator=torch.Generator().manual_seed(5))
    ]
    with torch.no_grad():
        ref = torch.log_softmax(twin(torch.tensor([ids])).logits[0].double(), -1)
    core = EngineCore(loaded, EngineConfig(kv_cache_gib=0.02, block_size=4))
    assert core.info.runner == "PagedRunner" and core.info.weights_in_blocks > 0.9

    def request(rid: str, prompt: list[int]) -> EngineRequest:
        spec = LogprobsSpec(top_k=2, prompt_top_k=1)
        return EngineRequest(
            rid, tuple(prompt), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), spec
        )

    alone = run_core(core, [request("p", ids)])["p"]
    prompt = next(o.prompt_logprobs for o in alone if o.prompt_logprobs is not None)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    np.testing.assert_allclose(prompt.logprobs, want, atol=1e-4)
    others = [request(f"o{i}", ids[i : i + 9]) for i in range(4)]
    mixed = run_core(core, [*others[:2], request("p", ids), *others[2:]])["p"]
    assert [o.new_token_ids for o in mixed] == [o.new_token_ids for o in alone]
    assert [np.asarray(o.logprobs.logprobs).tobytes() for o in mixed if o.logprobs] == [
        np.asarray(o.logprobs.logprobs).tobytes() for o in alone if o.logprobs
    ]
    if arch == "llama":
        with pytest.raises(ModelLoadError, match="Mixtral"):
            load_model(str(path), "float32")
        return
    float32 = load_model(str(path), "float32").model
    with torch.no_grad():
        theirs = torch.log_softmax(float32(torch.tensor([ids])).logits[0].double(), -1)
    np.testing.assert_allclose(theirs.numpy(), ref.numpy(), atol=1e-5)
