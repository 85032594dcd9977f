"""Qwen3.5 dense, Qwen3.5-MoE and Qwen3-Next GGUF files (llama.cpp's `qwen35`, `qwen35moe`,
`qwen3next`; models/gguf_hybrid.py) served in their blocks: tiny random models of transformers'
own classes written as llama.cpp's converter writes them (tests/gguf_hybrid_util.py: norms + 1,
ssm_a, value heads tiled, conv squeezed, an extra multi-token-prediction block), read back with
gguf-py, loaded with `--weights native` (matrices kept as Q8_0 blocks, experts held once, the
configuration, tokenizer and chat template from the file), and served on the paged forward within
1e-4 of transformers' float32 forward of the file's dequantized weights (transformers' own GGUF
loader for Qwen3.5; for Qwen3-Next, which it does not read, the test's inverse of the converter),
greedy tokens its argmax, and the same bits alone and among five others in 7-token steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_core
from gguf import GGMLQuantizationType, GGUFReader, dequantize
from gguf_hybrid_util import ARCHS, write_hybrid_gguf
from test_families import _request, against_transformers
from test_qwen35 import _config, _numbers, _prompt, off_init

from probserve.engine import EngineConfig, EngineCore
from probserve.models import LoadedModel, ModelLoadError, load_model
from probserve.models.gguf_blocks import QuantizedTensor, as_float

KINDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


def _tiny(kind: str, vocab: int) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(11)
    config = _config(kind, vocab)
    if kind == "qwen3_next":  # every layer sparse, as the real model (llama.cpp's qwen3next
        config.mlp_only_layers = []  # has no dense feed-forward tensors)
    config._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.requires_grad_(False)
    off_init(hf)
    return hf


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from probserve.kernels.build import build

    out = tmp_path_factory.mktemp("cache")
    (out / "kernels").symlink_to(build().parent, target_is_directory=True)
    return out


@pytest.fixture(scope="module", params=KINDS)
def written(
    request: pytest.FixtureRequest, smol: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Any, Path]:
    hf = _tiny(request.param, smol.vocab_size)
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, hf, write_hybrid_gguf(hf, folder / "m.gguf", GGMLQuantizationType.Q8_0)


def _twin(hf: Any, loaded: LoadedModel) -> Any:
    """transformers' model of `hf`'s class holding the served weights dequantized (out_proj's
    columns, which the forward keeps in the file's tiled order, put back in the grouped one; the
    packed Qwen3-Next projections packed again): the reference for Qwen3-Next, whose GGUF files
    transformers does not read, and for Qwen3.5 the same numbers as transformers' reading."""
    from transformers import AutoModelForCausalLM

    from probserve.models.gguf_hybrid import grouped_to_tiled

    weights, cfg = loaded.weights, hf.config
    assert weights is not None
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
    tiled = getattr(loaded.model.config, "gguf_value_heads", None) == "tiled"
    twin = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().requires_grad_(False)
    state = {}
    for name, param in twin.named_parameters():
        base = name.rsplit(".", 1)[0]
        if name.endswith("in_proj_qkvz.weight"):  # [q k v z] per key head again
            qkv = as_float(weights[base.replace("qkvz", "qkv") + ".weight"])
            z = as_float(weights[base.replace("qkvz", "z") + ".weight"])
            q, k, v = qkv.split([nk * dk, nk * dk, nv * dv])
            groups = [q.reshape(nk, dk, -1), k.reshape(nk, dk, -1), v.reshape(nk, r * dv, -1)]
            groups.append(z.reshape(nk, r * dv, -1))
            state[name] = torch.cat(groups, 1).reshape(param.shape)
        elif name.endswith("in_proj_ba.weight"):
            b = as_float(weights[base.replace("_ba", "_b") + ".weight"]).reshape(nk, r, -1)
            a = as_float(weights[base.replace("_ba", "_a") + ".weight"]).reshape(nk, r, -1)
            state[name] = torch.cat([b, a], 1).reshape(param.shape)
        elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            parts = ("gate_proj", "up_proj") if "gate_up" in name else ("down_proj",)
            state[name] = torch.stack([
                torch.cat([as_float(weights[f"{base}.{e}.{p}.weight"]) for p in parts])
                for e in range(cfg.num_experts)
            ])  # fmt: skip
        elif name.endswith("out_proj.weight") and tiled:
            state[name] = as_float(weights[name])[:, torch.argsort(grouped_to_tiled(nk, r, dv))]
        else:
            state[name] = as_float(weights[name]).reshape(param.shape)
    twin.load_state_dict(state)
    return twin


def test_a_gguf_file_is_served_in_its_blocks_within_1e_4_of_transformers(
    written: tuple[str, Any, Path], cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PROBSERVE_CACHE_DIR", str(cache))
    kind, hf, path = written
    cfg = hf.config
    arch = ARCHS[cfg.model_type]
    # gguf-py reads the file back: its architecture, the trunk and one MTP block, Q8_0
    # matrices, F32 vectors, norms stored as w + 1 and ssm_a as -exp(A_log)
    reader = GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == arch
    assert reader.fields[f"{arch}.block_count"].contents() == 5
    assert reader.fields[f"{arch}.nextn_predict_layers"].contents() == 1
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.0.attn_qkv.weight"].tensor_type == GGMLQuantizationType.Q8_0
    assert tensors["blk.0.ssm_out.weight"].tensor_type == GGMLQuantizationType.Q8_0
    assert "blk.4.nextn.eh_proj.weight" in tensors
    norm = dequantize(tensors["blk.1.attn_norm.weight"].data, GGMLQuantizationType.F32)
    want = hf.model.layers[1].input_layernorm.weight.numpy() + 1
    np.testing.assert_allclose(norm, want, rtol=0, atol=1e-6)
    a = dequantize(tensors["blk.0.ssm_a"].data, GGMLQuantizationType.F32)
    a_log = hf.model.layers[0].linear_attn.A_log
    assert sorted(a.tolist()) == pytest.approx(sorted((-torch.exp(a_log)).tolist()), abs=1e-6)

    loaded = load_model(str(path), "native")
    got = loaded.model.config
    assert got.model_type == cfg.model_type and got.num_hidden_layers == 4  # MTP left out
    assert list(got.layer_types) == list(cfg.layer_types)
    assert loaded.weights is not None and loaded.weights_format == "Q8_0"
    assert loaded.weights_in_blocks > 0.9
    for name in ("linear_attn.in_proj_qkv", "linear_attn.out_proj", "self_attn.q_proj"):
        layer = 1 if name.startswith("self_attn") else 0
        assert isinstance(loaded.weights[f"model.layers.{layer}.{name}.weight"], QuantizedTensor)
    if kind != "qwen3_5":  # each expert's rows a view of the file's stacked blocks
        down = loaded.weights["model.layers.2.mlp.experts.7.down_proj.weight"]
        assert isinstance(down, QuantizedTensor) and (down.n, down.k) == (64, 32)
    template = reader.fields["tokenizer.chat_template"].contents()
    assert loaded.chat_template == template and loaded.tokenizer("Hi there").input_ids
    if kind == "qwen3_next":
        reference = _twin(hf, loaded)
    else:  # transformers' own GGUF loader, float32
        reference = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    # the forward holds transformers' tensors (the twin: each undone from the served blocks)
    ids = _prompt(1, 23)
    twin = reference if kind == "qwen3_next" else _twin(hf, loaded)
    # every served tensor is the checkpoint's within Q8_0's rounding (a head out of place: ~0.1)
    served = dict(twin.named_parameters())
    for name, param in hf.named_parameters():
        torch.testing.assert_close(served[name], param, rtol=0, atol=4e-3, msg=name)
    if kind != "qwen3_next":
        with torch.no_grad():
            mine, theirs = (m(torch.tensor([ids])).logits for m in (twin, reference))
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)
    ref = LoadedModel(
        model=reference, tokenizer=loaded.tokenizer, name=kind, eos_token_ids=frozenset({2}),
        context_length=256, vocab_size=loaded.vocab_size,
    )  # fmt: skip
    core = EngineCore(loaded, EngineConfig(deterministic=True, kv_cache_gib=0.02, block_size=4))
    assert core.info.runner == "RecurrentRunner" and core.info.deterministic
    alone = run_core(core, [_request(ids, "r", 8)])["r"]
    gen = [t for o in alone for t in o.new_token_ids]
    against_transformers(ref, alone, ids, gen)
    mixed_core = EngineCore(
        loaded,
        EngineConfig(deterministic=True, kv_cache_gib=0.02, block_size=4, max_num_batched_tokens=7),
    )
    others = [_request(_prompt(10 + i, 5 + 4 * i), f"o{i}", 3 + i) for i in range(5)]
    mixed = run_core(mixed_core, [*others[:2], _request(ids, "r", 8), *others[2:]])["r"]
    assert _numbers(mixed) == _numbers(alone)
    if kind == "qwen3_next":  # transformers cannot read it: served in its blocks only
        with pytest.raises(ModelLoadError, match="blocks only"):
            load_model(str(path), "float32")


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_a_half_precision_file_is_served_from_transformers_reading_of_it(
    smol: LoadedModel, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """An F16 file (no block format: `--weights native` loads float32 through transformers'
    GGUF loader, which undoes the converter itself, given the configuration completed from the
    file): on the paged forward, within 1e-4."""
    monkeypatch.setenv("PROBSERVE_CACHE_DIR", str(cache))
    hf = _tiny(kind, smol.vocab_size)
    path = write_hybrid_gguf(hf, tmp_path / "f16.gguf", GGMLQuantizationType.F16)
    loaded = load_model(str(path), "native")
    assert loaded.weights is None and loaded.model.config.num_hidden_layers == 4
    core = EngineCore(loaded, EngineConfig(deterministic=True, kv_cache_gib=0.02, block_size=4))
    assert core.info.runner == "RecurrentRunner"
    ids = _prompt(4, 15)
    outs = run_core(core, [_request(ids, "h", 4)])["h"]
    against_transformers(loaded, outs, ids, [t for o in outs for t in o.new_token_ids])
