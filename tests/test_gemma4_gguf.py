"""Gemma 4 (text) GGUF files (arch `gemma4`, written as llama.cpp's converter writes them:
tests/gemma4_gguf.py) served from their blocks (`--weights native`): tiny random
`Gemma4ForCausalLM` models of two shapes (sliding and full layers of different head sizes, the
last layers reading an earlier layer's KV cache, per-layer input embeddings; keys as values
with fewer KV heads on the full layers, double-wide MLPs in the shared layers, no per-layer
inputs; and a mixture of experts beside every layer's MLP, as 26B-A4B), in float32 and in Q8_0
blocks. The configuration comes from the file's metadata
(transformers' reading of it has Gemma 4's defaults), every tensor is the one gguf-py reads from
the file, the matrices and the per-layer embedding table stay in their blocks, prompt and
generated logprobs are within 1e-4 of transformers' float32 forward of the dequantized weights
with the same greedy tokens, and a request's numbers are bitwise the same alone, among others in
chunks of a 7-token step budget and from the prefix cache. A Gemma 4 file whose experts cannot be
routed (more a token than it has), and the float32 path of any Gemma 4 file, are refused in one
line."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_core
from gemma4_gguf import gguf_name, gguf_names, write_gemma4_gguf
from gguf import GGMLQuantizationType, GGUFReader, dequantize
from test_families import _numbers, _prompt, _request, against_transformers
from test_gemma4 import MOE, off_init

from probserve.engine import EngineConfig, EngineCore
from probserve.models import LoadedModel, ModelLoadError, load_model
from probserve.models.gguf_blocks import QuantizedTensor, as_float

TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
SHAPES = {
    "shared": {},  # per-layer inputs, one KV head count
    "k_eq_v": {
        "attention_k_eq_v": True, "num_global_key_value_heads": 1, "use_double_wide_mlp": True,
        "hidden_size_per_layer_input": 0,
    },
    "moe": {
        "attention_k_eq_v": True, "num_global_key_value_heads": 1,
        "hidden_size_per_layer_input": 0, **MOE,
    },
}  # fmt: skip
Q8_0, F32 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.F32


def _hf(vocab: int, shape: str, **extra: Any) -> Any:
    """A random Gemma4ForCausalLM whose every matrix has whole Q8_0 blocks a row, its norms,
    scalars and embeddings away from their initial values."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    common = {
        "vocab_size": vocab, "vocab_size_per_layer_input": vocab, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "global_head_dim": 64, "sliding_window": 6,
        "layer_types": TYPES, "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 32,
        "final_logit_softcapping": 5.0, "max_position_embeddings": 256, "eos_token_id": 2,
        "pad_token_id": 0,
    }  # fmt: skip
    config = Gemma4TextConfig(**(common | SHAPES[shape] | extra))
    torch.manual_seed(13)
    hf = Gemma4ForCausalLM(config).eval().requires_grad_(False)
    off_init(hf)
    return hf


@dataclasses.dataclass
class Served:
    hf: Any  # the model written
    qtype: GGMLQuantizationType  # its matrices' format in the file
    path: Path
    loaded: LoadedModel  # probserve's native load of the file
    twin: Any  # transformers' model of the file's configuration, gguf-py's dequantized tensors


def _twin(config: Any, path: Path) -> Any:
    """transformers' Gemma 4 of `config` holding the file's tensors as gguf-py dequantizes them
    (each found by the converter's own name map)."""
    from transformers import Gemma4ForCausalLM

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    twin = Gemma4ForCausalLM(config).eval().requires_grad_(False)
    twin.config._attn_implementation = "eager"
    twin.config._experts_implementation = "eager"
    names = gguf_names(config)
    own = dict(twin.named_parameters())
    own |= {k: v for k, v in twin.named_buffers() if k.endswith("layer_scalar")}
    for hf_name, target in own.items():
        t = tensors[str(gguf_name(names, hf_name))]
        values = dequantize(t.data, t.tensor_type).astype(np.float32)
        target.copy_(torch.from_numpy(values.reshape(tuple(target.shape))))
    return twin


@pytest.fixture(
    scope="module", params=[("shared", F32), ("shared", Q8_0), ("k_eq_v", Q8_0), ("moe", Q8_0)]
)
def served(
    request: pytest.FixtureRequest, smol: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> Served:
    from probserve.kernels.build import build

    shape, qtype = request.param
    where = tmp_path_factory.mktemp(f"gemma4-gguf-{shape}-{qtype.name}")
    cache = where / "cache"
    cache.mkdir()
    (cache / "kernels").symlink_to(build().parent, target_is_directory=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("PROBSERVE_CACHE_DIR", str(cache))
    request.addfinalizer(mp.undo)
    hf = _hf(smol.vocab_size, shape)
    path = write_gemma4_gguf(hf, where / "gemma4.gguf", qtype)
    loaded = load_model(str(path), "native")
    return Served(hf, qtype, path, loaded, _twin(loaded.model.config, path))


def test_the_configuration_comes_from_the_files_metadata(served: Served, smol: LoadedModel):
    """Each layer's type, head size and KV heads, the layers sharing KV, keys as values, the
    MLP widths, the per-layer input width, each layer type's RoPE and the soft-cap: the model
    written's (transformers' own reading of the file has Gemma 4's defaults for them); the
    end-of-sequence tokens, the tokenizer and the chat template: the file's."""
    smol_ids = smol.tokenizer.encode
    want, got = served.hf.config, served.loaded.model.config
    assert got.model_type == "gemma4_text"
    n = want.num_hidden_layers
    assert got.layer_types == want.layer_types and got.kv_sharing_modes == want.kv_sharing_modes
    for i in range(n):
        ours, theirs = got.per_layer_config[i], want.per_layer_config[i]
        assert (ours.head_dim, ours.num_key_value_heads) == (
            theirs.head_dim, theirs.num_key_value_heads
        )  # fmt: skip
    for key in (
        "attention_k_eq_v", "use_double_wide_mlp", "intermediate_size",
        "hidden_size_per_layer_input", "final_logit_softcapping", "sliding_window",
        "rope_parameters", "tie_word_embeddings", "vocab_size", "enable_moe_block",
        "num_experts", "top_k_experts", "moe_intermediate_size",
    ):  # fmt: skip
        assert getattr(got, key) == getattr(want, key), key
    assert served.loaded.eos_token_ids == frozenset({served.loaded.tokenizer.eos_token_id})
    # the tokenizer and chat template: the file's
    template = GGUFReader(str(served.path)).fields["tokenizer.chat_template"].contents()
    assert served.loaded.chat_template == template
    text = "Gemma 4, served from its blocks."
    assert served.loaded.tokenizer.encode(text) == smol_ids(text)


def test_every_tensor_is_the_one_gguf_py_reads_and_blocks_stay_blocks(served: Served):
    """Each weight probserve holds dequantizes to the bits gguf-py reads from the file under
    the converter's name for it (a stacked expert tensor: each expert's, held apart); in a Q8_0
    file every matrix (each expert's, the per-layer embedding table too) is held as the file's
    blocks."""
    weights = served.loaded.weights
    assert weights is not None
    q8 = served.qtype == Q8_0
    assert served.loaded.weights_format == ("Q8_0" if q8 else "float32")
    for name, param in served.twin.named_parameters():
        if name == "lm_head.weight":  # tied: the embedding
            continue
        if param.ndim == 3:  # experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]
            at, _, which = name.rpartition(".")
            parts = [(weights[f"{at}.{e}.{which}.weight"], param[e]) for e in range(len(param))]
        else:
            parts = [(weights[name], param)]
        for held, value in parts:
            assert torch.equal(as_float(held).reshape(value.shape), value), name
            if q8 and value.ndim == 2:
                assert isinstance(held, QuantizedTensor) and held.type_name == "Q8_0", name
    if q8 and served.hf.config.hidden_size_per_layer_input:
        table = weights["model.embed_tokens_per_layer.weight"]
        assert isinstance(table, QuantizedTensor)
        ids = np.array([5, 70, 5, 4000])
        assert torch.equal(table.rows(ids), table.dequantize()[torch.from_numpy(ids)])


@pytest.mark.parametrize("deterministic", [True, False])
def test_its_blocks_serve_transformers_numbers(served: Served, deterministic: bool):
    core = EngineCore(
        served.loaded,
        EngineConfig(deterministic=deterministic, kv_cache_gib=0.02, block_size=4),
    )
    assert core.info.runner == "PagedRunner"
    if served.qtype == Q8_0 and deterministic:  # (torch's products: dequantized matrices)
        assert core.info.weights_in_blocks > 0.99
    ids = _prompt(1, 23)
    outs = run_core(core, [_request(ids, "r")])["r"]
    gen = [t for o in outs for t in o.new_token_ids]
    assert len(gen) == 8
    against_transformers(dataclasses.replace(served.loaded, model=served.twin), outs, ids, gen)


def test_a_request_is_bitwise_the_same_among_others_and_in_chunks(served: Served):
    canary = _prompt(2, 19)
    fresh = EngineConfig(deterministic=True, kv_cache_gib=0.02, prefix_caching=False)
    alone = run_core(EngineCore(served.loaded, fresh), [_request(canary, "c")])["c"]
    core = EngineCore(
        served.loaded,
        EngineConfig(deterministic=True, kv_cache_gib=0.02, block_size=4, max_num_batched_tokens=7),
    )
    others = [_request(_prompt(10 + i, 5 + 4 * i), f"o{i}", 3 + i) for i in range(5)]
    mixed = run_core(core, [*others[:2], _request(canary, "c"), *others[2:]])["c"]
    again = run_core(core, [_request(canary, "again")])["again"]  # its prefix cached
    assert core.stats().prefix_cache_hits > 0
    assert _numbers(mixed) == _numbers(alone) == _numbers(again)


def test_its_float32_path_is_refused_in_one_line(served: Served):
    """transformers' GGUF loader sizes a Gemma 4 from its defaults and leaves its layer
    scalars at 1: the file is served in its blocks only."""
    with pytest.raises(ModelLoadError, match="blocks only") as refused:
        load_model(str(served.path), "float32")
    assert "\n" not in str(refused.value)


def test_a_gemma4_file_whose_experts_cannot_be_routed_is_refused_in_one_line(
    smol: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A file whose metadata routes each token to more experts than it has: the load says so
    in one line naming its mixture-of-experts block."""
    monkeypatch.setenv("PROBSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gemma4_gguf(
        _hf(smol.vocab_size, "shared"), tmp_path / "moe.gguf", F32,
        extra=[("expert_count", 2), ("expert_used_count", 3), ("expert_feed_forward_length", 32)],
    )  # fmt: skip
    with pytest.raises(ModelLoadError) as refused:
        load_model(str(path), "native")
    line = str(refused.value)
    assert "\n" not in line and "mixture-of-experts block" in line and "gemma4_text" in line
