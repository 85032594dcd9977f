"""Gemma 4 (text) on the paged forward (models/gemma4.py, models/gemma4_layer.py) against
transformers' own float32 forward: tiny random `Gemma4ForCausalLM` models saved to a directory
and served from it as a user's would be, with sliding and full layers of different head sizes
(the full ones' proportional RoPE), the last layers reading an earlier layer's KV cache,
per-layer input embeddings, layer scalars, v norms and a final soft-cap; one also with keys as
values and fewer KV heads on its full layers (attention_k_eq_v), double-wide MLPs in its shared
layers and no per-layer inputs; one a mixture of experts as 26B-A4B is (keys as values, no
per-layer inputs, 4 experts of which 2 a token beside each layer's dense MLP). Prompt and
generated logprobs within 1e-4 on both paths (deterministic kernels and torch), no further from
a float64 forward than twice transformers' float32 one, greedy tokens equal, the experts and
weights transformers' router picks, bitwise the same alone, among others in chunks of a 7-token
step budget, from the prefix cache, with speculation (accepted and rejected proposals) and
after preemption; a shared layer holds no cache of its own; a Gemma 4 the forward lacks a part
of is refused in one line; the skeleton a GGUF file's blocks are read into has transformers'
names and shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_core
from float64_truth import truth_everywhere
from test_families import _numbers, _prompt, _request, _routed, against_transformers
from test_speculation import _numbers as _flat

from probserve.engine import EngineConfig, EngineCore
from probserve.models import LoadedModel, ModelLoadError
from probserve.models.family import family
from probserve.models.llama import KVCache
from probserve.models.loader import load_model

WINDOW = 6  # shorter than the prompts: the sliding layers drop keys
TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}


def _config(kind: str, vocab: int, **extra: Any) -> Any:
    from transformers import Gemma4TextConfig

    common = {
        "vocab_size": vocab, "vocab_size_per_layer_input": vocab, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
        "sliding_window": WINDOW, "layer_types": TYPES, "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 8, "final_logit_softcapping": 5.0,
        "max_position_embeddings": 256, "eos_token_id": 2, "pad_token_id": 0,
    }  # fmt: skip
    if kind == "k_eq_v":  # the full layers: keys as values, one KV head; wide shared MLPs; no
        # per-layer inputs
        common |= {
            "attention_k_eq_v": True, "num_global_key_value_heads": 1,
            "use_double_wide_mlp": True, "hidden_size_per_layer_input": 0,
        }  # fmt: skip
    if kind == "moe":  # 26B-A4B's: keys as values on the full layers, no per-layer inputs, a
        # mixture of experts beside every layer's MLP
        common |= {
            "attention_k_eq_v": True, "num_global_key_value_heads": 1,
            "hidden_size_per_layer_input": 0, **MOE,
        }  # fmt: skip
    return Gemma4TextConfig(**(common | extra))


def _saved(config: Any, where: Path, tokenizer: Any) -> Path:
    """A random model of `config` saved to `where`, its norms, scalars and embeddings away from
    their initial ones."""
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(11)
    hf = Gemma4ForCausalLM(config).eval()
    off_init(hf)
    hf.save_pretrained(where)
    tokenizer.save_pretrained(where)
    return where


@pytest.fixture(scope="module", params=["shared", "k_eq_v", "moe"])
def model(
    request: pytest.FixtureRequest, smol: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> LoadedModel:
    config = _config(request.param, smol.vocab_size)
    where = _saved(config, tmp_path_factory.mktemp(f"gemma4-{request.param}"), smol.tokenizer)
    loaded = load_model(str(where))
    loaded.model.config._attn_implementation = "eager"  # the reference's plain attention
    loaded.model.config._experts_implementation = "eager"  # (and its experts one by one)
    return loaded


def test_the_layout_is_transformers(model: LoadedModel):
    """Each layer's head size and KV heads, and the cache layer a shared one reads: the last
    earlier layer of its type that writes (transformers' kv_sharing_modes' "store")."""
    config = model.model.config
    shape = family(config).gemma4
    assert shape is not None
    modes = config.kv_sharing_modes
    assert shape.writes == tuple(m != "reuse" for m in modes)
    stores = {config.layer_types[i]: i for i, m in enumerate(modes) if m == "store"}
    for i, layer in enumerate(model.model.model.layers):
        assert shape.head_dims[i] == layer.self_attn.head_dim
        groups = layer.self_attn.num_key_value_groups
        assert shape.kv_heads[i] == config.num_attention_heads // groups
        source = stores[config.layer_types[i]] if modes[i] == "reuse" else i
        assert shape.cache_layer[i] == sum(shape.writes[:source])
    # one cache layer per layer that writes, none for a shared one
    cache = KVCache.allocate(config, 3, 4)
    assert isinstance(cache.k, list) and len(cache.k) == sum(shape.writes) == 4
    assert [tuple(k.shape[1:]) for k in cache.k] == shape.cache_shapes()


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_paged_forward_equals_transformers(model: LoadedModel, deterministic: bool):
    core = EngineCore(
        model, EngineConfig(deterministic=deterministic, kv_cache_gib=0.02, block_size=4)
    )
    assert core.info.runner == "PagedRunner" and core.info.deterministic == deterministic
    ids = _prompt(1, 23)
    outs = run_core(core, [_request(ids, "r", routing=_routed(model))])["r"]
    gen = [t for o in outs for t in o.new_token_ids]
    assert len(gen) == 8
    ref, got, lps = against_transformers(model, outs, ids, gen)
    # no further from a float64 forward than twice transformers' float32 one is (RMS over every
    # prompt and generated token: tests/test_exactness.py's rule; float64 everywhere, its norms'
    # and router's float32 casts included)
    tokens = ids + gen
    f64 = truth_everywhere(model.model, tokens)
    ours = np.concatenate([got, lps])
    f32 = np.array([float(ref[j, tokens[j + 1]]) for j in range(len(tokens) - 1)])
    assert _rms(ours - f64) <= 2 * _rms(f32 - f64)
    if _routed(model):
        _check_routing(model, outs, tokens)


def _check_routing(model: LoadedModel, outs: list, tokens: list[int]) -> None:
    """The experts each position was routed to in every layer are those transformers' router
    picks (in its order), their weights (renormalised, times each expert's scale) within 1e-5."""
    prompt = next(o.prompt_routed for o in outs if o.prompt_routed is not None)
    parts = [prompt, *(o.routed for o in outs if o.new_token_ids)]
    experts = np.concatenate([p.experts for p in parts])
    weights = np.concatenate([p.weights for p in parts])
    layers = model.model.model.layers
    assert experts.shape == (len(tokens) - 1, len(layers), MOE["top_k_experts"])
    picked: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = [
        layer.router.register_forward_hook(lambda _m, _i, out: picked.append(out[1:]))
        for layer in layers
    ]
    try:
        with torch.no_grad():
            model.model(input_ids=torch.tensor([tokens]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(picked) == len(layers)
    for li, (want_w, want_ids) in enumerate(picked):
        assert np.array_equal(experts[:, li], want_ids[:-1].numpy()), f"layer {li}"
        assert np.abs(weights[:, li] - want_w[:-1].numpy()).max() < 1e-5


def _rms(errors: np.ndarray) -> float:
    return float(np.sqrt(np.mean(errors**2)))


def test_a_request_is_bitwise_the_same_among_others_and_in_chunks(model: LoadedModel):
    """Its numbers (a mixture of experts' routing too)."""
    canary = _prompt(2, 19)
    routed = _routed(model)
    fresh = EngineConfig(deterministic=True, kv_cache_gib=0.02, prefix_caching=False)
    alone = run_core(EngineCore(model, fresh), [_request(canary, "c", routing=routed)])["c"]
    core = EngineCore(
        model,
        EngineConfig(deterministic=True, kv_cache_gib=0.02, block_size=4, max_num_batched_tokens=7),
    )
    others = [_request(_prompt(10 + i, 5 + 4 * i), f"o{i}", 3 + i) for i in range(5)]
    mixed = run_core(core, [*others[:2], _request(canary, "c", routing=routed), *others[2:]])["c"]
    again = run_core(core, [_request(canary, "again", routing=routed)])["again"]  # cached prefix
    assert core.stats().prefix_cache_hits > 0
    assert _numbers(mixed) == _numbers(alone) == _numbers(again)


class _Misguided:
    """Proposes each request's true continuation with its last proposed token wrong: the rest
    accepted, that one rejected."""

    def __init__(self, full: dict[tuple[int, ...], list[int]]) -> None:
        self.full = full

    def propose_many(self, asks: list) -> dict[str, tuple[int, ...]]:
        out = {}
        for rid, tokens, k in asks:
            full = next(f for p, f in self.full.items() if tuple(tokens[: len(p)]) == p)
            guess = full[len(tokens) : len(tokens) + k]
            out[rid] = (*guess[:-1], guess[-1] + 1) if guess else ()
        return out


def test_speculation_and_preemption_change_no_bit(model: LoadedModel):
    """Speculation's proposals (their rows through the shared layers, accepted and rejected
    ones), and preemption in a cache too small for every sequence (recomputed), leave every
    token and logprob the bits each request has alone."""
    prompts = [_prompt(20 + i, 16) for i in range(4)]
    det = {"deterministic": True, "block_size": 4}

    def requests() -> list:
        return [_request(p, f"s{i}", 12) for i, p in enumerate(prompts)]

    alone = {}
    for r in requests():
        core = EngineCore(model, EngineConfig(kv_cache_gib=0.02, speculative="off", **det))
        alone[r.request_id] = _flat(run_core(core, [r])[r.request_id])
    spec = EngineCore(model, EngineConfig(kv_cache_gib=0.02, speculative="ngram", **det))
    full = {tuple(p): p + alone[f"s{i}"][0] for i, p in enumerate(prompts)}
    spec.speculator.proposer = _Misguided(full)
    outs = run_core(spec, requests())
    assert 0 < spec.speculator.accepted < spec.speculator.drafted
    assert {rid: _flat(o) for rid, o in outs.items()} == alone
    tokens = 48 * KVCache.bytes_per_token(model.model.config)  # 4 requests of 28 tokens
    tight = EngineCore(model, EngineConfig(kv_cache_gib=tokens / 2**30, **det))
    outs = run_core(tight, requests())
    assert tight.scheduler.num_preemptions > 0
    assert {rid: _flat(o) for rid, o in outs.items()} == alone


def test_a_gemma4_the_forward_lacks_a_part_of_is_refused_in_one_line(
    smol: LoadedModel, tmp_path: Path
):
    """Its bidirectional attention (an embedding model's) is not built: the engine refuses
    it, saying so in one line, rather than serving it some other way."""
    config = _config("shared", smol.vocab_size, use_bidirectional_attention="all")
    loaded = load_model(str(_saved(config, tmp_path, smol.tokenizer)))
    with pytest.raises(ModelLoadError) as refused:
        EngineCore(loaded, EngineConfig(kv_cache_gib=0.02))
    line = str(refused.value)
    assert "\n" not in line and "bidirectional attention" in line and "gemma4_text" in line


@pytest.mark.parametrize("kind", ["shared", "k_eq_v", "moe"])
def test_its_skeleton_names_and_shapes_every_tensor_as_transformers(smol: LoadedModel, kind: str):
    """The weightless skeleton a GGUF file's blocks are read into (models/skeleton.py): each
    layer of its own shape, a shared layer without k/v, keys as values without v, double-wide
    shared MLPs, the per-layer input embedding's tensors, the layer scalars (a buffer in
    transformers), a mixture of experts' router, stacked experts and branch norms, tied head:
    transformers' names and shapes, none more, none less."""
    from transformers import Gemma4ForCausalLM

    from probserve.models.skeleton import Skeleton

    config = _config(kind, smol.vocab_size)
    ours = {n: tuple(p.shape) for n, p in Skeleton(config).named_parameters()}
    with torch.device("meta"):
        hf = Gemma4ForCausalLM(config)
    theirs = {n: tuple(p.shape) for n, p in hf.named_parameters()}
    theirs |= {n: tuple(b.shape) for n, b in hf.named_buffers() if n.endswith("layer_scalar")}
    assert ours == theirs


def test_transformers_runner_serves_it_too(model: LoadedModel):
    """`--runner hf` (transformers' own forward) sizes its cache from each layer's shapes (the
    global head_dim is refused) and gives the paged forward's greedy tokens."""
    ids = _prompt(1, 23)
    hf = EngineCore(model, EngineConfig(runner="hf", kv_cache_gib=0.02, block_size=4))
    paged = EngineCore(model, EngineConfig(kv_cache_gib=0.02, block_size=4))
    assert hf.info.runner == "HFRunner"
    tokens = [
        [t for o in run_core(core, [_request(ids, "r")])["r"] for t in o.new_token_ids]
        for core in (hf, paged)
    ]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8


def test_its_prefix_blocks_come_back_from_disk_with_the_same_bits(
    model: LoadedModel, tmp_path: Path
):
    """--prefix-cache-dir with a cache of one tensor per layer (its layers differ in shape): the
    blocks written at shutdown are read by the next engine, and the request's numbers are the
    cold run's bits."""
    ids = _prompt(3, 37)  # two full blocks of 16

    def engine(directory: Path | None) -> EngineCore:
        where = str(directory) if directory else None
        return EngineCore(model, EngineConfig(kv_cache_gib=0.02, prefix_cache_dir=where))

    cold = _flat(run_core(engine(None), [_request(ids, "r")])["r"])
    first = engine(tmp_path)
    assert _flat(run_core(first, [_request(ids, "r")])["r"]) == cold
    first.close()
    second = engine(tmp_path)
    assert _flat(run_core(second, [_request(ids, "r")])["r"]) == cold
    assert second.stats().prefix_cache_disk_hits == len(ids) // 16 > 0
    second.close()


def off_init(hf: Any) -> None:
    """Gemma 4's norms (w, not 1 + w), weights and layer scalars off their init (a router's
    scales about 1, as a norm's)."""
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                param.copy_(torch.randn_like(param) * 0.3 + 1.0)
            else:
                param.normal_(0.0, 0.08)
        for name, buffer in hf.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(torch.rand_like(buffer) + 0.5)
