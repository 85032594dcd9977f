"""The native path's model skeleton (models/skeleton.py) against transformers' own modules: the
same parameter names, shapes and ties, the same constants, the same rotary tables bit for bit,
and no transformers modeling import on the way."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from probserve.models.skeleton import Skeleton

BASE = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
ROPES = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
     "original_max_position_embeddings": 1024},
]  # fmt: skip
CASES = [
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False}),
    ("llama", {"head_dim": 32}),
    ("mistral", {"sliding_window": None}),
    ("qwen2", {"tie_word_embeddings": False}),
]


def _configs(model_type: str, extra: dict, rope: dict):  # type: ignore[no-untyped-def]
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **BASE, **extra, rope_parameters=rope)


@pytest.mark.parametrize("model_type,extra", CASES)
def test_the_skeleton_has_transformers_names_shapes_and_ties(model_type: str, extra: dict):
    from transformers import AutoModelForCausalLM

    config = _configs(model_type, extra, ROPES[0])
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    ours = Skeleton(config)

    def shapes(m: torch.nn.Module) -> dict[str, tuple[int, ...]]:
        return {n: tuple(p.shape) for n, p in m.named_parameters(remove_duplicate=False)}

    assert shapes(ours) == shapes(hf)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == (
        hf.lm_head.weight is hf.model.embed_tokens.weight
    )
    for a, b in zip(ours.model.layers, hf.model.layers, strict=True):
        assert a.self_attn.scaling == b.self_attn.scaling
        assert a.self_attn.head_dim == b.self_attn.head_dim
        assert a.input_layernorm.variance_epsilon == b.input_layernorm.variance_epsilon
    assert ours.model.norm.variance_epsilon == hf.model.norm.variance_epsilon


@pytest.mark.parametrize("rope", ROPES, ids=[r["rope_type"] for r in ROPES])
def test_the_rotary_tables_are_transformers_bit_for_bit(rope: dict):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _configs("llama", {}, rope)
    theirs, ours = LlamaRotaryEmbedding(config), Skeleton(config).model.rotary_emb
    assert ours.rope_type == theirs.rope_type
    x = torch.zeros(1, 1, 16)
    positions = torch.arange(0, 4096, 7).unsqueeze(0)
    for a, b in zip(ours(x, positions), theirs(x, positions), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow  # a fresh interpreter (make test-fast starts no process)
def test_native_loading_imports_no_modeling_code(smol):  # type: ignore[no-untyped-def]
    """Native weights load without transformers' modeling code (seconds of imports saved at
    every engine start: a worker, a restarted worker, a Ray replica), and without torch._dynamo
    and Triton (a meta embedding's own initialization imported them: ~100 MB of resident
    memory in a CPU worker)."""
    code = (
        "import sys\n"
        "from probserve.models.loader import load_source, prepared_source\n"
        "m = load_source(prepared_source(None), 'native')\n"
        "assert m.weights_format != 'float32', m.weights_format\n"
        "bad = [n for n in sys.modules if n.startswith('transformers.models.llama.modeling')\n"
        "       or n == 'transformers.modeling_utils' or n in ('torch._dynamo', 'triton')]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
