"""Mixture-of-experts routing (kernels/route.cpp, models/moe.py): a token's experts and weights are
a function of its own row (ties by expert id, the same bits alone and in any batch), softmax
and renormalisation as transformers computes them, and the families the paged forward refuses
say in one line what is missing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from probserve.kernels.invariant import InvariantKernels
from probserve.kernels.torch_ops import TorchOps
from probserve.models.family import Unsupported, family


@pytest.fixture(scope="module")
def kernels() -> InvariantKernels:
    return InvariantKernels()


def test_routing_matches_transformers_and_breaks_ties_by_id(kernels):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(50, 16, generator=gen) * 3
    for norm in (False, True):
        ids, w = kernels.route(logits, 4, norm)
        ref_ids, ref_w = TorchOps().route(logits, 4, norm)  # torch's softmax and topk
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
    ref_ids, ref_w = TorchOps().route(wide, 80, True)
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
    from transformers import OlmoeConfig, Qwen2MoeConfig

    with pytest.raises(Unsupported, match="shared expert"):
        family(Qwen2MoeConfig(num_hidden_layers=2))
    with pytest.raises(Unsupported, match="clip_qkv"):
        family(OlmoeConfig(num_hidden_layers=2, clip_qkv=8.0))


@pytest.mark.parametrize(
    ("arch", "layout"),
    [
        ("qwen3moe", "stacked"), ("qwen3moe", "fused"), ("llama", "stacked"),
        ("llama", "per_expert"), ("gpt-oss", "stacked"),
    ],
)  # fmt: skip
def test_a_moe_gguf_serves_its_experts_in_blocks(tmp_path, monkeypatch, arch: str, layout: str):
    """A Qwen3-MoE, Mixtral (arch llama with experts, as llama.cpp writes it) or gpt-oss GGUF
    file (3-D expert tensors in Q8_0, gpt-oss's in MXFP4 with biases, a float32 router): each
    expert's rows held as the file's blocks (no float32 copy), the configuration's experts from
    the file (gpt-oss's YaRN, windows and head size too), prompt logprobs within 1e-4 of
    transformers' forward of the dequantized weights, and a request the same bits among others;
    Mixtral's first files (each expert its own tensors) and gate/up in one stacked tensor too.
    The float32 path: Qwen3-MoE through transformers' own GGUF loader with the completed
    configuration, the same numbers; a file transformers misreads (Mixtral: a dense Llama;
    gpt-oss; fused gate/up) refused in one line."""
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
        per_expert=layout == "per_expert", fused=layout == "fused",
    )  # fmt: skip
    loaded = load_model(str(path), "native")
    cfg = loaded.model.config
    fam = family(cfg)
    assert (fam.experts, fam.top_k, fam.expert_intermediate, fam.norm_topk) == (8, 3, 32, True)
    kinds = {"qwen3moe": "qwen3_moe", "llama": "mixtral", "gpt-oss": "gpt_oss"}
    assert cfg.model_type == kinds[arch]
    weights = loaded.weights
    gpt_oss = arch == "gpt-oss"
    assert weights is not None and loaded.weights_format == ("MXFP4+Q8_0" if gpt_oss else "Q8_0")
    down = weights["model.layers.1.mlp.experts.7.down_proj.weight"]
    assert isinstance(down, QuantizedTensor) and (down.n, down.k) == (64, 32)
    twin = AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)
    state = {}
    for name, param in twin.named_parameters():
        if gpt_oss and ".experts." in name:  # x @ W layouts, gate and up interleaved
            base, what = name.rsplit(".", 1)
            kind = "bias" if what.endswith("_bias") else "weight"

            def part(e: int, p: str, kind: str = kind, base: str = base) -> torch.Tensor:
                return as_float(weights[f"{base}.{e}.{p}.{kind}"])

            if what.startswith("gate_up"):
                pairs = [
                    torch.stack([part(e, "gate_proj"), part(e, "up_proj")], -1)
                    for e in range(fam.experts)
                ]
                state[name] = torch.stack([
                    p.transpose(0, 1).reshape(p.shape[1], -1) if kind == "weight" else p.reshape(-1)
                    for p in pairs
                ])  # fmt: skip
            else:
                downs = [part(e, "down_proj") for e in range(fam.experts)]
                state[name] = torch.stack([d.T if kind == "weight" else d for d in downs])
        elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            base = name.rsplit(".", 1)[0]
            parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
            if layout == "fused" and len(parts) == 2:
                parts = ("gate_up_proj",)
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
    # (rows in any grouping: an output carries several tokens where proposals were kept)
    assert [t for o in mixed for t in o.new_token_ids] == [
        t for o in alone for t in o.new_token_ids
    ]
    assert b"".join(np.asarray(o.logprobs.logprobs).tobytes() for o in mixed if o.logprobs) == (
        b"".join(np.asarray(o.logprobs.logprobs).tobytes() for o in alone if o.logprobs)
    )
    if arch != "qwen3moe" or layout == "fused":
        with pytest.raises(ModelLoadError, match="blocks only"):
            load_model(str(path), "float32")
        return
    float32 = load_model(str(path), "float32").model
    with torch.no_grad():
        theirs = torch.log_softmax(float32(torch.tensor([ids])).logits[0].double(), -1)
    np.testing.assert_allclose(theirs.numpy(), ref.numpy(), atol=1e-5)


def _tiny_qwen3_moe(smol):
    """A tiny random Qwen3-MoE over the embedded tokenizer (layer 1 dense, 0 and 2 sparse)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from probserve.models import LoadedModel

    torch.manual_seed(11)
    config = Qwen3MoeConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=3, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
        vocab_size=smol.vocab_size, max_position_embeddings=256, eos_token_id=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    config._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.copy_(torch.randn_like(param) * (0.3 if "norm" in name else 0.08))
            if "norm" in name:
                param.add_(1.0)
    return LoadedModel(
        model=hf, tokenizer=smol.tokenizer, name="tiny-moe", eos_token_ids=frozenset({2}),
        context_length=256, vocab_size=smol.vocab_size,
    )  # fmt: skip


def _decoded(entries: list, k: int) -> tuple[np.ndarray, np.ndarray]:
    """return_routed_experts' entries (no nulls) as experts [n, layers, k] and weights."""
    import base64

    experts = [np.frombuffer(base64.b64decode(e["experts"]), "<i2") for e in entries]
    weights = [np.frombuffer(base64.b64decode(e["weights"]), "<f4") for e in entries]
    n = len(entries)
    return np.stack(experts).reshape(n, -1, k), np.stack(weights).reshape(n, -1, k)


def test_return_routed_experts_names_the_routers_picks_on_every_route(smol):
    """Completions (echo: the prompt's too) and chat (prompt_logprobs: the prompt's too), whole
    and streamed: one entry per token, each the experts and weights transformers' router gives
    the row before the token in each MoE layer; /health names the layers; a request past
    --max-routed-tokens, Responses, and a dense model's server refuse the field by name."""
    import httpx
    from server_util import running_server

    loaded = _tiny_qwen3_moe(smol)
    hf, k = loaded.model, 3
    with running_server(loaded, "--deterministic", "--max-routed-tokens", "200") as url:
        c = httpx.Client(base_url=url, timeout=120)
        health = c.get("/health").json()
        assert health["routed_experts"] == {"layers": [0, 2], "experts_per_token": k}
        body = {
            "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
            "echo": True, "return_routed_experts": True, "return_token_ids": True,
            "ignore_eos": True,
        }  # fmt: skip
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        prompt, gen = choice["prompt_token_ids"], choice["token_ids"]
        assert choice["prompt_routed_experts"][0] is None
        assert len(choice["prompt_routed_experts"]) == len(prompt)
        assert len(choice["routed_experts"]) == len(gen) == 6
        entries = choice["prompt_routed_experts"][1:] + choice["routed_experts"]
        experts, weights = _decoded(entries, k)
        ids = prompt + gen
        with torch.no_grad():
            router = hf(input_ids=torch.tensor([ids]), output_router_logits=True).router_logits
        assert experts.shape == (len(ids) - 1, 2, k)
        for m, logits in enumerate(router):
            w, e = torch.topk(torch.softmax(logits[: len(ids) - 1].double(), -1), k)
            assert np.array_equal(experts[:, m], e.numpy())
            assert np.abs(weights[:, m] - (w / w.sum(-1, keepdim=True)).numpy()).max() < 1e-5
        # streamed: the same entries, chunk by chunk (the prompt's in the first chunk)
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            chunks = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
        firsts = [ch["choices"][0] for ch in chunks]
        assert firsts[0]["prompt_routed_experts"] == choice["prompt_routed_experts"]
        streamed = [e for ch in firsts for e in ch["routed_experts"] or []]
        assert streamed == choice["routed_experts"]
        # without echo: the generated tokens' alone, the same entries
        plain = c.post("/v1/completions", json={**body, "echo": False}).json()["choices"][0]
        assert "prompt_routed_experts" not in plain
        assert plain["routed_experts"] == choice["routed_experts"]
        # chat: the reply's tokens, and with prompt_logprobs the rendered prompt's
        chat = {
            "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 5,
            "temperature": 0, "ignore_eos": True, "return_routed_experts": True,
            "return_token_ids": True, "prompt_logprobs": 0,
        }  # fmt: skip
        r = c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        answer = r.json()
        got = answer["choices"][0]
        assert len(got["prompt_routed_experts"]) == len(answer["prompt_token_ids"])
        assert len(got["routed_experts"]) == len(got["token_ids"]) == 5
        ids = answer["prompt_token_ids"] + got["token_ids"]
        experts, _ = _decoded(got["prompt_routed_experts"][1:] + got["routed_experts"], k)
        with torch.no_grad():
            router = hf(input_ids=torch.tensor([ids]), output_router_logits=True).router_logits
        for m, logits in enumerate(router):
            want = torch.topk(torch.softmax(logits[: len(ids) - 1].double(), -1), k).indices
            assert np.array_equal(experts[:, m], want.numpy())
        with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
            chunks = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
        parts = [ch["choices"][0] for ch in chunks if ch["choices"]]
        assert [e for p in parts for e in p.get("routed_experts") or []] == got["routed_experts"]
        assert next(p["prompt_routed_experts"] for p in parts if p.get("prompt_routed_experts"))
        # bounded, and refused where it is not served
        over = c.post("/v1/completions", json={**body, "max_tokens": 199})
        assert over.status_code == 400, over.text
        assert over.json()["error"]["param"] == "return_routed_experts"
        unbounded = c.post("/v1/completions", json={**body, "max_tokens": None, "echo": False})
        assert unbounded.status_code == 400
        resp = c.post("/v1/responses", json={"input": "Hi", "return_routed_experts": True})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "return_routed_experts"
        assert c.post("/v1/completions", json=body).json()["choices"][0] == choice  # canary


@pytest.mark.slow  # the session's server (its worker is a process)
def test_a_dense_model_refuses_return_routed_experts(http):
    r = http.post(
        "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2, "return_routed_experts": True},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "return_routed_experts"
    assert "mixture-of-experts" in r.json()["error"]["message"]


class _Parts:
    """A projection of packed parts side by side (models/linear.py's Linear or Joined)."""

    def __init__(self, kernels: InvariantKernels, parts: list) -> None:
        self.kernels, self.parts = kernels, parts

    @property
    def weights(self) -> list:
        return self.parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.kernels.linear(x, p) for p in self.parts], dim=-1)


def _mixed_experts(kernels: InvariantKernels, count: int, hidden: int, inter: int) -> list:
    """Experts in float32 panels, in one block format, and in two joined (Q8_0 gate, Q4_K up)."""
    from gguf import GGMLQuantizationType as Q
    from test_quantized import random_blocks

    from probserve.kernels.experts import Expert

    rng = np.random.default_rng(5)
    gen = torch.Generator().manual_seed(5)
    halves = rng.standard_normal(64) * 0.01  # finite products

    def dense(n: int, k: int):
        return kernels.pack(torch.randn(n, k, generator=gen) * 0.05)

    def blocks(qtype, n: int, k: int):
        return kernels.qpack(random_blocks(qtype, n, k, rng, halves), qtype.value)

    experts = []
    for e in range(count):
        if e % 3 == 0:
            gate_up, down = [dense(2 * inter, hidden)], [dense(hidden, inter)]
        elif e % 3 == 1:
            gate_up, down = [blocks(Q.Q4_K, 2 * inter, hidden)], [blocks(Q.Q6_K, hidden, inter)]
        else:
            gate_up = [blocks(Q.Q8_0, inter, hidden), blocks(Q.Q4_K, inter, hidden)]
            down = [blocks(Q.Q4_0, hidden, inter)]
        experts.append(Expert(_Parts(kernels, gate_up), _Parts(kernels, down)))
    return experts


def test_the_native_experts_are_the_bits_of_the_python_loop(kernels):
    """A layer's experts in one ps_experts call (the hybrid families' and Gemma 4's path) give
    each token the bits kernels/experts.py's loop gives, for every activation the library has,
    any routing (experts with no token, one, or many; a token's k in any order), in block
    formats, float32 and joined parts; another activation runs the loop."""
    from functools import partial

    from probserve.kernels.experts import EachExpert
    from probserve.kernels.native_experts import NativeExperts

    count, hidden, inter, k = 7, 256, 256, 3
    experts = _mixed_experts(kernels, count, hidden, inter)
    native = kernels.experts(iter(experts), count)
    assert isinstance(native, NativeExperts)
    loop = EachExpert(tuple(experts))
    gen = torch.Generator().manual_seed(6)
    acts = [
        kernels.silu_mul,
        kernels.gelu_tanh_mul,
        partial(kernels.gpt_oss_glu, alpha=1.702, limit=0.05),
    ]
    for rows in (0, 1, 5, 37):
        x = torch.randn(rows, hidden, generator=gen)
        picks = [torch.randperm(count, generator=gen)[:k] for _ in range(rows)]
        ids = torch.stack(picks) if picks else torch.zeros(0, k, dtype=torch.int64)
        if rows > 1:
            ids[1] = ids[0].flip(0)  # the same experts in another order
        weights = torch.rand(rows, k, generator=gen)
        for act in acts:
            assert kernels.native_activation(act) is not None
            got, want = native(x, ids, weights, act), loop(x, ids, weights, act)
            assert got.shape == want.shape == (rows, hidden)
            assert got.numpy().tobytes() == want.numpy().tobytes(), (rows, act)
        other = lambda gu: kernels.silu_mul(gu) * 2  # noqa: E731 (not one the library has)
        assert kernels.native_activation(other) is None
        want = loop(x, ids, weights, other)
        assert native(x, ids, weights, other).numpy().tobytes() == want.numpy().tobytes()
    with pytest.raises(IndexError, match="expert"):
        native(torch.zeros(1, hidden), torch.tensor([[0, count, 1]]), torch.ones(1, k), acts[0])
