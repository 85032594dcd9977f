"""The model types the paged forward runs, one entry each (`TYPES`), beside models/family.py: what
is particular to a type beyond a configuration's standard fields. Its layer's parts (Gemma's
norms, scaling and soft-caps, q/k norms, a fused checkpoint, which layers slide a window, its
experts), how a GGUF file's metadata completes its configuration where transformers' reading of
the file leaves it short (`gguf`, `unread`), and how its checkpoints lay its tensors out
(`attention_bias`, `column_experts`). models/family.py reads a configuration into the forward's
`Family` through it, models/loader.py completes a GGUF configuration, models/skeleton.py names
and shapes the parameters; adding a family is an entry here and its layer's builders
(models/llama.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from probserve.models import gemma4

if TYPE_CHECKING:
    import torch

# a GGUF file's metadata field by key, or its tensor (gguf's ReaderTensor) by name (None where
# it has neither)
Read = Callable[[str], Any]


@dataclass(frozen=True)
class ModelType:
    gemma: bool = False  # (1 + w) norms, sqrt(hidden) embedding, hidden_activation, sandwich
    # norms, query_pre_attn_scalar's scaling, soft-capped scores and logits (Gemma 2, 3)
    qk_norm: Literal["", "head", "projection"] = ""  # RMS-normed q and k: per head, or the
    # whole projection (OLMoE)
    fused: bool = False  # the checkpoint's qkv_proj and gate_up_proj (Phi-3)
    window_asked: bool = False  # a sliding window only where use_sliding_window (Qwen2/3)
    experts: Callable[[Any], dict[str, Any]] | None = None  # a mixture of experts' parameters
    column_experts: bool = False  # stacked experts as x @ W, gate and up columns interleaved,
    # biased, and a biased `router` (gpt-oss)
    attention_bias: tuple[bool, bool] | None = None  # (q/k/v, o) biases, where the type fixes
    # them (else the configuration's attention_bias)
    gguf: Callable[[Any, Read], Any] | None = None  # its GGUF configuration completed
    unread: Callable[[Path], str | None] | None = None  # what of its GGUF files transformers'
    # loader misreads (None: it reads them)
    passes_config: bool = False  # transformers' float32 GGUF load takes the completed
    # configuration (its own reading lacks the experts' width)
    # a type whose layers differ (Gemma 4: models/gemma4.py): its `Family` fields read from
    # its configuration, and what the forward lacks for a configuration (None: nothing)
    own: Callable[[Any], dict[str, Any]] | None = None
    missing: Callable[[Any], str | None] | None = None
    paged_only: bool = False  # no other runner serves it (transformers' sizes one head for
    # every layer): where the forward lacks a part of it, the model is refused
    hybrid: bool = False  # Qwen3.5's layers: Gated DeltaNet layers among gated full-attention
    # ones (partial rotary), (1 + w) norms, a shared expert beside the routed ones
    # (models/deltanet.py)
    packed_linear: bool = False  # its linear layers' projections packed per key head
    # (Qwen3-Next's in_proj_qkvz and in_proj_ba)


def _qwen3_moe_experts(config: Any) -> dict[str, Any]:
    n, experts = config.num_hidden_layers, int(config.num_experts)
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    return {
        "experts": experts, "top_k": int(config.num_experts_per_tok),
        "norm_topk": bool(getattr(config, "norm_topk_prob", False)),
        "expert_intermediate": int(config.moe_intermediate_size),
        "sparse": tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n)),
    }  # fmt: skip


def _qwen3_5_moe_experts(config: Any) -> dict[str, Any]:
    """Experts in every layer, renormalised top k, and a shared expert beside them."""
    return {
        "experts": int(config.num_experts), "top_k": int(config.num_experts_per_tok),
        "norm_topk": True, "expert_intermediate": int(config.moe_intermediate_size),
        "sparse": (True,) * config.num_hidden_layers, "shared_expert": True,
    }  # fmt: skip


def _qwen3_next_experts(config: Any) -> dict[str, Any]:
    """Qwen3-MoE's sparse layers and routing, and a shared expert beside the routed ones."""
    return _qwen3_moe_experts(config) | {"shared_expert": True}


def _every_layer(experts: int, config: Any, norm: bool) -> dict[str, Any]:
    """Experts in every layer, `config.intermediate_size` wide."""
    return {
        "experts": experts, "top_k": int(config.num_experts_per_tok), "norm_topk": norm,
        "expert_intermediate": int(config.intermediate_size),
        "sparse": (True,) * config.num_hidden_layers,
    }  # fmt: skip


def _olmoe_experts(config: Any) -> dict[str, Any]:
    norm = bool(getattr(config, "norm_topk_prob", False))
    return _every_layer(int(config.num_experts), config, norm)


def _mixtral_experts(config: Any) -> dict[str, Any]:
    return _every_layer(int(config.num_local_experts), config, True)


def _gpt_oss_experts(config: Any) -> dict[str, Any]:
    """Its router takes the softmax of its k largest logits: the renormalised top k of the full
    softmax, the same function; its experts' clamped SwiGLU; a sink logit per head."""
    return _every_layer(int(config.num_local_experts), config, True) | {
        "sinks": True,
        "swiglu_limit": float(config.swiglu_limit),
        "swiglu_alpha": float(getattr(config, "swiglu_alpha", 1.702)),
    }


# a Llama configuration's fields a Mixtral one does not take
_NOT_MIXTRAL = ("model_type", "architectures", "transformers_version", "mlp_bias", "pretraining_tp")


def _llama_gguf(config: Any, read: Read) -> Any:
    """A Mixtral file (arch `llama` with `llama.expert_count`), which transformers reads as a
    dense Llama, becomes the Mixtral configuration it is."""
    experts = read("llama.expert_count")
    if not experts:
        return config
    from transformers import MixtralConfig

    fields = {k: v for k, v in config.to_dict().items() if k not in _NOT_MIXTRAL}
    used = int(read("llama.expert_used_count") or 2)
    return MixtralConfig(**fields, num_local_experts=int(experts), num_experts_per_tok=used)


def _qwen3_moe_gguf(config: Any, read: Read) -> Any:
    """The experts' width (`expert_feed_forward_length`), and the renormalised top k llama.cpp
    always applies to it."""
    width = read("qwen3moe.expert_feed_forward_length")
    if width is not None:
        config.moe_intermediate_size = int(width)
    config.norm_topk_prob = True
    return config


# metadata transformers' GGUF loader fails on (read here instead: _gpt_oss_gguf, and
# gemma4.gguf_config: one value a layer where a Gemma 4's layers differ)
GGUF_UNREADABLE = (
    "gpt-oss.rope.scaling.",
    "gemma4.feed_forward_length",
    "gemma4.attention.head_count_kv",
)


def _gpt_oss_gguf(config: Any, read: Read) -> Any:
    """The head size, the experts' width, the window and the RoPE scaling (YaRN, untruncated as
    gpt-oss's own configuration has it)."""
    head = read("gpt-oss.attention.key_length")
    if head is not None:
        config.head_dim = int(head)
    width = read("gpt-oss.expert_feed_forward_length")
    if width is not None:
        config.intermediate_size = int(width)
    window = read("gpt-oss.attention.sliding_window")
    if window is not None:
        config.sliding_window = int(window)
    theta = float(read("gpt-oss.rope.freq_base") or config.rope_parameters.get("rope_theta"))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if read("gpt-oss.rope.scaling.type") == "yarn":
        rope = {
            "rope_type": "yarn", "rope_theta": theta,
            "factor": float(read("gpt-oss.rope.scaling.factor")),
            "original_max_position_embeddings": int(
                read("gpt-oss.rope.scaling.original_context_length")
            ),
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        }  # fmt: skip
    config.rope_parameters = rope
    return config


def _hybrid_gguf(arch: str) -> Callable[[Any, Read], Any]:
    """A Qwen3.5 / Qwen3-Next file's layer kinds as the converter lists them
    (`attention.recurrent_layers`, its multi-token-prediction layers after the trunk), where it
    does: they need not follow `full_attention_interval`, which is all transformers reads."""

    def complete(config: Any, read: Read) -> Any:
        recurrent = read(f"{arch}.attention.recurrent_layers")
        if recurrent:
            trunk = recurrent[: config.num_hidden_layers]
            config.layer_types = ["linear_attention" if r else "full_attention" for r in trunk]
        return config

    return complete


def _fused_experts(gguf: Path) -> str | None:
    """Experts' gate and up in one tensor, which transformers leaves random."""
    from gguf import GGUFReader

    fused = (t.name.endswith("ffn_gate_up_exps.weight") for t in GGUFReader(str(gguf)).tensors)
    return "fused gate/up experts" if any(fused) else None


def column_expert_rows(
    gate_up: torch.Tensor, bias: torch.Tensor | None, down: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """An expert stored as x @ W with gate and up columns interleaved (`column_experts`: gpt-oss)
    as the forward holds one: rows [gate | up] (and their bias) and down's rows."""
    import torch  # (the API process imports this table, and never loads torch)

    rows = torch.cat([gate_up.T[0::2], gate_up.T[1::2]]).contiguous()
    if bias is not None:
        bias = torch.cat([bias[0::2], bias[1::2]])
    return rows, bias, down.T.contiguous()


TYPES: dict[str, ModelType] = {
    "llama": ModelType(gguf=_llama_gguf),
    "mistral": ModelType(attention_bias=(False, False)),
    "qwen2": ModelType(window_asked=True, attention_bias=(True, False)),
    "qwen3": ModelType(qk_norm="head", window_asked=True),
    "gemma2": ModelType(gemma=True),
    "gemma3_text": ModelType(gemma=True, qk_norm="head"),
    "gemma4_text": ModelType(
        own=gemma4.family_fields, missing=gemma4.missing, paged_only=True,
        gguf=gemma4.gguf_config, unread=lambda _: "gemma4",  # (transformers' GGUF loader
        # sizes it from its defaults, and leaves its layer scalars at 1)
    ),
    "phi3": ModelType(fused=True, attention_bias=(False, False)),
    "qwen3_moe": ModelType(
        qk_norm="head", experts=_qwen3_moe_experts, gguf=_qwen3_moe_gguf, unread=_fused_experts,
        passes_config=True,
    ),
    "olmoe": ModelType(qk_norm="projection", experts=_olmoe_experts),
    "mixtral": ModelType(experts=_mixtral_experts, unread=lambda _: "mixtral"),
    "gpt_oss": ModelType(
        experts=_gpt_oss_experts, column_experts=True, gguf=_gpt_oss_gguf,
        unread=lambda _: "gpt_oss",
    ),
    "qwen3_5_text": ModelType(qk_norm="head", hybrid=True, gguf=_hybrid_gguf("qwen35")),
    "qwen3_5_moe_text": ModelType(
        qk_norm="head", hybrid=True, experts=_qwen3_5_moe_experts, gguf=_hybrid_gguf("qwen35moe"),
        passes_config=True,
    ),
    "qwen3_next": ModelType(
        qk_norm="head", hybrid=True, experts=_qwen3_next_experts, packed_linear=True,
        gguf=_hybrid_gguf("qwen3next"), unread=lambda _: "qwen3next",
    ),
}  # fmt: skip
# what the paged forward lacks for a type it does not run (the refusal's line)
MISSING = {
    "qwen2_moe": "its shared expert is not built",
    "deepseek_v3": "multi-head latent attention and its grouped routing are not built",
}
