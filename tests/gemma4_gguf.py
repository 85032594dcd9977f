"""A Gemma 4 (text) model written as a GGUF file the way llama.cpp's converter writes one (its
`Gemma4Model`, arch `gemma4`), for the tests: the configuration as metadata (the full layers'
head size as key_length, the sliding ones' as key_length_swa, the sliding pattern as one bool a
layer, the shared-KV layer count, the per-layer input width, each layer type's RoPE base, the
final soft-cap; KV heads and MLP widths as one value a layer where they differ), a rope_freqs
tensor marking the pairs the full layers' proportional RoPE leaves unrotated (1e30), the
tensors under gguf's names for transformers' (layer_scalar as layer_output_scale.weight; a
mixture of experts' stacked gate/up [E, 2I, H] as ffn_gate_up_exps, down as ffn_down_exps, the
router's proj as ffn_gate_inp, its scale as ffn_gate_inp.scale and its per-expert scale as
ffn_down_exps.scale, the branches' norms as pre_ffw_norm_2, post_ffw_norm_1 and _2), norms
as they are (Gemma 4's are w, not Gemma 3's 1 + w, so nothing is added), vectors float32 and
every matrix in `qtype` (float16 where its rows are not whole blocks)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    MODEL_ARCH,
    GGMLQuantizationType,
    GGUFValueType,
    get_tensor_name_map,
    quants,
)
from gguf_util import _writer


def gguf_names(config: Any) -> Any:
    """gguf's map from transformers' names to the file's (what the converter maps through)."""
    return get_tensor_name_map(MODEL_ARCH.GEMMA4, int(config.num_hidden_layers))


# a layer's router vectors, which llama.cpp's converter names after the tensors they scale
_SCALES = {
    "router.scale": "router.proj.scale",
    "router.per_expert_scale": "experts.down_proj.scale",
}


def gguf_name(names: Any, hf_name: str) -> str | None:
    """The file's name of transformers' tensor `hf_name` (None: the converter drops it)."""
    if hf_name.endswith("layer_scalar"):  # the converter's filter_tensors
        hf_name += ".weight"
    if hf_name.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # stacked [E, ., .]
        hf_name += ".weight"
    head, _, tail = hf_name.partition(".router.")
    if tail and f"router.{tail}" in _SCALES:
        hf_name = f"{head}.{_SCALES[f'router.{tail}']}"
    base, _, suffix = hf_name.rpartition(".")
    mapped = names.get_name(base)
    return None if mapped is None else f"{mapped}.{suffix}"


def write_gemma4_gguf(
    hf: Any, path: Path, qtype: GGMLQuantizationType, extra: Sequence[tuple[str, int]] = ()
) -> Path:
    """`hf` (a Gemma4ForCausalLM) as llama.cpp writes it, with the embedded model's tokenizer
    (`extra`: more gemma4.* unsigned metadata); a mixture of experts' counts and width."""
    cfg = hf.config
    writer, _vocab = _writer(path, "gemma4")
    types = list(cfg.layer_types)
    n = int(cfg.num_hidden_layers)
    layers = [cfg.per_layer_config[i] for i in range(n)]
    full = next(c for c, t in zip(layers, types, strict=True) if t == "full_attention")
    sliding = next(c for c, t in zip(layers, types, strict=True) if t == "sliding_attention")
    rope = cfg.rope_parameters
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    kv = [int(c.num_key_value_heads) for c in layers]
    first_shared = n - int(cfg.num_kv_shared_layers)
    width = int(cfg.intermediate_size)
    ffn = [width * (2 if cfg.use_double_wide_mlp and i >= first_shared else 1) for i in range(n)]
    keys: list[tuple[str, Any, GGUFValueType]] = [
        ("block_count", n, u32),
        ("context_length", int(cfg.max_position_embeddings), u32),
        ("embedding_length", int(cfg.hidden_size), u32),
        ("attention.head_count", int(cfg.num_attention_heads), u32),
        ("rope.freq_base", float(rope["full_attention"]["rope_theta"]), f32),
        ("rope.freq_base_swa", float(rope["sliding_attention"]["rope_theta"]), f32),
        ("attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps), f32),
        ("attention.key_length", int(full.head_dim), u32),
        ("attention.value_length", int(full.head_dim), u32),
        ("attention.key_length_swa", int(sliding.head_dim), u32),
        ("attention.value_length_swa", int(sliding.head_dim), u32),
        ("final_logit_softcapping", float(cfg.final_logit_softcapping), f32),
        ("attention.sliding_window", int(cfg.sliding_window), u32),
        ("attention.shared_kv_layers", int(cfg.num_kv_shared_layers), u32),
        ("embedding_length_per_layer_input", int(cfg.hidden_size_per_layer_input or 0), u32),
        ("rope.dimension_count", int(full.head_dim), u32),
        ("rope.dimension_count_swa", int(sliding.head_dim), u32),
    ]
    if cfg.enable_moe_block:
        keys += [
            ("expert_count", int(cfg.num_experts), u32),
            ("expert_used_count", int(cfg.top_k_experts), u32),
            ("expert_feed_forward_length", int(cfg.moe_intermediate_size), u32),
        ]
    keys += [(key, value, u32) for key, value in extra]
    for key, value, vtype in keys:
        writer.add_key_value(f"gemma4.{key}", value, vtype)
    # one value for every layer, else one a layer (the converter's arrays)
    for key, values in (("attention.head_count_kv", kv), ("feed_forward_length", ffn)):
        if len(set(values)) == 1:
            writer.add_key_value(f"gemma4.{key}", values[0], u32)
        else:
            writer.add_array(f"gemma4.{key}", values)
    writer.add_array(
        "gemma4.attention.sliding_window_pattern", [t != "full_attention" for t in types]
    )
    writer.add_key_value("general.file_type", 0 if qtype == GGMLQuantizationType.F32 else 7, u32)
    # the full layers' proportional RoPE: 1.0 for each rotated pair, 1e30 for the rest
    half = int(full.head_dim) // 2
    rotated = int(int(full.head_dim) * float(rope["full_attention"]["partial_rotary_factor"]) / 2)
    writer.add_tensor(
        "rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (half - rotated), np.float32)
    )
    names = gguf_names(cfg)
    tensors = dict(hf.named_parameters())  # (a tied head: once, as the embedding)
    tensors |= {k: v for k, v in hf.named_buffers() if k.endswith("layer_scalar")}
    for hf_name, value in tensors.items():
        name = gguf_name(names, hf_name)
        assert name is not None, hf_name
        data = value.detach().float().numpy()
        if data.ndim < 2 or qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, data.astype(np.float32))
        elif data.shape[-1] % 32:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
