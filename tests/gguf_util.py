"""GGUF files written in a test: a Llama-shape model with the embedded model's tokenizer and random
Q8_0 blocks (random bytes with a small scale: fast to make at any size), for the loading tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

Q8_0_BYTES = 34  # a block: float16 scale, 32 int8 weights
MXFP4_BYTES = 17  # a block: an E8M0 scale, 32 FP4 (E2M1) weights in 16 bytes


def _q8_0_rows(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    blocks = rng.integers(0, 256, size=(rows, cols // 32, Q8_0_BYTES), dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def _mxfp4_rows(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    blocks = rng.integers(0, 256, size=(rows, cols // 32, MXFP4_BYTES), dtype=np.uint8)
    blocks[:, :, 0] = rng.integers(118, 122, size=(rows, cols // 32))  # 2^-9 .. 2^-6
    return blocks.reshape(rows, -1)


def _writer(path: Path, arch: str) -> tuple[GGUFWriter, int]:
    """A writer for `arch` holding the embedded model's tokenizer (and its vocabulary size)."""
    from probserve.models.loader import embedded_gguf_path

    reader = GGUFReader(str(embedded_gguf_path()))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    writer = GGUFWriter(str(path), arch=arch)
    for name, field in reader.fields.items():
        if name.startswith(("tokenizer.", "general.")) and name not in (
            "general.file_type",
            "general.architecture",
        ):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    return writer, vocab


def write_moe_gguf(
    path: Path,
    *,
    arch: str,
    hidden: int,
    layers: int,
    experts: int,
    used: int,
    expert_ffn: int,
    per_expert: bool = False,
    fused: bool = False,
    seed: int = 0,
) -> Path:
    """A mixture-of-experts GGUF file, `arch` "qwen3moe" (q/k head norms), "llama" with
    experts (Mixtral, as llama.cpp writes it) or "gpt-oss" (biases on the attention, the router
    and the experts, a sink per head, alternating 8-token windows, YaRN; its experts in MXFP4,
    as gpt-oss's files hold them): a router and 3-D expert tensors in every layer, untied head;
    the experts and attention Q8_0, the router float32, norms random around 1. `per_expert`:
    each expert's matrices as their own tensors (blk.N.ffn_gate.E.weight, as the first Mixtral
    GGUFs hold them) instead of stacked ffn_*_exps; `fused`: gate and up as one stacked
    ffn_gate_up_exps, rows [gate | up] (newer converters' option)."""
    writer, vocab = _writer(path, arch)
    heads, kv_heads, head_dim = 4, 2, hidden // 4
    gpt_oss = arch == "gpt-oss"
    expert_kind = "mxfp4" if gpt_oss else "q8"
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    keys: list[tuple[str, object, GGUFValueType]] = [
        ("context_length", 2048, u32),
        ("embedding_length", hidden, u32),
        ("block_count", layers, u32),
        ("expert_count", experts, u32),
        ("expert_used_count", used, u32),
        ("attention.head_count", heads, u32),
        ("attention.head_count_kv", kv_heads, u32),
        ("rope.freq_base", 10000.0, f32),
        ("attention.layer_norm_rms_epsilon", 1e-6, f32),
    ]
    if gpt_oss:
        keys += [
            ("feed_forward_length", expert_ffn, u32),
            ("expert_feed_forward_length", expert_ffn, u32),
            ("attention.key_length", head_dim, u32),
            ("attention.value_length", head_dim, u32),
            ("attention.sliding_window", 8, u32),
            ("rope.scaling.type", "yarn", GGUFValueType.STRING),
            ("rope.scaling.factor", 4.0, f32),
            ("rope.scaling.original_context_length", 16, u32),
        ]
    elif arch == "qwen3moe":
        keys += [
            ("feed_forward_length", 4 * hidden, u32),
            ("expert_feed_forward_length", expert_ffn, u32),
            ("attention.key_length", head_dim, u32),
            ("attention.value_length", head_dim, u32),
        ]
    else:  # Mixtral: the experts' width is the feed-forward length
        keys += [
            ("feed_forward_length", expert_ffn, u32),
            ("vocab_size", vocab, u32),
            ("rope.dimension_count", head_dim, u32),
        ]
    for key, value, vtype in keys:
        writer.add_key_value(f"{arch}.{key}", value, vtype)
    writer.add_key_value("general.file_type", 7, u32)
    q, kv = heads * head_dim, kv_heads * head_dim
    plan: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (vocab, hidden), "q8")]
    for i in range(layers):
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (hidden,), "norm"),
            (p + "attn_q.weight", (q, hidden), "q8"),
            (p + "attn_k.weight", (kv, hidden), "q8"),
            (p + "attn_v.weight", (kv, hidden), "q8"),
            (p + "attn_output.weight", (hidden, q), "q8"),
        ]
        if gpt_oss:
            plan += [
                (p + "attn_q.bias", (q,), "f32"),
                (p + "attn_k.bias", (kv,), "f32"),
                (p + "attn_v.bias", (kv,), "f32"),
                (p + "attn_output.bias", (hidden,), "f32"),
                (p + "attn_sinks.weight", (heads,), "f32"),
                (p + "ffn_gate_inp.bias", (experts,), "f32"),
            ]
        if arch == "qwen3moe":
            plan += [
                (p + "attn_q_norm.weight", (head_dim,), "norm"),
                (p + "attn_k_norm.weight", (head_dim,), "norm"),
            ]
        norm = "post_attention_norm" if gpt_oss else "ffn_norm"
        plan += [
            (p + f"{norm}.weight", (hidden,), "norm"),
            (p + "ffn_gate_inp.weight", (experts, hidden), "f32"),
        ]
        shapes = {
            "gate": (expert_ffn, hidden),
            "up": (expert_ffn, hidden),
            "down": (hidden, expert_ffn),
        }
        if fused:
            shapes = {"gate_up": (2 * expert_ffn, hidden), "down": shapes["down"]}
        for which, dims in shapes.items():
            if per_expert:
                plan += [(p + f"ffn_{which}.{e}.weight", dims, "q8") for e in range(experts)]
            else:
                plan += [(p + f"ffn_{which}_exps.weight", (experts, *dims), expert_kind)]
            if gpt_oss:
                plan += [(p + f"ffn_{which}_exps.bias", (experts, dims[0]), "f32")]
    plan += [("output_norm.weight", (hidden,), "norm"), ("output.weight", (vocab, hidden), "q8")]
    blocks = {"q8": (Q8_0_BYTES, GGMLQuantizationType.Q8_0)}
    blocks["mxfp4"] = (MXFP4_BYTES, GGMLQuantizationType.MXFP4)
    for name, shape, kind in plan:
        if kind in blocks:
            size, qtype = blocks[kind]
            byte_shape = (*shape[:-1], shape[-1] // 32 * size)
            writer.add_tensor_info(
                name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype
            )
        else:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, shape, kind in plan:
        if kind in blocks:
            make = _q8_0_rows if kind == "q8" else _mxfp4_rows
            rows = make(rng, int(np.prod(shape[:-1])), shape[-1])
            writer.write_tensor_data(rows.reshape(*shape[:-1], -1))
        elif kind == "norm":
            writer.write_tensor_data(1.0 + 0.2 * rng.standard_normal(shape, dtype=np.float32))
        else:
            writer.write_tensor_data(rng.standard_normal(shape, dtype=np.float32) * 0.3)
    writer.close()
    return path


def write_llama_gguf(
    path: Path,
    *,
    hidden: int,
    layers: int,
    ffn: int,
    heads: int,
    kv_heads: int,
    half: tuple[str, ...] = (),
    seed: int = 0,
) -> Path:
    """A Llama-shape GGUF file (untied head, norms 1.0) at `path`: every matrix Q8_0, except
    those whose name holds one of `half` ("ffn_down"): float16 (a format without a kernel)."""
    writer, vocab = _writer(path, "llama")
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    for key, value, vtype in [
        ("llama.context_length", 2048, u32),
        ("llama.embedding_length", hidden, u32),
        ("llama.block_count", layers, u32),
        ("llama.feed_forward_length", ffn, u32),
        ("llama.attention.head_count", heads, u32),
        ("llama.attention.head_count_kv", kv_heads, u32),
        ("llama.rope.freq_base", 10000.0, f32),
        ("llama.attention.layer_norm_rms_epsilon", 1e-5, f32),
        ("llama.vocab_size", vocab, u32),
        ("llama.rope.dimension_count", hidden // heads, u32),
        ("general.file_type", 7, u32),
    ]:
        writer.add_key_value(key, value, vtype)
    kv = kv_heads * hidden // heads
    plan: list[tuple[str, tuple[int, int] | tuple[int]]] = [("token_embd.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (hidden,)),
            (p + "attn_q.weight", (hidden, hidden)),
            (p + "attn_k.weight", (kv, hidden)),
            (p + "attn_v.weight", (kv, hidden)),
            (p + "attn_output.weight", (hidden, hidden)),
            (p + "ffn_norm.weight", (hidden,)),
            (p + "ffn_gate.weight", (ffn, hidden)),
            (p + "ffn_up.weight", (ffn, hidden)),
            (p + "ffn_down.weight", (hidden, ffn)),
        ]
    plan += [("output_norm.weight", (hidden,)), ("output.weight", (vocab, hidden))]

    def is_half(name: str) -> bool:
        return any(part in name for part in half)

    for name, shape in plan:
        if len(shape) == 1:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        elif is_half(name):
            writer.add_tensor_info(name, shape, np.dtype(np.float16), shape[0] * shape[1] * 2)
        else:
            byte_shape = (shape[0], shape[1] // 32 * Q8_0_BYTES)
            writer.add_tensor_info(
                name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1],
                raw_dtype=GGMLQuantizationType.Q8_0,
            )  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape in plan:
        if len(shape) == 1:
            writer.write_tensor_data(np.ones(shape, dtype=np.float32))
        elif is_half(name):
            values = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
            writer.write_tensor_data(values.astype(np.float16))
        else:
            writer.write_tensor_data(_q8_0_rows(rng, shape[0], shape[1]))
    writer.close()
    return path
