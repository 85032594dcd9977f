"""A transformers Qwen3.5 / Qwen3.5-MoE / Qwen3-Next model written as a GGUF file the way
llama.cpp's converter (convert_hf_to_gguf.py: Qwen3NextModel and its Qwen3.5 subclasses) writes
one: architectures `qwen35`, `qwen35moe`, `qwen3next`; `blk.N.*` names; norms stored as w + 1
(all but the gated norm `ssm_norm`); `ssm_a` = -exp(A_log); `ssm_dt.bias`; the conv weight
squeezed to [C, K]; Qwen3.5's value heads reordered from grouped by key head to tiled (every
value-indexed row, and ssm_out's columns); Qwen3-Next's in_proj_qkvz unpacked into attn_qkv and
attn_gate (in_proj_ba kept packed as ssm_ba); experts stacked; vectors, norms, routers and the
conv weight F32, matrices in `matrices` (F32, F16, or a block format gguf's quantizer writes);
an extra multi-token-prediction block (`nextn_predict_layers`) that a server ignores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, quantize
from gguf.quants import QuantError
from gguf_util import _writer

ARCHS = {"qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next"}


def tiled(x: torch.Tensor, dim: int, nk: int, r: int, size: int) -> torch.Tensor:
    """Value heads along `dim` from grouped (head g*r + j) to tiled order (j*nk + g)."""
    shape = list(x.shape)
    x = x.reshape(*shape[:dim], nk, r, size, *shape[dim + 1 :]).transpose(dim, dim + 1)
    return x.contiguous().reshape(shape)


def _tensors(model: Any, arch: str) -> list[tuple[str, torch.Tensor]]:
    """(GGUF name, value) as the converter emits them, before types are chosen."""
    cfg = model.config
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
    reorder = arch != "qwen3next" and nk != nv
    qk = 2 * nk * dk
    out: list[tuple[str, torch.Tensor]] = []
    experts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, value in model.state_dict().items():
        x = value.detach().float().clone()
        if name == "model.embed_tokens.weight":
            out.append(("token_embd.weight", x))
            continue
        if name == "lm_head.weight":
            out.append(("output.weight", x))
            continue
        if name == "model.norm.weight":
            out.append(("output_norm.weight", x + 1))
            continue
        parts = name.split(".")
        i, rest = int(parts[2]), ".".join(parts[3:])
        p = f"blk.{i}."
        if rest.endswith("norm.weight") and rest != "linear_attn.norm.weight":
            x = x + 1
        if reorder and rest.startswith("linear_attn."):
            if rest == "linear_attn.in_proj_qkv.weight":
                x = torch.cat([x[:qk], tiled(x[qk:], 0, nk, r, dv)])
            elif rest == "linear_attn.in_proj_z.weight":
                x = tiled(x, 0, nk, r, dv)
            elif rest.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
                x = tiled(x, 0, nk, r, 1)  # one row (or value) a head
            elif rest == "linear_attn.conv1d.weight":
                x = torch.cat([x[:qk], tiled(x[qk:], 0, nk, r, dv)])
            elif rest == "linear_attn.out_proj.weight":
                x = tiled(x, 1, nk, r, dv)
        if rest == "linear_attn.in_proj_qkvz.weight":  # Qwen3-Next: [q k v z] per key head
            g = x.reshape(nk, 2 * dk + 2 * r * dv, -1)
            q, k, v, z = torch.split(g, [dk, dk, r * dv, r * dv], dim=1)
            flat = [t.reshape(-1, x.shape[1]) for t in (q, k, v, z)]
            out += [(p + "attn_qkv.weight", torch.cat(flat[:3])), (p + "attn_gate.weight", flat[3])]
            continue
        if rest.startswith("mlp.experts."):
            if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up
                half = x.shape[1] // 2
                out += [
                    (p + "ffn_gate_exps.weight", x[:, :half]),
                    (p + "ffn_up_exps.weight", x[:, half:]),
                ]
            elif rest == "mlp.experts.down_proj":
                out.append((p + "ffn_down_exps.weight", x))
            else:  # per-expert modules (Qwen3-Next): stacked
                e, which = int(parts[5]), parts[6]
                experts.setdefault(p + f"ffn_{which[:-5]}_exps.weight", []).append((e, x))
            continue
        names = {
            "input_layernorm.weight": "attn_norm.weight",
            "post_attention_layernorm.weight": "post_attention_norm.weight",
            "self_attn.q_proj.weight": "attn_q.weight",
            "self_attn.k_proj.weight": "attn_k.weight",
            "self_attn.v_proj.weight": "attn_v.weight",
            "self_attn.o_proj.weight": "attn_output.weight",
            "self_attn.q_norm.weight": "attn_q_norm.weight",
            "self_attn.k_norm.weight": "attn_k_norm.weight",
            "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
            "linear_attn.in_proj_z.weight": "attn_gate.weight",
            "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
            "linear_attn.in_proj_b.weight": "ssm_beta.weight",
            "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
            "linear_attn.conv1d.weight": "ssm_conv1d.weight",
            "linear_attn.A_log": "ssm_a",
            "linear_attn.dt_bias": "ssm_dt.bias",
            "linear_attn.norm.weight": "ssm_norm.weight",
            "linear_attn.out_proj.weight": "ssm_out.weight",
            "mlp.gate_proj.weight": "ffn_gate.weight",
            "mlp.up_proj.weight": "ffn_up.weight",
            "mlp.down_proj.weight": "ffn_down.weight",
            "mlp.gate.weight": "ffn_gate_inp.weight",
            "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
            "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
            "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
            "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
        }
        if rest == "linear_attn.A_log":
            x = -torch.exp(x)
        elif rest == "linear_attn.conv1d.weight":
            x = x.squeeze()
        out.append((p + names[rest], x))
    for name, pairs in experts.items():
        out.append((name, torch.stack([t for _, t in sorted(pairs, key=lambda p: p[0])])))
    return out


def _mtp_block(layer: int, cfg: Any) -> list[tuple[str, torch.Tensor]]:
    """A multi-token-prediction block as the converter appends it (`blk.{n}.nextn.*` beside a
    full-attention layer's tensors): random, for a server to leave out."""
    g = torch.Generator().manual_seed(99)
    h, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    p = f"blk.{layer}."
    shapes = {
        "nextn.eh_proj.weight": (h, 2 * h), "nextn.enorm.weight": (h,),
        "nextn.hnorm.weight": (h,), "nextn.shared_head_norm.weight": (h,),
        "attn_norm.weight": (h,), "attn_q.weight": (2 * q, h), "attn_k.weight": (kv, h),
        "attn_v.weight": (kv, h), "attn_output.weight": (h, q),
    }  # fmt: skip
    return [(p + k, torch.randn(s, generator=g)) for k, s in shapes.items()]


def write_hybrid_gguf(
    model: Any, path: Path, matrices: GGMLQuantizationType, *, mtp: bool = True
) -> Path:
    """`model` (a transformers Qwen3.5 / Qwen3.5-MoE / Qwen3-Next causal LM) as llama.cpp's
    converter writes it, with the embedded model's tokenizer (the test model's vocabulary)."""
    cfg = model.config
    arch = ARCHS[cfg.model_type]
    writer, _ = _writer(path, arch)
    n = cfg.num_hidden_layers
    blocks = n + (1 if mtp else 0)
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    head = cfg.head_dim
    rotary = int(head * cfg.rope_parameters.get("partial_rotary_factor", 0.25))
    keys: list[tuple[str, Any, GGUFValueType]] = [
        ("block_count", blocks, u32), ("context_length", cfg.max_position_embeddings, u32),
        ("embedding_length", cfg.hidden_size, u32),
        ("attention.head_count", cfg.num_attention_heads, u32),
        ("attention.head_count_kv", cfg.num_key_value_heads, u32),
        ("rope.freq_base", float(cfg.rope_parameters["rope_theta"]), f32),
        ("attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps), f32),
        ("attention.key_length", head, u32), ("attention.value_length", head, u32),
        ("ssm.conv_kernel", cfg.linear_conv_kernel_dim, u32),
        ("ssm.state_size", cfg.linear_key_head_dim, u32),
        ("ssm.group_count", cfg.linear_num_key_heads, u32),
        ("ssm.time_step_rank", cfg.linear_num_value_heads, u32),
        ("ssm.inner_size", cfg.linear_value_head_dim * cfg.linear_num_value_heads, u32),
        ("full_attention_interval", 2, u32), ("rope.dimension_count", rotary, u32),
    ]  # fmt: skip
    if getattr(cfg, "intermediate_size", None) and arch != "qwen35moe":
        keys.append(("feed_forward_length", cfg.intermediate_size, u32))
    if arch != "qwen35":
        keys += [
            ("expert_count", cfg.num_experts, u32),
            ("expert_used_count", cfg.num_experts_per_tok, u32),
            ("expert_feed_forward_length", cfg.moe_intermediate_size, u32),
            ("expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size, u32),
        ]
    if arch != "qwen3next":
        writer.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])
    if mtp:
        keys.append(("nextn_predict_layers", 1, u32))
    for key, value, vtype in keys:
        writer.add_key_value(f"{arch}.{key}", value, vtype)
    recurrent = [t == "linear_attention" for t in cfg.layer_types] + [False] * (blocks - n)
    writer.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    writer.add_key_value("general.file_type", 1, u32)
    tensors = _tensors(model, arch) + (_mtp_block(n, cfg) if mtp else [])
    f32_always = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")
    for name, value in tensors:
        data = value.numpy().astype(np.float32)
        if (
            data.ndim <= 1
            or name.endswith(("_norm.weight", *f32_always))
            or not name.endswith(".weight")
        ):
            writer.add_tensor(name, data)
        elif matrices == GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        elif matrices == GGMLQuantizationType.F32:
            writer.add_tensor(name, data)
        else:
            try:
                writer.add_tensor(name, quantize(data, matrices), raw_dtype=matrices)
            except QuantError:  # rows not whole blocks: the converter falls back to F16
                writer.add_tensor(name, data.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
