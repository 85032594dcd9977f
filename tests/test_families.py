"""Every family the paged forward runs (models/family.py) against transformers' own float32
forward: tiny random models built here (Qwen3's q/k norms; Gemma 2's soft-capping and alternating
windows; Gemma 3's (1 + w) norms, GeGLU, sandwich norms, q/k norms and local/global RoPE bases;
Phi-3's fused projections and per-position LongRoPE; Mistral's sliding window; the mixtures of
experts: Qwen3-MoE with a dense layer among sparse ones and renormalised top-k, OLMoE's
whole-projection q/k norms and plain top-k, Mixtral's windowed attention, gpt-oss's sinks, biases,
clamped SwiGLU, alternating windows and YaRN), prompt and generated
logprobs within 1e-4 on both paths (deterministic kernels and torch), and bitwise the same alone
and among other requests; a mixture of experts' returned routing (every prompt and generated
token's experts and weights in each MoE layer) is the experts transformers' router picks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_core
from native_util import assert_native_equals_op_by_op
from reference import full_logprobs

from probserve.engine import (
    EngineConfig,
    EngineCore,
    EngineRequest,
    LogprobsSpec,
    RoutedExperts,
    RoutingSpec,
    SamplingParams,
)
from probserve.models import LoadedModel
from probserve.models.family import family

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4}
WINDOW = 6  # shorter than the prompts: the windowed layers drop keys


def _longrope(head_dim: int) -> dict[str, Any]:
    half = head_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [2.0 + 0.3 * i for i in range(half)],
        "original_max_position_embeddings": 64,
    }


def _config(kind: str, vocab: int) -> Any:
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GptOssConfig,
        MistralConfig,
        MixtralConfig,
        OlmoeConfig,
        Phi3Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = {**SMALL, "vocab_size": vocab, "max_position_embeddings": 256, "eos_token_id": 2}
    if kind == "qwen3":
        return Qwen3Config(
            **common, num_hidden_layers=2, num_key_value_heads=2, head_dim=32,
            tie_word_embeddings=False,
        )  # fmt: skip
    if kind == "gemma2":
        return Gemma2Config(
            **common, num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
            query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
        )  # fmt: skip
    if kind == "gemma3":
        return Gemma3TextConfig(
            **common, num_hidden_layers=3, num_key_value_heads=1, head_dim=32,
            query_pre_attn_scalar=32, sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        )  # fmt: skip
    if kind == "phi3":
        return Phi3Config(
            **common, num_hidden_layers=2, num_key_value_heads=2, sliding_window=WINDOW + 3,
            rope_parameters=_longrope(16), pad_token_id=0, tie_word_embeddings=False,
        )  # fmt: skip
    if kind == "qwen3_moe":  # layer 1 dense (mlp_only_layers), 0 and 2 sparse
        return Qwen3MoeConfig(
            **common, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, num_experts=8,
            num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
            mlp_only_layers=[1], tie_word_embeddings=False,
        )  # fmt: skip
    if kind == "olmoe":
        return OlmoeConfig(
            **common, num_hidden_layers=2, num_key_value_heads=2, num_experts=8,
            num_experts_per_tok=2, tie_word_embeddings=False, pad_token_id=0,
        )  # fmt: skip
    if kind == "mixtral":
        return MixtralConfig(
            **common, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=WINDOW, tie_word_embeddings=False,
        )  # fmt: skip
    if kind == "gpt_oss":  # alternating windows, YaRN past 16 positions, sinks, clamped SwiGLU
        return GptOssConfig(
            **{**common, "intermediate_size": 32}, num_hidden_layers=2, num_key_value_heads=2,
            head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16,
            },
            swiglu_limit=0.3,
        )  # fmt: skip
    return MistralConfig(
        **common, num_hidden_layers=2, num_key_value_heads=2, sliding_window=WINDOW,
        tie_word_embeddings=False,
    )  # fmt: skip


KINDS = [
    *("qwen3", "gemma2", "gemma3", "phi3", "mistral"),
    *("qwen3_moe", "olmoe", "mixtral", "gpt_oss"),
]


@pytest.fixture(scope="module", params=KINDS)
def model(request: pytest.FixtureRequest, smol: LoadedModel) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    config = _config(request.param, smol.vocab_size)
    config._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.requires_grad_(False)
    with torch.no_grad():  # norms and embeddings away from their initial ones and zeros
        for name, param in hf.named_parameters():
            if "norm" in name:  # Gemma's are 1 + w
                centre = 0.0 if "gemma" in request.param else 1.0
                param.copy_(torch.randn_like(param) * 0.3 + centre)
            else:
                param.normal_(0.0, 0.08)
    return LoadedModel(
        model=hf,
        tokenizer=smol.tokenizer,
        name=f"tiny-{request.param}",
        eos_token_ids=frozenset({2}),
        context_length=256,
        vocab_size=smol.vocab_size,
    )


def _request(ids: list[int], rid: str, max_tokens: int = 8, routing: bool = False) -> EngineRequest:
    return EngineRequest(
        rid,
        tuple(ids),
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        LogprobsSpec(top_k=3, prompt_top_k=2, entropy=True),
        routing=RoutingSpec(prompt=True) if routing else None,
    )


def _routed(model: LoadedModel) -> bool:
    """A mixture of experts: its requests here also ask for their routing."""
    return bool(family(model.model.config).experts)


def _check_routing(model: LoadedModel, outs: list, ids: list[int], gen: list[int]) -> None:
    """The routing returned for prompt tokens 1.. and every generated token (each the row
    before it: positions 0 .. len-2 of prompt + generated) is transformers' router's: the top-k
    of the softmax of its logits in each MoE layer, weights renormalised where the model does."""
    fam = family(model.model.config)
    prompt = next(o.prompt_routed for o in outs if o.prompt_routed is not None)
    parts = [prompt, *(o.routed for o in outs if o.new_token_ids)]
    assert all(isinstance(p, RoutedExperts) for p in parts)
    experts = np.concatenate([p.experts for p in parts])
    weights = np.concatenate([p.weights for p in parts])
    total = len(ids) + len(gen) - 1
    layers = sum(fam.sparse)
    assert experts.shape == weights.shape == (total, layers, fam.top_k)
    assert experts.dtype == np.int16 and weights.dtype == np.float32
    with torch.no_grad():
        hf = model.model(input_ids=torch.tensor([ids + gen]), output_router_logits=True)
    assert len(hf.router_logits) == layers
    for m, logits in enumerate(hf.router_logits):
        probs = torch.softmax(logits[:total].double(), dim=-1)
        want_w, want_ids = torch.topk(probs, fam.top_k, dim=-1)
        if fam.norm_topk:
            want_w = want_w / want_w.sum(-1, keepdim=True)
        assert np.array_equal(experts[:, m], want_ids.numpy()), f"MoE layer {m}"
        assert np.abs(weights[:, m] - want_w.numpy()).max() < 1e-5


def against_transformers(
    model: LoadedModel, outs: list, ids: list[int], gen: list[int]
) -> tuple[Any, np.ndarray, np.ndarray]:
    """Checks a request's prompt and generated logprobs within 1e-4 of transformers' float32
    forward, and its greedy tokens; returns transformers' logprobs and ours (prompt, generated:
    float64)."""
    ref = full_logprobs(model.model, ids + gen)
    prompt = next(o.prompt_logprobs for o in outs if o.prompt_logprobs is not None)
    got = np.asarray(prompt.logprobs, dtype=np.float64)
    assert list(prompt.token_ids) == ids[1:]
    want = np.array([float(ref[j, ids[j + 1]]) for j in range(len(ids) - 1)])
    assert np.abs(got - want).max() < 1e-4
    sampled = [o.logprobs for o in outs if o.logprobs is not None and len(o.logprobs)]
    lps = np.concatenate([np.asarray(lp.logprobs, dtype=np.float64) for lp in sampled])
    want = np.array([float(ref[len(ids) - 1 + j, t]) for j, t in enumerate(gen)])
    assert np.abs(lps - want).max() < 1e-4
    assert gen == [int(ref[len(ids) - 1 + j].argmax()) for j in range(len(gen))]
    return ref, got, lps


def _prompt(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, 40000, size=n)]


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_paged_forward_equals_transformers(model: LoadedModel, deterministic: bool):
    family(model.model.config)  # a family the paged forward runs
    core = EngineCore(
        model, EngineConfig(deterministic=deterministic, kv_cache_gib=0.02, block_size=4)
    )
    assert core.info.runner == "PagedRunner" and core.info.deterministic == deterministic
    ids = _prompt(1, 23)
    outs = run_core(core, [_request(ids, "r", routing=_routed(model))])["r"]
    gen = [t for o in outs for t in o.new_token_ids]
    if _routed(model):
        assert core.info.moe_layers == tuple(
            i for i, s in enumerate(family(model.model.config).sparse) if s
        )
        _check_routing(model, outs, ids, gen)
    against_transformers(model, outs, ids, gen)


def _numbers(outs: list) -> list[bytes]:
    """The tokens and every array of a request's outputs, each field joined over them (rows in
    any grouping: a step that accepts speculation's proposals sends several tokens at once)."""
    fields: dict[str, list[bytes]] = {}
    for o in outs:
        fields.setdefault("tokens", []).append(np.asarray(o.new_token_ids, np.int64).tobytes())
        for kind, lp in (("gen", o.logprobs), ("prompt", o.prompt_logprobs)):
            if lp is not None:
                arrays = (lp.token_ids, lp.logprobs, lp.top_ids, lp.top_logprobs, lp.entropy)
                for i, arr in enumerate(arrays):
                    fields.setdefault(f"{kind}{i}", []).append(np.ascontiguousarray(arr).tobytes())
        for kind, routed in (("gen", o.routed), ("prompt", o.prompt_routed)):
            if routed is not None:
                fields.setdefault(f"{kind}-experts", []).append(routed.experts.tobytes())
                fields.setdefault(f"{kind}-weights", []).append(routed.weights.tobytes())
    return [name.encode() + b"".join(parts) for name, parts in sorted(fields.items())]


def test_a_request_is_bitwise_the_same_among_others_and_in_chunks(model: LoadedModel):
    canary = _prompt(2, 19)
    routed = _routed(model)
    # alone: plain decoding; among others: the default (prompt lookup where it runs)
    fresh = EngineConfig(
        deterministic=True, kv_cache_gib=0.02, prefix_caching=False, speculative="off"
    )
    alone = run_core(EngineCore(model, fresh), [_request(canary, "c", routing=routed)])["c"]
    core = EngineCore(
        model,
        EngineConfig(deterministic=True, kv_cache_gib=0.02, block_size=4, max_num_batched_tokens=7),
    )
    others = [_request(_prompt(10 + i, 5 + 4 * i), f"o{i}", 3 + i) for i in range(5)]
    mixed = run_core(core, [*others[:2], _request(canary, "c", routing=routed), *others[2:]])["c"]
    again = run_core(core, [_request(canary, "again", routing=routed)])["again"]  # cached prefix
    assert not routed or any(o.routed is not None for o in mixed)
    assert _numbers(mixed) == _numbers(alone) == _numbers(again)


def test_the_native_layers_are_the_op_by_op_kernels_bit_for_bit(model: LoadedModel):
    assert_native_equals_op_by_op(model.model)


def test_longrope_chooses_its_factors_per_position():
    """Below the original context the short factors (transformers' choice for such a sequence),
    from it on the long ones (transformers' choice for a sequence that long)."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from probserve.models.skeleton import Rotary

    config = Phi3Config(**SMALL, vocab_size=100, max_position_embeddings=256,
                        rope_parameters=_longrope(16), pad_token_id=0)  # fmt: skip
    ours, theirs = Rotary(config), Phi3RotaryEmbedding(config)
    x = torch.zeros(1)
    short = torch.arange(0, 64).unsqueeze(0)
    long = torch.arange(0, 200).unsqueeze(0)
    for pos in (short, long):
        cos, sin = ours(x, pos)
        ref_cos, ref_sin = theirs(x, pos)
        first = 0 if pos is short else 64  # transformers: long for every position of it
        assert torch.equal(cos[0, first:], ref_cos[0, first:])
        assert torch.equal(sin[0, first:], ref_sin[0, first:])


@pytest.mark.slow
def test_gemma3_270m_q4_k_m_in_its_blocks_equals_transformers(gemma_gguf):
    """The real file, served from its blocks on the paged forward (deterministic), against
    transformers' float32 forward of the same file: a prompt longer than its 512-token window,
    prompt and generated logprobs within 1e-4, every greedy token transformers' top-1."""
    from probserve.models.gguf_once import parsed_once

    with parsed_once():  # the file's header parsed once for both loads (~20 s each here)
        _gemma3_equals_transformers(gemma_gguf)


def _gemma3_equals_transformers(gemma_gguf: Path) -> None:
    from transformers import AutoModelForCausalLM

    from probserve.models.loader import load_model

    native = load_model(str(gemma_gguf), "native")
    assert native.weights is not None and native.weights_in_blocks > 0.99
    core = EngineCore(native, EngineConfig(kv_cache_gib=0.2))
    assert core.info.runner == "PagedRunner" and core.info.deterministic
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box." for i in range(70))
    ids = native.tokenizer(text).input_ids
    assert len(ids) > 600
    outs = run_core(core, [_request(ids, "g", max_tokens=6)])["g"]
    gen = [t for o in outs for t in o.new_token_ids]
    hf = AutoModelForCausalLM.from_pretrained(
        str(gemma_gguf.parent), gguf_file=gemma_gguf.name, dtype=torch.float32
    ).eval()
    ref = full_logprobs(hf, ids + gen)
    prompt = next(o.prompt_logprobs for o in outs if o.prompt_logprobs is not None)
    want = np.array([float(ref[j, ids[j + 1]]) for j in range(len(ids) - 1)])
    assert np.abs(np.asarray(prompt.logprobs, np.float64) - want).max() < 1e-4
    sampled = np.concatenate([np.asarray(o.logprobs.logprobs, np.float64) for o in outs
                              if o.logprobs is not None and len(o.logprobs)])  # fmt: skip
    want = np.array([float(ref[len(ids) - 1 + j, t]) for j, t in enumerate(gen)])
    assert np.abs(sampled - want).max() < 1e-4
    assert gen == [int(ref[len(ids) - 1 + j].argmax()) for j in range(len(gen))]
