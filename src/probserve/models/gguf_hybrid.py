"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next GGUF files (llama.cpp's architectures `qwen35`,
`qwen35moe`, `qwen3next`): what llama.cpp's converter did to a checkpoint's tensors, undone as
the blocks are read (models/gguf_blocks.py), so the forward gets transformers' tensors.

The converter stores every RMSNorm but the gated one (`ssm_norm`) as w + 1, `ssm_a` as
-exp(A_log), dt_bias as `ssm_dt.bias`, the conv weight squeezed to [C, K], and appends its
multi-token-prediction layers after the trunk (`nextn_predict_layers` of `block_count`: not
served). Qwen3.5's linear layers with fewer key heads (nk) than value heads (nv = r * nk) have
their value heads tiled (value head g*r + j of key head g at j*nk + g) in every tensor a value
head indexes: the v rows of attn_qkv and of the conv, attn_gate's rows, ssm_alpha's, ssm_beta's,
ssm_a, ssm_dt, and ssm_out's columns. Rows are whole in a block format, so they are put back in
transformers' grouped order in their blocks; ssm_out's columns are not (a K-quant block spans
two heads of 128), so ssm_out keeps the file's order and the forward hands it its input in that
order (`TiledInput`, a gather; the configuration's `gguf_value_heads` says so). Qwen3-Next's
files hold its packed in_proj_qkvz unpacked (attn_qkv, attn_gate: the forward's own order) and
in_proj_ba as it is (ssm_ba, [b a] per key head), split here into in_proj_b and in_proj_a.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

# the converter's tensor names for parameters that do not end in .weight / .bias
NAMES = {"A_log": ("A_log", ""), "dt_bias": ("dt_proj", "bias")}
# the model types whose GGUF files hold the value heads tiled (Qwen3.5; Qwen3-Next's grouped)
TILED = frozenset({"qwen3_5_text", "qwen3_5_moe_text"})
HYBRID = TILED | {"qwen3_next"}
# what a Qwen3-Next file holds in place of its packed projections
UNPACKED = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


# architectures transformers' GGUF loader does not read, whose configuration is made here
OWN_CONFIG = {"qwen3next": "qwen3_next"}


def own_config(path: str) -> Any | None:
    """A Qwen3-Next file's configuration from its metadata (transformers reads Qwen3.5's files
    but not these), or None for a file of another architecture. The layer kinds are completed
    from the file's recurrent-layer list by models/families.py like the others'."""
    from transformers import AutoConfig
    from transformers.integrations.gguf import read_gguf_metadata

    meta, tensors = read_gguf_metadata(path)
    arch = meta["general.architecture"]
    if arch not in OWN_CONFIG:
        return None

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    head, nv = int(key("attention.key_length")), int(key("ssm.time_step_rank"))
    layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))
    every = int(key("full_attention_interval", 4))
    routed = {int(n.split(".")[1]) for n in tensors if n.endswith("ffn_gate_inp.weight")}
    fields = {
        "vocab_size": meta["tokenizer.ggml.tokens"], "hidden_size": key("embedding_length"),
        "num_hidden_layers": layers, "max_position_embeddings": key("context_length"),
        "num_attention_heads": key("attention.head_count"),
        "num_key_value_heads": key("attention.head_count_kv"), "head_dim": head,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_parameters": {
            "rope_type": "default", "rope_theta": key("rope.freq_base"),
            "partial_rotary_factor": key("rope.dimension_count") / head,
        },
        "linear_conv_kernel_dim": key("ssm.conv_kernel"),
        "linear_key_head_dim": key("ssm.state_size"),
        "linear_num_key_heads": key("ssm.group_count"), "linear_num_value_heads": nv,
        "linear_value_head_dim": key("ssm.inner_size") // nv,
        "layer_types": [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)
        ],
        "num_experts": key("expert_count", 0), "num_experts_per_tok": key("expert_used_count", 0),
        "moe_intermediate_size": key("expert_feed_forward_length", 0),
        "shared_expert_intermediate_size": key("expert_shared_feed_forward_length", 0),
        "intermediate_size": key("feed_forward_length", 0), "norm_topk_prob": True,
        "mlp_only_layers": [i for i in range(layers) if i not in routed],
        "tie_word_embeddings": "output.weight" not in tensors,
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }  # fmt: skip
    return AutoConfig.for_model(OWN_CONFIG[arch], **fields)


def grouped_to_tiled(nk: int, r: int, size: int) -> torch.Tensor:
    """The index that takes a grouped vector of nk * r heads of `size` to the tiled order:
    tiled = grouped[index]."""
    return torch.arange(nk * r * size).reshape(nk, r, size).transpose(0, 1).reshape(-1)


def _tiled_to_grouped(nk: int, r: int, size: int) -> np.ndarray:
    return torch.argsort(grouped_to_tiled(nk, r, size)).numpy()


def _rows(weight: Any, index: np.ndarray) -> Any:
    """`weight`'s rows in the order `index` (a float32 tensor, or a block tensor's rows)."""
    if isinstance(weight, torch.Tensor):
        return weight[torch.from_numpy(index)].contiguous()
    return dataclasses.replace(weight, data=np.ascontiguousarray(weight.blocks[index]))


def restore(out: dict[str, Any], config: Any) -> None:
    """Undo the converter's changes in `out` (transformers' names), in place."""
    kind = config.model_type
    if kind not in HYBRID:
        return
    nk, nv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
    dk, dv, r = int(config.linear_key_head_dim), int(config.linear_value_head_dim), nv // nk
    qk = 2 * nk * dk
    tiled = kind in TILED and r > 1
    value_rows = np.concatenate([np.arange(qk), qk + _tiled_to_grouped(nk, r, dv)])
    per_value = _tiled_to_grouped(nk, r, dv)
    per_head = _tiled_to_grouped(nk, r, 1)
    changes: dict[str, Callable[[Any], Any]] = {
        "A_log": lambda a: torch.log(-a),
        "conv1d.weight": lambda w: w.reshape(w.shape[0], 1, -1),
    }
    if tiled:
        changes |= {
            "in_proj_qkv.weight": lambda w: _rows(w, value_rows),
            "in_proj_z.weight": lambda w: _rows(w, per_value),
            "in_proj_a.weight": lambda w: _rows(w, per_head),
            "in_proj_b.weight": lambda w: _rows(w, per_head),
            "A_log": lambda a: torch.log(-a)[torch.from_numpy(per_head)],
            "dt_bias": lambda b: b[torch.from_numpy(per_head)],
            "conv1d.weight": lambda w: w[torch.from_numpy(value_rows)].reshape(w.shape[0], 1, -1),
        }
    for name in list(out):
        head, _, leaf = name.partition(".linear_attn.")
        if leaf in changes:
            out[name] = changes[leaf](out[name])
        elif name.endswith("norm.weight") and leaf != "norm.weight":
            out[name] = out[name] - 1  # stored as w + 1
        elif name.endswith("shared_expert_gate.weight") and getattr(out[name], "ndim", 2) == 1:
            out[name] = out[name].reshape(1, -1)  # (a file may hold its one row as a vector)
        if leaf == "in_proj_ba.weight":  # Qwen3-Next: [b a] per key head, split
            ba = out.pop(name)
            at = np.arange(nk)[:, None] * 2 * r
            b, a = (at + np.arange(r)).reshape(-1), (at + r + np.arange(r)).reshape(-1)
            out[f"{head}.linear_attn.in_proj_b.weight"] = _rows(ba, b)
            out[f"{head}.linear_attn.in_proj_a.weight"] = _rows(ba, a)


def unpacked(name: str) -> bool:
    """A Qwen3-Next skeleton parameter the file holds unpacked (its parts under the Qwen3.5
    names: attn_qkv, attn_gate and ssm_ba's two halves)."""
    return name.endswith(("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"))


def unpacked_names(name_map: Any, layer: str) -> dict[str, str]:
    """A Qwen3-Next file's tensors for layer `layer`'s ("model.layers.N") packed projections:
    GGUF name -> the name the forward reads them under."""
    at = f"{layer}.linear_attn."
    qkv = name_map.get_name(at + "in_proj_qkv")  # attn_qkv
    gate = name_map.get_name(at + "in_proj_z")  # attn_gate
    ba = name_map.get_name(at + "in_proj_ba")  # ssm_ba
    return {
        f"{qkv}.weight": at + "in_proj_qkv.weight",
        f"{gate}.weight": at + "in_proj_z.weight",
        f"{ba}.weight": at + "in_proj_ba.weight",
    }


class TiledInput:
    """A projection whose input columns a GGUF file holds in the tiled value-head order: the
    forward's grouped input gathered into that order first (exact: a permutation)."""

    def __init__(self, linear: Callable[[torch.Tensor], torch.Tensor], config: Any) -> None:
        nk, nv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        self.linear = linear
        self.index = grouped_to_tiled(nk, nv // nk, int(config.linear_value_head_dim))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.index.device != x.device:
            self.index = self.index.to(x.device)
        return self.linear(x[:, self.index].contiguous())
