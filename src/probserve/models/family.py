"""A model family as parameters of the one paged forward (models/llama.py): what differs between
Llama, Mistral, Qwen2/3, Gemma 2/3 and Phi-3 is read from the configuration once, here.

- Qwen3 and Gemma 3 normalize each query and key head (RMSNorm over the head dimension) before
  RoPE;
- Gemma scales its RMSNorm by (1 + w), multiplies the embedding by sqrt(hidden), uses GeGLU
  (tanh GELU), norms the attention's and the MLP's outputs too (pre- and post-feed-forward), scales
  queries by query_pre_attn_scalar^-0.5, and Gemma 2 soft-caps attention scores and final logits;
- Gemma 2/3 interleave sliding-window and global layers (Gemma 3 with a RoPE base of each),
  Mistral and Phi-3 window every layer;
- Phi-3 stores QKV and gate/up fused in its checkpoint;
- Qwen3-MoE, OLMoE and Mixtral replace the MLP (in every layer, or Qwen3-MoE's sparse ones) by
  a mixture of experts: a router's softmax, the top k experts of each token (renormalised:
  Qwen3-MoE's norm_topk_prob, always for Mixtral), their SwiGLUs summed by weight
  (models/moe.py); OLMoE RMS-norms the whole query and key projections, not each head;
- gpt-oss: a mixture of experts in every layer whose router has a bias and takes the softmax
  of its k largest logits (the renormalised top k of the full softmax: the same function), its
  experts biased with a clamped SwiGLU ((clamp(up) + 1) * g * sigmoid(1.702 g), g = min(gate,
  7)), attention with biases and a learned sink logit per head, alternating 128-token windows
  and YaRN RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

SUPPORTED_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"}
    | {"qwen3_moe", "olmoe", "mixtral", "gpt_oss"}
)
# what the paged forward lacks for a mixture-of-experts type it does not run (the refusal's line)
MISSING = {
    "qwen2_moe": "its shared expert is not built",
    "deepseek_v3": "multi-head latent attention and its grouped routing are not built",
}
_GEMMA = frozenset({"gemma2", "gemma3_text"})
_ACTIVATIONS: dict[str, Literal["silu", "gelu_tanh"]] = {
    "silu": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
}
# RoPE variants whose cos/sin depend on the position alone (models/skeleton.py's `Rotary`;
# longrope's short/long factor is chosen per position there); dynamic rescales with the batch
STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn", "longrope"})


class Unsupported(ValueError):
    """The paged forward does not reproduce this model; the message says why."""


@dataclass(frozen=True)
class Family:
    """One model type's layer, as the forward's parameters."""

    model_type: str
    head_dim: int
    activation: Literal["silu", "gelu_tanh"]
    scale: float  # the attention's query scaling
    windows: tuple[int | None, ...]  # each layer's sliding window (None: global)
    rope_keys: tuple[str | None, ...]  # each layer's entry of rope_parameters (Gemma 3)
    norm_plus_one: bool = False  # RMSNorm scales by (1 + w) (Gemma)
    embed_scale: float | None = None  # the embedding's factor (Gemma: sqrt(hidden))
    qk_norm: bool = False  # an RMSNorm over each query and key head (Qwen3, Gemma 3)
    sandwich: bool = False  # norms after attention and around the MLP (Gemma)
    fused: bool = False  # the checkpoint's qkv_proj and gate_up_proj (Phi-3)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    experts: int = 0  # a MoE layer's experts (0: every layer dense)
    top_k: int = 0  # the experts a token is routed to
    norm_topk: bool = False  # the chosen experts' weights renormalised to sum to 1
    expert_intermediate: int = 0  # an expert's SwiGLU width
    sparse: tuple[bool, ...] = ()  # each layer: a MoE feed-forward (else the dense MLP)
    qk_norm_full: bool = False  # q and k RMS-normed over the whole projection (OLMoE)
    sinks: bool = False  # a learned sink logit per attention head (gpt-oss)
    # gpt-oss's clamped SwiGLU in its experts: (clamp(up, +-limit) + 1) * g * sigmoid(alpha g),
    # g = min(gate, limit); None: the family's activation
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_keys(config: Any) -> tuple[str | None, ...]:
    """Each layer's key into `config.rope_parameters` where it holds one set per layer type
    (Gemma 3), else None for every layer."""
    params = getattr(config, "rope_parameters", None) or {}
    types = getattr(config, "layer_types", None)
    if types and isinstance(params, dict) and all(t in params for t in set(types)):
        return tuple(types)
    return (None,) * config.num_hidden_layers


def rope_params(config: Any, key: str | None) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or {}
    return dict(params[key] if key is not None else params)


def rope_type(config: Any, key: str | None) -> str:
    """The RoPE variant of one entry of the configuration's rope_parameters."""
    return str(rope_params(config, key).get("rope_type", "default"))


def _windows(config: Any) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None)
    n = config.num_hidden_layers
    if not window:
        return (None,) * n
    types = getattr(config, "layer_types", None)
    if config.model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        return (None,) * n
    if types:
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    return (int(window),) * n


def family(config: Any) -> Family:
    """The forward's parameters for `config`; raises Unsupported, saying why, for a model the
    paged forward does not reproduce."""
    kind = getattr(config, "model_type", None)
    if kind in MISSING:
        raise Unsupported(f"{kind} does not run on the paged forward: {MISSING[kind]}")
    if kind not in SUPPORTED_TYPES:
        raise Unsupported(f"{kind} does not run on the paged forward")
    if getattr(config, "clip_qkv", None) is not None:
        raise Unsupported("its clip_qkv (clamped q/k/v) is not one the paged forward has")
    gemma = kind in _GEMMA
    act_name = getattr(config, "hidden_activation", None) if gemma else None
    act_name = act_name or getattr(config, "hidden_act", "silu")
    activation = _ACTIVATIONS.get(act_name) if act_name is not None else None
    if activation is None:
        raise Unsupported(f"its activation {act_name!r} is not one the paged forward has")
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise Unsupported("its partial rotary embedding is not one the paged forward has")
    if getattr(config, "use_bidirectional_attention", False):
        raise Unsupported("its attention is bidirectional (an embedding model)")
    types = getattr(config, "layer_types", None) or []
    if any(t not in ("full_attention", "sliding_attention") for t in types):
        raise Unsupported(f"its layer types {sorted(set(types))} are not all attention layers")
    d = head_dim(config)
    scale = float(config.query_pre_attn_scalar) ** -0.5 if gemma else d**-0.5
    return Family(
        model_type=kind,
        head_dim=d,
        activation=activation,
        scale=scale,
        norm_plus_one=gemma,
        embed_scale=float(config.hidden_size) ** 0.5 if gemma else None,
        qk_norm=kind in ("qwen3", "gemma3_text", "qwen3_moe"),
        qk_norm_full=kind == "olmoe",
        sandwich=gemma,
        fused=kind == "phi3",
        attn_softcap=getattr(config, "attn_logit_softcapping", None) if gemma else None,
        final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
        windows=_windows(config),
        rope_keys=rope_keys(config),
        **_experts(config),
    )


def _experts(config: Any) -> dict[str, Any]:
    """A mixture of experts' parameters (Qwen3-MoE, OLMoE, Mixtral, gpt-oss), else none."""
    kind, n = config.model_type, config.num_hidden_layers
    if kind not in ("qwen3_moe", "olmoe", "mixtral", "gpt_oss"):
        return {}
    local = kind in ("mixtral", "gpt_oss")
    experts = int(config.num_local_experts if local else config.num_experts)
    sparse = (True,) * n
    if kind == "qwen3_moe":
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n))
    width = config.moe_intermediate_size if kind == "qwen3_moe" else config.intermediate_size
    found = {
        "experts": experts,
        "top_k": int(config.num_experts_per_tok),
        "norm_topk": local or bool(getattr(config, "norm_topk_prob", False)),
        "expert_intermediate": int(width),
        "sparse": sparse,
    }
    if kind == "gpt_oss":
        found |= {
            "sinks": True,
            "swiglu_limit": float(config.swiglu_limit),
            "swiglu_alpha": float(getattr(config, "swiglu_alpha", 1.702)),
        }
    return found
